/* Linear layers with bfloat16 weights and float32 activations ("bf16 storage, fp32
 * compute"), for 1..32 rows (decode steps), reading each weight from memory once for all the
 * rows.
 *
 * A bfloat16 value is the top 16 bits of a float32, so widening one is exact: zero-extend to
 * 32 bits and shift left by 16. Every product here is then an ordinary float32 product of the
 * activation and the exactly widened weight, summed in float32: for a bf16 checkpoint the
 * same arithmetic as computing in float32 from upcast weights, with half the weight bytes.
 *
 * pagedkv_bf16_tiled: y[r, j] = sum_k x[r, k] * W[k, j] (+ bias[j]) for a weight W [in, out]
 *   stored as column tiles: t [ceil(out / 16)][in][16] bf16, W[k, j] = t[j / 16][k][j % 16]
 *   (the last tile zero-padded; bf16_linear.py's TiledWeight packs it), columns [j_begin,
 *   j_end) with j_begin a multiple of 16. Order: for every (r, j) one fused multiply-add per
 *   k, in increasing k, from 0; the bias after the sum.
 * pagedkv_bf16_nt: y[r, j] = sum_k x[r, k] * e[j, k] for e [out, in] bf16 (row stride lde; the
 *   tied vocabulary projection's embedding as stored), columns [j_begin, j_end). Order: 8 lane
 *   sums (lane l takes k = l, l + 8, ... below in - in % 8, one FMA each in increasing k),
 *   added as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then the last in % 8 products
 *   by FMA in increasing k.
 * Neither order depends on the row count or on the split of columns among threads, so a row's
 * output is the same bits alone or in any batch (batch invariance).
 *
 * Why tiles: a tile is one contiguous stream of in * 32 bytes, so a pass over a few tiles
 * reads a few sequential streams that the hardware prefetcher follows, where the [in, out]
 * layout made every weight row a separate short stream; and a thread's columns are one
 * contiguous range of memory. Measured against the [in, out] kernel it replaced (the
 * development machine, a 2-core AMD EPYC, quiet, 320 MB of weight copies, the same bits):
 * one row 1.24-2.05x (19.7-23.2 GB/s on SmolLM2's four shapes), two rows 1.17-2.01x, 4-32 rows
 * 1.3-2.2x (benchmarks/RESULTS.md, "bf16 weights in column tiles").
 *
 * Blocking (tiled): one row runs 4 tiles a pass (8 accumulators, 8 FMA chains), two rows 3
 * tiles (12), each tile's stream prefetched TL_AHEAD k ahead once per 64-byte line; 3..32 rows
 * run each tile through 6-row register blocks (12 accumulators) over all of k, so a tile comes
 * from memory once and from L1/L2 for the other row blocks (whole k measured faster than
 * chunks of 16, 64 or 128 k). Columns of a last partial tile take the scalar loop.
 * nt keeps 4 rows x 3 embedding rows of lane sums in registers; 1 row takes 8 embedding rows
 * (2 rows: 4) at a time, 8 FMA chains, the 8 (4) rows a range's width / 8 (4) apart so each is
 * one long stream (nt_wide1 says why), the rest in the 3-row blocks.
 *
 * Builds: with AVX-512F (gcc -march=native on such a CPU) the tiled paths hold a tile in
 * one zmm and the nt path of 3..32 rows holds two rows' lane sums in one zmm (the "512-bit"
 * sections below); with AVX2 + FMA the vector paths widen 8 weights with vpmovzxwd + vpslld;
 * otherwise the portable loops run (fmaf: the same single rounding as a vector FMA), and the
 * *_portable entry points always run them, so tests can check that every build gives the
 * same bits. bf16 arithmetic on AMX (the activations rounded to bf16) is a different contract
 * from this file's: bf16_dot.c, opt-in (matmul_precision "medium").
 * Returns 0, or -1 for a bad range or stride.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BF_AVX2 1
#else
#define BF_AVX2 0
#endif

#define TILE 16  /* columns per tile: 2 vectors of 8 */
#define RB 6     /* rows per register block (tiled, 3+ rows) */
#define RB_NT 4  /* rows per register block (nt) */
#ifndef TL_AHEAD
#define TL_AHEAD 16 /* k rows of a tile prefetched ahead (512 bytes) */
#endif

static inline float widen(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Columns [j0, j1) of rows [0, nr) of the tiled weight t, one scalar FMA at a time. */
static void tl_scalar(const float *x, int64_t ldx, const uint16_t *t, int64_t in, float *y,
                      int64_t ldy, int64_t nr, int64_t j0, int64_t j1) {
    for (int64_t r = 0; r < nr; r++)
        for (int64_t j = j0; j < j1; j++) {
            const uint16_t *tj = t + (j / TILE) * in * TILE + j % TILE;
            float acc = 0.0f;
            for (int64_t k = 0; k < in; k++) acc = fmaf(x[r * ldx + k], widen(tj[k * TILE]), acc);
            y[r * ldy + j] = acc;
        }
}

#if BF_AVX2
/* 8 bf16 at p as 8 float32 (exact). */
static inline __m256 load8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* A prefetch past the weight's end is harmless (prefetches never fault). */
#define PF_AT(p) _mm_prefetch((const char *)(uintptr_t)(p), _MM_HINT_T0)

#define NN_FMA(r)                                           \
    if (NR > r) {                                           \
        __m256 xv = _mm256_broadcast_ss(x + (r) * ldx + k); \
        c##r##0 = _mm256_fmadd_ps(xv, w0, c##r##0);         \
        c##r##1 = _mm256_fmadd_ps(xv, w1, c##r##1);         \
    }
#define NN_ROW_STORE(r)                                 \
    if (NR > r) {                                       \
        _mm256_storeu_ps(y + (r) * ldy, c##r##0);       \
        _mm256_storeu_ps(y + (r) * ldy + 8, c##r##1);   \
    }
/* NR rows (a constant after inlining) over all of the tile t: named accumulators so they
 * stay in registers (12 + 2 weights + a broadcast). */
static inline __attribute__((always_inline)) void nn_block(
    const float *x, int64_t ldx, const uint16_t *t, float *y, int64_t ldy, const int NR,
    int64_t in) {
    __m256 z = _mm256_setzero_ps();
    __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z;
    __m256 c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
    for (int64_t k = 0; k < in; k++) {
        __m256 w0 = load8(t + k * TILE), w1 = load8(t + k * TILE + 8);
        NN_FMA(0) NN_FMA(1) NN_FMA(2) NN_FMA(3) NN_FMA(4) NN_FMA(5)
    }
    NN_ROW_STORE(0) NN_ROW_STORE(1) NN_ROW_STORE(2) NN_ROW_STORE(3) NN_ROW_STORE(4)
    NN_ROW_STORE(5)
}

/* Every row over the tile t (its 16 columns of y at y), RB rows a register block. */
static void nn_rows(const float *x, int64_t ldx, const uint16_t *t, float *y, int64_t ldy,
                    int64_t rows, int64_t in) {
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
        const float *xr = x + r0 * ldx;
        float *yr = y + r0 * ldy;
        switch (rows - r0 < RB ? rows - r0 : RB) {
            case 1: nn_block(xr, ldx, t, yr, ldy, 1, in); break;
            case 2: nn_block(xr, ldx, t, yr, ldy, 2, in); break;
            case 3: nn_block(xr, ldx, t, yr, ldy, 3, in); break;
            case 4: nn_block(xr, ldx, t, yr, ldy, 4, in); break;
            case 5: nn_block(xr, ldx, t, yr, ldy, 5, in); break;
            default: nn_block(xr, ldx, t, yr, ldy, 6, in);
        }
    }
}

#define TL_PF(i) \
    if (NT > i) PF_AT(t##i + (k + TL_AHEAD) * TILE)
#define TL_FMA(i)                                                                 \
    if (NT > i) {                                                                 \
        __m256 u0 = load8(t##i + k * TILE), u1 = load8(t##i + k * TILE + 8);     \
        a##i##0 = _mm256_fmadd_ps(xa, u0, a##i##0);                               \
        a##i##1 = _mm256_fmadd_ps(xa, u1, a##i##1);                               \
        if (M > 1) {                                                              \
            b##i##0 = _mm256_fmadd_ps(xb, u0, b##i##0);                           \
            b##i##1 = _mm256_fmadd_ps(xb, u1, b##i##1);                           \
        }                                                                         \
    }
#define TL_STORE(i)                                               \
    if (NT > i) {                                                 \
        _mm256_storeu_ps(y + TILE * (i), a##i##0);                \
        _mm256_storeu_ps(y + TILE * (i) + 8, a##i##1);            \
        if (M > 1) {                                              \
            _mm256_storeu_ps(y + ldy + TILE * (i), b##i##0);      \
            _mm256_storeu_ps(y + ldy + TILE * (i) + 8, b##i##1);  \
        }                                                         \
    }
/* M = 1 or 2 rows over NT <= 4 consecutive tiles from t0 (constants after inlining), all of
 * k: 2 * NT * M accumulators (M = 2 takes NT <= 3: 12 of the 16 registers). */
static inline __attribute__((always_inline)) void tl_pass(
    const float *x, int64_t ldx, const uint16_t *t0, int64_t in, float *y, int64_t ldy,
    const int M, const int NT) {
    const uint16_t *t1 = t0 + in * TILE, *t2 = t1 + in * TILE, *t3 = t2 + in * TILE;
    __m256 z = _mm256_setzero_ps();
    __m256 a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z;
    __m256 b00 = z, b01 = z, b10 = z, b11 = z, b20 = z, b21 = z, b30 = z, b31 = z;
    for (int64_t k = 0; k < in; k++) {
        if ((k & 1) == 0) { /* a 64-byte line holds 2 k of a tile */
            TL_PF(0); TL_PF(1); TL_PF(2); TL_PF(3);
        }
        __m256 xa = _mm256_broadcast_ss(x + k);
        __m256 xb = M > 1 ? _mm256_broadcast_ss(x + ldx + k) : z;
        TL_FMA(0) TL_FMA(1) TL_FMA(2) TL_FMA(3)
    }
    TL_STORE(0) TL_STORE(1) TL_STORE(2) TL_STORE(3)
}

/* The full tiles of columns [j, full) (multiples of 16) of 1..32 rows. */
static __attribute__((unused)) void tl_vector(const float *x, int64_t ldx, const uint16_t *t, float *y, int64_t ldy,
                      int64_t rows, int64_t in, int64_t j, int64_t full) {
    if (rows == 1) {
        for (; j + 4 * TILE <= full; j += 4 * TILE) tl_pass(x, ldx, t + j * in, in, y + j, ldy, 1, 4);
        for (; j < full; j += TILE) tl_pass(x, ldx, t + j * in, in, y + j, ldy, 1, 1);
    } else if (rows == 2) {
        for (; j + 3 * TILE <= full; j += 3 * TILE) tl_pass(x, ldx, t + j * in, in, y + j, ldy, 2, 3);
        for (; j < full; j += TILE) tl_pass(x, ldx, t + j * in, in, y + j, ldy, 2, 1);
    } else {
        for (; j < full; j += TILE) nn_rows(x, ldx, t + j * in, y + j, ldy, rows, in);
    }
}
#endif

#if BF_AVX2 && defined(__AVX512F__)
/* ---- The tiled paths with 512-bit vectors (an AVX-512F build) ----
 * One zmm holds a tile's 16 columns, so a k step of a tile is one widening (vpmovzxwd +
 * vpslld) and one FMA per row instead of two of each. Every output is still one FMA per k in
 * increasing k from 0: the same bits as the AVX2 and portable loops. */
#define BF_512 1
#ifndef ZN_AHEAD
#define ZN_AHEAD 32 /* k rows of a tile prefetched ahead by the row blocks */
#endif
static inline __m512 load16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#define ZN_FMA(r)                                                 \
    if (NR > r) {                                                 \
        __m512 xv = _mm512_set1_ps(x[(r) * ldx + k]);             \
        c##r##0 = _mm512_fmadd_ps(xv, w0, c##r##0);               \
        if (NT > 1) c##r##1 = _mm512_fmadd_ps(xv, w1, c##r##1);   \
    }
#define ZN_STORE(r)                                                \
    if (NR > r) {                                                  \
        _mm512_storeu_ps(y + (r) * ldy, c##r##0);                  \
        if (NT > 1) _mm512_storeu_ps(y + (r) * ldy + TILE, c##r##1); \
    }
/* NR <= 12 rows over NT = 1 or 2 consecutive tiles from t (constants after inlining), all of
 * k: NR * NT accumulators, the weights widened once per k for all the rows and each x value
 * broadcast once for both tiles (2 tiles x 12 rows: 24 FMAs to 4 widening operations and 14
 * loads a k, within the two load ports where one tile x 16 rows needed 17). */
static inline __attribute__((always_inline)) void zn_block(
    const float *x, int64_t ldx, const uint16_t *t, int64_t in, float *y, int64_t ldy,
    const int NR, const int NT) {
    const uint16_t *t1 = t + in * TILE;
    __m512 z = _mm512_setzero_ps();
    __m512 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z;
    __m512 c40 = z, c41 = z, c50 = z, c51 = z, c60 = z, c61 = z, c70 = z, c71 = z;
    __m512 c80 = z, c81 = z, c90 = z, c91 = z, c100 = z, c101 = z, c110 = z, c111 = z;
    for (int64_t k = 0; k < in; k++) {
        if ((k & 1) == 0) { /* a 64-byte line holds 2 k of a tile */
            PF_AT(t + (k + ZN_AHEAD) * TILE);
            if (NT > 1) PF_AT(t1 + (k + ZN_AHEAD) * TILE);
        }
        __m512 w0 = load16(t + k * TILE), w1 = NT > 1 ? load16(t1 + k * TILE) : z;
        ZN_FMA(0) ZN_FMA(1) ZN_FMA(2) ZN_FMA(3) ZN_FMA(4) ZN_FMA(5)
        ZN_FMA(6) ZN_FMA(7) ZN_FMA(8) ZN_FMA(9) ZN_FMA(10) ZN_FMA(11)
    }
    ZN_STORE(0) ZN_STORE(1) ZN_STORE(2) ZN_STORE(3) ZN_STORE(4) ZN_STORE(5)
    ZN_STORE(6) ZN_STORE(7) ZN_STORE(8) ZN_STORE(9) ZN_STORE(10) ZN_STORE(11)
}

#define ZN_CASE(n)                                                        \
    case n:                                                               \
        if (nt == 2) zn_block(xr, ldx, t, in, yr, ldy, n, 2);             \
        else zn_block(xr, ldx, t, in, yr, ldy, n, 1);                     \
        break;
/* Every row over nt = 1 or 2 tiles from t, in ceil(rows / 12) register blocks of near-equal
 * size (16 rows run 8 + 8, 13 rows 7 + 6: no block is left with a row or two). */
static void zn_rows(const float *x, int64_t ldx, const uint16_t *t, float *y, int64_t ldy,
                    int64_t rows, int64_t in, int nt) {
    const int64_t blocks = (rows + 11) / 12, per = (rows + blocks - 1) / blocks;
    for (int64_t r0 = 0; r0 < rows; r0 += per) {
        const float *xr = x + r0 * ldx;
        float *yr = y + r0 * ldy;
        switch (rows - r0 < per ? rows - r0 : per) {
            ZN_CASE(1) ZN_CASE(2) ZN_CASE(3) ZN_CASE(4) ZN_CASE(5) ZN_CASE(6)
            ZN_CASE(7) ZN_CASE(8) ZN_CASE(9) ZN_CASE(10) ZN_CASE(11)
            default:
                if (nt == 2) zn_block(xr, ldx, t, in, yr, ldy, 12, 2);
                else zn_block(xr, ldx, t, in, yr, ldy, 12, 1);
        }
    }
}

#define ZL_PF(i) \
    if (NT > i) PF_AT(t##i + (k + TL_AHEAD) * TILE)
#define ZL_FMA(i)                                           \
    if (NT > i) {                                           \
        __m512 u = load16(t##i + k * TILE);                 \
        a##i = _mm512_fmadd_ps(xa, u, a##i);                \
        if (M > 1) b##i = _mm512_fmadd_ps(xb, u, b##i);     \
    }
#define ZL_STORE(i)                                                      \
    if (NT > i) {                                                        \
        _mm512_storeu_ps(y + TILE * (i), a##i);                          \
        if (M > 1) _mm512_storeu_ps(y + ldy + TILE * (i), b##i);         \
    }
/* M = 1 or 2 rows over NT <= 8 consecutive tiles from t0, all of k: NT * M accumulators,
 * so 8 FMA chains at M = 1 (8 tiles) and M = 2 (4 tiles). */
static inline __attribute__((always_inline)) void zl_pass(
    const float *x, int64_t ldx, const uint16_t *t0, int64_t in, float *y, int64_t ldy,
    const int M, const int NT) {
    const int64_t s = in * TILE;
    const uint16_t *t1 = t0 + s, *t2 = t1 + s, *t3 = t2 + s, *t4 = t3 + s, *t5 = t4 + s,
                   *t6 = t5 + s, *t7 = t6 + s;
    __m512 z = _mm512_setzero_ps();
    __m512 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z;
    __m512 b0 = z, b1 = z, b2 = z, b3 = z, b4 = z, b5 = z, b6 = z, b7 = z;
    for (int64_t k = 0; k < in; k++) {
        if ((k & 1) == 0) { /* a 64-byte line holds 2 k of a tile */
            ZL_PF(0); ZL_PF(1); ZL_PF(2); ZL_PF(3); ZL_PF(4); ZL_PF(5); ZL_PF(6); ZL_PF(7);
        }
        __m512 xa = _mm512_set1_ps(x[k]);
        __m512 xb = M > 1 ? _mm512_set1_ps(x[ldx + k]) : z;
        ZL_FMA(0) ZL_FMA(1) ZL_FMA(2) ZL_FMA(3) ZL_FMA(4) ZL_FMA(5) ZL_FMA(6) ZL_FMA(7)
    }
    ZL_STORE(0) ZL_STORE(1) ZL_STORE(2) ZL_STORE(3) ZL_STORE(4) ZL_STORE(5) ZL_STORE(6)
    ZL_STORE(7)
}

/* The full tiles of columns [j, full) of 1..32 rows, 512-bit. */
static void tl_vector512(const float *x, int64_t ldx, const uint16_t *t, float *y,
                         int64_t ldy, int64_t rows, int64_t in, int64_t j, int64_t full) {
    if (rows == 1) {
        for (; j + 8 * TILE <= full; j += 8 * TILE) zl_pass(x, ldx, t + j * in, in, y + j, ldy, 1, 8);
        for (; j < full; j += TILE) zl_pass(x, ldx, t + j * in, in, y + j, ldy, 1, 1);
    } else if (rows == 2) {
        for (; j + 4 * TILE <= full; j += 4 * TILE) zl_pass(x, ldx, t + j * in, in, y + j, ldy, 2, 4);
        for (; j < full; j += TILE) zl_pass(x, ldx, t + j * in, in, y + j, ldy, 2, 1);
    } else {
        for (; j + 2 * TILE <= full; j += 2 * TILE) zn_rows(x, ldx, t + j * in, y + j, ldy, rows, in, 2);
        for (; j < full; j += TILE) zn_rows(x, ldx, t + j * in, y + j, ldy, rows, in, 1);
    }
}
#else
#define BF_512 0
#endif

static void add_bias(const float *bias, float *y, int64_t ldy, int64_t rows, int64_t j0,
                     int64_t j1) {
    if (!bias) return;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = j0; j < j1; j++) y[r * ldy + j] += bias[j];
}

static int tl_bad(int64_t rows, int64_t in, int64_t out, int64_t j_begin, int64_t j_end,
                  int64_t ldx, int64_t ldy) {
    return rows < 0 || in < 0 || j_begin < 0 || j_begin % TILE || j_end > out ||
           j_begin > j_end || ldx < in || ldy < out;
}

int pagedkv_bf16_tiled(const float *x, int64_t ldx, const uint16_t *t, const float *bias,
                       float *y, int64_t ldy, int64_t rows, int64_t in, int64_t out,
                       int64_t j_begin, int64_t j_end) {
    if (tl_bad(rows, in, out, j_begin, j_end, ldx, ldy)) return -1;
    int64_t j = j_begin; /* columns from j take the scalar loop */
#if BF_AVX2
    if (rows > 0) {
        j = j_begin + (j_end - j_begin) / TILE * TILE;
#if BF_512
        tl_vector512(x, ldx, t, y, ldy, rows, in, j_begin, j);
#else
        tl_vector(x, ldx, t, y, ldy, rows, in, j_begin, j);
#endif
    }
#endif
    tl_scalar(x, ldx, t, in, y, ldy, rows, j, j_end);
    add_bias(bias, y, ldy, rows, j_begin, j_end);
    return 0;
}

/* The products past the last full 8 (k >= k8), added to s in increasing k. */
static inline float nt_tail(float s, const float *xr, const uint16_t *ej, int64_t k8,
                            int64_t in) {
    for (int64_t k = k8; k < in; k++) s = fmaf(xr[k], widen(ej[k]), s);
    return s;
}

static void nt_scalar(const float *x, int64_t ldx, const uint16_t *e, int64_t lde, float *y,
                      int64_t ldy, int64_t rows, int64_t in, int64_t j0, int64_t j1) {
    int64_t k8 = in / 8 * 8;
    for (int64_t j = j0; j < j1; j++)
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + r * ldx;
            const uint16_t *ej = e + j * lde;
            float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t k = 0; k < k8; k += 8)
                for (int t = 0; t < 8; t++) l[t] = fmaf(xr[k + t], widen(ej[k + t]), l[t]);
            float s = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
            y[r * ldy + j] = nt_tail(s, xr, ej, k8, in);
        }
}

#if BF_AVX2
/* The portable tree in registers: (l0+l4, l1+l5, l2+l6, l3+l7), then (.0+.2, .1+.3), then
 * .0 + .1. */
static inline float hsum(__m256 v) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

#define NT_FMA(r)                                               \
    if (NR > r) {                                               \
        __m256 xv = _mm256_loadu_ps(x + (r) * ldx + k);         \
        c##r##0 = _mm256_fmadd_ps(xv, e0, c##r##0);             \
        if (NC > 1) c##r##1 = _mm256_fmadd_ps(xv, e1, c##r##1); \
        if (NC > 2) c##r##2 = _mm256_fmadd_ps(xv, e2, c##r##2); \
    }
#define NT_OUT1(r, v) \
    y[(r) * ldy + (v) * sy] = nt_tail(hsum(c##r##v), x + (r) * ldx, e + (v) * st, k8, in);
#define NT_OUT(r)                      \
    if (NR > r) {                      \
        NT_OUT1(r, 0)                  \
        if (NC > 1) { NT_OUT1(r, 1) }  \
        if (NC > 2) { NT_OUT1(r, 2) }  \
    }
/* NR rows x NC embedding rows (output columns) st elements apart, their outputs sy columns
 * apart; y and e offset to the block's first. */
static inline __attribute__((always_inline)) void nt_block(
    const float *x, int64_t ldx, const uint16_t *e, int64_t st, float *y, int64_t ldy,
    int64_t sy, const int NR, const int NC, int64_t in) {
    __m256 z = _mm256_setzero_ps();
    __m256 c00 = z, c01 = z, c02 = z, c10 = z, c11 = z, c12 = z;
    __m256 c20 = z, c21 = z, c22 = z, c30 = z, c31 = z, c32 = z;
    int64_t k8 = in / 8 * 8;
    for (int64_t k = 0; k < k8; k += 8) {
        __m256 e0 = load8(e + k);
        __m256 e1 = NC > 1 ? load8(e + st + k) : z;
        __m256 e2 = NC > 2 ? load8(e + 2 * st + k) : z;
        NT_FMA(0) NT_FMA(1) NT_FMA(2) NT_FMA(3)
    }
    NT_OUT(0) NT_OUT(1) NT_OUT(2) NT_OUT(3)
}

/* One row over NC_WIDE = 8 outputs, or two rows over 4: 8 lane-sum accumulators, so 8
 * independent FMA chains (nt_block at one row has 3). The outputs are S columns apart
 * (pagedkv_bf16_nt spreads a range's columns over NC streams, S = its width / NC), so each
 * embedding row stream runs through one long contiguous run of rows over successive calls,
 * which the hardware prefetcher follows; each stream also prefetches NT_AHEAD elements ahead,
 * once per 64-byte line (every fourth k8 step). Measured (one row, 49152 x 576, cold): 8
 * adjacent rows a call 10.8 GB/s, 8 rows S apart 23.2 GB/s. The same order per output as
 * nt_block and nt_scalar. */
#define NC_WIDE 8
#ifndef NT_AHEAD
#define NT_AHEAD 256
#endif
#define T_FMA(i) a##i = _mm256_fmadd_ps(xv, load8(e + (i) * st + k), a##i)
#define T_PF(i) PF_AT(e + (i) * st + k + NT_AHEAD)
#define T_OUT(r, i, v) \
    y[(r) * ldy + (i) * S] = nt_tail(hsum(v), x + (r) * ldx, e + (i) * st, k8, in)
static void nt_wide1(const float *x, const uint16_t *e, int64_t lde, int64_t S, float *y,
                     int64_t in) {
    const int64_t ldx = 0, ldy = 0, k8 = in / 8 * 8, st = S * lde;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0;
    for (int64_t k = 0; k < k8; k += 8) {
        if ((k & 31) == 0) { T_PF(0); T_PF(1); T_PF(2); T_PF(3); T_PF(4); T_PF(5); T_PF(6); T_PF(7); }
        __m256 xv = _mm256_loadu_ps(x + k);
        T_FMA(0); T_FMA(1); T_FMA(2); T_FMA(3); T_FMA(4); T_FMA(5); T_FMA(6); T_FMA(7);
    }
    T_OUT(0, 0, a0); T_OUT(0, 1, a1); T_OUT(0, 2, a2); T_OUT(0, 3, a3);
    T_OUT(0, 4, a4); T_OUT(0, 5, a5); T_OUT(0, 6, a6); T_OUT(0, 7, a7);
}

static void nt_wide2(const float *x, int64_t ldx, const uint16_t *e, int64_t lde, int64_t S,
                     float *y, int64_t ldy, int64_t in) {
    const int64_t k8 = in / 8 * 8, st = S * lde;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0,
           b3 = a0;
    for (int64_t k = 0; k < k8; k += 8) {
        if ((k & 31) == 0) { T_PF(0); T_PF(1); T_PF(2); T_PF(3); }
        __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + ldx + k);
        __m256 e0 = load8(e + k), e1 = load8(e + st + k), e2 = load8(e + 2 * st + k),
               e3 = load8(e + 3 * st + k);
        a0 = _mm256_fmadd_ps(x0, e0, a0); a1 = _mm256_fmadd_ps(x0, e1, a1);
        a2 = _mm256_fmadd_ps(x0, e2, a2); a3 = _mm256_fmadd_ps(x0, e3, a3);
        b0 = _mm256_fmadd_ps(x1, e0, b0); b1 = _mm256_fmadd_ps(x1, e1, b1);
        b2 = _mm256_fmadd_ps(x1, e2, b2); b3 = _mm256_fmadd_ps(x1, e3, b3);
    }
    T_OUT(0, 0, a0); T_OUT(0, 1, a1); T_OUT(0, 2, a2); T_OUT(0, 3, a3);
    T_OUT(1, 0, b0); T_OUT(1, 1, b1); T_OUT(1, 2, b2); T_OUT(1, 3, b3);
}

/* Columns [j0, j1) of M = 1 or 2 rows as nc = 8 / M streams of S = (j1 - j0) / nc columns
 * each (the first nc * S columns); returns the first column left over. */
static int64_t nt_spread(const float *x, int64_t ldx, const uint16_t *e, int64_t lde, float *y,
                         int64_t ldy, int M, int64_t in, int64_t j0, int64_t j1) {
    const int64_t nc = NC_WIDE / M, S = (j1 - j0) / nc;
    for (int64_t j = j0; j < j0 + S; j++) {
        if (M == 1) nt_wide1(x, e + j * lde, lde, S, y + j, in);
        else nt_wide2(x, ldx, e + j * lde, lde, S, y + j, ldy, in);
    }
    return j0 + nc * S;
}

#define NT_CASE(nr, nc) nt_block(xr, ldx, ej, st, yr, ldy, sy, nr, nc, in)
/* Every row over nc <= 3 embedding rows st elements apart (outputs sy columns apart). */
static void nt_rows(const float *x, int64_t ldx, const uint16_t *ej, int64_t st, float *y,
                    int64_t ldy, int64_t sy, int64_t rows, int nc, int64_t in) {
    for (int64_t r0 = 0; r0 < rows; r0 += RB_NT) {
        int64_t nr = rows - r0 < RB_NT ? rows - r0 : RB_NT;
        const float *xr = x + r0 * ldx;
        float *yr = y + r0 * ldy;
        switch (nr * 4 + nc) {
            case 5: NT_CASE(1, 1); break;
            case 6: NT_CASE(1, 2); break;
            case 7: NT_CASE(1, 3); break;
            case 9: NT_CASE(2, 1); break;
            case 10: NT_CASE(2, 2); break;
            case 11: NT_CASE(2, 3); break;
            case 13: NT_CASE(3, 1); break;
            case 14: NT_CASE(3, 2); break;
            case 15: NT_CASE(3, 3); break;
            case 17: NT_CASE(4, 1); break;
            case 18: NT_CASE(4, 2); break;
            default: NT_CASE(4, 3);
        }
    }
}
#endif

#if BF_512
/* ---- The vocabulary projection with 512-bit vectors, 3..32 rows ----
 * One zmm holds two rows' 8 lane sums for one embedding row: x is packed once per call as
 * pairs of rows, xp[p][k / 8] = x[2p, k..k+8) | x[2p+1, k..k+8) (zeros for the missing row of
 * an odd count), and an embedding row's 8 weights are widened into both halves. Each half is
 * then nt_block's accumulator for its row, summed by the same hsum and nt_tail: the same bits.
 * A block is NP <= 8 row pairs x NC <= 3 embedding rows (24 accumulators; per 8 k: 24 FMAs,
 * 6 widening operations, 11 loads). */
static inline __m512 load8x2(const uint16_t *p) {
    __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m256 upper8(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* x's rows as pairs (the layout above); NULL when out of memory. */
static float *zt_pack(const float *x, int64_t ldx, int64_t rows, int64_t k8) {
    const int64_t pairs = (rows + 1) / 2;
    float *xp = malloc((size_t)(pairs * k8 * 2 + 16) * sizeof(float));
    if (!xp) return NULL;
    for (int64_t p = 0; p < pairs; p++)
        for (int64_t k = 0; k < k8; k += 8)
            for (int h = 0; h < 2; h++)
                for (int l = 0; l < 8; l++) {
                    const int64_t r = 2 * p + h;
                    xp[(p * k8 + k) * 2 + h * 8 + l] = r < rows ? x[r * ldx + k + l] : 0.0f;
                }
    return xp;
}

#define ZT_FMA(p)                                                    \
    if (NP > p) {                                                    \
        __m512 xv = _mm512_loadu_ps(xp + ((p) * k8 + k) * 2);        \
        c##p##0 = _mm512_fmadd_ps(xv, e0, c##p##0);                  \
        if (NC > 1) c##p##1 = _mm512_fmadd_ps(xv, e1, c##p##1);      \
        if (NC > 2) c##p##2 = _mm512_fmadd_ps(xv, e2, c##p##2);      \
    }
#define ZT_OUT1(p, v)                                                                       \
    y[2 * (p) * ldy + (v) * sy] =                                                           \
        nt_tail(hsum(_mm512_castps512_ps256(c##p##v)), x + 2 * (p) * ldx, e + (v) * st, k8, in); \
    if (2 * (p) + 1 < nr)                                                                   \
        y[(2 * (p) + 1) * ldy + (v) * sy] =                                                 \
            nt_tail(hsum(upper8(c##p##v)), x + (2 * (p) + 1) * ldx, e + (v) * st, k8, in);
#define ZT_OUT(p)                     \
    if (NP > p) {                     \
        ZT_OUT1(p, 0)                 \
        if (NC > 1) { ZT_OUT1(p, 1) } \
        if (NC > 2) { ZT_OUT1(p, 2) } \
    }
/* nr rows (NP = ceil(nr / 2) pairs from xp) x NC embedding rows st elements apart, outputs sy
 * columns apart; x, xp, y and e offset to the block's first. */
static inline __attribute__((always_inline)) void zt_block(
    const float *x, int64_t ldx, const float *xp, const uint16_t *e, int64_t st, float *y,
    int64_t ldy, int64_t sy, int64_t nr, const int NP, const int NC, int64_t in) {
    __m512 z = _mm512_setzero_ps();
    __m512 c00 = z, c01 = z, c02 = z, c10 = z, c11 = z, c12 = z, c20 = z, c21 = z;
    __m512 c22 = z, c30 = z, c31 = z, c32 = z, c40 = z, c41 = z, c42 = z, c50 = z;
    __m512 c51 = z, c52 = z, c60 = z, c61 = z, c62 = z, c70 = z, c71 = z, c72 = z;
    const int64_t k8 = in / 8 * 8;
    for (int64_t k = 0; k < k8; k += 8) {
        __m512 e0 = load8x2(e + k);
        __m512 e1 = NC > 1 ? load8x2(e + st + k) : z;
        __m512 e2 = NC > 2 ? load8x2(e + 2 * st + k) : z;
        ZT_FMA(0) ZT_FMA(1) ZT_FMA(2) ZT_FMA(3) ZT_FMA(4) ZT_FMA(5) ZT_FMA(6) ZT_FMA(7)
    }
    ZT_OUT(0) ZT_OUT(1) ZT_OUT(2) ZT_OUT(3) ZT_OUT(4) ZT_OUT(5) ZT_OUT(6) ZT_OUT(7)
}

#define ZT_NC(np)                                                                  \
    case np:                                                                       \
        if (nc == 3) zt_block(xr, ldx, xq, ej, st, yr, ldy, sy, nr, np, 3, in);    \
        else if (nc == 2) zt_block(xr, ldx, xq, ej, st, yr, ldy, sy, nr, np, 2, in); \
        else zt_block(xr, ldx, xq, ej, st, yr, ldy, sy, nr, np, 1, in);            \
        break;
/* Every row over nc <= 3 embedding rows st elements apart (outputs sy columns apart), in
 * ceil(pairs / 8) blocks of near-equal size. */
static void zt_rows(const float *x, int64_t ldx, const float *xp, const uint16_t *ej,
                    int64_t st, float *y, int64_t ldy, int64_t sy, int64_t rows, int nc,
                    int64_t in) {
    const int64_t pairs = (rows + 1) / 2, blocks = (pairs + 7) / 8;
    const int64_t per = (pairs + blocks - 1) / blocks, k8 = in / 8 * 8;
    for (int64_t p0 = 0; p0 < pairs; p0 += per) {
        const int64_t np = pairs - p0 < per ? pairs - p0 : per;
        const int64_t nr = rows - 2 * p0 < 2 * np ? rows - 2 * p0 : 2 * np;
        const float *xr = x + 2 * p0 * ldx, *xq = xp + p0 * k8 * 2;
        float *yr = y + 2 * p0 * ldy;
        switch (np) {
            ZT_NC(1) ZT_NC(2) ZT_NC(3) ZT_NC(4) ZT_NC(5) ZT_NC(6) ZT_NC(7)
            default:
                if (nc == 3) zt_block(xr, ldx, xq, ej, st, yr, ldy, sy, nr, 8, 3, in);
                else if (nc == 2) zt_block(xr, ldx, xq, ej, st, yr, ldy, sy, nr, 8, 2, in);
                else zt_block(xr, ldx, xq, ej, st, yr, ldy, sy, nr, 8, 1, in);
        }
    }
}

/* Columns [j, j_end) of 3..32 rows as nt's 3 streams; -1 when the packing buffer cannot be
 * had (the caller then runs the 256-bit path). */
static int zt_columns(const float *x, int64_t ldx, const uint16_t *e, int64_t lde, float *y,
                      int64_t ldy, int64_t rows, int64_t in, int64_t j, int64_t j_end) {
    float *xp = zt_pack(x, ldx, rows, in / 8 * 8);
    if (!xp) return -1;
    const int64_t S = (j_end - j) / 3;
    for (int64_t i = j; i < j + S; i++)
        zt_rows(x, ldx, xp, e + i * lde, S * lde, y + i, ldy, S, rows, 3, in);
    j += 3 * S;
    if (j < j_end) zt_rows(x, ldx, xp, e + j * lde, lde, y + j, ldy, 1, rows, (int)(j_end - j), in);
    free(xp);
    return 0;
}
#endif

static int nt_bad(int64_t rows, int64_t in, int64_t out, int64_t j_begin, int64_t j_end,
                  int64_t ldx, int64_t lde, int64_t ldy) {
    return rows < 0 || in < 0 || j_begin < 0 || j_end > out || j_begin > j_end || ldx < in ||
           lde < in || ldy < out;
}

int pagedkv_bf16_nt(const float *x, int64_t ldx, const uint16_t *e, int64_t lde, float *y,
                    int64_t ldy, int64_t rows, int64_t in, int64_t out, int64_t j_begin,
                    int64_t j_end) {
    if (nt_bad(rows, in, out, j_begin, j_end, ldx, lde, ldy)) return -1;
#if BF_AVX2
    int64_t j = j_begin;
    if (rows == 1 || rows == 2) j = nt_spread(x, ldx, e, lde, y, ldy, (int)rows, in, j, j_end);
#if BF_512
    else if (zt_columns(x, ldx, e, lde, y, ldy, rows, in, j, j_end) == 0) return 0;
#endif
    const int64_t S = (j_end - j) / 3; /* 3 streams of S columns, as nt_spread's */
    for (int64_t i = j; i < j + S; i++)
        nt_rows(x, ldx, e + i * lde, S * lde, y + i, ldy, S, rows, 3, in);
    j += 3 * S;
    if (j < j_end) nt_rows(x, ldx, e + j * lde, lde, y + j, ldy, 1, rows, (int)(j_end - j), in);
#else
    nt_scalar(x, ldx, e, lde, y, ldy, rows, in, j_begin, j_end);
#endif
    return 0;
}

/* The portable paths, exported so tests can check they give the vector paths' bits. */
int pagedkv_bf16_tiled_portable(const float *x, int64_t ldx, const uint16_t *t,
                                const float *bias, float *y, int64_t ldy, int64_t rows,
                                int64_t in, int64_t out, int64_t j_begin, int64_t j_end) {
    if (tl_bad(rows, in, out, j_begin, j_end, ldx, ldy)) return -1;
    tl_scalar(x, ldx, t, in, y, ldy, rows, j_begin, j_end);
    add_bias(bias, y, ldy, rows, j_begin, j_end);
    return 0;
}

int pagedkv_bf16_nt_portable(const float *x, int64_t ldx, const uint16_t *e, int64_t lde,
                             float *y, int64_t ldy, int64_t rows, int64_t in, int64_t out,
                             int64_t j_begin, int64_t j_end) {
    if (nt_bad(rows, in, out, j_begin, j_end, ldx, lde, ldy)) return -1;
    nt_scalar(x, ldx, e, lde, y, ldy, rows, in, j_begin, j_end);
    return 0;
}

/* The vector width the tiled and multi-row nt paths run: 512 (an AVX-512F build), 256 (AVX2
 * + FMA) or 0 (the portable loops); the wrapper reports it. */
int pagedkv_bf16_vector_bits(void) { return BF_512 ? 512 : BF_AVX2 ? 256 : 0; }

/* ---- One call over all columns, split among threads (pagedkv_bf16_{tiled,nt}_par) ----
 *
 * Built with -fopenmp (bf16_linear.py's first flag set), the parts run on the process's
 * OpenMP threads: torch's, which is loaded first and whose soname (libgomp.so.1) the dynamic
 * linker reuses, so no second pool of threads competes with torch's for the cores (each
 * part a Python worker's call was dear enough that a batch-1 step split only its
 * vocabulary projection). Parts are columns on whole tiles (16 columns), at least
 * BF_PAR_MIN_MACS multiply-adds each, so a tiled part reads one contiguous range of the
 * weight; a part's outputs do not depend on the split (the header), so the bits are the
 * one-thread call's. Without OpenMP the parts run one after another here. */
#ifdef _OPENMP
#include <omp.h>
#define BF_IN_PARALLEL omp_in_parallel()
#else
#define BF_IN_PARALLEL 1
#endif
#define BF_PAR_MAX 8
#ifndef BF_PAR_MIN_MACS
#define BF_PAR_MIN_MACS (1 << 15)
#endif

int pagedkv_bf16_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Cut points of columns [0, out) into at most `threads` parts of at least min_macs
 * multiply-adds each; returns the number of parts. */
static int bf_cuts(int64_t rows, int64_t in, int64_t out, int threads, int64_t min_macs,
                   int64_t *cuts) {
    int64_t parts = threads < BF_PAR_MAX ? threads : BF_PAR_MAX;
    const int64_t tiles = (out + TILE - 1) / TILE;
    if (parts > tiles) parts = tiles;
    if (parts > rows * in * out / min_macs) parts = rows * in * out / min_macs;
    if (parts < 1 || BF_IN_PARALLEL) parts = 1;
    for (int64_t p = 0; p <= parts; p++) {
        const int64_t c = TILE * ((tiles * p + parts / 2) / parts);
        cuts[p] = c < out ? c : out;
    }
    return (int)parts;
}

int pagedkv_bf16_tiled_par(const float *x, int64_t ldx, const uint16_t *t, const float *bias,
                           float *y, int64_t ldy, int64_t rows, int64_t in, int64_t out,
                           int threads) {
    int64_t cuts[BF_PAR_MAX + 1];
    int rcs[BF_PAR_MAX] = {0};
    const int parts = bf_cuts(rows, in, out, threads, BF_PAR_MIN_MACS, cuts);
    if (parts == 1) return pagedkv_bf16_tiled(x, ldx, t, bias, y, ldy, rows, in, out, 0, out);
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int p = 0; p < parts; p++)
        rcs[p] = pagedkv_bf16_tiled(x, ldx, t, bias, y, ldy, rows, in, out, cuts[p],
                                    cuts[p + 1]);
    for (int p = 0; p < parts; p++)
        if (rcs[p]) return rcs[p];
    return 0;
}

int pagedkv_bf16_nt_par(const float *x, int64_t ldx, const uint16_t *e, int64_t lde, float *y,
                        int64_t ldy, int64_t rows, int64_t in, int64_t out, int threads) {
    int64_t cuts[BF_PAR_MAX + 1];
    int rcs[BF_PAR_MAX] = {0};
    const int parts = bf_cuts(rows, in, out, threads, BF_PAR_MIN_MACS, cuts);
    if (parts == 1) return pagedkv_bf16_nt(x, ldx, e, lde, y, ldy, rows, in, out, 0, out);
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int p = 0; p < parts; p++)
        rcs[p] = pagedkv_bf16_nt(x, ldx, e, lde, y, ldy, rows, in, out, cuts[p], cuts[p + 1]);
    for (int p = 0; p < parts; p++)
        if (rcs[p]) return rcs[p];
    return 0;
}
