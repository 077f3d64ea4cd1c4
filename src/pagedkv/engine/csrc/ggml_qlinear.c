/* Linear layers on GGUF (ggml) block-quantized weights, kept quantized in memory:
 * y[r, j] = sum_k x[r, k] * W[j, k] (+ bias[j]) for output rows j in [j_begin, j_end).
 *
 * w is the tensor's bytes as the GGUF file holds them: W's row j (one output channel) is
 * in / 32 consecutive blocks of 32 values along k (ggml's layout, so no repacking):
 *
 *     Q8_0  20+ bytes: d f16 | qs[32] int8                          w = d * q
 *     Q4_0  18 bytes:  d f16 | qs[16] (value i: low nibble of qs[i],
 *                                      value i+16: its high nibble) w = d * (q - 8)
 *     Q4_1  20 bytes:  d f16 | m f16 | qs[16] (as Q4_0)             w = d * q + m
 *
 * Each weight is dequantized in registers to exactly the float32 value ggml's reference
 * dequantize_row_* gives (d * q and d * (q - 8) are exact products; d * q + m is one rounding,
 * the same whether fused or not because d * q is exact), so the kernel is a float32 matmul on
 * the dequantized matrix; pagedkv_ggml_dequant writes that matrix (the > 64-row path).
 *
 * Summation order, the same for every (r, j) whatever the row count, the tile of outputs or
 * the split of outputs among threads: eight lanes, lane l adds x[k] * w[j, k] for the k with
 * k % 8 == l in increasing k (one fused multiply-add each, starting from 0), then
 * ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then + bias[j]. The portable path
 * (fmaf, scalar) does exactly these operations, so it is bit-identical to the AVX2 one.
 *
 * Why this shape: at batch 1..~8 a linear layer is bound by reading its weights; a tile of
 * NJ outputs x NR rows of accumulators stays in registers while k walks the blocks, each
 * block is dequantized once per row block and used by every row of it, and the blocks of the
 * NJ rows stream sequentially. Row blocks after the first re-read the tile (NJ rows of
 * in/32 blocks, < 4 KB for SmolLM2) from L1.
 *
 * Returns 0, or -1 for a bad argument (unknown type, in not a multiple of 32, a bad range).
 */
#pragma GCC optimize("no-fast-math") /* the stated summation order, kept as written */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GQ_AVX2 1
#else
#define GQ_AVX2 0
#endif

enum { GQ_Q8_0 = 0, GQ_Q4_0 = 1, GQ_Q4_1 = 2 };
#define QK 32
#define NJ 4 /* outputs per tile */
#define NR 3 /* rows per row block: NJ x NR = 12 accumulators */

static inline int64_t type_size(int type) {
    return type == GQ_Q8_0 ? 34 : type == GQ_Q4_0 ? 18 : type == GQ_Q4_1 ? 20 : -1;
}

/* IEEE half -> float, exact (subnormals, inf, nan included). */
static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The 32 dequantized values of one block (the reference the kernels match). */
static void dequant_block(int type, const uint8_t *b, float *out) {
    float d = f16_to_f32(b);
    if (type == GQ_Q8_0) {
        for (int i = 0; i < QK; i++) out[i] = d * (float)(int8_t)b[2 + i];
    } else if (type == GQ_Q4_0) {
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)((b[2 + i] & 0x0f) - 8);
            out[i + 16] = d * (float)((b[2 + i] >> 4) - 8);
        }
    } else {
        float m = f16_to_f32(b + 2);
        for (int i = 0; i < 16; i++) {
            out[i] = fmaf(d, (float)(b[4 + i] & 0x0f), m);
            out[i + 16] = fmaf(d, (float)(b[4 + i] >> 4), m);
        }
    }
}

static inline float lanes_sum(const float *l) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* Portable: one output (r, j) at a time, the same operations as the AVX2 tile. */
static void rows_portable(int type, const float *x, int64_t ldx, const uint8_t *w,
                          const float *bias, float *y, int64_t ldy, int64_t rows, int64_t in,
                          int64_t j_begin, int64_t j_end) {
    int64_t ts = type_size(type), nb = in / QK;
    float wb[QK];
    for (int64_t j = j_begin; j < j_end; j++) {
        const uint8_t *wj = w + j * nb * ts;
        for (int64_t r = 0; r < rows; r++) {
            float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            const float *xr = x + r * ldx;
            for (int64_t b = 0; b < nb; b++) {
                dequant_block(type, wj + b * ts, wb);
                for (int i = 0; i < QK; i++) lane[i & 7] = fmaf(xr[b * QK + i], wb[i], lane[i & 7]);
            }
            float v = lanes_sum(lane);
            y[r * ldy + j] = bias ? v + bias[j] : v;
        }
    }
}

#if GQ_AVX2
/* Chunk c (values 8c .. 8c+7) of a block, dequantized. */
static inline __attribute__((always_inline)) __m256 chunk(int type, const uint8_t *b, int c,
                                                         __m256 d, __m256 m) {
    if (type == GQ_Q8_0) {
        __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * c)));
        return _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
    }
    const uint8_t *qs = b + (type == GQ_Q4_0 ? 2 : 4) + 8 * (c & 1);
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    q = c < 2 ? _mm256_and_si256(q, _mm256_set1_epi32(0x0f)) : _mm256_srli_epi32(q, 4);
    if (type == GQ_Q4_0) return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8))));
    return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), m);
}

static inline __m256 half8(const uint8_t *p) {
    return _mm256_set1_ps(_cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))));
}

/* nj <= NJ outputs from j0, nr <= NR rows; type and nr are constants after inlining. The
 * 12 accumulators are named variables, not an array: with an array GCC 12 kept them in memory
 * (a load and a store per FMA, ~2.5 GB/s), as qlinear.c's comment found for int8. */
#define GQ_R(j, ch, r)                                                                     \
    if (nr > r) c##j##r = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + k + 8 * ch), wv, c##j##r);
#define GQ_C(j, ch)                                                                        \
    {                                                                                     \
        __m256 wv = chunk(type, blk, ch, d, m);                                            \
        GQ_R(j, ch, 0) GQ_R(j, ch, 1) GQ_R(j, ch, 2)                                         \
    }
#define GQ_J(j)                                                                           \
    if (nj > j) {                                                                         \
        const uint8_t *blk = w + ((j0 + j) * nb + b) * ts;                                \
        __m256 d = half8(blk), m = type == GQ_Q4_1 ? half8(blk + 2) : d;                  \
        GQ_C(j, 0) GQ_C(j, 1) GQ_C(j, 2) GQ_C(j, 3)                                       \
    }
#define GQ_OUT(j, r)                                                                      \
    if (nj > j && nr > r) {                                                               \
        _mm256_storeu_ps(lane, c##j##r);                                                  \
        float v = lanes_sum(lane);                                                        \
        y[r * ldy + j0 + j] = bias ? v + bias[j0 + j] : v;                                \
    }
static inline __attribute__((always_inline)) void tile_avx2(
    const int type, const float *x, int64_t ldx, const uint8_t *w, const float *bias, float *y,
    int64_t ldy, const int nr, int64_t nb, int64_t j0, int nj) {
    const int64_t ts = type == GQ_Q8_0 ? 34 : type == GQ_Q4_0 ? 18 : 20;
    __m256 z = _mm256_setzero_ps();
    __m256 c00 = z, c01 = z, c02 = z, c10 = z, c11 = z, c12 = z;
    __m256 c20 = z, c21 = z, c22 = z, c30 = z, c31 = z, c32 = z;
    for (int64_t b = 0; b < nb; b++) {
        int64_t k = b * QK;
        GQ_J(0) GQ_J(1) GQ_J(2) GQ_J(3)
    }
    float lane[8];
    GQ_OUT(0, 0) GQ_OUT(0, 1) GQ_OUT(0, 2) GQ_OUT(1, 0) GQ_OUT(1, 1) GQ_OUT(1, 2)
    GQ_OUT(2, 0) GQ_OUT(2, 1) GQ_OUT(2, 2) GQ_OUT(3, 0) GQ_OUT(3, 1) GQ_OUT(3, 2)
}

#define GQ_ROWS(T)                                                                          \
    static void rows_avx2_##T(const float *x, int64_t ldx, const uint8_t *w, const float *bias, \
                              float *y, int64_t ldy, int64_t rows, int64_t nb, int64_t j_begin, \
                              int64_t j_end) {                                              \
        for (int64_t j0 = j_begin; j0 < j_end; j0 += NJ) {                                  \
            int nj = j_end - j0 < NJ ? (int)(j_end - j0) : NJ;                              \
            for (int64_t r0 = 0; r0 < rows; r0 += NR) {                                     \
                const float *xr = x + r0 * ldx;                                             \
                float *yr = y + r0 * ldy;                                                   \
                int64_t left = rows - r0;                                                   \
                if (left == 1) tile_avx2(T, xr, ldx, w, bias, yr, ldy, 1, nb, j0, nj);      \
                else if (left == 2) tile_avx2(T, xr, ldx, w, bias, yr, ldy, 2, nb, j0, nj); \
                else tile_avx2(T, xr, ldx, w, bias, yr, ldy, 3, nb, j0, nj);                \
            }                                                                               \
        }                                                                                   \
    }
GQ_ROWS(GQ_Q8_0)
GQ_ROWS(GQ_Q4_0)
GQ_ROWS(GQ_Q4_1)
#endif

static int bad_args(int type, int64_t rows, int64_t in, int64_t out, int64_t j_begin,
                    int64_t j_end) {
    return type_size(type) < 0 || rows < 0 || in < 0 || in % QK || j_begin < 0 ||
           j_end > out || j_begin > j_end;
}

/* 1: this build has the AVX2/FMA/F16C kernel; 0: only the portable one. */
int pagedkv_ggml_has_avx2(void) { return GQ_AVX2; }

/* y [rows, ldy] for outputs [j_begin, j_end); portable != 0 forces the portable path. */
int pagedkv_ggml_qlinear(int type, const float *x, int64_t ldx, const uint8_t *w,
                         const float *bias, float *y, int64_t ldy, int64_t rows, int64_t in,
                         int64_t out, int64_t j_begin, int64_t j_end, int portable) {
    if (bad_args(type, rows, in, out, j_begin, j_end) || ldx < in || ldy < out) return -1;
#if GQ_AVX2
    if (!portable) {
        int64_t nb = in / QK;
        if (type == GQ_Q8_0) rows_avx2_GQ_Q8_0(x, ldx, w, bias, y, ldy, rows, nb, j_begin, j_end);
        else if (type == GQ_Q4_0) rows_avx2_GQ_Q4_0(x, ldx, w, bias, y, ldy, rows, nb, j_begin, j_end);
        else rows_avx2_GQ_Q4_1(x, ldx, w, bias, y, ldy, rows, nb, j_begin, j_end);
        return 0;
    }
#endif
    (void)portable;
    rows_portable(type, x, ldx, w, bias, y, ldy, rows, in, j_begin, j_end);
    return 0;
}

/* dst [j_end - j_begin, in] float32: rows j_begin.. of the dequantized W. */
int pagedkv_ggml_dequant(int type, const uint8_t *w, int64_t in, int64_t out, int64_t j_begin,
                         int64_t j_end, float *dst) {
    if (bad_args(type, 0, in, out, j_begin, j_end)) return -1;
    int64_t ts = type_size(type), nb = in / QK;
    for (int64_t j = j_begin; j < j_end; j++)
        for (int64_t b = 0; b < nb; b++)
            dequant_block(type, w + (j * nb + b) * ts, dst + (j - j_begin) * in + b * QK);
    return 0;
}
