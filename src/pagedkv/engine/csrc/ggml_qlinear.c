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
 * Why this shape (measured: benchmarks/RESULTS.md, "Issue 15: quantized kernels streaming"):
 *   1-2 rows (stream_*): bound by reading the weights, or at Q4 by the ~20 vector operations a
 *   block of 32 costs to dequantize and multiply. A tile of 8 outputs (4 at two rows) keeps
 *   its lane sums in registers while k walks the blocks, so 8 FMA chains hide the FMA latency
 *   (the first version's 4 outputs x 3 rows tile ran at ~5 GB/s), each block is dequantized
 *   once for both rows, and the 8 rows of blocks stream with a software prefetch of the next tile.
 *   3..64 rows (fewrow_*): bound by the FMAs. A panel of 6 outputs is dequantized once into an
 *   aligned float32 buffer (L1/L2), then every pair of rows runs over it with 2 x 6 lane sums
 *   in registers, so a block is dequantized once per call instead of once per 3 rows (the
 *   first version: 16 rows 1.4x slower than this), and each activation vector is loaded once
 *   per 6 outputs.
 *
 * Returns 0, -1 for a bad argument (unknown type, in not a multiple of 32, a bad range), or -2
 * when the few-row panel (6 x in floats) cannot be allocated.
 */
#pragma GCC optimize("no-fast-math") /* the stated summation order, kept as written */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_f16.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GQ_AVX2 1
#else
#define GQ_AVX2 0
#endif

enum { GQ_Q8_0 = 0, GQ_Q4_0 = 1, GQ_Q4_1 = 2 };
#define QK 32
#define STREAM_MAX_ROWS 2 /* up to here the streaming path, above the few-row one */

static inline int64_t type_size(int type) {
    return type == GQ_Q8_0 ? 34 : type == GQ_Q4_0 ? 18 : type == GQ_Q4_1 ? 20 : -1;
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
/* The four 8-value chunks of one block (values 8c .. 8c+7 in *c), dequantized to
 * dequant_block's values: Q8_0 d * q (exact), Q4_0 fma(d, q, -8d) (= d * (q - 8): the
 * exact product is representable, 11 x 4 bits, so the one rounding changes nothing), Q4_1
 * fma(d, q, m). The scales come from one 2- or 4-byte load and one F16C conversion, the quants
 * from one 16- or 32-byte load (no per-chunk reload). */
static inline __attribute__((always_inline)) void block_avx2(const int type, const uint8_t *b,
                                                              __m256 *c0, __m256 *c1, __m256 *c2,
                                                              __m256 *c3) {
    if (type == GQ_Q8_0) {
        __m256 d = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)b));
        __m128i lo = _mm_loadu_si128((const __m128i *)(b + 2));
        __m128i hi = _mm_loadu_si128((const __m128i *)(b + 18));
        *c0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
        *c1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
        *c2 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
        *c3 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
        return;
    }
    __m256 d, m;
    if (type == GQ_Q4_1) {
        __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t *)b)); /* d, m */
        d = _mm256_broadcastss_ps(dm);
        m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    } else {
        d = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)b));
        m = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    }
    const __m128i *qs = (const __m128i *)(b + (type == GQ_Q4_0 ? 2 : 4));
    __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs));             /* bytes 0..7 */
    __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)qs + 8)));
    __m256i nib = _mm256_set1_epi32(0x0f);
    *c0 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(lo, nib)), m);
    *c1 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(hi, nib)), m);
    *c2 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), m);
    *c3 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)), m);
}

/* ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) in registers (lanes_sum's tree). */
static inline float hsum(__m256 v) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* Streaming path (1-2 rows, weight bound): NJ outputs x NR rows of lane sums in registers,
 * each block dequantized in registers once and used by both rows. At one row NJ = 8 gives 8
 * independent FMA chains, enough to hide the FMA latency (the 4-output tile of the first
 * version waited on it: 5 GB/s). The accumulators are named variables, not an array (an array
 * made GCC 12 keep them in memory). Each output's row prefetches the same block of the row NJ
 * ahead (the next tile), measured 20-30% faster out of cache than prefetching 512 or 2048
 * bytes ahead along the row (a prefetch past the weight's end never faults). */
#define ST_FMA(j, r, c, ch)                                                                  \
    if (NR > r) a##j##r = _mm256_fmadd_ps(_mm256_loadu_ps(x + (r) * ldx + k + 8 * c), ch, a##j##r);
#define ST_J(j)                                                                              \
    if (NJ > j) {                                                                            \
        const uint8_t *blk = w + (j) * row_bytes + b * ts;                                   \
        _mm_prefetch((const char *)((uintptr_t)blk + NJ * row_bytes), _MM_HINT_T0);          \
        __m256 q0, q1, q2, q3;                                                               \
        block_avx2(type, blk, &q0, &q1, &q2, &q3);                                           \
        ST_FMA(j, 0, 0, q0) ST_FMA(j, 1, 0, q0) ST_FMA(j, 0, 1, q1) ST_FMA(j, 1, 1, q1)      \
        ST_FMA(j, 0, 2, q2) ST_FMA(j, 1, 2, q2) ST_FMA(j, 0, 3, q3) ST_FMA(j, 1, 3, q3)      \
    }
#define ST_OUT(j, r)                                                                         \
    if (NJ > j && NR > r) y[(r) * ldy + (j)] = hsum(a##j##r) + (bias ? bias[j] : 0.0f);
static inline __attribute__((always_inline)) void stream_tile(
    const int type, const int NJ, const int NR, const float *x, int64_t ldx, const uint8_t *w,
    const float *bias, float *y, int64_t ldy, int64_t nb) {
    const int64_t ts = type == GQ_Q8_0 ? 34 : type == GQ_Q4_0 ? 18 : 20, row_bytes = nb * ts;
    __m256 z = _mm256_setzero_ps();
    __m256 a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z;
    __m256 a40 = z, a41 = z, a50 = z, a51 = z, a60 = z, a61 = z, a70 = z, a71 = z;
    for (int64_t b = 0; b < nb; b++) {
        int64_t k = b * QK;
        ST_J(0) ST_J(1) ST_J(2) ST_J(3) ST_J(4) ST_J(5) ST_J(6) ST_J(7)
    }
    ST_OUT(0, 0) ST_OUT(0, 1) ST_OUT(1, 0) ST_OUT(1, 1) ST_OUT(2, 0) ST_OUT(2, 1)
    ST_OUT(3, 0) ST_OUT(3, 1) ST_OUT(4, 0) ST_OUT(5, 0) ST_OUT(6, 0) ST_OUT(7, 0)
}
#undef ST_FMA
#undef ST_J
#undef ST_OUT

/* Outputs [j_begin, j_end) of 1 or 2 rows (bias offset to j_begin by the caller's arith). */
#define STREAM(T)                                                                            \
    static void stream_##T(const float *x, int64_t ldx, const uint8_t *w, const float *bias, \
                           float *y, int64_t ldy, int64_t rows, int64_t nb, int64_t j_begin, \
                           int64_t j_end) {                                                  \
        const int64_t rb = nb * (T == GQ_Q8_0 ? 34 : T == GQ_Q4_0 ? 18 : 20);               \
        const int nj = rows == 1 ? 8 : 4;                                                    \
        for (int64_t j = j_begin; j < j_end; j += nj) {                                      \
            int left = j_end - j < nj ? (int)(j_end - j) : nj;                               \
            const uint8_t *wj = w + j * rb;                                                  \
            const float *bj = bias ? bias + j : NULL;                                        \
            if (rows == 1 && left == 8) stream_tile(T, 8, 1, x, ldx, wj, bj, y + j, ldy, nb); \
            else if (rows == 1) {                                                            \
                for (int i = 0; i < left; i++)                                               \
                    stream_tile(T, 1, 1, x, ldx, wj + i * rb, bj ? bj + i : NULL, y + j + i, \
                                ldy, nb);                                                    \
            } else if (left == 4) stream_tile(T, 4, 2, x, ldx, wj, bj, y + j, ldy, nb);     \
            else {                                                                           \
                for (int i = 0; i < left; i++)                                               \
                    stream_tile(T, 1, 2, x, ldx, wj + i * rb, bj ? bj + i : NULL, y + j + i, \
                                ldy, nb);                                                    \
            }                                                                                \
        }                                                                                    \
    }
STREAM(GQ_Q8_0)
STREAM(GQ_Q4_0)
STREAM(GQ_Q4_1)

/* Few-row path (3..64 rows, FMA bound): dequantize a panel of PANEL_J outputs (PANEL_J x in
 * float32: 14 KB at in = 576, 36 KB at 1536) once, then run every row over it with FR_NR rows
 * x PANEL_J outputs of lane sums in registers (12 accumulators; per 12 FMAs 6 panel loads from
 * L1/L2 and 2 activation loads). Each activation vector is loaded once per panel and used by 6
 * outputs: a 4-row x 3-output block (the fewrow.c shape) re-read the activations from L2 twice
 * as often and measured slower than the int8 kernel. The float32 values and the per-output
 * order are the streaming path's, so a row's output is the same bits on either path. */
#define PANEL_J 6
#define FR_NR 2
#define FR_E(c) __m256 e##c = NC > c ? _mm256_load_ps(e + (c) * in + k) : z;
#define FR_FMA(r, c) if (NR > r && NC > c) a##r##c = _mm256_fmadd_ps(x##r, e##c, a##r##c);
#define FR_ROW(r)                                                                            \
    if (NR > r) {                                                                            \
        __m256 x##r = _mm256_loadu_ps(x + (r) * ldx + k);                                    \
        FR_FMA(r, 0) FR_FMA(r, 1) FR_FMA(r, 2) FR_FMA(r, 3) FR_FMA(r, 4) FR_FMA(r, 5)        \
    }
#define FR_OUT(r, c) if (NR > r && NC > c) y[(r) * ldy + (c)] = hsum(a##r##c) + (bias ? bias[c] : 0.0f);
static inline __attribute__((always_inline)) void panel_block(
    const float *x, int64_t ldx, const float *e, int64_t in, const float *bias, float *y,
    int64_t ldy, const int NR, const int NC) {
    __m256 z = _mm256_setzero_ps();
    __m256 a00 = z, a01 = z, a02 = z, a03 = z, a04 = z, a05 = z;
    __m256 a10 = z, a11 = z, a12 = z, a13 = z, a14 = z, a15 = z;
    for (int64_t k = 0; k < in; k += 8) {
        FR_E(0) FR_E(1) FR_E(2) FR_E(3) FR_E(4) FR_E(5)
        FR_ROW(0) FR_ROW(1)
    }
    FR_OUT(0, 0) FR_OUT(0, 1) FR_OUT(0, 2) FR_OUT(0, 3) FR_OUT(0, 4) FR_OUT(0, 5)
    FR_OUT(1, 0) FR_OUT(1, 1) FR_OUT(1, 2) FR_OUT(1, 3) FR_OUT(1, 4) FR_OUT(1, 5)
}
#undef FR_E
#undef FR_FMA
#undef FR_ROW
#undef FR_OUT

#define FR_CASE(nr, nc) panel_block(xr, ldx, e, in, bias, yr, ldy, nr, nc)
#define FR_NC(nr)                                                                            \
    switch (nc) {                                                                            \
        case 1: FR_CASE(nr, 1); break;                                                       \
        case 2: FR_CASE(nr, 2); break;                                                       \
        case 3: FR_CASE(nr, 3); break;                                                       \
        case 4: FR_CASE(nr, 4); break;                                                       \
        case 5: FR_CASE(nr, 5); break;                                                       \
        default: FR_CASE(nr, 6);                                                             \
    }
static void panel_rows(const float *x, int64_t ldx, const float *e, int64_t in,
                       const float *bias, float *y, int64_t ldy, int64_t rows, int nc) {
    for (int64_t r0 = 0; r0 < rows; r0 += FR_NR) {
        const float *xr = x + r0 * ldx;
        float *yr = y + r0 * ldy;
        if (rows - r0 >= 2) {
            FR_NC(2)
        } else {
            FR_NC(1)
        }
    }
}
#undef FR_CASE
#undef FR_NC

#define FEWROW(T)                                                                            \
    static void fewrow_##T(const float *x, int64_t ldx, const uint8_t *w, const float *bias, \
                           float *y, int64_t ldy, int64_t rows, int64_t nb, int64_t j_begin, \
                           int64_t j_end, float *panel) {                                    \
        const int64_t ts = T == GQ_Q8_0 ? 34 : T == GQ_Q4_0 ? 18 : 20, in = nb * QK;        \
        for (int64_t j = j_begin; j < j_end; j += PANEL_J) {                                 \
            int nc = j_end - j < PANEL_J ? (int)(j_end - j) : PANEL_J;                       \
            for (int c = 0; c < nc; c++) {                                                   \
                const uint8_t *row = w + (j + c) * nb * ts;                                  \
                float *dst = panel + c * in;                                                 \
                for (int64_t b = 0; b < nb; b++) {                                           \
                    __m256 q0, q1, q2, q3;                                                   \
                    block_avx2(T, row + b * ts, &q0, &q1, &q2, &q3);                         \
                    _mm256_store_ps(dst + b * QK, q0);                                       \
                    _mm256_store_ps(dst + b * QK + 8, q1);                                   \
                    _mm256_store_ps(dst + b * QK + 16, q2);                                  \
                    _mm256_store_ps(dst + b * QK + 24, q3);                                  \
                }                                                                            \
            }                                                                                \
            panel_rows(x, ldx, panel, in, bias ? bias + j : NULL, y + j, ldy, rows, nc);     \
        }                                                                                    \
    }
FEWROW(GQ_Q8_0)
FEWROW(GQ_Q4_0)
FEWROW(GQ_Q4_1)
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
        if (rows <= STREAM_MAX_ROWS) {
            if (type == GQ_Q8_0) stream_GQ_Q8_0(x, ldx, w, bias, y, ldy, rows, nb, j_begin, j_end);
            else if (type == GQ_Q4_0) stream_GQ_Q4_0(x, ldx, w, bias, y, ldy, rows, nb, j_begin, j_end);
            else stream_GQ_Q4_1(x, ldx, w, bias, y, ldy, rows, nb, j_begin, j_end);
            return 0;
        }
        float *panel = aligned_alloc(32, (size_t)(PANEL_J * in) * sizeof(float));
        if (!panel) return -2;
        if (type == GQ_Q8_0) fewrow_GQ_Q8_0(x, ldx, w, bias, y, ldy, rows, nb, j_begin, j_end, panel);
        else if (type == GQ_Q4_0) fewrow_GQ_Q4_0(x, ldx, w, bias, y, ldy, rows, nb, j_begin, j_end, panel);
        else fewrow_GQ_Q4_1(x, ldx, w, bias, y, ldy, rows, nb, j_begin, j_end, panel);
        free(panel);
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

/* ---- One call over all outputs, split among threads (pagedkv_ggml_qlinear_par) ----
 *
 * Built with -fopenmp (gguf_qlinear.py's first flag set), the parts run on the process's
 * OpenMP threads: torch's, which is loaded first and whose soname (libgomp.so.1) the dynamic
 * linker reuses, so no second pool competes with torch's for the cores (a Python worker per
 * part cost tens of microseconds, so a batch-1 step split almost nothing). Parts are runs of
 * outputs on multiples of 4 of about equal size, of GQ_PAR_MIN_MACS multiply-adds or more
 * each; a part's outputs do not depend on the split, so the bits are the one-thread call's.
 * Without OpenMP this runs the whole range on the calling thread (the wrapper then splits on
 * Python workers). */
#ifdef _OPENMP
#include <omp.h>
#endif
#define GQ_PAR_MAX 8
#ifndef GQ_PAR_MIN_MACS
#define GQ_PAR_MIN_MACS (1 << 15)
#endif

int pagedkv_ggml_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int pagedkv_ggml_qlinear_par(int type, const float *x, int64_t ldx, const uint8_t *w,
                             const float *bias, float *y, int64_t ldy, int64_t rows, int64_t in,
                             int64_t out, int threads) {
    const int64_t tiles = (out + 3) / 4;
    int64_t parts = threads < GQ_PAR_MAX ? threads : GQ_PAR_MAX;
    if (parts > tiles) parts = tiles;
    if (parts > rows * out * in / GQ_PAR_MIN_MACS) parts = rows * out * in / GQ_PAR_MIN_MACS;
#ifdef _OPENMP
    if (omp_in_parallel()) parts = 1;
#else
    parts = 1;
#endif
    if (parts <= 1)
        return pagedkv_ggml_qlinear(type, x, ldx, w, bias, y, ldy, rows, in, out, 0, out, 0);
    int64_t cuts[GQ_PAR_MAX + 1];
    int rcs[GQ_PAR_MAX] = {0};
    for (int64_t p = 0; p <= parts; p++) {
        const int64_t c = 4 * ((tiles * p * 2 + parts) / (2 * parts));
        cuts[p] = c < out ? c : out;
    }
#pragma omp parallel for num_threads((int)parts) schedule(static, 1)
    for (int64_t p = 0; p < parts; p++)
        rcs[p] = pagedkv_ggml_qlinear(type, x, ldx, w, bias, y, ldy, rows, in, out, cuts[p],
                                      cuts[p + 1], 0);
    for (int64_t p = 0; p < parts; p++)
        if (rcs[p]) return rcs[p];
    return 0;
}
