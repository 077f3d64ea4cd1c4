/* A prompt's causal attention in float32 from pagedkv's paged, head-major KV pool (float32,
 * or bf16 widened exactly as it is read): the ``highest`` precision's counterpart of
 * prompt_attention.c, with the same walk and the same row invariance.
 *
 * Contract. The chunk's query rows i = 0..n-1 sit at positions pos0 + i of one sequence and
 * attend to positions 0..pos0 + i, or with a sliding window W > 0 to pos0 + i - W + 1 ..
 * pos0 + i. For every query vector (row, head), in float32:
 *   s_p = scale * (sum over x = 0, 1, .., d-1 of q[x] * k_p[x]), one fused multiply-add per x
 *   in increasing x (then one multiplication); positions walked in steps of 32 from position 0
 *   with an online softmax (prompt_softmax.h: m' = max(m, max_p s_p), c = exp(m - m'),
 *   l = l * c + sum_p e_p in p order, e_p = exp512(s_p - m')); acc = acc * c, then for p in
 *   increasing order acc[x] = fma(v_p[x], e_p, acc[x]); finally out = acc * (1 / l).
 * Positions past a query's own enter with e_p = 0 exactly, and K/V past the chunk as zeros, so
 * (as in prompt_attention.c) a query's result depends on its own q and the K/V of positions
 * 0..its own, and on nothing else: not the chunk's other rows or length, a cached prefix, the
 * thread count, or stale pool slots. No step rounds anything to bf16.
 *
 * Work. One KV head at a time (its scratch only): the K and V rows of the chunk's span are
 * copied (widened) into float32 scratch, zeros outside it, and the queries into [tile][d][16]
 * (16 query vectors in the lanes: each score or value step is one FMA of a broadcast pool
 * element with 16 queries). The head's packing and its query tiles (the longest first) are
 * shared among the process's OpenMP threads.
 *
 * Layouts: q [n, ldq], out [n, ldo] float32 rows (head h at column h * head_dim); k_pool,
 * v_pool [num_kv_heads, num_blocks, block_size, head_dim], float32 (elem 4) or bf16 (elem 2);
 * table: the sequence's block ids, ceil((pos0 + n) / block_size) of them. head_dim a multiple
 * of 16 and at most 256. Returns 0; -1 for a bad shape or block id; -2 when a buffer cannot be
 * allocated; -3 when the build has no AVX-512 (the caller keeps torch's SDPA).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prompt_args.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "prompt_softmax.h"
#define PF_512 1
#else
#define PF_512 0
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#if PF_512
/* Rows 32t .. 32t + 31 of one KV head's pool as float32 rows of dst ([.][d]), zero outside
 * [from, ctx). */
static void pack_step_rows(const char *pool_h, int64_t elem, const int64_t *table,
                           int64_t block_size, int64_t d, int64_t from, int64_t ctx, int64_t t,
                           float *dst) {
    for (int64_t pos = t * PT; pos < (t + 1) * PT; pos++) {
        float *o = dst + pos * d;
        if (pos < from || pos >= ctx) {
            memset(o, 0, sizeof(float) * d);
            continue;
        }
        const int64_t at = (table[pos / block_size] * block_size + pos % block_size) * d;
        if (elem == 4) {
            memcpy(o, (const float *)pool_h + at, sizeof(float) * d);
            continue;
        }
        const uint16_t *src = (const uint16_t *)pool_h + at;
        for (int64_t x = 0; x < d; x += 16)
            _mm512_storeu_ps(o + x, _mm512_castsi512_ps(_mm512_slli_epi32(
                                        _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                            (const __m256i *)(src + x))),
                                        16)));
    }
}

/* Query tile t of one KV head as [d][16] float32 at qt + t * d * 16 (zero past nq). */
static void pack_query_tile(const float *q, int64_t ldq, int64_t h, int64_t group, int64_t d,
                            int64_t nq, int64_t t, float *qt) {
    for (int64_t col = 0; col < QT; col++) {
        const int64_t u = t * QT + col;
        float *o = qt + t * d * QT + col;
        const float *src = q + (u / group) * ldq + (h * group + u % group) * d;
        for (int64_t x = 0; x < d; x++) o[x * QT] = u < nq ? src[x] : 0.0f;
    }
}

/* Scores of one step: sc[p][lane] for 32 positions from p0 (the rows of kf), halves past `hi`
 * left unwritten (step_softmax masks them). */
static void step_scores(const float *kf, const float *qt, int64_t d, int64_t p0, int64_t hi,
                        float *sc) {
    for (int64_t half = 0; half < 2 && p0 + 16 * half < hi; half++) {
        const float *k = kf + (p0 + 16 * half) * d;
        __m512 acc[16];
        for (int p = 0; p < 16; p++) acc[p] = _mm512_setzero_ps();
        for (int64_t x = 0; x < d; x++) {
            const __m512 qv = _mm512_load_ps(qt + x * QT);
            for (int p = 0; p < 16; p++)
                acc[p] = _mm512_fmadd_ps(_mm512_set1_ps(k[p * d + x]), qv, acc[p]);
        }
        for (int p = 0; p < 16; p++) _mm512_store_ps(sc + (16 * half + p) * QT, acc[p]);
    }
}

/* obuf[x][lane] += sum over the step's positions p (increasing) of v[p][x] * pe[p][lane]. */
static void step_values(const float *vf, const float *pe, int64_t d, float *obuf) {
    for (int64_t x0 = 0; x0 < d; x0 += 16) {
        __m512 acc[16];
        for (int x = 0; x < 16; x++) acc[x] = _mm512_load_ps(obuf + (x0 + x) * QT);
        for (int p = 0; p < PT; p++) {
            const __m512 e = _mm512_load_ps(pe + p * QT);
            const float *v = vf + p * d + x0;
            for (int x = 0; x < 16; x++) acc[x] = _mm512_fmadd_ps(_mm512_set1_ps(v[x]), e, acc[x]);
        }
        for (int x = 0; x < 16; x++) _mm512_store_ps(obuf + (x0 + x) * QT, acc[x]);
    }
}

/* One query tile of KV head h: the walk over its steps, then its outputs. */
static void query_tile(const float *kf, const float *vf, const float *qt, int64_t d, int64_t h,
                       int64_t group, int64_t pos0, int64_t nq, int64_t tile, int64_t window,
                       float scale, float *out, int64_t ldo) {
    float sc[PT * QT] __attribute__((aligned(64)));
    float pe[PT * QT] __attribute__((aligned(64)));
    float obuf[MAX_D * QT] __attribute__((aligned(64)));
    const qtile tq = tile_limits(pos0, group, nq, tile, window);
    memset(obuf, 0, sizeof(float) * d * QT);
    __m512 m = _mm512_set1_ps(-FLT_MAX), l = _mm512_setzero_ps();
    const float *q0 = qt + tile * d * QT;
    for (int64_t t = tq.first / PT; t * PT < tq.hi; t++) {
        const int64_t p0 = t * PT;
        step_scores(kf, q0, d, p0, tq.hi, sc);
        const __m512 corr = step_softmax(sc, scale, p0, &tq, &m, &l, pe);
        if (_mm512_cmp_ps_mask(corr, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ)) rescale(obuf, d, corr);
        step_values(vf + p0 * d, pe, d, obuf);
    }
    write_out(obuf, l, &tq, d, h, group, out, ldo);
}
#endif

int pagedkv_prompt_attention_f32_built(void) { return PF_512; }

int pagedkv_prompt_attention_f32(const float *q, int64_t ldq, float *out, int64_t ldo, int64_t n,
                                 const void *k_pool, const void *v_pool, int64_t elem,
                                 const int64_t *table, int64_t pos0, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                                 int64_t head_dim, float scale, int64_t window, int threads) {
    const int64_t d = head_dim, ctx = pos0 + n, from = window_start(pos0, window);
    if ((elem != 2 && elem != 4) ||
        prompt_args(n, pos0, window, num_heads, num_kv_heads, d, 16, ldq, ldo, table,
                    num_blocks, block_size))
        return -1;
#if PF_512
    const int64_t group = num_heads / num_kv_heads, nq = n * group;
    const int64_t qtiles = (nq + QT - 1) / QT, rows = (ctx + PT - 1) / PT * PT;
    const int64_t qt_elems = qtiles * d * QT, kv_elems = rows * d, steps = rows / PT;
    float *qt = aligned_alloc(64, sizeof(float) * (size_t)(qt_elems + 2 * kv_elems));
    if (!qt) return -2; /* one head's scratch */
    float *kf = qt + qt_elems, *vf = kf + kv_elems;
    const int64_t head_bytes = num_blocks * block_size * d * elem;
    int parts = threads < 1 ? 1 : threads;
    if (parts > qtiles) parts = (int)qtiles;
    for (int64_t h = 0; h < num_kv_heads; h++) { /* a head at a time: its scratch only */
        const char *kh = (const char *)k_pool + h * head_bytes;
        const char *vh = (const char *)v_pool + h * head_bytes;
#pragma omp parallel num_threads(parts) if (parts > 1)
        {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < qtiles; t++) pack_query_tile(q, ldq, h, group, d, nq, t, qt);
#pragma omp for schedule(static)
            for (int64_t t = from / PT; t < steps; t++) {
                pack_step_rows(kh, elem, table, block_size, d, from, ctx, t, kf);
                pack_step_rows(vh, elem, table, block_size, d, from, ctx, t, vf);
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < qtiles; it++) /* the longest (last) query tiles first */
                query_tile(kf, vf, qt, d, h, group, pos0, nq, qtiles - 1 - it, window, scale, out,
                           ldo);
        }
    }
    free(qt);
    return 0;
#else
    (void)q, (void)out, (void)k_pool, (void)v_pool, (void)scale, (void)threads, (void)from, (void)ctx;
    return -3;
#endif
}
