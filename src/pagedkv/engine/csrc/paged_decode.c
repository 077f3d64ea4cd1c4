/* Decode attention straight from pagedkv's paged, head-major KV pool.
 *
 * One query token per sequence; grouped-query attention (each KV head serves `group`
 * consecutive query heads). For every (sequence, KV head) the kernel walks the sequence's
 * block table once, reading each K and V block of that head from the pool a single time for
 * all the group's queries, with an online (per-block) softmax. Nothing is gathered: torch's
 * path copies the blocks into a padded batch first and SDPA reads that copy again.
 *
 * Per block the work is two small matrix products, each vectorised across positions or
 * head_dim rather than one dot product per position:
 *   scores[group][rows] = Q[group][d] . K[rows][d]^T   tiles of 4 rows x up to 3 queries: each
 *                        K row chunk is loaded once for the tile's queries, the 12 running sums
 *                        stay in registers, and one horizontal reduction serves 4 positions;
 *   acc[group][d]      += P[group][rows] . V[rows][d]   tiles of 16 lanes of d x up to 3
 *                        queries: each V row chunk is loaded once for the tile's queries and
 *                        the accumulators stay in registers across the block's rows.
 * With AVX2 + FMA (gcc -march=native on such a CPU) these are intrinsics; otherwise the same
 * tiles are plain loops. With AVX-512 and head_dim a multiple of 16, 512-bit tiles read either
 * pool as stored (bf16 widened in registers, no scratch copy; the "512-bit tiles" below), as
 * fast as the float32 pool's memory allows: SmolLM2's 16-sequence decode attention over a bf16
 * pool 9.3 -> 8.1 ms per step on one core of the AVX-512 Xeon, the float32 pool unchanged
 * (13.5 ms: the core's outstanding misses, not the arithmetic, bound it; most samples sit on
 * the prefetches of the next block). On those builds the online softmax also runs 16 positions a
 * step, its exponentials by exp512 (Cephes' expf polynomial, within 1 ulp of exp), and the
 * values accumulate 64 columns at a time (12 independent FMA chains, not 3): the 16-sequence
 * call 4-11% faster (float32 pools, bench_decode_kernel.py), 6-7% (bf16). Only the order of the
 * float additions, and there the exponential, differ from a dot product per position and
 * expf (the tests compare with a float64 reference).
 *
 * Layouts (contiguous; float32, or bf16 pools for pagedkv_decode_bf16kv):
 *   q, out     [num_seqs, num_heads, head_dim]
 *   k_pool     [num_kv_heads, num_blocks, block_size, head_dim]   (v_pool the same)
 *   tables     [num_seqs, table_stride] block ids; row s holds ceil(lens[s] / block_size) ids
 *   lens       [num_seqs] context lengths (>= 1), the query's own position included
 *   starts     [num_seqs] or NULL: positions of the first block not attended (a sliding
 *              window that begins inside it; 0 <= starts[s] < min(lens[s], block_size)).
 *              The table then begins at the window's first block and lens counts from it.
 *
 * bfloat16 pools (pagedkv_decode_bf16kv, q and out still float32): each block's K and V rows
 * are widened (exact: a bf16 value is the top half of a float32) into float32 scratch as they
 * are read, or in registers by the 512-bit tiles, and the same float32 tiles run, so the
 * result is bit for bit the float32 entry's on the widened pools while the pool bytes read
 * halve. While a block computes, the next one in the walk (the next head's or sequence's
 * first block after a last one) is prefetched.
 *
 * Returns 0, -1 when a block id is out of range, a length is not positive or a start is out
 * of range, -2 when a shape is above the kernel's limits, or -3 when the bf16 scratch cannot
 * be allocated (nothing meaningful is written then; the caller raises). Compiled (not linked) with -ffast-math for vectorised expf: the
 * code never produces infinities or NaNs for finite inputs (the running max starts at
 * -FLT_MAX, not -inf).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDKV_AVX2 1
#endif
#if defined(PAGEDKV_AVX2) && defined(__AVX512F__) && defined(__AVX512DQ__)
#define PAGEDKV_512 1
#include "exp512.h"
#endif

#define MAX_GROUP 64
#define MAX_BLOCK 256
#define MAX_HEAD_DIM 512
#define QTILE 3 /* queries per tile: 3 x 4 score sums, or 3 x 2 accumulators, in registers */

/* The tile functions take their query count as an argument that is a constant at every call
 * site: inlined, the loops over it unroll and the accumulator arrays live in registers. */
#if defined(__GNUC__)
#define TILE_FN static inline __attribute__((always_inline)) void
#else
#define TILE_FN static inline void
#endif

#ifdef PAGEDKV_AVX2
/* Lane r (r < 4) of the result: the sum of all 8 lanes of a[r]. */
static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

static inline float hsum1(__m256 a) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 p = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}
#endif

/* sc[i * ld + j] = scale * q[i] . k[j] for i < nq (nq <= QTILE) and 4 rows j = 0..3. */
TILE_FN scores_4rows(const float *restrict q, int64_t nq, const float *restrict k, int64_t d,
                     float scale, float *restrict sc, int64_t ld) {
    int64_t x = 0;
    float tile[QTILE][4];
#ifdef PAGEDKV_AVX2
    __m256 acc[QTILE][4];
    for (int i = 0; i < QTILE; ++i)
        for (int r = 0; r < 4; ++r) acc[i][r] = _mm256_setzero_ps();
    for (; x + 8 <= d; x += 8) {
        const __m256 k0 = _mm256_loadu_ps(k + x), k1 = _mm256_loadu_ps(k + d + x);
        const __m256 k2 = _mm256_loadu_ps(k + 2 * d + x), k3 = _mm256_loadu_ps(k + 3 * d + x);
        for (int i = 0; i < nq; ++i) {
            const __m256 qv = _mm256_loadu_ps(q + i * d + x);
            acc[i][0] = _mm256_fmadd_ps(qv, k0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(qv, k1, acc[i][1]);
            acc[i][2] = _mm256_fmadd_ps(qv, k2, acc[i][2]);
            acc[i][3] = _mm256_fmadd_ps(qv, k3, acc[i][3]);
        }
    }
    for (int i = 0; i < nq; ++i)
        _mm_storeu_ps(tile[i], hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
#else
    float part[QTILE][4][8];
    memset(part, 0, sizeof part);
    for (; x + 8 <= d; x += 8)
        for (int i = 0; i < nq; ++i)
            for (int r = 0; r < 4; ++r)
                for (int t = 0; t < 8; ++t) part[i][r][t] += q[i * d + x + t] * k[r * d + x + t];
    for (int i = 0; i < nq; ++i)
        for (int r = 0; r < 4; ++r) {
            float s = 0.0f;
            for (int t = 0; t < 8; ++t) s += part[i][r][t];
            tile[i][r] = s;
        }
#endif
    for (int i = 0; i < nq; ++i)
        for (int r = 0; r < 4; ++r) {
            float s = tile[i][r];
            for (int64_t t = x; t < d; ++t) s += q[i * d + t] * k[r * d + t];
            sc[i * ld + r] = s * scale;
        }
}

/* One row: sc[i * ld] = scale * q[i] . k for i < nq (a block's last rows, fewer than 4). */
TILE_FN scores_1row(const float *restrict q, int64_t nq, const float *restrict k, int64_t d,
                    float scale, float *restrict sc, int64_t ld) {
    for (int64_t i = 0; i < nq; ++i) {
        const float *qi = q + i * d;
        int64_t x = 0;
        float s = 0.0f;
#ifdef PAGEDKV_AVX2
        __m256 a = _mm256_setzero_ps();
        for (; x + 8 <= d; x += 8)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(qi + x), _mm256_loadu_ps(k + x), a);
        s = hsum1(a);
#else
        float part[8] = {0};
        for (; x + 8 <= d; x += 8)
            for (int t = 0; t < 8; ++t) part[t] += qi[x + t] * k[x + t];
        for (int t = 0; t < 8; ++t) s += part[t];
#endif
        for (; x < d; ++x) s += qi[x] * k[x];
        sc[i * ld] = s * scale;
    }
}

/* The rows j0 <= j < n of one tile of nq queries (a constant after inlining). */
TILE_FN tile_scores(
    const float *restrict q, int64_t nq, const float *restrict kb, int64_t j0, int64_t n,
    int64_t d, float scale, float *restrict sc, int64_t ld) {
    int64_t j = j0;
    for (; j + 4 <= n; j += 4) scores_4rows(q, nq, kb + j * d, d, scale, sc + j, ld);
    for (; j < n; ++j) scores_1row(q, nq, kb + j * d, d, scale, sc + j, ld);
}

/* scores[i * ld + j] = scale * q[i] . kb[j] for i < group, j0 <= j < n. */
static void block_scores(const float *restrict q, int64_t group, const float *restrict kb,
                         int64_t j0, int64_t n, int64_t d, float scale, float *restrict scores,
                         int64_t ld) {
    int64_t i = 0;
    for (; i + QTILE <= group; i += QTILE)
        tile_scores(q + i * d, QTILE, kb, j0, n, d, scale, scores + i * ld, ld);
    if (group - i == 2) tile_scores(q + i * d, 2, kb, j0, n, d, scale, scores + i * ld, ld);
    if (group - i == 1) tile_scores(q + i * d, 1, kb, j0, n, d, scale, scores + i * ld, ld);
}

/* a[t][x] += sum_j p[t * ld + j] * vb[j][x] for one tile of nq queries (a constant after
 * inlining), j0 <= j < n, x < d. */
TILE_FN tile_values(
    float *restrict a, int64_t nq, const float *restrict vb, int64_t j0, int64_t n, int64_t d,
    const float *restrict p, int64_t ld) {
    int64_t x = 0;
#ifdef PAGEDKV_AVX2
    for (; x + 16 <= d; x += 16) {
        __m256 lo[QTILE], hi[QTILE];
        for (int t = 0; t < nq; ++t) {
            lo[t] = _mm256_loadu_ps(a + t * d + x);
            hi[t] = _mm256_loadu_ps(a + t * d + x + 8);
        }
        for (int64_t j = j0; j < n; ++j) {
            const __m256 v0 = _mm256_loadu_ps(vb + j * d + x);
            const __m256 v1 = _mm256_loadu_ps(vb + j * d + x + 8);
            for (int t = 0; t < nq; ++t) {
                const __m256 w = _mm256_broadcast_ss(p + t * ld + j);
                lo[t] = _mm256_fmadd_ps(w, v0, lo[t]);
                hi[t] = _mm256_fmadd_ps(w, v1, hi[t]);
            }
        }
        for (int t = 0; t < nq; ++t) {
            _mm256_storeu_ps(a + t * d + x, lo[t]);
            _mm256_storeu_ps(a + t * d + x + 8, hi[t]);
        }
    }
#endif
    for (int64_t t = 0; t < nq; ++t)
        for (int64_t j = j0; j < n; ++j) {
            const float w = p[t * ld + j];
            const float *vj = vb + j * d;
            for (int64_t y = x; y < d; ++y) a[t * d + y] += w * vj[y];
        }
}

/* acc[i][x] += sum_j p[i * ld + j] * vb[j][x] for i < group, j0 <= j < n, x < d. */
static void block_values(float *restrict acc, int64_t group, const float *restrict vb,
                         int64_t j0, int64_t n, int64_t d, const float *restrict p, int64_t ld) {
    int64_t i = 0;
    for (; i + QTILE <= group; i += QTILE)
        tile_values(acc + i * d, QTILE, vb, j0, n, d, p + i * ld, ld);
    if (group - i == 2) tile_values(acc + i * d, 2, vb, j0, n, d, p + i * ld, ld);
    if (group - i == 1) tile_values(acc + i * d, 1, vb, j0, n, d, p + i * ld, ld);
}

#ifdef PAGEDKV_512
/* The 512-bit tiles (AVX-512F builds, head_dim a multiple of 16). They read the pool rows as
 * stored, float32 (elem 4) or bf16 (elem 2, widened in registers: exact), with elem a constant
 * after inlining, so both entry points run the same arithmetic, bit for bit. The scores'
 * 16-lane partial sums fold into 8 lanes and then reduce as the AVX2 tiles' do; the values'
 * lanes run the AVX2 tiles' order exactly. */
static inline __m512 load16(const char *p, int64_t elem) {
    if (elem == 2)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}

static inline __m256 fold(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}

/* sc[i * ld + r] = scale * q[i] . k[r] for i < nq, r < nr (nr 4 or 1, constants). */
TILE_FN scores512(const float *restrict q, int64_t nq, const char *restrict k, int64_t nr,
                  int64_t elem, int64_t d, float scale, float *restrict sc, int64_t ld) {
    __m512 acc[QTILE][4];
    for (int i = 0; i < QTILE; ++i)
        for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t x = 0; x < d; x += 16) {
        __m512 kr[4];
        for (int r = 0; r < nr; ++r) kr[r] = load16(k + (r * d + x) * elem, elem);
        for (int i = 0; i < nq; ++i) {
            const __m512 qv = _mm512_loadu_ps(q + i * d + x);
            for (int r = 0; r < nr; ++r) acc[i][r] = _mm512_fmadd_ps(qv, kr[r], acc[i][r]);
        }
    }
    for (int i = 0; i < nq; ++i) {
        if (nr == 4) {
            _mm_storeu_ps(sc + i * ld, _mm_mul_ps(hsum4(fold(acc[i][0]), fold(acc[i][1]),
                                                        fold(acc[i][2]), fold(acc[i][3])),
                                                  _mm_set1_ps(scale)));
        } else {
            sc[i * ld] = hsum1(fold(acc[i][0])) * scale;
        }
    }
}

/* scores[i * ld + j] = scale * q[i] . kb[j] for i < group, j0 <= j < n. */
static inline void block_scores512(const float *restrict q, int64_t group,
                                   const char *restrict kb, int64_t elem, int64_t j0, int64_t n,
                                   int64_t d, float scale, float *restrict scores, int64_t ld) {
    for (int64_t i = 0; i < group; i += QTILE) {
        const int64_t nq = group - i < QTILE ? group - i : QTILE;
        const float *qi = q + i * d;
        float *si = scores + i * ld;
        int64_t j = j0;
#define SC_ROWS(nqc)                                                                         \
    for (j = j0; j + 4 <= n; j += 4) scores512(qi, nqc, kb + j * d * elem, 4, elem, d, scale, \
                                              si + j, ld);                                   \
    for (; j < n; ++j) scores512(qi, nqc, kb + j * d * elem, 1, elem, d, scale, si + j, ld);
        if (nq == 3) {
            SC_ROWS(3)
        } else if (nq == 2) {
            SC_ROWS(2)
        } else {
            SC_ROWS(1)
        }
#undef SC_ROWS
    }
}

/* a[t][x] += sum_j p[t * ld + j] * vb[j][x] for t < nq (a constant), j0 <= j < n, x < d.
 * 64 columns at a time where d allows: 4 x nq independent accumulators, so the FMAs over j
 * are not one dependent chain per column block (one chain of 16 rows was latency bound);
 * every lane still sums over j in increasing order, so the bits are the 16-column loop's. */
TILE_FN values512(float *restrict a, int64_t nq, const char *restrict vb, int64_t elem,
                  int64_t j0, int64_t n, int64_t d, const float *restrict p, int64_t ld) {
    int64_t x0 = 0;
    for (; x0 + 64 <= d; x0 += 64) {
        __m512 acc[QTILE][4];
        for (int t = 0; t < nq; ++t)
            for (int c = 0; c < 4; ++c) acc[t][c] = _mm512_loadu_ps(a + t * d + x0 + 16 * c);
        for (int64_t j = j0; j < n; ++j) {
            __m512 v[4];
            for (int c = 0; c < 4; ++c) v[c] = load16(vb + (j * d + x0 + 16 * c) * elem, elem);
            for (int t = 0; t < nq; ++t) {
                const __m512 w = _mm512_set1_ps(p[t * ld + j]);
                for (int c = 0; c < 4; ++c) acc[t][c] = _mm512_fmadd_ps(w, v[c], acc[t][c]);
            }
        }
        for (int t = 0; t < nq; ++t)
            for (int c = 0; c < 4; ++c) _mm512_storeu_ps(a + t * d + x0 + 16 * c, acc[t][c]);
    }
    for (int64_t x = x0; x < d; x += 16) {
        __m512 acc[QTILE];
        for (int t = 0; t < nq; ++t) acc[t] = _mm512_loadu_ps(a + t * d + x);
        for (int64_t j = j0; j < n; ++j) {
            const __m512 v = load16(vb + (j * d + x) * elem, elem);
            for (int t = 0; t < nq; ++t)
                acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(p[t * ld + j]), v, acc[t]);
        }
        for (int t = 0; t < nq; ++t) _mm512_storeu_ps(a + t * d + x, acc[t]);
    }
}

static inline void block_values512(float *restrict acc, int64_t group, const char *restrict vb,
                                   int64_t elem, int64_t j0, int64_t n, int64_t d,
                                   const float *restrict p, int64_t ld) {
    int64_t i = 0;
    for (; i + QTILE <= group; i += QTILE)
        values512(acc + i * d, QTILE, vb, elem, j0, n, d, p + i * ld, ld);
    if (group - i == 2) values512(acc + i * d, 2, vb, elem, j0, n, d, p + i * ld, ld);
    if (group - i == 1) values512(acc + i * d, 1, vb, elem, j0, n, d, p + i * ld, ld);
}

static inline __mmask16 first_lanes(int64_t k) {
    return k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << k) - 1u);
}

/* block_softmax on 16 positions a step: the max and the sum as lane reductions, the
 * exponentials by exp512 (the same arithmetic for both pool dtypes). */
static inline void block_softmax512(float *restrict sc, int64_t j0, int64_t n,
                                    float *restrict acc, int64_t d, float *restrict run_max,
                                    float *restrict run_sum) {
    const __m512 lowest = _mm512_set1_ps(-FLT_MAX);
    __m512 mx = lowest;
    for (int64_t j = j0; j < n; j += 16)
        mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(lowest, first_lanes(n - j), sc + j));
    const float block_max = _mm512_reduce_max_ps(mx);
    const float new_max = block_max > *run_max ? block_max : *run_max;
    const float corr = expf(*run_max - new_max);
    if (corr != 1.0f) {
        *run_sum *= corr;
        for (int64_t x = 0; x < d; x += 16)
            _mm512_storeu_ps(acc + x,
                             _mm512_mul_ps(_mm512_loadu_ps(acc + x), _mm512_set1_ps(corr)));
    }
    const __m512 top = _mm512_set1_ps(new_max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = j0; j < n; j += 16) {
        const __mmask16 m = first_lanes(n - j);
        const __m512 e = _mm512_maskz_mov_ps(
            m, exp512(_mm512_sub_ps(_mm512_mask_loadu_ps(top, m, sc + j), top)));
        _mm512_mask_storeu_ps(sc + j, m, e);
        sum = _mm512_add_ps(sum, e);
    }
    *run_sum += _mm512_reduce_add_ps(sum);
    *run_max = new_max;
}
#endif

/* The online softmax for query row sc[j0..n): subtract the new running max, exponentiate in
 * place, rescale the accumulator and running sum when the max moved. */
static inline void block_softmax(float *restrict sc, int64_t j0, int64_t n, float *restrict acc,
                                 int64_t d, float *restrict run_max, float *restrict run_sum) {
    float block_max = -FLT_MAX;
    for (int64_t j = j0; j < n; ++j) block_max = sc[j] > block_max ? sc[j] : block_max;
    const float new_max = block_max > *run_max ? block_max : *run_max;
    const float corr = expf(*run_max - new_max);
    if (corr != 1.0f) {
        *run_sum *= corr;
        for (int64_t x = 0; x < d; ++x) acc[x] *= corr;
    }
    float sum = 0.0f;
    for (int64_t j = j0; j < n; ++j) {
        sc[j] = expf(sc[j] - new_max);
        sum += sc[j];
    }
    *run_sum += sum;
    *run_max = new_max;
}

/* dst[i] = the float32 value of the bf16 src[i], i < n (exact). */
static void widen_rows(const uint16_t *restrict src, float *restrict dst, int64_t n) {
    int64_t i = 0;
#ifdef PAGEDKV_AVX2
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
#endif
    for (; i < n; ++i) {
        const uint32_t u = (uint32_t)src[i] << 16;
        memcpy(dst + i, &u, sizeof u);
    }
}

/* Both entry points: pools of float32 (elem 4) or bf16 (elem 2, widened through kbuf/vbuf,
 * block_size * head_dim floats each). */
static int decode(const float *restrict q, float *restrict out, const char *restrict k_pool,
                  const char *restrict v_pool, const int64_t elem, float *restrict kbuf,
                  float *restrict vbuf, const int64_t *restrict tables,
                  const int64_t *restrict lens, const int64_t *restrict starts,
                  int64_t num_seqs, int64_t table_stride, int64_t num_heads,
                  int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                  int64_t head_dim, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t d = head_dim;
    float scores[MAX_GROUP * MAX_BLOCK];
    float acc[MAX_GROUP * MAX_HEAD_DIM];
    float run_max[MAX_GROUP], run_sum[MAX_GROUP];
    const int64_t block_elems = block_size * d;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t len = lens[s];
        const int64_t first = starts ? starts[s] : 0;
        if (len <= 0 || first < 0 || first >= len || first >= block_size) return -1;
        const int64_t nblk = (len + block_size - 1) / block_size;
        const int64_t *table = tables + s * table_stride;
        for (int64_t b = 0; b < nblk; ++b)
            if (table[b] < 0 || table[b] >= num_blocks) return -1;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const float *qh = q + (s * num_heads + h * group) * d;
            const char *kh = k_pool + h * num_blocks * block_elems * elem;
            const char *vh = v_pool + h * num_blocks * block_elems * elem;
            for (int64_t i = 0; i < group; ++i) {
                run_max[i] = -FLT_MAX;
                run_sum[i] = 0.0f;
            }
            memset(acc, 0, sizeof(float) * group * d);
            for (int64_t b = 0; b < nblk; ++b) {
                const float *kb = (const float *)(kh + table[b] * block_elems * elem);
                const float *vb = (const float *)(vh + table[b] * block_elems * elem);
                { /* the block after this one (the next head's or sequence's first after the
                   * last) is elsewhere: start fetching it */
                    int64_t nh = h, nb = b + 1;
                    const int64_t *nt = table;
                    if (nb >= nblk) {
                        nb = 0;
                        if (++nh == num_kv_heads) {
                            nh = 0;
                            nt = s + 1 < num_seqs ? tables + (s + 1) * table_stride : NULL;
                        }
                    }
                    if (nt && nt[nb] >= 0 && nt[nb] < num_blocks) {
                        const int64_t at = (nh * num_blocks + nt[nb]) * block_elems * elem;
                        for (int64_t off = 0; off < block_elems * elem; off += 64) {
                            __builtin_prefetch(k_pool + at + off);
                            __builtin_prefetch(v_pool + at + off);
                        }
                    }
                }
                const int64_t n = (b + 1 < nblk) ? block_size : len - b * block_size;
                const int64_t j0 = b ? 0 : first; /* rows before the window are skipped */
#ifdef PAGEDKV_512
                if (d % 16 == 0) { /* the 512-bit tiles read either pool as stored */
                    block_scores512(qh, group, (const char *)kb, elem, j0, n, d, scale, scores,
                                    block_size);
                    for (int64_t i = 0; i < group; ++i)
                        block_softmax512(scores + i * block_size, j0, n, acc + i * d, d,
                                      run_max + i, run_sum + i);
                    block_values512(acc, group, (const char *)vb, elem, j0, n, d, scores,
                                    block_size);
                    continue;
                }
#endif
                if (elem == 2) { /* bf16: rows j0..n-1 widened; the tiles read the scratch */
                    widen_rows((const uint16_t *)kb + j0 * d, kbuf + j0 * d, (n - j0) * d);
                    widen_rows((const uint16_t *)vb + j0 * d, vbuf + j0 * d, (n - j0) * d);
                    kb = kbuf;
                    vb = vbuf;
                }
                block_scores(qh, group, kb, j0, n, d, scale, scores, block_size);
                for (int64_t i = 0; i < group; ++i)
                    block_softmax(scores + i * block_size, j0, n, acc + i * d, d, run_max + i,
                                  run_sum + i);
                block_values(acc, group, vb, j0, n, d, scores, block_size);
            }
            float *oh = out + (s * num_heads + h * group) * d;
            for (int64_t i = 0; i < group; ++i) {
                const float inv = 1.0f / run_sum[i];
                for (int64_t x = 0; x < d; ++x) oh[i * d + x] = acc[i * d + x] * inv;
            }
        }
    }
    return 0;
}

int pagedkv_decode_f32(const float *restrict q, float *restrict out,
                       const float *restrict k_pool, const float *restrict v_pool,
                       const int64_t *restrict tables, const int64_t *restrict lens,
                       const int64_t *restrict starts, int64_t num_seqs, int64_t table_stride,
                       int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                       int64_t block_size, int64_t head_dim, float scale) {
    if (num_heads / num_kv_heads > MAX_GROUP || block_size > MAX_BLOCK ||
        head_dim > MAX_HEAD_DIM)
        return -2;
    return decode(q, out, (const char *)k_pool, (const char *)v_pool, 4, NULL, NULL, tables,
                  lens, starts, num_seqs, table_stride, num_heads, num_kv_heads, num_blocks,
                  block_size, head_dim, scale);
}

int pagedkv_decode_bf16kv(const float *restrict q, float *restrict out,
                          const uint16_t *restrict k_pool, const uint16_t *restrict v_pool,
                          const int64_t *restrict tables, const int64_t *restrict lens,
                          const int64_t *restrict starts, int64_t num_seqs,
                          int64_t table_stride, int64_t num_heads, int64_t num_kv_heads,
                          int64_t num_blocks, int64_t block_size, int64_t head_dim,
                          float scale) {
    if (num_heads / num_kv_heads > MAX_GROUP || block_size > MAX_BLOCK ||
        head_dim > MAX_HEAD_DIM)
        return -2;
    float *scratch = malloc(sizeof(float) * 2 * (size_t)(block_size * head_dim));
    if (!scratch) return -3;
    const int code = decode(q, out, (const char *)k_pool, (const char *)v_pool, 2, scratch,
                            scratch + block_size * head_dim, tables, lens, starts, num_seqs,
                            table_stride, num_heads, num_kv_heads, num_blocks, block_size,
                            head_dim, scale);
    free(scratch);
    return code;
}

/* ---- One call, rows split among OpenMP threads (pagedkv_decode_*_par) ----
 *
 * Built with -fopenmp (native.py's first flag set), the parts run on the process's OpenMP
 * threads (torch's: the dynamic linker reuses its libgomp), which costs a few microseconds a
 * call where the Python workers' hand-off cost tens and lost to one thread at 16 sequences.
 * Parts are whole sequences with about the same context positions each, at least
 * PD_PAR_MIN_POS a part; a sequence's output does not depend on the split. Without OpenMP,
 * or inside a parallel region, one part runs here. */
#ifdef _OPENMP
#include <omp.h>
#define PD_IN_PARALLEL omp_in_parallel()
#else
#define PD_IN_PARALLEL 1
#endif
#define PD_PAR_MAX 16
#ifndef PD_PAR_MIN_POS
#define PD_PAR_MIN_POS 256
#endif

int pagedkv_decode_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Cut points [0, ..., num_seqs] of at most `threads` non-empty parts, each ending at the first
 * row by which its share of the context positions is reached; returns the number of parts. */
static int pd_cuts(const int64_t *lens, int64_t num_seqs, int threads, int64_t *cuts) {
    int64_t total = 0;
    for (int64_t s = 0; s < num_seqs; ++s) total += lens[s] > 0 ? lens[s] : 0;
    int64_t parts = threads < PD_PAR_MAX ? threads : PD_PAR_MAX;
    if (parts > num_seqs) parts = num_seqs;
    if (parts > total / PD_PAR_MIN_POS) parts = total / PD_PAR_MIN_POS;
    if (parts < 1 || PD_IN_PARALLEL) parts = 1;
    int64_t p = 1, seen = 0;
    cuts[0] = 0;
    for (int64_t s = 0; s < num_seqs && p < parts; ++s) {
        seen += lens[s] > 0 ? lens[s] : 0;
        if (seen * parts >= total * p) cuts[p++] = s + 1;
    }
    if (p > 1 && cuts[p - 1] == num_seqs) p--; /* the last row closed a part: no empty one */
    cuts[p] = num_seqs;
    return (int)p;
}

/* pd_cuts for tests: cuts needs room for min(threads, 16) + 1 values. */
int pagedkv_decode_cuts(const int64_t *lens, int64_t num_seqs, int threads, int64_t *cuts) {
    return pd_cuts(lens, num_seqs, threads, cuts);
}

typedef int (*pd_entry)(const float *, float *, const void *, const void *, const int64_t *,
                        const int64_t *, const int64_t *, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int64_t, float);

static int decode_par(pd_entry fn, const float *q, float *out, const void *k_pool,
                      const void *v_pool, const int64_t *tables, const int64_t *lens,
                      const int64_t *starts, int64_t num_seqs, int64_t table_stride,
                      int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                      int64_t block_size, int64_t head_dim, float scale, int threads) {
    int64_t cuts[PD_PAR_MAX + 1];
    int codes[PD_PAR_MAX] = {0};
    const int parts = pd_cuts(lens, num_seqs, threads, cuts);
    const int64_t row = num_heads * head_dim;
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
    for (int p = 0; p < parts; ++p) {
        const int64_t a = cuts[p], n = cuts[p + 1] - a;
        codes[p] = fn(q + a * row, out + a * row, k_pool, v_pool, tables + a * table_stride,
                      lens + a, starts ? starts + a : NULL, n, table_stride, num_heads,
                      num_kv_heads, num_blocks, block_size, head_dim, scale);
    }
    for (int p = 0; p < parts; ++p)
        if (codes[p]) return codes[p];
    return 0;
}

int pagedkv_decode_f32_par(const float *q, float *out, const float *k_pool,
                           const float *v_pool, const int64_t *tables, const int64_t *lens,
                           const int64_t *starts, int64_t num_seqs, int64_t table_stride,
                           int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                           int64_t block_size, int64_t head_dim, float scale, int threads) {
    return decode_par((pd_entry)pagedkv_decode_f32, q, out, k_pool, v_pool, tables, lens,
                      starts, num_seqs, table_stride, num_heads, num_kv_heads, num_blocks,
                      block_size, head_dim, scale, threads);
}

int pagedkv_decode_bf16kv_par(const float *q, float *out, const uint16_t *k_pool,
                              const uint16_t *v_pool, const int64_t *tables,
                              const int64_t *lens, const int64_t *starts, int64_t num_seqs,
                              int64_t table_stride, int64_t num_heads, int64_t num_kv_heads,
                              int64_t num_blocks, int64_t block_size, int64_t head_dim,
                              float scale, int threads) {
    return decode_par((pd_entry)pagedkv_decode_bf16kv, q, out, k_pool, v_pool, tables, lens,
                      starts, num_seqs, table_stride, num_heads, num_kv_heads, num_blocks,
                      block_size, head_dim, scale, threads);
}
