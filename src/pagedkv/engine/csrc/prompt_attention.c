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
#define QT_MAX 16 /* query heads a KV head at most for pagedkv_decode_amx (one tile) */

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

/* ---- Decode rows (pagedkv_decode_amx) ----
 *
 * One query row per sequence (a decode step), walked with the arithmetic of query_tile for
 * that row: the same S^T tiles, the same softmax (step_softmax2: its steps of 32 from
 * position 0, the lazy max, the even/odd sums), the same bf16 P and float32 sums, so a row's
 * result is bit for bit what pagedkv_prompt_attention gives for it at position len - 1 (no
 * window; a window's rows start their steps at their table's first block instead). The
 * values are multiplied as O = P V instead of O^T = V^T P^T: the same products summed in the
 * same order (TDPBF16PS sums a row-column pair by k in order, whichever operand is A), so V
 * needs no transposing (each pair of positions' rows interleaved into the B tile layout) and
 * P^T only the one 16 x 16 dword transpose into P's A tile. */

/* V's B tiles of one step (positions p0 .. p0 + 31, zero outside [from, ctx)):
 * vp[d / 16][16 position pairs][16 of d][2] bf16. */
static void pack_value_pairs(const uint16_t *vh, const int64_t *table, int64_t block_size,
                             int64_t d, int64_t from, int64_t ctx, int64_t p0, uint16_t *vp) {
    __m512i idx[2];
    {
        int16_t lo[32], hi[32];
        for (int i = 0; i < 16; i++) {
            lo[2 * i] = (int16_t)i, lo[2 * i + 1] = (int16_t)(32 + i);
            hi[2 * i] = (int16_t)(16 + i), hi[2 * i + 1] = (int16_t)(48 + i);
        }
        idx[0] = _mm512_loadu_si512(lo);
        idx[1] = _mm512_loadu_si512(hi);
    }
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t k0 = 0; k0 < PT / 2; k0 += 4) { /* 4 pairs' rows loaded, then stored: the
                                                 * loads do not wait behind the stores */
        __m512i a[4][RES_D / 32], b[4][RES_D / 32];
        for (int64_t k = 0; k < 4; k++) {
            const uint16_t *row[2];
            for (int e = 0; e < 2; e++) {
                const int64_t pos = p0 + 2 * (k0 + k) + e;
                row[e] = pos >= from && pos < ctx
                             ? vh + (table[pos / block_size] * block_size + pos % block_size) * d
                             : NULL;
            }
            for (int64_t c = 0; c < d / 32; c++) { /* 32 of d: two 16-wide tiles */
                a[k][c] = row[0] ? _mm512_loadu_si512(row[0] + 32 * c) : zero;
                b[k][c] = row[1] ? _mm512_loadu_si512(row[1] + 32 * c) : zero;
            }
        }
        for (int64_t k = 0; k < 4; k++)
            for (int64_t c = 0; c < d / 32; c++)
                for (int half = 0; half < 2; half++)
                    _mm512_store_si512(vp + ((2 * c + half) * (PT / 2) + k0 + k) * 32,
                                       _mm512_permutex2var_epi16(a[k][c], idx[half], b[k][c]));
    }
}

/* Rows q of the O tiles' buffer (obuf[j][16 queries][16 of d]) times corr's lane q: the
 * products rescale() makes of the same values in the O^T layout. */
static void rescale_rows(float *obuf, int64_t d, __m512 corr) {
    float c[QT] __attribute__((aligned(64)));
    _mm512_store_ps(c, corr);
    for (int64_t j = 0; j < d / 16; j++)
        for (int q = 0; q < QT; q++) {
            float *r = obuf + (j * QT + q) * 16;
            _mm512_store_ps(r, _mm512_mul_ps(_mm512_load_ps(r), _mm512_set1_ps(c[q])));
        }
}

/* Prefetch the K and V rows of the step at p0 (positions [p0, min(p0 + 32, ctx)), each 16-run
 * one block's contiguous rows): a decode walk reads each row once, straight from memory. */
static inline void prefetch_step(const uint16_t *kh, const uint16_t *vh, const int64_t *table,
                                 int64_t block_size, int64_t d, int64_t p0, int64_t ctx) {
    for (int64_t r0 = p0; r0 < p0 + PT && r0 < ctx; r0 += 16) {
        const int64_t at = (table[r0 / block_size] * block_size + r0 % block_size) * d;
        const int64_t bytes = (ctx - r0 < 16 ? ctx - r0 : 16) * d * 2;
        for (int64_t off = 0; off < bytes; off += 64) {
            _mm_prefetch((const char *)(kh + at) + off, _MM_HINT_T0);
            _mm_prefetch((const char *)(vh + at) + off, _MM_HINT_T0);
        }
    }
}

/* The walk after this one, whose first step a walk's last step prefetches (kh NULL: none). */
typedef struct {
    const uint16_t *kh, *vh;
    const int64_t *table;
    int64_t start, len;
} decode_next;

/* One (sequence, KV head) decode walk; head_dim d <= RES_D (O in tiles 4..). */
static void decode_row(const float *q, int64_t ldq, float *out, const uint16_t *kh,
                       const uint16_t *vh, const int64_t *table, int64_t block_size, int64_t d,
                       int64_t h, int64_t group, int64_t len, int64_t start, float scale,
                       const decode_next *nx) {
    uint16_t qt[RES_D / 32 * 16 * QT * 2] __attribute__((aligned(64)));
    float scores[2][PT * QT] __attribute__((aligned(64)));
    uint32_t pt[PT / 2 * QT] __attribute__((aligned(64)));
    uint16_t vps[2][RES_D / 16 * PT / 2 * 32] __attribute__((aligned(64))); /* by step parity */
    float obuf[RES_D * QT] __attribute__((aligned(64)));
    const int64_t pos0 = len - 1, window = start ? len - start : 0;
    const qtile tq = tile_limits(pos0, group, group, 0, window);
    const int64_t hi = tq.hi, end = (hi + PT - 1) / PT, from = tq.first;
    const float scale2 = scale * 1.44269504088896341f; /* as query_tile's */
    pack_query_tile(q, ldq, h, group, d, group, 0, qt);
    _tile_zero(4);
    _tile_zero(5);
    if (d > 32) _tile_zero(6);
    if (d > 48) _tile_zero(7);
    __m512 m = _mm512_set1_ps(-FLT_MAX), l = _mm512_setzero_ps();
    float *sc = scores[0], *next = scores[1];
    int64_t t = from / PT;
    int guess = 0; /* step_softmax2's, as query_tile's */
    if (t + 1 < end) prefetch_step(kh, vh, table, block_size, d, (t + 1) * PT, hi);
    scores_store(sc, scores_issue(kh, table, block_size, d, qt, t * PT, hi));
    pack_value_pairs(vh, table, block_size, d, from, hi, t * PT, vps[t & 1]);
    for (; t < end; t++) {
        const int64_t p0 = t * PT;
        const uint16_t *vp = vps[t & 1];
        const int more = t + 1 < end;
        if (t + 2 < end) /* step t + 1's rows are on their way: ask for t + 2's */
            prefetch_step(kh, vh, table, block_size, d, p0 + 2 * PT, hi);
        else if (!more && nx->kh)
            prefetch_step(nx->kh, nx->vh, nx->table, block_size, d, nx->start / PT * PT, nx->len);
        const int two = more ? scores_issue(kh, table, block_size, d, qt, p0 + PT, hi) : 0;
        if (more) /* step t + 1's V while its scores run on the tiles and before t's softmax:
                   * its rows' loads overlap the softmax (same values, a step earlier) */
            pack_value_pairs(vh, table, block_size, d, from, hi, p0 + PT, vps[(t + 1) & 1]);
        const __m512 corr = step_softmax2(sc, scale2, p0, &tq, &m, &l, pt, &guess);
        if (more) scores_store(next, two);
        if (_mm512_cmp_ps_mask(corr, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ)) { /* the max moved */
            O_TILES(_tile_stored);
            rescale_rows(obuf, d, corr);
            O_TILES(_tile_loadd);
        }
        __m512 r[16];
        for (int k = 0; k < 16; k++) r[k] = _mm512_load_ps((const float *)(pt + k * QT));
        transpose16(r); /* P^T pairs -> P: row q holds query q's 32 bf16, position order */
        for (int k = 0; k < 16; k++) _mm512_store_ps((float *)(pt + k * QT), r[k]);
        _tile_loadd(1, pt, 64);
        for (int64_t j = 0; j < d / 16; j++) { /* O[:, 16j..] += P V[:, 16j..] */
            _tile_loadd(2, vp + j * (PT / 2) * 32, 64);
            switch (j) { /* a tile number must be a constant */
            case 0: _tile_dpbf16ps(4, 1, 2); break;
            case 1: _tile_dpbf16ps(5, 1, 2); break;
            case 2: _tile_dpbf16ps(6, 1, 2); break;
            default: _tile_dpbf16ps(7, 1, 2); break;
            }
        }
        float *done = sc;
        sc = next;
        next = done;
    }
    O_TILES(_tile_stored);
    float inv[QT] __attribute__((aligned(64)));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
    for (int64_t u = 0; u < group; u++) { /* out = acc * (1 / l), as write_out */
        float *dst = out + (h * group + u) * d;
        for (int64_t j = 0; j < d / 16; j++)
            _mm512_storeu_ps(dst + j * 16, _mm512_mul_ps(_mm512_load_ps(obuf + (j * QT + u) * 16),
                                                         _mm512_set1_ps(inv[u])));
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

/* Decode attention over bf16 pools in the arithmetic of pagedkv_prompt_attention ("medium"):
 * paged_decode.c's pagedkv_decode_bf16kv_par call (the same arguments and layouts: q, out
 * [num_seqs, num_heads, head_dim] float32; tables [num_seqs, table_stride]; lens, starts as
 * there), each sequence's row walked by decode_row. The sequences are cut among `threads`
 * OpenMP threads into runs of about equal context (at least DA_MIN_POS positions a run); a
 * row's result does not depend on the cut. Returns 0; -1 for a length, start or block id out
 * of range (checked before anything is written); -2 for a shape it does not take (more than
 * 16 query heads a KV head, head_dim not a multiple of 32 or above 64, block_size not a
 * multiple of 16); -3 where AMX is not built or the OS refuses the tile data. */
#define DA_MIN_POS 256
#define DA_PAR_MAX 16
int pagedkv_decode_amx(const float *q, float *out, const uint16_t *k_pool,
                       const uint16_t *v_pool, const int64_t *tables, const int64_t *lens,
                       const int64_t *starts, int64_t num_seqs, int64_t table_stride,
                       int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                       int64_t block_size, int64_t head_dim, float scale, int threads) {
    const int64_t d = head_dim;
    if (num_seqs < 0 || num_kv_heads < 1 || num_heads % num_kv_heads ||
        num_heads / num_kv_heads > QT_MAX || d % 32 || d > RES_D || block_size < 16 ||
        block_size % 16)
        return -2;
    int64_t total = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t len = lens[s], start = starts ? starts[s] : 0;
        if (len < 1 || start < 0 || start >= len || start >= block_size) return -1;
        const int64_t *table = tables + s * table_stride;
        for (int64_t b = 0; b < (len + block_size - 1) / block_size; b++)
            if (table[b] < 0 || table[b] >= num_blocks) return -1;
        total += len;
    }
#if PA_AMX
    if (!amx_permitted()) return -3;
    int64_t parts = threads < DA_PAR_MAX ? threads : DA_PAR_MAX, cuts[DA_PAR_MAX + 1];
    if (parts > num_seqs) parts = num_seqs;
    if (parts > total / DA_MIN_POS) parts = total / DA_MIN_POS;
#ifdef _OPENMP
    if (omp_in_parallel()) parts = 1;
#endif
    if (parts < 1) parts = 1;
    int64_t p = 1, seen = 0; /* each run ends at the row by which its share is reached */
    cuts[0] = 0;
    for (int64_t s = 0; s < num_seqs && p < parts; s++) {
        seen += lens[s];
        if (seen * parts >= total * p) cuts[p++] = s + 1;
    }
    if (p > 1 && cuts[p - 1] == num_seqs) p--;
    cuts[p] = num_seqs;
    const int64_t group = num_heads / num_kv_heads, row = num_heads * d;
    const int64_t head_elems = num_blocks * block_size * d;
#pragma omp parallel for num_threads((int)p) schedule(static, 1) if (p > 1)
    for (int64_t part = 0; part < p; part++) {
        tiles_on();
        for (int64_t s = cuts[part]; s < cuts[part + 1]; s++)
            for (int64_t h = 0; h < num_kv_heads; h++) {
                decode_next nx = {NULL, NULL, NULL, 0, 0};
                const int64_t ns = h + 1 < num_kv_heads ? s : s + 1;
                if (ns < cuts[part + 1]) {
                    const int64_t nh = h + 1 < num_kv_heads ? h + 1 : 0;
                    nx = (decode_next){k_pool + nh * head_elems, v_pool + nh * head_elems,
                                       tables + ns * table_stride, starts ? starts[ns] : 0,
                                       lens[ns]};
                }
                decode_row(q + s * row, row, out + s * row, k_pool + h * head_elems,
                           v_pool + h * head_elems, tables + s * table_stride, block_size, d, h,
                           group, lens[s], starts ? starts[s] : 0, scale, &nx);
            }
        _tile_release();
    }
    return 0;
#else
    (void)q, (void)out, (void)k_pool, (void)v_pool, (void)scale, (void)threads, (void)total;
    return -3;
#endif
}
