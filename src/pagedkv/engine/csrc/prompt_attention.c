/* A prompt's causal attention in bf16 on AMX-BF16 tiles, straight from pagedkv's paged,
 * head-major bf16 KV pool ("matmul precision medium": the arithmetic of torch's bf16 SDPA).
 *
 * Contract. The chunk's query rows i = 0..n-1 sit at positions pos0 + i of one sequence and
 * attend to positions 0..pos0 + i (causal), or with a sliding window W > 0 to positions
 * pos0 + i - W + 1 .. pos0 + i. For every query vector (row, head):
 *   q is rounded to bf16 (nearest even); each score d_p = q . k_p is the dot product of bf16
 *   values summed in float32 on AMX (TDPBF16PS); with a = scale * log2(e) (float32, > 0),
 *   positions are walked in steps of 32 from position 0 with an online softmax in float32,
 *   in base 2 (prompt_softmax.h's softmax2_in): per step, with M = a * max_p d_p (one float32
 *   multiplication: the max of the products a * d_p, exactly), the reference max
 *   m' = max(m, M) where M > m + 8, else m' = m (lazy, prompt_softmax.h's LAZY_MAX),
 *   e_p = 2^t_p with t_p = fma(d_p, a, -m') (one rounding) by softmax_exp2 (within 2.9e-6
 *   relative), c = 2^(m - m'), l = l * c + (sum of the even p's e_p + sum of the odd p's,
 *   each in p order), acc = acc * c + sum_p bf16(e_p) * v_p (AMX, float32 sums); finally
 *   out = acc * (1 / l) (float32). Mathematically exp(natural score - max) as torch's SDPA;
 *   the roundings differ.
 * Positions outside a query's range are excluded exactly (e_p = 0; a step wholly outside it
 * leaves m, l and acc unchanged, bit for bit), and V is read only within the chunk's span
 * (zeros outside it). So a query's result depends on its own q and the K/V of its own range,
 * and on nothing else: not on the chunk's other rows, its length, where the chunk starts (a
 * cached prefix), the thread count, or stale pool data.
 * That is what makes prefix caching and chunked prefill give the same bits as one
 * uncached prefill, at any prompt length (torch's SDPA blocks by the context length it is
 * given, so its rows change with it from ~600 tokens).
 *
 * Work. One KV head at a time (its scratch only): the queries of its group are listed
 * row-major (row i, group member g: u = i * group + g) and cut into tiles of 16; a tile walks
 * the 32-position steps from its first window's to its last query's. S^T = K Q^T puts
 * positions in rows and queries in columns: the pool's K rows load as the A tile as stored
 * (row stride head_dim * 2 bytes), the queries as B tiles (packed per head), and the softmax
 * runs 16 queries wide with no horizontal sums (prompt_softmax.h). O^T = V^T P^T: V^T is
 * packed per head (16 of d x 32 positions tiles, zeros outside the chunk's span), P^T is
 * built per step in the B (pair) layout, and O^T stays in tiles 4-7 up to head_dim 64 (else
 * an L1 buffer the C tile is loaded from and stored to). The head's packing and its query
 * tiles (the longest first) are shared among the process's OpenMP threads.
 *
 * Layouts: q [n, ldq], out [n, ldo] float32 rows (head h at column h * head_dim); k_pool, v_pool
 * [num_kv_heads, num_blocks, block_size, head_dim] bf16 (elem 2: the float32 kernel's
 * signature); table: the sequence's block ids,
 * ceil((pos0 + n) / block_size) of them (indexed by position; with a window, entries wholly
 * before the chunk's first window are not read). block_size a multiple of 16, head_dim a
 * multiple of 32 and at most 256. Returns 0; -1 for a bad shape or block id; -2 when a
 * buffer cannot be allocated; -3 when AMX is not built or the OS refuses the tile data.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_tiles.h"
#include "prompt_args.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__linux__)
#include "amx.h"
#include "prompt_softmax.h"
#define PA_AMX 1
#else
#define PA_AMX 0
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define RES_D 64 /* up to this head_dim, O^T stays in tiles 4-7 across the walk */

/* Where a call's outputs go: float32 rows out (row stride ldo), or, with xa, bf16 A tiles for
 * the o projection (bf16_tiles.h: row r0 + i, k = head * d + x; k kp). */
typedef struct {
    float *out;
    int64_t ldo;
    uint16_t *xa;
    int64_t kp, r0;
} pa_out;

#if PA_AMX
/* Tiles 0 and 3: S^T (16 positions x 16 queries each, float32); 1: A operand, K (16
 * positions x 32 bf16 of d) or V^T (16 of d x 32 positions); 2: B operand, Q^T (16 d pairs x
 * 16 queries) or P^T (16 position pairs x 16 queries); 4-7: O^T (16 of d x 16 queries,
 * float32 each). */
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

/* 32 consecutive values as 16 bf16 pairs from two vectors of rounded values (round_bf16: value
 * i in the low half of lane i; lo holds values 0..15, hi 16..31): word j of the result is value
 * j, so lane k holds the pair (2k, 2k + 1), the B tile's layout. */
static inline __m512i pair_words(__m512i lo, __m512i hi) {
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36,
                                          34, 32, 30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8,
                                          6, 4, 2, 0);
    return _mm512_permutex2var_epi16(lo, even, hi);
}

/* Q^T tile t of one KV head: qt[d / 32][16 pairs][16 queries][2] bf16 (zero past nq). Each
 * query's 32 values of a chunk become one vector of 16 pairs; 16 queries' vectors are
 * transposed (transpose16) into the tile's 16 rows. */
static void pack_query_tile(const float *q, int64_t ldq, int64_t h, int64_t group, int64_t d,
                            int64_t nq, int64_t t, uint16_t *qt) {
    const int64_t chunks = d / 32;
    uint32_t *dst = (uint32_t *)qt + t * chunks * 16 * QT;
    for (int64_t c = 0; c < chunks; c++) {
        __m512 r[QT];
        for (int64_t col = 0; col < QT; col++) {
            const int64_t u = t * QT + col;
            if (u >= nq) {
                r[col] = _mm512_setzero_ps();
                continue;
            }
            const float *src = q + (u / group) * ldq + (h * group + u % group) * d + c * 32;
            r[col] = _mm512_castsi512_ps(pair_words(round_bf16(_mm512_loadu_ps(src)),
                                                    round_bf16(_mm512_loadu_ps(src + 16))));
        }
        transpose16(r);
        for (int64_t k = 0; k < 16; k++) _mm512_store_ps((float *)(dst + (c * 16 + k) * QT), r[k]);
    }
}

/* V^T tiles of step t of one KV head (positions 32t .. 32t + 31, zero outside [from, ctx)):
 * vt[t][d / 16][16 of d][32 positions] bf16. */
static void pack_value_step(const uint16_t *vh, const int64_t *table, int64_t block_size,
                            int64_t d, int64_t from, int64_t ctx, int64_t t, int gather,
                            uint16_t *vt) {
    uint16_t *o = vt + t * d * PT;
    if (gather) { /* pairs of d gathered as dwords from the 32 rows, split into two rows */
        int32_t at[PT]; /* each row's first dword; outside [from, ctx): masked to zero */
        uint32_t in = 0;
        for (int64_t p = 0; p < PT; p++) {
            const int64_t pos = t * PT + p;
            const int ok = pos >= from && pos < ctx;
            at[p] = ok ? (int32_t)((table[pos / block_size] * block_size + pos % block_size) *
                                   d / 2)
                       : 0;
            in |= (uint32_t)ok << p;
        }
        const __m512i lo_at = _mm512_loadu_si512(at), hi_at = _mm512_loadu_si512(at + 16);
        const __mmask16 lo_in = (__mmask16)in, hi_in = (__mmask16)(in >> 16);
        __m512i odd; /* the high words; the low ones are pair_words' */
        {
            int16_t f[32];
            for (int i = 0; i < 16; i++)
                f[i] = (int16_t)(2 * i + 1), f[16 + i] = (int16_t)(33 + 2 * i);
            odd = _mm512_loadu_si512(f);
        }
        const __m512i zero = _mm512_setzero_si512();
        for (int64_t x = 0; x < d; x += 2) {
            const int *base = (const int *)(vh + x);
            const __m512i g0 = _mm512_mask_i32gather_epi32(zero, lo_in, lo_at, base, 4);
            const __m512i g1 = _mm512_mask_i32gather_epi32(zero, hi_in, hi_at, base, 4);
            _mm512_storeu_si512(o + x * PT, pair_words(g0, g1));
            _mm512_storeu_si512(o + (x + 1) * PT, _mm512_permutex2var_epi16(g0, odd, g1));
        }
        return;
    }
    for (int64_t p = 0; p < PT; p++) {
        const int64_t pos = t * PT + p;
        if (pos < from || pos >= ctx) {
            for (int64_t x = 0; x < d; x++) o[x * PT + p] = 0;
            continue;
        }
        const uint16_t *row = vh + (table[pos / block_size] * block_size + pos % block_size) * d;
        for (int64_t x = 0; x < d; x++) o[x * PT + p] = row[x];
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

/* S^T of the step at p0 issued into tiles 0 and 3 (two 16-position halves, so that their two
 * chains of products overlap); returns whether the second half is computed: a half past
 * `hi` (no query of the tile attends to it) is not, and step_softmax masks it. */
static int scores_issue(const uint16_t *kh, const int64_t *table, int64_t block_size,
                        int64_t d, const uint16_t *q0, int64_t p0, int64_t hi) {
    const int two = p0 + 16 < hi;
    const int64_t p1 = p0 + 16;
    const uint16_t *k0 = kh + (table[p0 / block_size] * block_size + p0 % block_size) * d;
    const uint16_t *k1 = two ? kh + (table[p1 / block_size] * block_size + p1 % block_size) * d
                             : k0;
    _tile_zero(0);
    if (two) _tile_zero(3);
    for (int64_t c = 0; c < d / 32; c++) {
        _tile_loadd(2, q0 + c * 512, 64);
        _tile_loadd(1, k0 + c * 32, d * 2);
        _tile_dpbf16ps(0, 1, 2);
        if (two) {
            _tile_loadd(1, k1 + c * 32, d * 2);
            _tile_dpbf16ps(3, 1, 2);
        }
    }
    return two;
}

/* The issued S^T into sc (32 positions x 16 queries). */
static inline void scores_store(float *sc, int two) {
    _tile_stored(0, sc, 64);
    if (two) _tile_stored(3, sc + 256, 64);
}

/* O^T += V^T P^T for the step's V^T tiles vs (P^T in tile 2): in tiles 4.. (resident), or
 * through obuf. */
static inline void step_values(const uint16_t *vs, int64_t d, int resident, float *obuf) {
    if (resident) {
        _tile_loadd(1, vs, 64);
        _tile_dpbf16ps(4, 1, 2);
        _tile_loadd(1, vs + 512, 64);
        _tile_dpbf16ps(5, 1, 2);
        if (d > 32) {
            _tile_loadd(1, vs + 1024, 64);
            _tile_dpbf16ps(6, 1, 2);
        }
        if (d > 48) {
            _tile_loadd(1, vs + 1536, 64);
            _tile_dpbf16ps(7, 1, 2);
        }
        return;
    }
    for (int64_t j = 0; j < d / 16; j++) {
        _tile_loadd(4, obuf + j * 256, 64);
        _tile_loadd(1, vs + j * 512, 64);
        _tile_dpbf16ps(4, 1, 2);
        _tile_stored(4, obuf + j * 256, 64);
    }
}

/* write_out into A tiles: the same float32 products out = acc * (1 / l), each rounded as the
 * o projection's packing rounds its input (to_bf16), 16 values of a query at a time. */
static void write_tiles(const float *obuf, __m512 l, const qtile *t, int64_t d, int64_t h,
                        int64_t group, const pa_out *o) {
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
    for (int64_t x0 = 0; x0 < d; x0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; i++)
            r[i] = _mm512_mul_ps(_mm512_load_ps(obuf + (x0 + i) * QT), inv);
        transpose16(r);
        for (int64_t col = 0; col < t->cols; col++) {
            const int64_t u = t->u0 + col, k = (h * group + u % group) * d + x0;
            _mm256_storeu_si256((__m256i *)&XA(o->xa, o->kp, o->r0 + u / group, k),
                                to_bf16_16(r[col]));
        }
    }
}

/* One query tile of KV head h: the walk over its steps, then its outputs. Software-pipelined:
 * step t + 1's scores are issued on the tiles before step t's softmax runs on the vector
 * units, and stored after it, so the two overlap (the same operations per step). */
static void query_tile(const uint16_t *kh, const uint16_t *qt, const uint16_t *vt,
                       const int64_t *table, int64_t block_size, int64_t d, int64_t h,
                       int64_t group, int64_t pos0, int64_t nq, int64_t tile, int64_t window,
                       float scale, const pa_out *o) {
    float scores[2][PT * QT] __attribute__((aligned(64)));
    uint32_t pt[PT / 2 * QT] __attribute__((aligned(64)));
    float obuf[MAX_D * QT] __attribute__((aligned(64)));
    const qtile tq = tile_limits(pos0, group, nq, tile, window);
    const int64_t hi = tq.hi, resident = d <= RES_D, end = (hi + PT - 1) / PT;
    const float scale2 = scale * 1.44269504088896341f; /* base-2 scores: softmax_exp2 */
    if (resident) { /* O^T starts at zero in its tiles; obuf is written before it is read */
        _tile_zero(4);
        _tile_zero(5);
        if (d > 32) _tile_zero(6);
        if (d > 48) _tile_zero(7);
    } else {
        memset(obuf, 0, sizeof(float) * d * QT);
    }
    __m512 m = _mm512_set1_ps(-FLT_MAX), l = _mm512_setzero_ps();
    const uint16_t *q0 = qt + tile * (d / 32) * 512;
    float *sc = scores[0], *next = scores[1];
    int64_t t = tq.first / PT;
    int guess = 0; /* step_softmax2's: the first step sets m */
    scores_store(sc, scores_issue(kh, table, block_size, d, q0, t * PT, hi));
    for (; t < end; t++) {
        const int64_t p0 = t * PT;
        const int more = t + 1 < end;
        const int two = more ? scores_issue(kh, table, block_size, d, q0, p0 + PT, hi) : 0;
        const __m512 corr = step_softmax2(sc, scale2, p0, &tq, &m, &l, pt, &guess);
        if (more) scores_store(next, two);
        if (_mm512_cmp_ps_mask(corr, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ)) { /* the max moved */
            if (resident) O_TILES(_tile_stored);
            rescale(obuf, d, corr);
            if (resident) O_TILES(_tile_loadd);
        }
        _tile_loadd(2, pt, 64);
        step_values(vt + t * d * PT, d, (int)resident, obuf);
        float *done = sc;
        sc = next;
        next = done;
    }
    if (resident) O_TILES(_tile_stored);
    if (o->xa)
        write_tiles(obuf, l, &tq, d, h, group, o);
    else
        write_out(obuf, l, &tq, d, h, group, o->out, o->ldo);
}
#endif

int pagedkv_prompt_attention_amx(void) {
#if PA_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

static int attention(const float *q, int64_t ldq, const pa_out *o, int64_t n,
                     const uint16_t *k_pool, const uint16_t *v_pool, int64_t elem,
                     const int64_t *table, int64_t pos0, int64_t num_heads, int64_t num_kv_heads,
                     int64_t num_blocks, int64_t block_size, int64_t head_dim, float scale,
                     int64_t window, int threads) {
    const int64_t ldo = o->xa ? num_heads * head_dim : o->ldo;
    const int64_t d = head_dim, ctx = pos0 + n, from = window_start(pos0, window);
    if (elem != 2 || block_size % 16 ||
        prompt_args(n, pos0, window, num_heads, num_kv_heads, d, 32, ldq, ldo, table,
                    num_blocks, block_size))
        return -1;
#if PA_AMX
    if (!amx_permitted()) return -3;
    const int64_t group = num_heads / num_kv_heads, nq = n * group;
    const int64_t qtiles = (nq + QT - 1) / QT, steps = (ctx + PT - 1) / PT;
    const int64_t qt_elems = qtiles * d * QT, vt_elems = steps * d * PT;
    uint16_t *qt = aligned_alloc(64, (size_t)(qt_elems + vt_elems) * 2); /* one head's */
    if (!qt) return -2;
    uint16_t *vt = qt + qt_elems;
    const int64_t head_elems = num_blocks * block_size * d;
    const int gather = head_elems / 2 <= INT32_MAX; /* dword offsets in the gathers' int32 */
    int parts = threads < 1 ? 1 : threads;
    if (parts > qtiles) parts = (int)qtiles;
    for (int64_t h = 0; h < num_kv_heads; h++) { /* a head at a time: its scratch only */
        const uint16_t *kh = k_pool + h * head_elems, *vh = v_pool + h * head_elems;
#pragma omp parallel num_threads(parts) if (parts > 1)
        {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < qtiles; t++) pack_query_tile(q, ldq, h, group, d, nq, t, qt);
#pragma omp for schedule(static)
            for (int64_t t = from / PT; t < steps; t++)
                pack_value_step(vh, table, block_size, d, from, ctx, t, gather, vt);
            tiles_on();
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < qtiles; it++) /* the longest (last) query tiles first */
                query_tile(kh, qt, vt, table, block_size, d, h, group, pos0, nq, qtiles - 1 - it,
                           window, scale, o);
            _tile_release();
        }
    }
    free(qt);
    return 0;
#else
    (void)q, (void)o, (void)k_pool, (void)v_pool, (void)scale, (void)threads, (void)from, (void)ctx;
    return -3;
#endif
}

int pagedkv_prompt_attention(const float *q, int64_t ldq, float *out, int64_t ldo, int64_t n,
                             const uint16_t *k_pool, const uint16_t *v_pool, int64_t elem,
                             const int64_t *table, int64_t pos0, int64_t num_heads,
                             int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                             int64_t head_dim, float scale, int64_t window, int threads) {
    const pa_out o = {out, ldo, NULL, 0, 0};
    return attention(q, ldq, &o, n, k_pool, v_pool, elem, table, pos0, num_heads, num_kv_heads,
                     num_blocks, block_size, head_dim, scale, window, threads);
}

/* pagedkv_prompt_attention with the outputs written as the o projection's bf16 A tiles
 * (pa_out): rows r0 .. r0 + n - 1 of xa, whose k is kp = num_heads * head_dim (a multiple of
 * 32 here). The tiles' other rows are not touched. */
int pagedkv_prompt_attention_tiles(const float *q, int64_t ldq, uint16_t *xa, int64_t kp,
                                   int64_t r0, int64_t n, const uint16_t *k_pool,
                                   const uint16_t *v_pool, const int64_t *table, int64_t pos0,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                                   int64_t block_size, int64_t head_dim, float scale,
                                   int64_t window, int threads) {
    if (!xa || r0 < 0 || kp != num_heads * head_dim) return -1;
    const pa_out o = {NULL, 0, xa, kp, r0};
    return attention(q, ldq, &o, n, k_pool, v_pool, 2, table, pos0, num_heads, num_kv_heads,
                     num_blocks, block_size, head_dim, scale, window, threads);
}
