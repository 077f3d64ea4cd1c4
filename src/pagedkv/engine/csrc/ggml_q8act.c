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
#if Q8_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define Q8_AVX512 1 /* two outputs per zmm, vpdpbusd (tile512) */
#else
#define Q8_AVX512 0
#endif
#if Q8_AVX2 && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define Q8_VNNI256 1 /* lane_dot's maddubs + madd as one vpdpbusd (the same exact sums) */
#else
#define Q8_VNNI256 0
#endif

enum { GQ_Q8_0 = 0, GQ_Q4_0 = 1, GQ_Q4_1 = 2 }; /* ggml_qlinear.c's codes */
#define QK 32
#define ROW_CHUNK 32

static inline int64_t type_size(int type) {
    return type == GQ_Q8_0 ? 34 : type == GQ_Q4_0 ? 18 : type == GQ_Q4_1 ? 20 : -1;
}

int pagedkv_q8_has_avx2(void) { return Q8_AVX2; }

/* 3: this build has the AVX-512 VNNI tiles, 2: AVX2 with 256-bit VNNI, 1: AVX2, 0: portable. */
int pagedkv_q8_isa(void) { return Q8_AVX512 ? 3 : Q8_VNNI256 ? 2 : Q8_AVX2; }

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
#if Q8_VNNI256 /* u8 x s8, four products per lane: the same exact lane sums */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
    __m256i p = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x);
#endif
#else
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
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

#if Q8_AVX512
/* AVX-512: outputs j and j + 1 share one zmm (tile512), so one vpdpbusd makes both outputs'
 * 8 exact lane sums of step 2 and one FMA adds both outputs' block terms: half the vector
 * operations of the AVX2 tile per weight. Every lane still does the header's operations in
 * block order (fma(dw * dx, lane, acc), Q4_1's fma(m, sx, summs) on a lane of its own), and
 * the final tree is lanes_sum's, so the bits are the AVX2 and portable paths'.
 *
 * Lane layouts (32-bit lanes of the zmm; jL = output j's lane L, kL = output j + 1's):
 *   Q8_0 (32 signed quant bytes per block): j0..j7 | k0..k7  (two 32-byte halves)
 *   Q4_0, Q4_1 (16 nibble bytes):           j0..j3 | k0..k3 | j4..j7 | k4..k7
 *     (128-bit quarters: the low nibbles of j's bytes, of j + 1's, then the high nibbles)
 * The activation block is laid out to match (pair_x), once per block and row. Signed
 * weights (Q8_0, Q4_0: q - 8) multiply |w| by x negated where w < 0 (vpdpbusd is u8 x s8). */
static inline __attribute__((always_inline)) __m512i pair_x(const int type, const int8_t *q) {
    __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)q));
    if (type == GQ_Q8_0) return x;
    return _mm512_shuffle_i64x2(x, x, 0x50); /* quarters 0, 0, 1, 1: values 0..15 twice, 16..31 twice */
}

/* Both outputs' weight bytes (*u unsigned factor, *neg the lanes' bytes where w < 0) and
 * their block scales as float32 (Q4_1: d_j, m_j, d_k, m_k; else d_j, d_k in lanes 0, 1). */
static inline __attribute__((always_inline)) __m512i pair_w(const int type, const uint8_t *bj,
                                                            const uint8_t *bk, __mmask64 *neg,
                                                            __m128 *dm) {
    if (type == GQ_Q4_1) {
        *dm = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(*(const int32_t *)bj),
                                            *(const int32_t *)bk, 1));
    } else {
        *dm = _mm_cvtph_ps(_mm_insert_epi16(_mm_cvtsi32_si128(*(const uint16_t *)bj),
                                            *(const uint16_t *)bk, 1));
    }
    __m512i w;
    if (type == GQ_Q8_0) {
        w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(bj + 2))),
                               _mm256_loadu_si256((const __m256i *)(bk + 2)), 1);
    } else {
        const int off = type == GQ_Q4_0 ? 2 : 4;
        __m256i t = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(bj + off))),
            _mm_loadu_si128((const __m128i *)(bk + off)), 1);
        w = _mm512_and_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1),
            _mm512_set1_epi8(0x0f));
        if (type == GQ_Q4_1) return w;
        w = _mm512_sub_epi8(w, _mm512_set1_epi8(8));
    }
    *neg = _mm512_movepi8_mask(w);
    return _mm512_abs_epi8(w);
}

/* The per-lane weight scale of the layout: lanes of j take dm[0], of j + 1 dm[1] (Q4_1: dm[2]). */
static inline __m512i scale_index(const int type) {
    if (type == GQ_Q8_0) return _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const int k = type == GQ_Q4_1 ? 2 : 1;
    return _mm512_set_epi32(k, k, k, k, 0, 0, 0, 0, k, k, k, k, 0, 0, 0, 0);
}

/* Output j's (h = 0) or j + 1's (h = 1) lane L from the 16 accumulated lanes. */
static inline float lane_of(const int type, const float *a, int h, int l) {
    if (type == GQ_Q8_0) return a[8 * h + l];
    return a[(l < 4 ? 0 : 8) + 4 * h + (l & 3)];
}

static inline float pair_out(const int type, const float *a, int h) {
    float l[8];
    for (int i = 0; i < 8; i++) l[i] = lane_of(type, a, h, i);
    return lanes_sum(l);
}

/* NP output pairs x NR rows (1 x 4 pairs or 2 x 2). */
#define Z_ROW(p, r)                                                                          \
    if (NR > r) {                                                                            \
        __m512i xv = NEG ? _mm512_mask_sub_epi8(x##r, neg, _mm512_setzero_si512(), x##r) : x##r; \
        __m512 lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xv)); \
        const __m512 d = _mm512_mul_ps(dwv, _mm512_set1_ps(xd[(r) * nb + b]));               \
        a##p##r = _mm512_fmadd_ps(d, lanes, a##p##r);                                        \
        if (type == GQ_Q4_1)                                                                 \
            m##p##r = _mm_fmadd_ps(dm, _mm_set1_ps(xs[(r) * nb + b]), m##p##r);              \
    }
#define Z_P(p)                                                                               \
    if (NP > p) {                                                                            \
        const uint8_t *bj = w + (2 * (p)) * row_bytes + b * ts, *bk = bj + row_bytes;        \
        _mm_prefetch((const char *)((uintptr_t)bj + 2 * NP * row_bytes), _MM_HINT_T0);       \
        _mm_prefetch((const char *)((uintptr_t)bk + 2 * NP * row_bytes), _MM_HINT_T0);       \
        __mmask64 neg = 0;                                                                   \
        __m128 dm;                                                                           \
        const __m512i u = pair_w(type, bj, bk, &neg, &dm);                                   \
        const __m512 dwv = _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(dm));          \
        Z_ROW(p, 0) Z_ROW(p, 1)                                                              \
    }
#define Z_OUT(p, r)                                                                          \
    if (NP > p && NR > r) {                                                                  \
        float a[16], ms[4];                                                                  \
        _mm512_storeu_ps(a, a##p##r);                                                        \
        _mm_storeu_ps(ms, m##p##r);                                                          \
        for (int h = 0; h < 2; h++) {                                                        \
            float v = pair_out(type, a, h);                                                  \
            if (type == GQ_Q4_1) v = v + ms[1 + 2 * h];                                      \
            const int j = 2 * (p) + h;                                                       \
            y[(r) * ldy + j] = bias ? v + bias[j] : v;                                       \
        }                                                                                    \
    }
static inline __attribute__((always_inline)) void tile512(
    const int type, const int NP, const int NR, const int8_t *xq, const float *xd,
    const float *xs, int64_t in, const uint8_t *w, const float *bias, float *y, int64_t ldy) {
    const int64_t ts = type_size(type), nb = in / QK, row_bytes = nb * ts;
    const int NEG = type != GQ_Q4_1;
    const __m512i sidx = scale_index(type);
    __m512 z = _mm512_setzero_ps();
    __m512 a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a30 = z;
    __m128 mz = _mm_setzero_ps();
    __m128 m00 = mz, m01 = mz, m10 = mz, m11 = mz, m20 = mz, m30 = mz;
    __m128 m21 = mz, m31 = mz;
    __m512 a21 = z, a31 = z;
    for (int64_t b = 0; b < nb; b++) {
        const __m512i x0 = pair_x(type, xq + b * QK);
        const __m512i x1 = NR > 1 ? pair_x(type, xq + in + b * QK) : _mm512_setzero_si512();
        Z_P(0) Z_P(1) Z_P(2) Z_P(3)
    }
    Z_OUT(0, 0) Z_OUT(0, 1) Z_OUT(1, 0) Z_OUT(1, 1) Z_OUT(2, 0) Z_OUT(3, 0)
    (void)a21; (void)a31; (void)m21; (void)m31;
}
#undef Z_ROW
#undef Z_P
#undef Z_OUT

/* Outputs [j_begin, j_end) of rows (<= ROW_CHUNK) rows: 4 pairs x 1 row at one row, else 2
 * pairs over every pair of rows (the last row alone when odd); the outputs left over (fewer
 * than a tile) through the AVX2 tiles one by one (the same bits). */
#define TILEZ(np, nr, jj) tile512(type, np, nr, q, d, s, in, w + (jj) * rb, bias ? bias + (jj) : NULL, yr + (jj), ldy)
#define TILE1(nr, jj) tile(type, 1, nr, q, d, s, in, w + (jj) * rb, bias ? bias + (jj) : NULL, yr + (jj), ldy)
#define ROWSZ(T)                                                                             \
    static void rowsz_##T(const int8_t *xq, const float *xd, const float *xs, int64_t in,    \
                          const uint8_t *w, const float *bias, float *y, int64_t ldy,        \
                          int64_t rows, int64_t j_begin, int64_t j_end) {                    \
        const int type = T, nj = rows == 1 ? 8 : 4;                                          \
        const int64_t nb = in / QK, rb = nb * type_size(T);                                 \
        for (int64_t j = j_begin; j < j_end; j += nj) {                                      \
            const int left = j_end - j < nj ? (int)(j_end - j) : nj;                         \
            for (int64_t r = 0; r < rows; r += 2) {                                          \
                const int nr = rows - r >= 2 ? 2 : 1;                                        \
                const int8_t *q = xq + r * in;                                               \
                const float *d = xd + r * nb, *s = xs + r * nb;                              \
                float *yr = y + r * ldy;                                                     \
                if (left == nj && rows == 1) TILEZ(4, 1, j);                                 \
                else if (left == nj && nr == 2) TILEZ(2, 2, j);                              \
                else if (left == nj) TILEZ(2, 1, j);                                         \
                else {                                                                       \
                    for (int i = 0; i < left; i++) {                                         \
                        if (nr == 2) TILE1(2, j + i);                                        \
                        else TILE1(1, j + i);                                                \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }
ROWSZ(GQ_Q8_0)
ROWSZ(GQ_Q4_0)
ROWSZ(GQ_Q4_1)
#undef ROWSZ
#undef TILEZ
#undef TILE1
#endif

#if Q8_AVX2
/* ---- The 16-output layout (AVX2 and AVX-512 builds; pagedkv_q8_pack16 writes it) ----
 *
 * tile512 above still spends most of its vector operations gathering two outputs' scales
 * and nibbles into one register. Repacked once at load, 16 outputs' block b sit together:
 *
 *   group g (outputs 16g .. 16g + 15), block b, 16 x type-size bytes:
 *     d[16] f16 | (Q4_1) m[16] f16 | chunk 0 | chunk 1 | ... (4 chunks for Q4, 8 for Q8_0)
 *     chunk c, 64 bytes: bytes 4c .. 4c + 3 of the 16 outputs' quant bytes, output o at 4o
 *
 * so one zmm holds one lane (step 2's lane) of 16 outputs: chunk c's low nibbles are lane c
 * and its high nibbles lane c + 4 (Q4; value i + 16 is byte i's high nibble), Q8_0's chunk c
 * is lane c. A block of 16 outputs then costs one vpdpbusd, one conversion and one FMA per
 * lane (8 of each), one scale load and conversion, and the nibble masks: ~42 vector
 * operations per 512 weights, against ~104 in tile512. The activations' four bytes of a lane
 * are one broadcast load. The integer lane sums are exact: Q4_1 nibbles are u8 already;
 * Q4_0's (q - 8) x = q x - 8 x and Q8_0's w x = (w + 128) x - 128 x, with the 8 x / 128 x
 * lane sums of the activation block subtracted up front (vpdpbusd's accumulator input).
 * The float operations are the header's, per lane, in block order, then lanes_sum's tree,
 * + summs, + bias: the bits of the AVX2 and portable paths. AVX2 builds read the same
 * layout half a chunk per ymm (half8 below: one lane of 8 outputs). */
/* Software prefetch of the group's stream. The AVX-512 kernel asks for the block PF_BLOCKS
 * ahead into L2 (prefetcht1), the AVX2 one for the block H_PF_BLOCKS ahead into L1. Measured
 * on the AMX Xeon (the engine at batch 1, SmolLM2 Q4_1, interleaved runs against llama.cpp):
 * 24 blocks into L2 0.98-1.13x llama.cpp's speed at 1 thread and 1.07-1.18x at 2, against
 * 0.86-0.91x and 0.86-0.88x with 4 blocks into L1 (which had beaten 2, 6, 8 and 12 into L1):
 * an L2 prefetch does not hold one of L1's few fill buffers, so more lines are in flight. */
#ifndef PF_BLOCKS
#define PF_BLOCKS 24
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
#ifndef H_PF_BLOCKS
#define H_PF_BLOCKS 4
#endif
static inline int64_t chunks_of(int type) { return type == GQ_Q8_0 ? 8 : 4; }
static inline int64_t scale_bytes(int type) { return type == GQ_Q4_1 ? 64 : 32; }
#endif


/* The 16-output layout above from the file's blocks w [out, in / 32 blocks] into dst (the
 * same number of bytes); out a multiple of 16. Plain C (run once at load). */
int pagedkv_q8_pack16(int type, const uint8_t *w, int64_t in, int64_t out, uint8_t *dst) {
    const int64_t ts = type_size(type);
    if (ts < 0 || in <= 0 || in % QK || out < 0 || out % 16) return -1;
    const int64_t nb = in / QK, q0 = type == GQ_Q4_1 ? 4 : 2, sb = type == GQ_Q4_1 ? 4 : 2;
    const int64_t nq = type == GQ_Q8_0 ? 32 : 16; /* quant bytes per block */
    for (int64_t g = 0; g < out / 16; g++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = dst + (g * nb + b) * 16 * ts;
            for (int64_t j = 0; j < 16; j++) {
                const uint8_t *blk = w + ((16 * g + j) * nb + b) * ts;
                memcpy(o + 2 * j, blk, 2);                           /* d */
                if (type == GQ_Q4_1) memcpy(o + 32 + 2 * j, blk + 2, 2); /* m */
                for (int64_t i = 0; i < nq; i++)
                    o[16 * sb + (i / 4) * 64 + 4 * j + (i % 4)] = blk[q0 + i];
            }
        }
    }
    return 0;
}

#if Q8_AVX2
/* The activation side of the 16-output kernel for one row: per block and lane the exact
 * correction -k * sum(x of the lane) (k = 8 for Q4_0, 128 for Q8_0, 0 for Q4_1). */
static void lane_corrections(int type, const int8_t *xq, int64_t nb, int32_t *corr) {
    const int32_t k = type == GQ_Q8_0 ? 128 : type == GQ_Q4_0 ? 8 : 0;
    for (int64_t b = 0; b < nb; b++)
        for (int l = 0; l < 8; l++) {
            const int8_t *q = xq + b * QK + 4 * l;
            corr[b * 8 + l] = -k * (q[0] + q[1] + q[2] + q[3]);
        }
}
#endif

#if Q8_AVX512

/* One group of 16 outputs, NR (1 or 2) rows; g points at the group's first block. */
#define P_LANE(r, l, u)                                                                       \
    if (NR > r) {                                                                            \
        __m512i xb = _mm512_set1_epi32(*(const int32_t *)(xq + (r) * in + b * QK + 4 * (l))); \
        __m512i init = type == GQ_Q4_1 ? _mm512_setzero_si512()                             \
                                       : _mm512_set1_epi32(corr[(r) * nb * 8 + b * 8 + (l)]); \
        __m512 lane = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init, u, xb));                 \
        a##r##l = _mm512_fmadd_ps(d##r, lane, a##r##l);                                      \
    }
#define P_Q4(c, c4)                                                                          \
    {                                                                                        \
        const __m512i v = _mm512_loadu_si512((const void *)(q + 64 * (c)));                  \
        const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib); \
        P_LANE(0, c, lo) P_LANE(1, c, lo) P_LANE(0, c4, hi) P_LANE(1, c4, hi)              \
    }
#define P_Q8(c)                                                                              \
    {                                                                                        \
        const __m512i u = _mm512_xor_si512(_mm512_loadu_si512((const void *)(q + 64 * (c))), sgn); \
        P_LANE(0, c, u) P_LANE(1, c, u)                                                      \
    }
#define P_OUT(r)                                                                             \
    if (NR > r) {                                                                            \
        __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a##r##0, a##r##4), _mm512_add_ps(a##r##2, a##r##6)), \
                                 _mm512_add_ps(_mm512_add_ps(a##r##1, a##r##5), _mm512_add_ps(a##r##3, a##r##7))); \
        if (type == GQ_Q4_1) v = _mm512_add_ps(v, s##r);                                     \
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));                               \
        _mm512_storeu_ps(y + (r) * ldy, v);                                                  \
    }
static inline __attribute__((always_inline)) void group16(
    const int type, const int NR, const int8_t *xq, const float *xd, const float *xs,
    const int32_t *corr, int64_t in, const uint8_t *g, const float *bias, float *y, int64_t ldy) {
    const int64_t nb = in / QK, gb = 16 * type_size(type), sb = scale_bytes(type);
    const __m512i nib = _mm512_set1_epi8(0x0f), sgn = _mm512_set1_epi8((char)0x80);
    __m512 z = _mm512_setzero_ps();
    __m512 a00 = z, a01 = z, a02 = z, a03 = z, a04 = z, a05 = z, a06 = z, a07 = z;
    __m512 a10 = z, a11 = z, a12 = z, a13 = z, a14 = z, a15 = z, a16 = z, a17 = z;
    __m512 s0 = z, s1 = z;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * gb, *q = blk + sb;
        _mm_prefetch((const char *)blk + PF_BLOCKS * gb, PF_HINT);
        _mm_prefetch((const char *)blk + PF_BLOCKS * gb + 64, PF_HINT);
        _mm_prefetch((const char *)blk + PF_BLOCKS * gb + 128, PF_HINT);
        _mm_prefetch((const char *)blk + PF_BLOCKS * gb + 192, PF_HINT);
        _mm_prefetch((const char *)blk + PF_BLOCKS * gb + 256, PF_HINT);
        if (type == GQ_Q8_0) {
            _mm_prefetch((const char *)blk + PF_BLOCKS * gb + 320, PF_HINT);
            _mm_prefetch((const char *)blk + PF_BLOCKS * gb + 384, PF_HINT);
            _mm_prefetch((const char *)blk + PF_BLOCKS * gb + 448, PF_HINT);
            _mm_prefetch((const char *)blk + PF_BLOCKS * gb + 512, PF_HINT);
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 d0 = _mm512_mul_ps(dw, _mm512_set1_ps(xd[b]));
        const __m512 d1 = NR > 1 ? _mm512_mul_ps(dw, _mm512_set1_ps(xd[nb + b])) : z;
        if (type == GQ_Q4_1) {
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
            s0 = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[b]), s0);
            if (NR > 1) s1 = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[nb + b]), s1);
        }
        if (type == GQ_Q8_0) {
            P_Q8(0) P_Q8(1) P_Q8(2) P_Q8(3) P_Q8(4) P_Q8(5) P_Q8(6) P_Q8(7)
        } else {
            P_Q4(0, 4) P_Q4(1, 5) P_Q4(2, 6) P_Q4(3, 7)
        }
    }
    P_OUT(0) P_OUT(1)
}
#undef P_LANE
#undef P_Q4
#undef P_Q8
#undef P_OUT

#define GROUPS(T)                                                                            \
    static void groups_##T(const int8_t *xq, const float *xd, const float *xs,               \
                           const int32_t *corr, int64_t in, const uint8_t *w,                \
                           const float *bias, float *y, int64_t ldy, int64_t rows,           \
                           int64_t j_begin, int64_t j_end) {                                 \
        const int64_t nb = in / QK, gbytes = nb * 16 * type_size(T);                         \
        for (int64_t j = j_begin; j < j_end; j += 16) {                                      \
            const uint8_t *g = w + (j / 16) * gbytes;                                        \
            const float *bj = bias ? bias + j : NULL;                                        \
            for (int64_t r = 0; r < rows; r += 2) {                                          \
                const int8_t *q = xq + r * in;                                               \
                const float *d = xd + r * nb, *s = xs + r * nb;                              \
                const int32_t *c = corr + r * nb * 8;                                        \
                if (rows - r >= 2) group16(T, 2, q, d, s, c, in, g, bj, y + r * ldy + j, ldy); \
                else group16(T, 1, q, d, s, c, in, g, bj, y + r * ldy + j, ldy);             \
            }                                                                                \
        }                                                                                    \
    }
GROUPS(GQ_Q8_0)
GROUPS(GQ_Q4_0)
GROUPS(GQ_Q4_1)
#undef GROUPS
#endif

#if Q8_AVX2 && !Q8_AVX512
/* AVX2 on the 16-output layout: one ymm holds one lane of 8 outputs (half of a chunk: the
 * group's outputs 8h .. 8h + 7 for h = 0, 1), so a block of 8 outputs costs per lane one
 * maddubs + madd (or one vpdpbusd with 256-bit VNNI), one conversion and one FMA, and one
 * scale conversion for the 8 outputs, against ~15 operations per output in tile(). The lane
 * sums are exact: Q4_1 and Q4_0 nibbles are u8 (Q4_0's - 8 x as lane_corrections' integer,
 * added after); Q8_0 multiplies |w| by sign(x, w) as unpack() does (|w| <= 128, so a
 * maddubs pair is at most 2 * 128 * 127 < 32767: no saturation). The float operations are
 * the header's per lane and block in block order, then lanes_sum's tree, + summs, + bias:
 * the bits of tile() and of the portable path. One row at a time (8 accumulators, the
 * scale, the masks and the temporaries fill the 16 ymm registers); the group's blocks stay
 * in L1/L2 for the call's other rows and the other half. */
#ifndef H_PF_ALL
#define H_PF_ALL 0 /* 1: prefetch in both halves (measured no better) */
#endif
static inline __attribute__((always_inline)) __m256i dot8(__m256i u, __m256i x) {
#if Q8_VNNI256
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x);
#endif
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}
#define H_LANE(l, u, xv)                                                                     \
    {                                                                                        \
        __m256i p = dot8(u, xv);                                                             \
        if (type == GQ_Q4_0) p = _mm256_add_epi32(p, _mm256_set1_epi32(corr[b * 8 + (l)]));  \
        a##l = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), a##l);                              \
    }
#define H_X(l) _mm256_set1_epi32(*(const int32_t *)(xq + b * QK + 4 * (l)))
#define H_Q4(c, c4)                                                                          \
    {                                                                                        \
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * (c)));               \
        H_LANE(c, _mm256_and_si256(v, nib), H_X(c))                                          \
        H_LANE(c4, _mm256_and_si256(_mm256_srli_epi16(v, 4), nib), H_X(c4))                  \
    }
#define H_Q8(c)                                                                              \
    {                                                                                        \
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * (c)));               \
        H_LANE(c, _mm256_sign_epi8(v, v), _mm256_sign_epi8(H_X(c), v))                       \
    }
static inline __attribute__((always_inline)) void half8(
    const int type, const int8_t *xq, const float *xd, const float *xs, const int32_t *corr,
    int64_t in, const uint8_t *g, int h, const float *bias, float *y) {
    const int64_t nb = in / QK, gb = 16 * type_size(type), sb = scale_bytes(type);
    const __m256i nib = _mm256_set1_epi8(0x0f);
    __m256 z = _mm256_setzero_ps();
    __m256 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z, s = z;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * gb, *q = blk + sb + 32 * h;
        if (H_PF_ALL || h == 0) { /* the second half reads the lines the first one fetched */
        _mm_prefetch((const char *)q + H_PF_BLOCKS * gb, _MM_HINT_T0);
        _mm_prefetch((const char *)q + H_PF_BLOCKS * gb + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)q + H_PF_BLOCKS * gb + 128, _MM_HINT_T0);
        _mm_prefetch((const char *)q + H_PF_BLOCKS * gb + 192, _MM_HINT_T0);
        }
        if ((H_PF_ALL || h == 0) && type == GQ_Q8_0) {
            _mm_prefetch((const char *)q + H_PF_BLOCKS * gb + 256, _MM_HINT_T0);
            _mm_prefetch((const char *)q + H_PF_BLOCKS * gb + 320, _MM_HINT_T0);
            _mm_prefetch((const char *)q + H_PF_BLOCKS * gb + 384, _MM_HINT_T0);
            _mm_prefetch((const char *)q + H_PF_BLOCKS * gb + 448, _MM_HINT_T0);
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
        const __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(xd[b]));
        if (type == GQ_Q4_1) {
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h)));
            s = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[b]), s);
        }
        if (type == GQ_Q8_0) {
            H_Q8(0) H_Q8(1) H_Q8(2) H_Q8(3) H_Q8(4) H_Q8(5) H_Q8(6) H_Q8(7)
        } else {
            H_Q4(0, 4) H_Q4(1, 5) H_Q4(2, 6) H_Q4(3, 7)
        }
    }
    __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a4), _mm256_add_ps(a2, a6)),
                             _mm256_add_ps(_mm256_add_ps(a1, a5), _mm256_add_ps(a3, a7)));
    if (type == GQ_Q4_1) v = _mm256_add_ps(v, s);
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * h));
    _mm256_storeu_ps(y + 8 * h, v);
}
#undef H_LANE
#undef H_X
#undef H_Q4
#undef H_Q8

#define GROUPS(T)                                                                            \
    static void groups_##T(const int8_t *xq, const float *xd, const float *xs,               \
                           const int32_t *corr, int64_t in, const uint8_t *w,                \
                           const float *bias, float *y, int64_t ldy, int64_t rows,           \
                           int64_t j_begin, int64_t j_end) {                                 \
        const int64_t nb = in / QK, gbytes = nb * 16 * type_size(T);                         \
        for (int64_t j = j_begin; j < j_end; j += 16) {                                      \
            const uint8_t *g = w + (j / 16) * gbytes;                                        \
            const float *bj = bias ? bias + j : NULL;                                        \
            for (int64_t r = 0; r < rows; r++)                                               \
                half8(T, xq + r * in, xd + r * nb, xs + r * nb, corr + r * nb * 8, in, g, 0, \
                      bj, y + r * ldy + j);                                                  \
            for (int64_t r = 0; r < rows; r++)                                               \
                half8(T, xq + r * in, xd + r * nb, xs + r * nb, corr + r * nb * 8, in, g, 1, \
                      bj, y + r * ldy + j);                                                  \
        }                                                                                    \
    }
GROUPS(GQ_Q8_0)
GROUPS(GQ_Q4_0)
GROUPS(GQ_Q4_1)
#undef GROUPS
#endif

/* 1: this build has the 16-output kernel (pagedkv_q8_linear16: AVX-512 VNNI or AVX2), 0: it
 * does not (portable only). */
int pagedkv_q8_has_pack16(void) { return Q8_AVX2; }

/* pagedkv_q8_linear on pagedkv_q8_pack16's layout: outputs [j_begin, j_end), both multiples
 * of 16. -3 when this build has no 16-output kernel, -2 when the corrections' buffer cannot
 * be allocated. */
int pagedkv_q8_linear16(int type, const int8_t *xq, const float *xd, const float *xs,
                        const uint8_t *w, const float *bias, float *y, int64_t ldy, int64_t rows,
                        int64_t in, int64_t out, int64_t j_begin, int64_t j_end) {
    if (type_size(type) < 0 || rows < 0 || in <= 0 || in % QK || out % 16 || j_begin < 0 ||
        j_end > out || j_begin > j_end || j_begin % 16 || j_end % 16 || ldy < out)
        return -1;
#if Q8_AVX2
    const int64_t nb = in / QK;
    int32_t stack[2 * 8 * 64], *corr = stack; /* rows x nb x 8 */
    if (rows * nb * 8 > (int64_t)(sizeof stack / sizeof *stack)) {
        corr = malloc((size_t)(rows * nb * 8) * sizeof *corr);
        if (!corr) return -2;
    }
    for (int64_t r = 0; r < rows; r++) lane_corrections(type, xq + r * in, nb, corr + r * nb * 8);
    if (type == GQ_Q8_0) groups_GQ_Q8_0(xq, xd, xs, corr, in, w, bias, y, ldy, rows, j_begin, j_end);
    else if (type == GQ_Q4_0) groups_GQ_Q4_0(xq, xd, xs, corr, in, w, bias, y, ldy, rows, j_begin, j_end);
    else groups_GQ_Q4_1(xq, xd, xs, corr, in, w, bias, y, ldy, rows, j_begin, j_end);
    if (corr != stack) free(corr);
    return 0;
#else
    (void)xq; (void)xd; (void)xs; (void)w; (void)bias; (void)y;
    return -3;
#endif
}

/* Quantize + pagedkv_q8_linear16 over every output (the one-thread fast path). */
int pagedkv_q8_linear16_f32(int type, const float *x, int64_t ldx, const uint8_t *w,
                            const float *bias, float *y, int64_t ldy, int64_t rows, int64_t in,
                            int64_t out) {
    if (rows < 0 || in <= 0 || in % QK || ldx < in) return -1;
    const int64_t nb = in / QK;
    void *buf = malloc((size_t)(rows * in) + 2 * (size_t)(rows * nb) * sizeof(float) + 1);
    if (!buf) return -2;
    float *xd = (float *)buf, *xs = xd + rows * nb;
    int8_t *xq = (int8_t *)(xs + rows * nb);
    int rc = pagedkv_q8_quantize(x, ldx, rows, in, xq, xd, xs);
    if (!rc) rc = pagedkv_q8_linear16(type, xq, xd, xs, w, bias, y, ldy, rows, in, out, 0, out);
    free(buf);
    return rc;
}

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
#if Q8_AVX512
            if (type == GQ_Q8_0) rowsz_GQ_Q8_0(q, d, s, in, w, bias, yr, ldy, n, j_begin, j_end);
            else if (type == GQ_Q4_0) rowsz_GQ_Q4_0(q, d, s, in, w, bias, yr, ldy, n, j_begin, j_end);
            else rowsz_GQ_Q4_1(q, d, s, in, w, bias, yr, ldy, n, j_begin, j_end);
#else
            if (type == GQ_Q8_0) rows_GQ_Q8_0(q, d, s, in, w, bias, yr, ldy, n, j_begin, j_end);
            else if (type == GQ_Q4_0) rows_GQ_Q4_0(q, d, s, in, w, bias, yr, ldy, n, j_begin, j_end);
            else rows_GQ_Q4_1(q, d, s, in, w, bias, yr, ldy, n, j_begin, j_end);
#endif
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

/* Both steps for outputs [j_begin, j_end) only (one part of a thread split, bound once:
 * gguf_q8act.bind_into): x quantized into a buffer of this call (each part quantizes the
 * same rows to the same bits), then pagedkv_q8_linear16 when packed (w in pack16's layout,
 * the range on multiples of 16), else pagedkv_q8_linear on the file's blocks. -2 when the
 * buffer cannot be allocated. */
int pagedkv_q8_linear_f32_range(int type, int packed, const float *x, int64_t ldx,
                                const uint8_t *w, const float *bias, float *y, int64_t ldy,
                                int64_t rows, int64_t in, int64_t out, int64_t j_begin,
                                int64_t j_end) {
    if (rows < 0 || in < 0 || in % QK || ldx < in) return -1;
    const int64_t nb = in / QK;
    void *buf = malloc((size_t)(rows * in) + 2 * (size_t)(rows * nb) * sizeof(float) + 1);
    if (!buf) return -2;
    float *xd = (float *)buf, *xs = xd + rows * nb;
    int8_t *xq = (int8_t *)(xs + rows * nb);
    int rc = pagedkv_q8_quantize(x, ldx, rows, in, xq, xd, xs);
    if (!rc && packed)
        rc = pagedkv_q8_linear16(type, xq, xd, xs, w, bias, y, ldy, rows, in, out, j_begin, j_end);
    else if (!rc)
        rc = pagedkv_q8_linear(type, xq, xd, xs, w, bias, y, ldy, rows, in, out, j_begin, j_end, 0);
    free(buf);
    return rc;
}

/* ---- Threads for one call (pagedkv_q8_linear_f32_par), OpenMP build ----
 *
 * Built with -fopenmp (gguf_q8act.py's first flag set), this library shares the process's
 * OpenMP runtime: torch's, which is loaded first and whose soname (libgomp.so.1) the dynamic
 * linker reuses, so the parts run on torch's intra-op threads. A pool of our own (the pthread
 * build below) competes with torch's OpenMP workers, which spin for a while after each of
 * torch's parallel regions: measured on the 2-core development machine, splitting SmolLM2's
 * batch-1 linears among two threads that way made decode slower (88 -> 60 tokens/s), and
 * with OMP_WAIT_POLICY=PASSIVE faster (130). The parts and their cut points are the pthread
 * build's, so the bits are the one-thread call's. Under 2^15 multiply-adds a call runs
 * alone: an OpenMP region costs a few microseconds. */
#define PAR_MAX 8

/* The parts of one call: outputs [0, out) in at most `threads` runs on multiples of 16 when
 * packed, else 8, each of at least min_macs multiply-adds; their cut points into
 * cuts[0..parts]. Returns the number of parts (1: the caller runs the call alone). Both
 * builds below split this way, so they give the same bits as one call. */
static int64_t par_cuts(int packed, int64_t rows, int64_t in, int64_t out, int threads,
                        int64_t min_macs, int64_t *cuts) {
    const int64_t step = packed ? 16 : 8, tiles = (out + step - 1) / step;
    int64_t parts = threads < PAR_MAX ? threads : PAR_MAX;
    if (parts > tiles) parts = tiles;
    if (parts > rows * out * in / min_macs) parts = rows * out * in / min_macs;
    if (parts < 1) parts = 1;
    for (int64_t p = 0; p <= parts; p++) {
        const int64_t c = step * ((tiles * p + parts / 2) / parts);
        cuts[p] = c < out ? c : out;
    }
    return parts;
}

#ifdef _OPENMP
#include <omp.h>

#ifndef PAR_MIN_MACS_OMP
#define PAR_MIN_MACS_OMP (1 << 15) /* multiply-adds per part at least */
#endif

int pagedkv_q8_par_openmp(void) { return 1; }

int pagedkv_q8_linear_f32_par(int type, int packed, const float *x, int64_t ldx,
                              const uint8_t *w, const float *bias, float *y, int64_t ldy,
                              int64_t rows, int64_t in, int64_t out, int threads) {
    int64_t cuts[PAR_MAX + 1];
    int rcs[PAR_MAX] = {0};
    const int64_t parts = par_cuts(packed, rows, in, out, threads, PAR_MIN_MACS_OMP, cuts);
    if (parts <= 1 || omp_in_parallel())
        return pagedkv_q8_linear_f32_range(type, packed, x, ldx, w, bias, y, ldy, rows, in, out,
                                           0, out);
#pragma omp parallel for num_threads((int)parts) schedule(static, 1)
    for (int64_t p = 0; p < parts; p++)
        rcs[p] = pagedkv_q8_linear_f32_range(type, packed, x, ldx, w, bias, y, ldy, rows, in,
                                             out, cuts[p], cuts[p + 1]);
    for (int64_t p = 0; p < parts; p++)
        if (rcs[p]) return rcs[p];
    return 0;
}
#else

int pagedkv_q8_par_openmp(void) { return 0; }

/* ---- Threads for one call (pagedkv_q8_linear_f32_par), pthread build ----
 *
 * A batch-1 decode step makes ~150 calls of 20-300 µs; handing half of each to a Python
 * worker (native.run_ranges, a futex wake-up per call) costs more than the half saves. Here
 * the caller runs part 0 and up to PAR_MAX - 1 threads of this library, started on first
 * use, run the others: each spins (pause) on a job counter for up to PAR_SPIN_NS after its
 * last part, then sleeps on a condition variable until the next job. Every started worker
 * acks every job (a counter the caller waits on), so the job is never rewritten while a
 * worker may still read it. One job at a time (a mutex); a caller that finds it held runs
 * the whole range itself. A forked child starts with no workers (pthread_atfork). The parts are outputs
 * [cut_p, cut_p+1) of one pagedkv_q8_linear_f32_range each, and a part's outputs do not
 * depend on the split (the header), so the bits are the one-thread call's. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#ifndef PAR_MIN_MACS
#define PAR_MIN_MACS (1 << 20) /* multiply-adds per part at least */
#endif
#ifndef PAR_SPIN_NS
#define PAR_SPIN_NS 500000L /* 0.5 ms: longer than the gaps between a step's calls */
#endif
typedef struct {
    int type, packed;
    const float *x;
    int64_t ldx;
    const uint8_t *w;
    const float *bias;
    float *y;
    int64_t ldy, rows, in, out;
    int64_t cuts[PAR_MAX + 1];
    int parts;
} par_job;

static pthread_mutex_t par_call = PTHREAD_MUTEX_INITIALIZER;  /* one job at a time */
static pthread_mutex_t par_sleep = PTHREAD_MUTEX_INITIALIZER; /* with par_wake */
static pthread_cond_t par_wake = PTHREAD_COND_INITIALIZER;
static par_job par_cur;
static atomic_long par_seq;           /* job counter: a new value = a new job */
static atomic_int par_left;           /* workers that have not acked the current job */
static atomic_int par_rc;             /* first non-zero part result of the current job */
static int par_threads;               /* workers started (1 .. PAR_MAX - 1) */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000L + t.tv_nsec;
}

static int run_part(const par_job *j, int p) {
    return pagedkv_q8_linear_f32_range(j->type, j->packed, j->x, j->ldx, j->w, j->bias, j->y,
                                       j->ldy, j->rows, j->in, j->out, j->cuts[p],
                                       j->cuts[p + 1]);
}

static long par_seen0[PAR_MAX]; /* worker i's first `seen`: the counter when it was made */

static void *par_worker(void *arg) {
    const int me = (int)(intptr_t)arg; /* runs part `me` of each job that has one */
    long seen = par_seen0[me];
    for (;;) {
        long seq = atomic_load_explicit(&par_seq, memory_order_acquire);
        if (seq == seen) {
            const int64_t until = now_ns() + PAR_SPIN_NS;
            int spins = 0;
            while ((seq = atomic_load_explicit(&par_seq, memory_order_acquire)) == seen) {
#if Q8_AVX2
                _mm_pause();
#endif
                if (++spins % 256 == 0 && now_ns() > until) {
                    pthread_mutex_lock(&par_sleep);
                    while ((seq = atomic_load(&par_seq)) == seen)
                        pthread_cond_wait(&par_wake, &par_sleep);
                    pthread_mutex_unlock(&par_sleep);
                    break;
                }
            }
        }
        seen = seq; /* the caller posts the next job only after every worker's ack */
        if (me < par_cur.parts) {
            const int rc = run_part(&par_cur, me);
            if (rc) {
                int zero = 0;
                atomic_compare_exchange_strong(&par_rc, &zero, rc);
            }
        }
        atomic_fetch_sub_explicit(&par_left, 1, memory_order_release); /* the ack */
    }
    return NULL;
}

/* A forked child has none of the parent's workers: start again from none. */
static void par_child(void) {
    pthread_mutex_init(&par_call, NULL);
    pthread_mutex_init(&par_sleep, NULL);
    pthread_cond_init(&par_wake, NULL);
    par_threads = 0;
}

/* pagedkv_q8_linear_f32_range over outputs [0, out) in `threads` parts (on multiples of 16
 * when packed, else 8; fewer when a part would have under 2^20 multiply-adds): the caller's
 * and this library's workers'. The same bits as one call. -4 when a worker cannot start. */
int pagedkv_q8_linear_f32_par(int type, int packed, const float *x, int64_t ldx,
                              const uint8_t *w, const float *bias, float *y, int64_t ldy,
                              int64_t rows, int64_t in, int64_t out, int threads) {
    int64_t cuts[PAR_MAX + 1];
    const int64_t parts = par_cuts(packed, rows, in, out, threads, PAR_MIN_MACS, cuts);
    if (parts <= 1 || pthread_mutex_trylock(&par_call) != 0)
        return pagedkv_q8_linear_f32_range(type, packed, x, ldx, w, bias, y, ldy, rows, in, out,
                                           0, out);
    if (par_threads == 0 && pthread_atfork(NULL, NULL, par_child)) {
        pthread_mutex_unlock(&par_call);
        return -4;
    }
    while (par_threads < parts - 1) {
        pthread_t t;
        par_seen0[par_threads + 1] = atomic_load(&par_seq); /* before the next job's post */
        if (pthread_create(&t, NULL, par_worker, (void *)(intptr_t)(par_threads + 1))) {
            pthread_mutex_unlock(&par_call);
            return -4;
        }
        pthread_detach(t);
        par_threads++;
    }
    par_job *j = &par_cur;
    *j = (par_job){type, packed, x, ldx, w, bias, y, ldy, rows, in, out, {0}, (int)parts};
    memcpy(j->cuts, cuts, sizeof j->cuts);
    atomic_store(&par_rc, 0);
    atomic_store(&par_left, par_threads); /* every worker acks, the idle ones too */
    pthread_mutex_lock(&par_sleep);
    atomic_fetch_add_explicit(&par_seq, 1, memory_order_release);
    pthread_cond_broadcast(&par_wake);
    pthread_mutex_unlock(&par_sleep);
    int rc = run_part(j, 0);
    for (int spins = 0; atomic_load_explicit(&par_left, memory_order_acquire) > 0; spins++) {
#if Q8_AVX2
        _mm_pause();
#endif
        if (spins > 4096) sched_yield(); /* a worker without a core: let it have this one */
    }
    const int wrc = atomic_load(&par_rc);
    pthread_mutex_unlock(&par_call);
    return rc ? rc : wrc;
}
#endif /* _OPENMP */
