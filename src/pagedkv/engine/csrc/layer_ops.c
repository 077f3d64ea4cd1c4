/* A decoder layer's small float32 ops in one pass each, bit-identical to torch's CPU ops.
 *
 * RMSNorm (optionally after the residual add), and RoPE on q and k with the K/V write into
 * the paged pool. The reference formulas (pagedkv.engine.models.llama, transformers'
 * LlamaRMSNorm and apply_rotary_pos_emb) are chains of elementwise torch ops, each of which
 * rounds once per element (IEEE add, mul, div, sqrt), plus one reduction: the sum of squares
 * inside `mean`. The elementwise steps are reproduced exactly by doing the same operations in
 * the same order in C (compiled WITHOUT -ffast-math and with -ffp-contract=off: no fused
 * multiply-adds, no reassociation, 1/sqrtf not replaced by an approximate rsqrt).
 *
 * The reduction is reproduced by following the order of torch's CPU sum kernel for a
 * contiguous inner dimension (aten/src/ATen/native/cpu/SumKernel.cpp, `vectorized_inner_sum`:
 * `row_sum` with 4 interleaved vector accumulators, each a 4-level cascade, then the scalar
 * tail, then the vector's lanes in order). `vw` is torch's float vector width (8 on AVX2, 16
 * on AVX512): lanes are plain arrays here, so the arithmetic is lane-wise and identical. The
 * Python side (pagedkv.engine.layer_ops) checks the result against torch bit for bit when it
 * loads the library and does not use it when they differ (another torch or CPU).
 *
 * Every function returns 0, or -1 (writing nothing) on arguments it cannot take.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16_tiles.h" /* the AMX linears' A tiles (pagedkv_add_rms_norm_tiles) */

/* Steps of at least PAR_ROWS rows (prefill chunks) split their rows among the process's
 * OpenMP threads (torch's; the library is built with -fopenmp where the compiler has it).
 * Every row is computed alone, the same operations in the same order, so the split changes
 * no bit. Fewer rows (decode) stay on the calling thread: a parallel region costs a few
 * microseconds, about what 16 rows of a norm take. */
#ifndef PAR_ROWS
#define PAR_ROWS 64
#endif

#define MAX_VW 64
#define NROWS 4  /* torch's ilp_factor */
#define NLEVELS 4 /* torch's num_levels */

static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) ++bits;
    return bits;
}

/* acc[k][lane] += squares of vector (base + k) for k < NROWS; a "vector" is vw floats. */
static inline __attribute__((always_inline)) void add_vectors(float acc[NROWS][MAX_VW], const float *x, int64_t first_vec,
                               int64_t vw) {
    for (int64_t k = 0; k < NROWS; ++k) {
        const float *v = x + (first_vec + k) * vw;
        for (int64_t l = 0; l < vw; ++l) {
            const float sq = v[l] * v[l];
            acc[k][l] = acc[k][l] + sq;
        }
    }
}

/* The sum of x[i] * x[i] over n floats, in torch's order (see the header). n >= vw.
 * Inlined into sum_squares for each vector width torch has, so the lane loops are compiled
 * for a known width; only the lanes in use are zeroed. */
static inline __attribute__((always_inline)) float sum_squares_vw(const float *x, int64_t n,
                                                                 int64_t vw) {
    const int64_t num_vec = n / vw;       /* torch's vec_size */
    const int64_t size = num_vec / NROWS; /* multi_row_sum's rows of NROWS vectors */
    const int64_t power = ceil_log2(size) / NLEVELS > 4 ? ceil_log2(size) / NLEVELS : 4;
    const int64_t step = (int64_t)1 << power;
    const int64_t mask = step - 1;
    float acc[NLEVELS][NROWS][MAX_VW];
    for (int64_t j = 0; j < NLEVELS; ++j)
        for (int64_t k = 0; k < NROWS; ++k)
            for (int64_t l = 0; l < vw; ++l) acc[j][k][l] = 0.0f;
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; ++j, ++i) add_vectors(acc[0], x, i * NROWS, vw);
        for (int64_t j = 1; j < NLEVELS; ++j) {
            for (int64_t k = 0; k < NROWS; ++k)
                for (int64_t l = 0; l < vw; ++l) {
                    acc[j][k][l] = acc[j][k][l] + acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < size; ++i) add_vectors(acc[0], x, i * NROWS, vw);
    for (int64_t j = 1; j < NLEVELS; ++j)
        for (int64_t k = 0; k < NROWS; ++k)
            for (int64_t l = 0; l < vw; ++l) acc[0][k][l] = acc[0][k][l] + acc[j][k][l];
    /* row_sum: the vectors left over after the NROWS-wide rows go to partial 0 */
    for (int64_t v = size * NROWS; v < num_vec; ++v)
        for (int64_t l = 0; l < vw; ++l) {
            const float sq = x[v * vw + l] * x[v * vw + l];
            acc[0][0][l] = acc[0][0][l] + sq;
        }
    for (int64_t k = 1; k < NROWS; ++k)
        for (int64_t l = 0; l < vw; ++l) acc[0][0][l] = acc[0][0][l] + acc[0][k][l];
    /* vectorized_inner_sum: scalar tail first, then the lanes in order */
    float total = 0.0f;
    for (int64_t e = num_vec * vw; e < n; ++e) {
        const float sq = x[e] * x[e];
        total = total + sq;
    }
    for (int64_t l = 0; l < vw; ++l) total = total + acc[0][0][l];
    return total;
}

static float sum_squares(const float *x, int64_t n, int64_t vw) {
    if (vw == 8) return sum_squares_vw(x, n, 8);
    if (vw == 16) return sum_squares_vw(x, n, 16);
    return sum_squares_vw(x, n, vw);
}

/* out = w * (x * (1 / sqrt(sum(x^2) / d + eps))), torch's _rms_norm in float32. */
static void norm_row(const float *restrict x, const float *restrict w, float *restrict out,
                     int64_t d, float eps, int64_t vw) {
    const float mean = sum_squares(x, d, vw) / (float)d;
    const float r = 1.0f / sqrtf(mean + eps);
    for (int64_t e = 0; e < d; ++e) {
        const float xr = x[e] * r;
        out[e] = w[e] * xr;
    }
}

static int bad_shape(int64_t rows, int64_t d, int64_t vw) {
    return rows < 0 || d < vw || vw < 1 || vw > MAX_VW;
}

/* out[r] = rms_norm(x[r]) for `rows` rows of d floats (x rows `x_stride` floats apart). */
int pagedkv_rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out,
                         int64_t rows, int64_t d, float eps, int64_t vw) {
    if (bad_shape(rows, d, vw) || x_stride < d) return -1;
#pragma omp parallel for schedule(static) if (rows >= PAR_ROWS)
    for (int64_t r = 0; r < rows; ++r) norm_row(x + r * x_stride, w, out + r * d, d, eps, vw);
    return 0;
}

/* h[r] += delta[r] (delta rows `delta_stride` floats apart), then out[r] = rms_norm(h[r]). */
int pagedkv_add_rms_norm_f32(float *h, const float *delta, int64_t delta_stride,
                             const float *w, float *out, int64_t rows, int64_t d, float eps,
                             int64_t vw) {
    if (bad_shape(rows, d, vw) || delta_stride < d) return -1;
#pragma omp parallel for schedule(static) if (rows >= PAR_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        float *hr = h + r * d;
        const float *dr = delta + r * delta_stride;
        for (int64_t e = 0; e < d; ++e) hr[e] = hr[e] + dr[e];
        norm_row(hr, w, out + r * d, d, eps, vw);
    }
    return 0;
}


/* pagedkv_add_rms_norm_f32 with the normed rows written as bf16 A tiles (bf16_tiles.h: k kp, a
 * multiple of 32 and at least d; rows rounded up to 16, the padding zeroed) instead of float32:
 * each value is the float32 norm's, rounded as bf16_dot's packing rounds it, so an AMX linear
 * over these tiles gives the bits of the same linear over the float32 rows. d at most 16384. */
#if defined(__AVX512F__)
#include <immintrin.h>
/* One row of pagedkv_add_rms_norm_tiles for d % 32 == 0, 16 lanes at a time: per element the
 * same IEEE operations in the same order as the scalar loops (h + delta; the torch-order sum
 * of squares; x * r, then w times that; to_bf16), so the same bits. Measured at SmolLM2's
 * width (576) on the AMX Xeon: 0.31 -> 0.23 ms per 1,024 rows, most of what is left the
 * first touch of h and delta. */
static void add_norm_tiles_row16(float *hr, const float *dr, const float *w, uint16_t *xa,
                                 int64_t kp, int64_t r, int64_t d, float eps, int64_t vw) {
    for (int64_t e = 0; e < d; e += 16)
        _mm512_storeu_ps(hr + e, _mm512_add_ps(_mm512_loadu_ps(hr + e), _mm512_loadu_ps(dr + e)));
    const float mean = sum_squares(hr, d, vw) / (float)d;
    const __m512 rv = _mm512_set1_ps(1.0f / sqrtf(mean + eps));
    for (int64_t k0 = 0; k0 < d; k0 += 32) {
        const __m512 a =
            _mm512_mul_ps(_mm512_loadu_ps(w + k0), _mm512_mul_ps(_mm512_loadu_ps(hr + k0), rv));
        const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(w + k0 + 16),
                                       _mm512_mul_ps(_mm512_loadu_ps(hr + k0 + 16), rv));
        uint16_t *dst = &XA(xa, kp, r, k0);
        _mm256_storeu_si256((__m256i *)dst, to_bf16_16(a));
        _mm256_storeu_si256((__m256i *)(dst + 16), to_bf16_16(b));
    }
    for (int64_t k0 = d; k0 < kp; k0 += 32) memset(&XA(xa, kp, r, k0), 0, 64);
}
#endif

int pagedkv_add_rms_norm_tiles(float *h, const float *delta, int64_t delta_stride,
                               const float *w, uint16_t *xa, int64_t kp, int64_t rows, int64_t d,
                               float eps, int64_t vw) {
    if (bad_shape(rows, d, vw) || delta_stride < d || kp < d || kp % 32 || d > 16384) return -1;
    const int64_t rows_pad = (rows + 15) / 16 * 16;
#pragma omp parallel for schedule(static) if (rows >= PAR_ROWS)
    for (int64_t r = 0; r < rows_pad; ++r) {
        if (r >= rows) {
            xa_put_row(xa, kp, r, NULL, 0);
            continue;
        }
        float *hr = h + r * d;
        const float *dr = delta + r * delta_stride;
#if defined(__AVX512F__)
        if (d % 32 == 0) {
            add_norm_tiles_row16(hr, dr, w, xa, kp, r, d, eps, vw);
            continue;
        }
#endif
        float normed[d];
        for (int64_t e = 0; e < d; ++e) hr[e] = hr[e] + dr[e];
        norm_row(hr, w, normed, d, eps, vw);
        xa_put_row(xa, kp, r, normed, d);
    }
    return 0;
}

/* ---- SiLU, as torch's CPU kernel computes it ----
 *
 * torch's silu (aten/src/ATen/native/cpu/Activation.cpp) is x / (1 + exp(-x)), through
 * cpu_kernel_vec: along a row, 2 vectors at a time with Vectorized<float> (on AVX-512 builds
 * exp is Sleef's Sleef_expf16_u10), then the last n % 32 one by one with std::exp (expf).
 * pagedkv_silu_init hands this library the vector exp from libtorch_cpu itself, so the vector
 * lanes are the same function; the rest are IEEE operations in the same order (no FMA
 * contraction here) and libm's expf. layer_ops.py checks the result against torch bit for bit
 * before it is used. */
#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 (*expf16_fn)(__m512);
static expf16_fn silu_exp16;
#endif

/* 0 when `expf16` (Sleef_expf16_u10's address) is kept; -1 when this build has no 16-lane path. */
int pagedkv_silu_init(const void *expf16) {
#if defined(__AVX512F__)
    silu_exp16 = (expf16_fn)(uintptr_t)expf16;
    return expf16 ? 0 : -1;
#else
    (void)expf16;
    return -1;
#endif
}

/* g[r] = silu(g[r]) in place for rows of d floats (row stride ldg), then, when u is not
 * NULL, out[r] = g[r] * u[r] (torch.mul of the result; strides ldu, ldo). -1 before a
 * successful pagedkv_silu_init or for a bad shape. */
int pagedkv_silu_f32(float *g, int64_t ldg, const float *u, int64_t ldu, float *out, int64_t ldo,
                     int64_t rows, int64_t d) {
#if defined(__AVX512F__)
    if (!silu_exp16 || rows < 0 || d < 0 || ldg < d || (u && (ldu < d || ldo < d))) return -1;
    const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
    for (int64_t r = 0; r < rows; ++r) {
        float *x = g + r * ldg;
        int64_t i = 0;
        for (; i + 32 <= d; i += 32)
            for (int h = 0; h < 32; h += 16) {
                const __m512 v = _mm512_loadu_ps(x + i + h);
                const __m512 e = silu_exp16(_mm512_xor_ps(v, sign));
                _mm512_storeu_ps(x + i + h, _mm512_div_ps(v, _mm512_add_ps(one, e)));
            }
        for (; i < d; ++i) x[i] = x[i] / (1.0f + expf(-x[i]));
        if (u)
            for (int64_t j = 0; j < d; ++j) out[r * ldo + j] = x[j] * u[r * ldu + j];
    }
    return 0;
#else
    (void)g; (void)ldg; (void)u; (void)ldu; (void)out; (void)ldo; (void)rows; (void)d;
    return -1;
#endif
}

/* x * cos + rotate_half(x) * sin for one head of hd floats (hd even). */
static inline void rope_head(const float *restrict x, const float *restrict c,
                             const float *restrict s, float *restrict out, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t j = 0; j < half; ++j) {
        const float a = x[j] * c[j];
        const float b = (-x[j + half]) * s[j];
        out[j] = a + b;
    }
    for (int64_t j = half; j < hd; ++j) {
        const float a = x[j] * c[j];
        const float b = x[j - half] * s[j];
        out[j] = a + b;
    }
}

/* dst[i] = src[i] rounded to bfloat16, to nearest even (NaN: a quiet NaN), as torch's
 * float -> bfloat16 conversion (c10::BFloat16's round_to_nearest_even) does. */
static inline void to_bf16_rows(const float *restrict src, uint16_t *restrict dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        uint32_t u;
        memcpy(&u, src + i, sizeof u);
        dst[i] = src[i] != src[i] ? (uint16_t)0x7FC0
                                  : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
}

/* RoPE on the q and k heads of each token's fused projection row, then the K/V write.
 *
 *   qkv      [rows, nh + 2 * nkv, hd]: q heads, k heads, v heads
 *   cos, sin [rows, hd]
 *   slots    [rows] destination slots, 0 <= slot < num_slots (checked before any write)
 *   q_out    [rows, nh, hd]
 *   k_pool, v_pool: one layer's [nkv, num_slots, hd] (a [nkv, blocks, block_size, hd] pool),
 *            float32 (pagedkv_rope_write_f32) or bfloat16 (pagedkv_rope_write_bf16kv: k and
 *            v computed in float32, then rounded as torch's cast rounds)
 *   q_norm, k_norm: NULL, or per-head RMSNorm weights [hd] applied before RoPE (Qwen3)
 */
static int rope_write(const float *qkv, const float *cos_, const float *sin_,
                      const int64_t *slots, float *q_out, void *k_pool, void *v_pool,
                      int bf16, int64_t rows, int64_t nh, int64_t nkv, int64_t hd,
                      int64_t num_slots, const float *q_norm, const float *k_norm, float eps,
                      int64_t vw) {
    if (rows < 0 || nh < 1 || nkv < 1 || hd < 2 || hd % 2 || hd > 4096) return -1;
    if ((q_norm || k_norm) && bad_shape(rows, hd, vw)) return -1;
    for (int64_t r = 0; r < rows; ++r)
        if (slots[r] < 0 || slots[r] >= num_slots) return -1;
    const int64_t row_elems = (nh + 2 * nkv) * hd;
#pragma omp parallel for schedule(static) if (rows >= PAR_ROWS)
    for (int64_t r = 0; r < rows; ++r) { /* a step's slots are distinct: each token its own
                                           * position in a block its request owns */
        float normed[4096], roped[4096];
        const float *row = qkv + r * row_elems;
        const float *c = cos_ + r * hd, *s = sin_ + r * hd;
        for (int64_t h = 0; h < nh; ++h) {
            const float *x = row + h * hd;
            if (q_norm) {
                norm_row(x, q_norm, normed, hd, eps, vw);
                x = normed;
            }
            rope_head(x, c, s, q_out + (r * nh + h) * hd, hd);
        }
        for (int64_t h = 0; h < nkv; ++h) {
            const float *x = row + (nh + h) * hd;
            if (k_norm) {
                norm_row(x, k_norm, normed, hd, eps, vw);
                x = normed;
            }
            const int64_t at = (h * num_slots + slots[r]) * hd;
            const float *v = row + (nh + nkv + h) * hd;
            if (bf16) {
                rope_head(x, c, s, roped, hd);
                to_bf16_rows(roped, (uint16_t *)k_pool + at, hd);
                to_bf16_rows(v, (uint16_t *)v_pool + at, hd);
            } else {
                rope_head(x, c, s, (float *)k_pool + at, hd);
                memcpy((float *)v_pool + at, v, sizeof(float) * hd);
            }
        }
    }
    return 0;
}

int pagedkv_rope_write_f32(const float *qkv, const float *cos_, const float *sin_,
                           const int64_t *slots, float *q_out, float *k_pool, float *v_pool,
                           int64_t rows, int64_t nh, int64_t nkv, int64_t hd,
                           int64_t num_slots, const float *q_norm, const float *k_norm,
                           float eps, int64_t vw) {
    return rope_write(qkv, cos_, sin_, slots, q_out, k_pool, v_pool, 0, rows, nh, nkv, hd,
                      num_slots, q_norm, k_norm, eps, vw);
}

int pagedkv_rope_write_bf16kv(const float *qkv, const float *cos_, const float *sin_,
                              const int64_t *slots, float *q_out, uint16_t *k_pool,
                              uint16_t *v_pool, int64_t rows, int64_t nh, int64_t nkv,
                              int64_t hd, int64_t num_slots, const float *q_norm,
                              const float *k_norm, float eps, int64_t vw) {
    return rope_write(qkv, cos_, sin_, slots, q_out, k_pool, v_pool, 1, rows, nh, nkv, hd,
                      num_slots, q_norm, k_norm, eps, vw);
}

/* A row's first pass for torch.argmax and torch.amax over its `cols` floats: the row's maximum
 * over its non-NaN entries in ARGMAX_LANES independent lanes (a max needs no rounding, so
 * the lane order cannot change it; NaN compares false and is skipped) into *best, and
 * whether some entry is a NaN or an infinity (x - x summed per lane: 0 for finite x, NaN
 * otherwise). A row of -inf and NaN entries alone gives -inf. */
#define ARGMAX_LANES 32
static int row_scan(const float *row, int64_t cols, float *best) {
    float m[ARGMAX_LANES], odd[ARGMAX_LANES];
    for (int l = 0; l < ARGMAX_LANES; ++l) {
        m[l] = -INFINITY;
        odd[l] = 0.0f;
    }
    int64_t i = 0;
    for (; i + ARGMAX_LANES <= cols; i += ARGMAX_LANES)
        for (int l = 0; l < ARGMAX_LANES; ++l) {
            const float v = row[i + l];
            m[l] = v > m[l] ? v : m[l];
            odd[l] = odd[l] + (v - v);
        }
    float b = -INFINITY;
    int special = 0;
    for (int l = 0; l < ARGMAX_LANES; ++l) {
        b = m[l] > b ? m[l] : b;
        special |= odd[l] != odd[l];
    }
    for (; i < cols; ++i) {
        const float v = row[i];
        b = v > b ? v : b;
        special |= v != v || isinf(v);
    }
    *best = b;
    return special;
}

/* The index of a row's first NaN, or -1. */
static int64_t first_nan(const float *row, int64_t cols) {
    for (int64_t j = 0; j < cols; ++j)
        if (row[j] != row[j]) return j;
    return -1;
}

/* Rows of at least this many columns are shared among the process's OpenMP threads (a
 * vocabulary's logits: each row ~10 us); every row is scanned alone, so the results do not
 * depend on the split. */
#define SCAN_PAR_COLS 4096

/* torch.argmax(x, dim=-1) of a [rows, cols] float32 matrix (row stride `stride`) into
 * out[rows]: the index of the first maximum of each row, or of its first NaN when it holds
 * one (torch treats NaN as the maximum). Two passes: row_scan, then the first index equal
 * to the maximum (-0.0 == 0.0: the first of either, as torch's tie rule picks), or, when
 * the row holds a NaN or an infinity, a scan for the first NaN. */
int pagedkv_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t stride,
                       int64_t *out) {
    if (rows < 0 || cols < 1 || stride < cols) return -1;
#pragma omp parallel for schedule(static) if (rows > 1 && cols >= SCAN_PAR_COLS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * stride;
        float best;
        int64_t at = row_scan(row, cols, &best) ? first_nan(row, cols) : -1;
        if (at < 0) { /* no NaN: the first maximum (every entry is >= -inf, so one exists) */
            at = 0;
            for (; at + ARGMAX_LANES <= cols; at += ARGMAX_LANES) { /* the block holding it */
                int hit = 0;
                for (int l = 0; l < ARGMAX_LANES; ++l) hit |= row[at + l] == best;
                if (hit) break;
            }
            while (row[at] != best) ++at;
        }
        out[r] = at;
    }
    return 0;
}

/* torch.amax(x, dim=-1) of the same matrix into out[rows]: NaN where the row holds a NaN,
 * else its maximum (+inf where it holds +inf; -inf where every entry is -inf). One pass
 * (row_scan), plus a scan for a NaN where the row holds a NaN or an infinity. */
int pagedkv_row_max_f32(const float *x, int64_t rows, int64_t cols, int64_t stride,
                        float *out) {
    if (rows < 0 || cols < 1 || stride < cols) return -1;
#pragma omp parallel for schedule(static) if (rows > 1 && cols >= SCAN_PAR_COLS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * stride;
        float best;
        if (row_scan(row, cols, &best) && first_nan(row, cols) >= 0) best = NAN;
        out[r] = best;
    }
    return 0;
}
