/* A prompt's causal attention in bf16 on AMX-BF16 tiles, straight from pagedkv's paged,
 * head-major bf16 KV pool ("matmul precision medium": the arithmetic of torch's bf16 SDPA).
 *
 * Contract. The chunk's query rows i = 0..n-1 sit at positions pos0 + i of one sequence and
 * attend to positions 0..pos0 + i (causal; no window). For every query vector (row, head):
 *   q is rounded to bf16 (nearest even); each score s_p = scale * (q . k_p), the dot product
 *   of bf16 values summed in float32 on AMX (TDPBF16PS), then one float32 multiplication;
 *   positions are walked in tiles of 16 from position 0 with an online softmax in float32:
 *   per tile, m' = max(m, max_p s_p), c = exp(m - m'), l = l * c + sum_p e_p (in p order),
 *   acc = acc * c + sum_p bf16(e_p) * v_p (AMX, float32 sums), with e_p = exp(s_p - m') by
 *   exp512 (exp512.h); finally out = acc * (1 / l) (float32).
 * Positions past a query's own are excluded exactly (e_p = 0; a tile wholly past it leaves
 * m, l and acc unchanged, bit for bit), and the pool is read only up to the chunk's last
 * position (V past it enters as zeros). So a query's result depends on its own q and the
 * K/V of positions 0..its own, and on nothing else: not on the chunk's other rows, its
 * length, where the chunk starts (a cached prefix), the thread count, or stale pool data.
 * That is what makes prefix caching and chunked prefill give the same bits as one
 * uncached prefill, at any prompt length (torch's SDPA blocks by the context length it is
 * given, so its rows change with it from ~600 tokens).
 *
 * Work. Per KV head, the queries of its group are listed row-major (row i, group member g:
 * u = i * group + g) and cut into tiles of 16; a tile walks the position tiles up to its last
 * query's. S^T = K Q^T puts positions in rows and queries in columns: the pool's K rows load
 * as the A tile as stored (row stride head_dim * 2 bytes), the queries as B tiles (packed
 * once per call), and the softmax runs 16 queries wide with no horizontal sums. O^T = V^T
 * P^T: V^T is packed once per call (16 x 16 tiles, zeros past the chunk), P^T is built per
 * tile in the B (pair) layout, and O^T stays in an L1 buffer (head_dim x 16 float32) that the
 * C tile is loaded from and stored to. Items (KV head, query tile) go to the process's
 * OpenMP threads, the longest first.
 *
 * Layouts: q [n, ldq], out [n, ldo] float32 rows (head h at column h * head_dim); k_pool, v_pool
 * [num_kv_heads, num_blocks, block_size, head_dim] bf16; table: the sequence's block ids,
 * ceil((pos0 + n) / block_size) of them. block_size a multiple of 16, head_dim a multiple of
 * 32 and at most 256. Returns 0; -1 for a bad shape or block id; -2 when a buffer cannot be
 * allocated; -3 when AMX is not built or the OS refuses the tile data.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__linux__)
#include "amx.h"
#include "exp512.h"
#define PA_AMX 1
#else
#define PA_AMX 0
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define PT 32 /* positions per step (two 16-row K tiles) */
#define QT 16 /* query vectors per tile */
#define MAX_D 256
#define RES_D 64 /* up to this head_dim, O^T stays in tiles 4-7 across the walk */

#if PA_AMX
/* Tile 0: S^T (16 positions x 16 queries, float32); 1: A operand, K (16 positions x 32 bf16
 * of d) or V^T (16 of d x 32 positions); 2: Q^T (16 d pairs x 16 queries); 3: P^T (16
 * position pairs x 16 queries); 4-7: O^T (16 of d x 16 queries, float32 each). */
static void tiles_on(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
}

/* bf16 of 16 floats, round to nearest even (a NaN stays a NaN), in the low half of each
 * 32-bit lane. */
static inline __m512i round_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

/* The pair layout of two rows: lane c = bf16(even[c]) | bf16(odd[c]) << 16 (nearest even;
 * even and odd are probabilities in [0, 1]: arithmetic results, so a NaN keeps its payload's
 * top bits). */
static inline __m512i pair_bf16(__m512 even, __m512 odd) {
#ifdef __AVX512BF16__
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even); /* even 0..15, odd 16..31 */
    const __m512i zip = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    return _mm512_permutexvar_epi16(zip, both);
#else
    return _mm512_or_si512(round_bf16(even), _mm512_slli_epi32(round_bf16(odd), 16));
#endif
}

/* Q^T tiles of one KV head: qt[tile][d / 32][16 pairs][16 queries][2] bf16 (zero past nq). */
static void pack_queries(const float *q, int64_t ldq, int64_t h, int64_t group, int64_t d,
                         int64_t nq, uint16_t *qt) {
    const int64_t chunks = d / 32, tiles = (nq + QT - 1) / QT;
    uint32_t *dst = (uint32_t *)qt;
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t c = 0; c < chunks; c++)
            for (int64_t col = 0; col < QT; col++) {
                const int64_t u = t * QT + col;
                uint32_t *o = dst + (t * chunks + c) * 16 * QT + col;
                if (u >= nq) {
                    for (int64_t k = 0; k < 16; k++) o[k * QT] = 0;
                    continue;
                }
                const float *src = q + (u / group) * ldq + (h * group + u % group) * d + c * 32;
                uint32_t lanes[32];
                _mm512_storeu_si512(lanes, round_bf16(_mm512_loadu_ps(src)));
                _mm512_storeu_si512(lanes + 16, round_bf16(_mm512_loadu_ps(src + 16)));
                for (int64_t k = 0; k < 16; k++) o[k * QT] = lanes[2 * k] | (lanes[2 * k + 1] << 16);
            }
}

/* V^T tiles of one KV head for positions [0, ctx): vt[step][d / 16][16 of d][32 positions]
 * bf16, zero past ctx. */
static void pack_values(const uint16_t *vh, const int64_t *table, int64_t block_size,
                        int64_t d, int64_t ctx, uint16_t *vt) {
    const int64_t steps = (ctx + PT - 1) / PT;
    for (int64_t t = 0; t < steps; t++) {
        uint16_t *o = vt + t * d * PT;
        for (int64_t p = 0; p < PT; p++) {
            const int64_t pos = t * PT + p;
            if (pos >= ctx) {
                for (int64_t x = 0; x < d; x++) o[x * PT + p] = 0;
                continue;
            }
            const uint16_t *row = vh + (table[pos / block_size] * block_size + pos % block_size) * d;
            for (int64_t x = 0; x < d; x++) o[x * PT + p] = row[x];
        }
    }
}

/* O^T tiles 4.. in and out of obuf (16 x 16 float32 each), for the resident walk. */
#define O_TILES(op)                                                                         \
    do {                                                                                    \
        op(4, obuf, 64);                                                                    \
        op(5, obuf + 256, 64);                                                              \
        if (d > 32) op(6, obuf + 512, 64);                                                  \
        if (d > 48) op(7, obuf + 768, 64);                                                  \
    } while (0)

/* The online softmax of one step (scores sc[32 positions][16 queries], scaled here) for
 * queries whose last attended position is lim[col] - 1; the step starts at position p0.
 * Writes P^T in the pair layout (pt) and returns the factor the accumulator must take. */
static __m512 step_softmax(const float *sc, float scale, int64_t p0, __m512i lim, int full,
                           __m512 *m, __m512 *l, uint32_t *pt) {
    const __m512 lowest = _mm512_set1_ps(-FLT_MAX);
    __m512 s[PT];
    __mmask16 valid[PT];
    __m512 mx = lowest;
    for (int p = 0; p < PT; p++) {
        valid[p] = full ? (__mmask16)0xFFFF
                        : _mm512_cmpgt_epi32_mask(lim, _mm512_set1_epi32((int)(p0 + p)));
        s[p] = _mm512_maskz_mul_ps(valid[p], _mm512_loadu_ps(sc + p * QT), _mm512_set1_ps(scale));
        s[p] = _mm512_mask_mov_ps(lowest, valid[p], s[p]);
        mx = _mm512_max_ps(mx, s[p]);
    }
    const __m512 top = _mm512_max_ps(*m, mx);
    const __m512 corr = exp512(_mm512_sub_ps(*m, top));
    __m512 sum = _mm512_setzero_ps();
    for (int p = 0; p < PT; p += 2) {
        const __m512 e0 = _mm512_maskz_mov_ps(valid[p], exp512(_mm512_sub_ps(s[p], top)));
        const __m512 e1 = _mm512_maskz_mov_ps(valid[p + 1], exp512(_mm512_sub_ps(s[p + 1], top)));
        sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
        _mm512_store_si512(pt + p / 2 * QT, pair_bf16(e0, e1));
    }
    *l = _mm512_add_ps(_mm512_mul_ps(*l, corr), sum);
    *m = top;
    return corr;
}

/* obuf's first d rows (16 lanes each) times corr. */
static void rescale(float *obuf, int64_t d, __m512 corr) {
    for (int64_t x = 0; x < d; x++)
        _mm512_store_ps(obuf + x * QT, _mm512_mul_ps(_mm512_load_ps(obuf + x * QT), corr));
}

/* S^T of one step into sc: two 16-position halves, a half past `hi` (no query of the tile
 * attends to it) left unwritten (step_softmax masks it). */
static void step_scores(const uint16_t *kh, const int64_t *table, int64_t block_size, int64_t d,
                        const uint16_t *q0, int64_t p0, int64_t hi, float *sc) {
    for (int64_t half = 0; half < 2 && p0 + 16 * half < hi; half++) {
        const int64_t p = p0 + 16 * half;
        const uint16_t *kt = kh + (table[p / block_size] * block_size + p % block_size) * d;
        _tile_zero(0);
        for (int64_t c = 0; c < d / 32; c++) {
            _tile_loadd(1, kt + c * 32, d * 2);
            _tile_loadd(2, q0 + c * 512, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, sc + half * 256, 64);
    }
}

/* One query tile of KV head h: the walk over its steps, then its outputs. */
static void query_tile(const uint16_t *kh, const uint16_t *qt, const uint16_t *vt,
                       const int64_t *table, int64_t block_size, int64_t d, int64_t h,
                       int64_t group, int64_t pos0, int64_t nq, int64_t tile, float scale,
                       float *out, int64_t ldo) {
    float sc[PT * QT] __attribute__((aligned(64)));
    uint32_t pt[PT / 2 * QT] __attribute__((aligned(64)));
    float obuf[MAX_D * QT] __attribute__((aligned(64)));
    int32_t lim_a[QT];
    const int64_t u0 = tile * QT, cols = nq - u0 < QT ? nq - u0 : QT;
    for (int64_t col = 0; col < QT; col++) /* padding columns take the last query's limit */
        lim_a[col] = (int32_t)(pos0 + (u0 + (col < cols ? col : cols - 1)) / group + 1);
    const __m512i lim = _mm512_loadu_si512(lim_a);
    const int64_t lo = lim_a[0], hi = lim_a[QT - 1], resident = d <= RES_D;
    memset(obuf, 0, sizeof(float) * d * QT);
    if (resident) O_TILES(_tile_loadd);
    __m512 m = _mm512_set1_ps(-FLT_MAX), l = _mm512_setzero_ps();
    const uint16_t *q0 = qt + tile * (d / 32) * 512;
    for (int64_t t = 0; t * PT < hi; t++) {
        const int64_t p0 = t * PT;
        step_scores(kh, table, block_size, d, q0, p0, hi, sc);
        const __m512 corr = step_softmax(sc, scale, p0, lim, p0 + PT <= lo, &m, &l, pt);
        const int moved = _mm512_cmp_ps_mask(corr, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) != 0;
        _tile_loadd(3, pt, 64);
        const uint16_t *vs = vt + t * d * PT;
        if (resident) {
            if (moved) {
                O_TILES(_tile_stored);
                rescale(obuf, d, corr);
                O_TILES(_tile_loadd);
            }
            _tile_loadd(1, vs, 64);
            _tile_dpbf16ps(4, 1, 3);
            _tile_loadd(1, vs + 512, 64);
            _tile_dpbf16ps(5, 1, 3);
            if (d > 32) {
                _tile_loadd(1, vs + 1024, 64);
                _tile_dpbf16ps(6, 1, 3);
            }
            if (d > 48) {
                _tile_loadd(1, vs + 1536, 64);
                _tile_dpbf16ps(7, 1, 3);
            }
            continue;
        }
        if (moved) rescale(obuf, d, corr);
        for (int64_t j = 0; j < d / 16; j++) {
            _tile_loadd(4, obuf + j * 256, 64);
            _tile_loadd(1, vs + j * 512, 64);
            _tile_dpbf16ps(4, 1, 3);
            _tile_stored(4, obuf + j * 256, 64);
        }
    }
    if (resident) O_TILES(_tile_stored);
    float inv[QT];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
    for (int64_t col = 0; col < cols; col++) {
        const int64_t u = u0 + col;
        float *o = out + (u / group) * ldo + (h * group + u % group) * d;
        for (int64_t x = 0; x < d; x++) o[x] = obuf[x * QT + col] * inv[col];
    }
}
#endif

int pagedkv_prompt_attention_amx(void) {
#if PA_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

int pagedkv_prompt_attention(const float *q, int64_t ldq, float *out, int64_t ldo, int64_t n,
                             const uint16_t *k_pool, const uint16_t *v_pool,
                             const int64_t *table, int64_t pos0, int64_t num_heads,
                             int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                             int64_t head_dim, float scale, int threads) {
    const int64_t d = head_dim, ctx = pos0 + n;
    if (n < 1 || pos0 < 0 || num_kv_heads < 1 || num_heads % num_kv_heads || d % 32 ||
        d > MAX_D || block_size % 16 || block_size < 16 || ldq < num_heads * d ||
        ldo < num_heads * d)
        return -1;
    for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; b++)
        if (table[b] < 0 || table[b] >= num_blocks) return -1;
#if PA_AMX
    if (!amx_permitted()) return -3;
    const int64_t group = num_heads / num_kv_heads, nq = n * group;
    const int64_t qtiles = (nq + QT - 1) / QT, steps = (ctx + PT - 1) / PT;
    const int64_t qt_elems = qtiles * d * QT, vt_elems = steps * d * PT;
    uint16_t *qt = aligned_alloc(64, (size_t)(num_kv_heads * (qt_elems + vt_elems)) * 2);
    if (!qt) return -2;
    uint16_t *vt = qt + num_kv_heads * qt_elems;
    const int64_t head_elems = num_blocks * block_size * d, items = num_kv_heads * qtiles;
    int parts = threads < 1 ? 1 : threads;
    if (parts > items) parts = (int)items;
#pragma omp parallel num_threads(parts) if (parts > 1)
    {
#pragma omp for schedule(static)
        for (int64_t h = 0; h < num_kv_heads; h++) {
            pack_queries(q, ldq, h, group, d, nq, qt + h * qt_elems);
            pack_values(v_pool + h * head_elems, table, block_size, d, ctx, vt + h * vt_elems);
        }
        tiles_on();
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) { /* the longest (last) query tiles first */
            const int64_t h = it % num_kv_heads, tile = qtiles - 1 - it / num_kv_heads;
            query_tile(k_pool + h * head_elems, qt + h * qt_elems, vt + h * vt_elems, table,
                       block_size, d, h, group, pos0, nq, tile, scale, out, ldo);
        }
        _tile_release();
    }
    free(qt);
    return 0;
#else
    (void)q, (void)out, (void)k_pool, (void)v_pool, (void)scale, (void)threads;
    return -3;
#endif
}
