/* The online softmax of one step of a prompt's attention, shared by the two prompt kernels
 * (prompt_attention.c on AMX, prompt_attention_f32.c in float32): a query tile's limits,
 * the step's softmax 16 queries wide, the rescale of the accumulator, and the outputs. Every
 * operation is per lane (per query), so a query's bits never depend on the other queries of
 * its tile. AVX-512F/BW builds only. */
#ifndef PAGEDKV_PROMPT_SOFTMAX_H
#define PAGEDKV_PROMPT_SOFTMAX_H

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp512.h"
#include "prompt_args.h"

#define PT 32 /* positions per step */
#define QT 16 /* query vectors per tile */
/* Base-2 walks (the AMX kernel) keep their reference max m until a step's max exceeds it by
 * more than this (FlashAttention-3's lazy rescaling): a probability is then up to 2^8, still
 * exact in float32 and rounded to bf16 with the same relative error, and the accumulator is
 * rescaled (its tiles stored, multiplied, reloaded) far less often: 12% of a layer's time at
 * 1,024 tokens of random scores. Decided per lane, so still per query. */
#define LAZY_MAX 8.0f

/* 2^t for 16 lanes, t <= 0 (a base-2 score minus its running max): 2^n (vscalefps) times a
 * degree-4 polynomial in f = t - n on [-1/2, 1/2] (n = round(t); f is exact), c0 = 1 so that
 * 2^0 = 1 exactly (a step that does not move the running max leaves the sums alone). Fitted
 * for relative error: within 2.9e-6 of 2^f with float32 evaluation, far below the bf16
 * rounding the probabilities then take (2^-9). t is clamped at -150 (the result 0) so that
 * an infinite t gives 0, not NaN. The AMX kernel's exponential: its scores come scaled by
 * log2(e), so 2^(s - m) is exp of the natural-base difference (7% fewer vector operations
 * per score than exp(x) = 2^(x log2 e) with a degree-5 polynomial, and 10% faster per
 * layer); the float32 kernel keeps exp512. */
static inline __m512 softmax_exp2(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-150.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.582818421622787e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.590637028830672e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402409886628741e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931241998313432e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* A query tile: queries u0 .. u0 + cols - 1 of a KV head (u = row * group + member); query
 * column c attends to positions low[c] .. lim[c] - 1 (low = lim - window with a sliding
 * window, else 0); lo and hi are the first and last limits, first the first low. The walk
 * covers steps first / PT .. (hi - 1) / PT: a step outside every column's range changes
 * nothing (e = 0, c = 1), so where the walk starts and ends does not change a column's bits. */
typedef struct {
    __m512i lim, low;
    int64_t u0, cols, lo, hi, first, low_max;
} qtile;

static inline qtile tile_limits(int64_t pos0, int64_t group, int64_t nq, int64_t tile,
                                int64_t window) {
    qtile t;
    int32_t lim[QT], low[QT];
    t.u0 = tile * QT;
    t.cols = nq - t.u0 < QT ? nq - t.u0 : QT;
    for (int64_t col = 0; col < QT; col++) { /* padding columns take the last query's range */
        lim[col] = (int32_t)(pos0 + (t.u0 + (col < t.cols ? col : t.cols - 1)) / group + 1);
        low[col] = window > 0 && lim[col] > window ? (int32_t)(lim[col] - window) : 0;
    }
    t.lim = _mm512_loadu_si512(lim);
    t.low = _mm512_loadu_si512(low);
    t.lo = lim[0];
    t.hi = lim[QT - 1];
    t.first = low[0];
    t.low_max = low[QT - 1];
    return t;
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

/* Which of the tile's columns take position `at` (within [low, lim)). */
static inline __mmask16 step_valid(const qtile *tq, int64_t at) {
    const __m512i a = _mm512_set1_epi32((int)at);
    return _mm512_cmpgt_epi32_mask(tq->lim, a) & _mm512_cmple_epi32_mask(tq->low, a);
}

/* The float32 kernel's online softmax of one step (scores sc[32 positions][16 queries],
 * scaled here: s_p = scale * sc_p, one float32 multiplication) for the tile's queries (each
 * over its own range, tq); the step starts at position p0. Writes the probabilities as
 * float32 rows pe and returns the factor the accumulator must take. */
static inline __attribute__((always_inline)) __m512
softmax_in(const float *sc, float scale, int64_t p0, const qtile *tq, __m512 *m, __m512 *l,
           float *pe, int full) {
    const __m512 lowest = _mm512_set1_ps(-FLT_MAX);
    __m512 s[PT];
    __mmask16 valid[PT];
    __m512 mx4[4] = {lowest, lowest, lowest, lowest}; /* max is exact: a tree, same bits */
    for (int p = 0; p < PT; p++) {
        valid[p] = full ? (__mmask16)0xFFFF : step_valid(tq, p0 + p);
        s[p] = _mm512_maskz_mul_ps(valid[p], _mm512_loadu_ps(sc + p * QT), _mm512_set1_ps(scale));
        s[p] = _mm512_mask_mov_ps(lowest, valid[p], s[p]);
        mx4[p % 4] = _mm512_max_ps(mx4[p % 4], s[p]);
    }
    const __m512 mx = _mm512_max_ps(_mm512_max_ps(mx4[0], mx4[1]), _mm512_max_ps(mx4[2], mx4[3]));
    const __m512 top = _mm512_max_ps(*m, mx);
    const __m512 corr = exp512(_mm512_sub_ps(*m, top));
    __m512 sum = _mm512_setzero_ps();
    for (int p = 0; p < PT; p += 2) {
        const __m512 e0 = _mm512_maskz_mov_ps(valid[p], exp512(_mm512_sub_ps(s[p], top)));
        const __m512 e1 = _mm512_maskz_mov_ps(valid[p + 1], exp512(_mm512_sub_ps(s[p + 1], top)));
        sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
        _mm512_store_ps(pe + p * QT, e0);
        _mm512_store_ps(pe + (p + 1) * QT, e1);
    }
    *l = _mm512_add_ps(_mm512_mul_ps(*l, corr), sum);
    *m = top;
    return corr;
}

/* softmax_in, compiled apart for a step every column takes whole (no masks), the common case. */
static inline __attribute__((always_inline)) __m512
step_softmax(const float *sc, float scale, int64_t p0, const qtile *tq, __m512 *m, __m512 *l,
             float *pe) {
    if (p0 + PT <= tq->lo && p0 >= tq->low_max) /* every column takes every p */
        return softmax_in(sc, scale, p0, tq, m, l, pe, 1);
    return softmax_in(sc, scale, p0, tq, m, l, pe, 0);
}

/* The AMX kernel's online softmax of one step, in base 2 (scores sc[32 positions][16
 * queries] as dot products; scale2 = scale * log2(e) > 0). Per column: M = scale2 * max_p
 * sc_p (a float32 product is monotone, so this is the max of the rounded products exactly);
 * the reference max m' = max(m, M) where M > m + LAZY_MAX, else m; t_p = fma(sc_p, scale2,
 * -m') (one rounding); e_p = softmax_exp2(t_p); l = l * c + (sum of the even p's e_p + sum
 * of the odd p's, each in p order), c = softmax_exp2(m - m'). Writes the probabilities as
 * bf16 in the pair layout (pt) and returns c. The max is taken over the raw scores (no
 * multiplication per score) and the scale rides on the exponential's subtraction: 4% of a
 * layer at 1,024 tokens. */
static inline __attribute__((always_inline)) __m512
softmax2_in(const float *sc, float scale2, int64_t p0, const qtile *tq, __m512 *m, __m512 *l,
            uint32_t *pt, int full) {
    /* outside a column's range a score reads as -inf: a step wholly outside it gives M = -inf,
     * so m stays and c = 2^0 = 1 exactly */
    const __m512 none = _mm512_set1_ps(-INFINITY), sv = _mm512_set1_ps(scale2);
    __mmask16 valid[PT];
    __m512 a[4] = {none, none, none, none}; /* four chains kept in registers */
    for (int p = 0; p < PT; p += 4)
        for (int i = 0; i < 4; i++) {
            valid[p + i] = full ? (__mmask16)0xFFFF : step_valid(tq, p0 + p + i);
            const __m512 x = full ? _mm512_load_ps(sc + (p + i) * QT)
                                  : _mm512_mask_load_ps(none, valid[p + i], sc + (p + i) * QT);
            a[i] = _mm512_max_ps(a[i], x);
        }
    const __m512 amax = _mm512_max_ps(_mm512_max_ps(a[0], a[1]), _mm512_max_ps(a[2], a[3]));
    const __m512 mx = _mm512_mul_ps(amax, sv);
    const __mmask16 up =
        _mm512_cmp_ps_mask(_mm512_sub_ps(mx, *m), _mm512_set1_ps(LAZY_MAX), _CMP_GT_OQ);
    const __m512 top = _mm512_mask_mov_ps(*m, up, _mm512_max_ps(*m, mx));
    const __m512 corr = softmax_exp2(_mm512_sub_ps(*m, top));
    const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), top);
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    for (int p = 0; p < PT; p += 2) {
        __m512 e0 = softmax_exp2(_mm512_fmadd_ps(_mm512_load_ps(sc + p * QT), sv, neg));
        __m512 e1 = softmax_exp2(_mm512_fmadd_ps(_mm512_load_ps(sc + (p + 1) * QT), sv, neg));
        if (!full) { /* outside a column's range: 0 (its score may be stale or not a number) */
            e0 = _mm512_maskz_mov_ps(valid[p], e0);
            e1 = _mm512_maskz_mov_ps(valid[p + 1], e1);
        }
        even = _mm512_add_ps(even, e0);
        odd = _mm512_add_ps(odd, e1);
        _mm512_store_si512(pt + p / 2 * QT, pair_bf16(e0, e1));
    }
    *l = _mm512_add_ps(_mm512_mul_ps(*l, corr), _mm512_add_ps(even, odd));
    *m = top;
    return corr;
}

/* softmax2_in on the guess that the step keeps the reference max: the exponentials run
 * against m at once, and the step's max (the same four chains and tree) is taken beside them
 * instead of before them, so they no longer wait for it. Where the guess holds (no lane's M
 * exceeds m + LAZY_MAX, and every lane's m is finite so that softmax2_in's c = 2^(m - m) is
 * exactly 1) this is softmax2_in's arithmetic operation for operation: l = l * 1 + (even +
 * odd), the same pt, m kept; returns 1. Else returns 0 with m and l untouched (pt partly
 * written), and the caller runs softmax2_in. */
static inline __attribute__((always_inline)) int
softmax2_kept(const float *sc, float scale2, int64_t p0, const qtile *tq, __m512 *m, __m512 *l,
              uint32_t *pt, int full) {
    const __m512 none = _mm512_set1_ps(-INFINITY), sv = _mm512_set1_ps(scale2);
    const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), *m);
    __m512 a[4] = {none, none, none, none};
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
#pragma GCC unroll 16 /* whole: the four chains stay in registers */
    for (int p = 0; p < PT; p += 2) {
        const __mmask16 v0 = full ? (__mmask16)0xFFFF : step_valid(tq, p0 + p);
        const __mmask16 v1 = full ? (__mmask16)0xFFFF : step_valid(tq, p0 + p + 1);
        const __m512 x0 = _mm512_load_ps(sc + p * QT), x1 = _mm512_load_ps(sc + (p + 1) * QT);
        a[p % 4] = _mm512_max_ps(a[p % 4], full ? x0 : _mm512_mask_mov_ps(none, v0, x0));
        a[(p + 1) % 4] =
            _mm512_max_ps(a[(p + 1) % 4], full ? x1 : _mm512_mask_mov_ps(none, v1, x1));
        __m512 e0 = softmax_exp2(_mm512_fmadd_ps(x0, sv, neg));
        __m512 e1 = softmax_exp2(_mm512_fmadd_ps(x1, sv, neg));
        if (!full) {
            e0 = _mm512_maskz_mov_ps(v0, e0);
            e1 = _mm512_maskz_mov_ps(v1, e1);
        }
        even = _mm512_add_ps(even, e0);
        odd = _mm512_add_ps(odd, e1);
        _mm512_store_si512(pt + p / 2 * QT, pair_bf16(e0, e1));
    }
    const __m512 amax = _mm512_max_ps(_mm512_max_ps(a[0], a[1]), _mm512_max_ps(a[2], a[3]));
    const __m512 mx = _mm512_mul_ps(amax, sv);
    const __mmask16 up =
        _mm512_cmp_ps_mask(_mm512_sub_ps(mx, *m), _mm512_set1_ps(LAZY_MAX), _CMP_GT_OQ);
    const __mmask16 odd_m = /* m infinite or NaN: m - m is not 0 */
        _mm512_cmp_ps_mask(_mm512_sub_ps(*m, *m), _mm512_setzero_ps(), _CMP_NEQ_UQ);
    if (up | odd_m) return 0;
    *l = _mm512_add_ps(_mm512_mul_ps(*l, _mm512_set1_ps(1.0f)), _mm512_add_ps(even, odd));
    return 1;
}

#ifndef PA_GUESS_KEPT
#define PA_GUESS_KEPT 1 /* 0: never guess (the tests' reference build) */
#endif

/* One step of the base-2 walk: softmax2_in, compiled apart for a step every column takes
 * whole (no masks). *guess (the caller's, 0 at a tile's first step) says whether the last
 * step kept every lane's max: then softmax2_kept runs first, and softmax2_in only where its
 * guess fails. Either way the step's bits are softmax2_in's. Measured (one layer of 1,024
 * tokens, SmolLM2's heads, 1 thread): 4% of the kernel. */
static inline __attribute__((always_inline)) __m512
step_softmax2(const float *sc, float scale2, int64_t p0, const qtile *tq, __m512 *m, __m512 *l,
              uint32_t *pt, int *guess) {
    const int full = p0 + PT <= tq->lo && p0 >= tq->low_max;
    if (PA_GUESS_KEPT && *guess &&
        (full ? softmax2_kept(sc, scale2, p0, tq, m, l, pt, 1)
              : softmax2_kept(sc, scale2, p0, tq, m, l, pt, 0)))
        return _mm512_set1_ps(1.0f);
    const __m512 c = full ? softmax2_in(sc, scale2, p0, tq, m, l, pt, 1)
                          : softmax2_in(sc, scale2, p0, tq, m, l, pt, 0);
    *guess = !_mm512_cmp_ps_mask(c, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ);
    return c;
}

/* obuf's first d rows (16 lanes each) times corr. */
static void rescale(float *obuf, int64_t d, __m512 corr) {
    for (int64_t x = 0; x < d; x++)
        _mm512_store_ps(obuf + x * QT, _mm512_mul_ps(_mm512_load_ps(obuf + x * QT), corr));
}

/* r[i][j] -> r[j][i] for a 16 x 16 block of floats: unpacks within 128-bit lanes, then
 * 128-bit lane shuffles (64 shuffles, no arithmetic). */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + k] lane L: column 4L + k of rows 4i .. 4i + 3 */
        u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; k++) { /* the 4 x 4 lanes of u[k], u[4 + k], u[8 + k], u[12 + k] */
        const __m512 v0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);
        const __m512 v1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
        const __m512 v2 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
        const __m512 v3 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
        r[k] = _mm512_shuffle_f32x4(v0, v2, 0x88);
        r[4 + k] = _mm512_shuffle_f32x4(v1, v3, 0x88);
        r[8 + k] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
        r[12 + k] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
    }
}

/* out[row][head] = obuf[x][col] * (1 / l[col]) for the tile's real columns (obuf: d x 16,
 * 64-byte aligned, d a multiple of 16): each product one float32 multiplication, then 16 x 16
 * blocks transposed so that a query's outputs are stored as contiguous runs. */
static inline void write_out(const float *obuf, __m512 l, const qtile *t, int64_t d, int64_t h,
                             int64_t group, float *out, int64_t ldo) {
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
    float *dst[QT];
    for (int64_t col = 0; col < t->cols; col++) {
        const int64_t u = t->u0 + col;
        dst[col] = out + (u / group) * ldo + (h * group + u % group) * d;
    }
    for (int64_t x0 = 0; x0 < d; x0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; i++)
            r[i] = _mm512_mul_ps(_mm512_load_ps(obuf + (x0 + i) * QT), inv);
        transpose16(r);
        for (int64_t col = 0; col < t->cols; col++) _mm512_storeu_ps(dst[col] + x0, r[col]);
    }
}

#endif
