/* Linear layers on GGUF (ggml) Q8_0/Q4_0/Q4_1 weights with 8-bit activations
 * (EngineConfig.gguf_activations = "int8"): y[r, j] ~= sum_k x[r, k] * W[j, k] (+ bias[j]).
 *
 * The weights are the GGUF file's blocks as ggml_qlinear.c describes them (row j = in / 32
 * blocks of 32 values: Q8_0 d | q[32] int8, w = d q; Q4_0 d | 16 nibble bytes, w = d (q - 8);
 * Q4_1 d | m | 16 nibble bytes, w = d q + m; value i of a Q4 block is the low nibble of byte i,
 * value i + 16 its high nibble). The method is llama.cpp's vec_dot with q8_0/q8_1 activations
 * (learnt from its ggml-cpu quants code, not copied):
 *
 *   1. pagedkv_q8_quantize, once per call: each row of x is cut into blocks of 32 values;
 *      per block  amax = max |x_i|,  dx = amax / 127,  id = dx ? 1 / dx : 0,
 *      qx_i = nearbyint(x_i * id) (round half to even, |qx_i| <= 127),
 *      sx = dx * (float)sum_i qx_i  (Q4_1's offset term needs the block sum).
 *   2. per output (r, j) and block b, an exact integer dot in 8 lanes: lane l sums
 *      wq_i * qx_i for i = 4l .. 4l + 3 (wq the signed weight quant: q, q - 8, or the Q4_1
 *      nibble q); |lane| <= 4 * 128 * 127, so (float)lane is exact.
 *   3. the float part, in block order: acc_l = fma(dw * dx, (float)lane_l, acc_l) (dw * dx one
 *      float product), and for Q4_1  summs = fma(m, sx, summs); then
 *      y = ((acc_0 + acc_4) + (acc_2 + acc_6)) + ((acc_1 + acc_5) + (acc_3 + acc_7)),
 *      + summs (Q4_1 only), + bias[j].
 *
 * The AVX2 path (maddubs_epi16 on |w| and sign(x, w), madd_epi16 with ones: the 8 lane sums
 * of step 2 exactly; no int16 saturation: a pair is at most 2 * 128 * 127 < 32767) and the
 * portable path perform the same float operations in the same order (fp contraction off), so
 * they give the same bits. A row's output depends only on that row (quantized alone) and W:
 * not on the other rows of the call, the tile, the loop order or the split of outputs among
 * threads. The only loss against the exact float32 kernel is step 1's rounding of x.
 *
 * Loop shape: tiles of NJ outputs x NR rows of lane sums in registers (8 x 1 at one row, 4 x 2
 * otherwise), each weight block unpacked once per tile and used by NR rows. Rows come in
 * chunks of ROW_CHUNK, and within a chunk every output tile runs over all the chunk's rows
 * while its blocks are in L1, so up to ROW_CHUNK rows read each weight from memory once.
 *
 * Returns 0, or -1 for a bad argument (unknown type, in not a multiple of 32, a bad range).
 */
#pragma GCC optimize("no-fast-math", "fp-contract=off") /* the stated order, kept as written */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_f16.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define Q8_AVX2 1
#else
#define Q8_AVX2 0
#endif

enum { GQ_Q8_0 = 0, GQ_Q4_0 = 1, GQ_Q4_1 = 2 }; /* ggml_qlinear.c's codes */
#define QK 32
#define ROW_CHUNK 32

static inline int64_t type_size(int type) {
    return type == GQ_Q8_0 ? 34 : type == GQ_Q4_0 ? 18 : type == GQ_Q4_1 ? 20 : -1;
}

int pagedkv_q8_has_avx2(void) { return Q8_AVX2; }

/* Step 1 for rows x in values of x (row stride ldx): xq [rows, in] int8, xd and xs
 * [rows, in / 32] float32. One scalar implementation for both paths (a call quantizes
 * rows * in values against the out * in weights it reads). */
int pagedkv_q8_quantize(const float *x, int64_t ldx, int64_t rows, int64_t in, int8_t *xq,
                        float *xd, float *xs) {
    if (rows < 0 || in < 0 || in % QK || ldx < in) return -1;
    const int64_t nb = in / QK;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * ldx + b * QK;
            int8_t *q = xq + r * in + b * QK;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t sum = 0;
            for (int i = 0; i < QK; i++) {
                q[i] = (int8_t)nearbyintf(v[i] * id);
                sum += q[i];
            }
            xd[r * nb + b] = d;
            xs[r * nb + b] = d * (float)sum;
        }
    }
    return 0;
}

static inline float lanes_sum(const float *l) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* The signed weight quants of one block, value order. */
static void block_quants(int type, const uint8_t *b, int32_t *wq) {
    if (type == GQ_Q8_0) {
        for (int i = 0; i < QK; i++) wq[i] = (int8_t)b[2 + i];
        return;
    }
    const uint8_t *qs = b + (type == GQ_Q4_0 ? 2 : 4);
    const int off = type == GQ_Q4_0 ? 8 : 0;
    for (int i = 0; i < 16; i++) {
        wq[i] = (qs[i] & 0x0f) - off;
        wq[i + 16] = (qs[i] >> 4) - off;
    }
}

/* Portable: one output (r, j) at a time, the operations of the header in that order. */
static void rows_portable(int type, const int8_t *xq, const float *xd, const float *xs,
                          const uint8_t *w, const float *bias, float *y, int64_t ldy,
                          int64_t rows, int64_t in, int64_t j_begin, int64_t j_end) {
    const int64_t ts = type_size(type), nb = in / QK;
    int32_t wq[QK];
    for (int64_t j = j_begin; j < j_end; j++) {
        for (int64_t r = 0; r < rows; r++) {
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, summs = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = w + (j * nb + b) * ts;
                const int8_t *q = xq + r * in + b * QK;
                block_quants(type, blk, wq);
                const float d = f16_to_f32(blk) * xd[r * nb + b];
                for (int l = 0; l < 8; l++) {
                    int32_t lane = 0;
                    for (int i = 4 * l; i < 4 * l + 4; i++) lane += wq[i] * q[i];
                    acc[l] = fmaf(d, (float)lane, acc[l]);
                }
                if (type == GQ_Q4_1) summs = fmaf(f16_to_f32(blk + 2), xs[r * nb + b], summs);
            }
            float v = lanes_sum(acc);
            if (type == GQ_Q4_1) v = v + summs;
            y[r * ldy + j] = bias ? v + bias[j] : v;
        }
    }
}

#if Q8_AVX2
/* ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) in registers (lanes_sum's tree). */
static inline float hsum(__m256 v) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* One block's weight quants as 32 bytes in value order, ready for maddubs: *u the unsigned
 * factor (|w|; the Q4_1 nibbles as they are) and *s non-zero where the activation's sign
 * must follow w's (Q8_0, Q4_0: w itself; Q4_1: unused). */
static inline __attribute__((always_inline)) __m256i unpack(const int type, const uint8_t *b,
                                                            __m256i *sgn) {
    if (type == GQ_Q8_0) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(b + 2));
        *sgn = w;
        return _mm256_sign_epi8(w, w);
    }
    __m128i t = _mm_loadu_si128((const __m128i *)(b + (type == GQ_Q4_0 ? 2 : 4)));
    __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t),
                                   _mm256_set1_epi8(0x0f));
    if (type == GQ_Q4_1) return nib;
    __m256i w = _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
    *sgn = w;
    return _mm256_sign_epi8(w, w);
}

/* The 8 exact lane sums of step 2 as floats. */
static inline __attribute__((always_inline)) __m256 lane_dot(const int type, __m256i u,
                                                             __m256i sgn, const int8_t *q) {
    __m256i x = _mm256_loadu_si256((const __m256i *)q);
    if (type != GQ_Q4_1) x = _mm256_sign_epi8(x, sgn);
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
    return _mm256_cvtepi32_ps(p);
}

/* NJ outputs x NR rows, accumulators in named registers (an array made GCC keep them in
 * memory: ggml_qlinear.c). xq/xd/xs and y point at the tile's first row, w at its first
 * output row. Each output row prefetches the block NJ rows ahead (the next tile). dw * dx is
 * one vector multiply of two broadcasts (the scalar product's bits in every lane): the weight
 * scale broadcast once per block for the NR rows, the activation scale a broadcast load. */
#define T_ROW(j, r)                                                                          \
    if (NR > r) {                                                                            \
        const __m256 d = _mm256_mul_ps(dwv, _mm256_broadcast_ss(xd + (r) * nb + b));         \
        a##j##r = _mm256_fmadd_ps(d, lane_dot(type, u, sgn, xq + (r) * in + k), a##j##r);    \
        if (type == GQ_Q4_1) m##j##r = fmaf(mw, xs[(r) * nb + b], m##j##r);                  \
    }
#define T_J(j)                                                                               \
    if (NJ > j) {                                                                            \
        const uint8_t *blk = w + (j) * row_bytes + b * ts;                                   \
        _mm_prefetch((const char *)((uintptr_t)blk + NJ * row_bytes), _MM_HINT_T0);          \
        __m256i sgn = _mm256_setzero_si256();                                                \
        const __m256i u = unpack(type, blk, &sgn);                                           \
        const __m256 dwv = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)blk));                \
        const float mw = type == GQ_Q4_1 ? _cvtsh_ss(*(const uint16_t *)(blk + 2)) : 0.0f;   \
        T_ROW(j, 0) T_ROW(j, 1)                                                              \
    }
#define T_OUT(j, r)                                                                          \
    if (NJ > j && NR > r) {                                                                  \
        float v = hsum(a##j##r);                                                             \
        if (type == GQ_Q4_1) v = v + m##j##r;                                                \
        y[(r) * ldy + (j)] = bias ? v + bias[j] : v;                                         \
    }
static inline __attribute__((always_inline)) void tile(
    const int type, const int NJ, const int NR, const int8_t *xq, const float *xd,
    const float *xs, int64_t in, const uint8_t *w, const float *bias, float *y, int64_t ldy) {
    const int64_t ts = type_size(type), nb = in / QK, row_bytes = nb * ts;
    __m256 z = _mm256_setzero_ps();
    __m256 a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z;
    __m256 a40 = z, a41 = z, a50 = z, a51 = z, a60 = z, a61 = z, a70 = z, a71 = z;
    float m00 = 0, m01 = 0, m10 = 0, m11 = 0, m20 = 0, m21 = 0, m30 = 0, m31 = 0;
    float m40 = 0, m41 = 0, m50 = 0, m51 = 0, m60 = 0, m61 = 0, m70 = 0, m71 = 0;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t k = b * QK;
        T_J(0) T_J(1) T_J(2) T_J(3) T_J(4) T_J(5) T_J(6) T_J(7)
    }
    T_OUT(0, 0) T_OUT(0, 1) T_OUT(1, 0) T_OUT(1, 1) T_OUT(2, 0) T_OUT(2, 1) T_OUT(3, 0)
    T_OUT(3, 1) T_OUT(4, 0) T_OUT(5, 0) T_OUT(6, 0) T_OUT(7, 0)
}
#undef T_ROW
#undef T_J
#undef T_OUT

/* Outputs [j_begin, j_end) of rows (<= ROW_CHUNK) rows: tiles of NJ1 outputs x 1 row at one
 * row, else of NJ2 outputs over every pair of rows (the last row alone when odd); the tail
 * outputs one by one. Q8_0/Q4_0: 8 x 1 and 4 x 2. Q4_1 halves both (4 x 1, 2 x 2): its
 * per-output scalar offset chains (m * sx) made 8 x 1 need more than the 16 vector
 * registers, and GCC spilled the accumulators to the stack in the inner loop. The tile shape
 * changes which registers hold a sum, never its operations. */
#define TILE(nj, nr, jj) tile(type, nj, nr, q, d, s, in, w + (jj) * rb, bias ? bias + (jj) : NULL, yr + (jj), ldy)
#define ROWS(T, NJ1, NJ2)                                                                    \
    static void rows_##T(const int8_t *xq, const float *xd, const float *xs, int64_t in,     \
                         const uint8_t *w, const float *bias, float *y, int64_t ldy,         \
                         int64_t rows, int64_t j_begin, int64_t j_end) {                     \
        const int type = T, nj = rows == 1 ? NJ1 : NJ2;                                      \
        const int64_t nb = in / QK, rb = nb * type_size(T);                                 \
        for (int64_t j = j_begin; j < j_end; j += nj) {                                      \
            const int left = j_end - j < nj ? (int)(j_end - j) : nj;                         \
            for (int64_t r = 0; r < rows; r += 2) {                                          \
                const int nr = rows - r >= 2 ? 2 : 1;                                        \
                const int8_t *q = xq + r * in;                                               \
                const float *d = xd + r * nb, *s = xs + r * nb;                              \
                float *yr = y + r * ldy;                                                     \
                if (left == nj && rows == 1) TILE(NJ1, 1, j);                                \
                else if (left == nj && nr == 2) TILE(NJ2, 2, j);                             \
                else if (left == nj) TILE(NJ2, 1, j);                                        \
                else {                                                                       \
                    for (int i = 0; i < left; i++) {                                         \
                        if (nr == 2) TILE(1, 2, j + i);                                      \
                        else TILE(1, 1, j + i);                                              \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }
ROWS(GQ_Q8_0, 8, 4)
ROWS(GQ_Q4_0, 8, 4)
ROWS(GQ_Q4_1, 4, 2)
#undef ROWS
#undef TILE
#endif

/* y [rows, ldy] for outputs [j_begin, j_end) from pagedkv_q8_quantize's xq/xd/xs;
 * portable != 0 forces the portable path (the same bits). */
int pagedkv_q8_linear(int type, const int8_t *xq, const float *xd, const float *xs,
                      const uint8_t *w, const float *bias, float *y, int64_t ldy, int64_t rows,
                      int64_t in, int64_t out, int64_t j_begin, int64_t j_end, int portable) {
    if (type_size(type) < 0 || rows < 0 || in < 0 || in % QK || j_begin < 0 || j_end > out ||
        j_begin > j_end || ldy < out)
        return -1;
#if Q8_AVX2
    if (!portable) {
        const int64_t nb = in / QK;
        for (int64_t r = 0; r < rows; r += ROW_CHUNK) {
            const int64_t n = rows - r < ROW_CHUNK ? rows - r : ROW_CHUNK;
            const int8_t *q = xq + r * in;
            const float *d = xd + r * nb, *s = xs + r * nb;
            float *yr = y + r * ldy;
            if (type == GQ_Q8_0) rows_GQ_Q8_0(q, d, s, in, w, bias, yr, ldy, n, j_begin, j_end);
            else if (type == GQ_Q4_0) rows_GQ_Q4_0(q, d, s, in, w, bias, yr, ldy, n, j_begin, j_end);
            else rows_GQ_Q4_1(q, d, s, in, w, bias, yr, ldy, n, j_begin, j_end);
        }
        return 0;
    }
#endif
    (void)portable;
    rows_portable(type, xq, xd, xs, w, bias, y, ldy, rows, in, j_begin, j_end);
    return 0;
}

/* Both steps in one call (the wrapper's one-thread fast path): x [rows, ldx] float32 quantized
 * into a buffer of this call, then every output. -2 when that buffer cannot be allocated. */
int pagedkv_q8_linear_f32(int type, const float *x, int64_t ldx, const uint8_t *w,
                          const float *bias, float *y, int64_t ldy, int64_t rows, int64_t in,
                          int64_t out) {
    if (rows < 0 || in < 0 || in % QK || ldx < in) return -1;
    const int64_t nb = in / QK;
    void *buf = malloc((size_t)(rows * in) + 2 * (size_t)(rows * nb) * sizeof(float) + 1);
    if (!buf) return -2;
    float *xd = (float *)buf, *xs = xd + rows * nb;
    int8_t *xq = (int8_t *)(xs + rows * nb);
    int rc = pagedkv_q8_quantize(x, ldx, rows, in, xq, xd, xs);
    if (!rc) rc = pagedkv_q8_linear(type, xq, xd, xs, w, bias, y, ldy, rows, in, out, 0, out, 0);
    free(buf);
    return rc;
}
