/* Float32 matmuls for a few rows (decode steps: 2..32 rows), reading each weight from memory
 * once for all the rows, with a summation order that does not depend on the row count or on the
 * split of columns among threads (batch invariance: a row's output is the same bits alone or in
 * any batch).
 *
 * pagedkv_fewrow_nn: y[r, j] = sum_k x[r, k] * w[k, j] (+ bias[j]) for w [in, out] (row stride
 *   ldw), columns [j_begin, j_end). Order: for every (r, j) one fused multiply-add per k, in
 *   increasing k, from 0; the bias is added after the sum.
 * pagedkv_fewrow_nt: y[r, j] = sum_k x[r, k] * e[j, k] for e [out, in] (row stride lde; the
 *   tied vocabulary projection's embedding as stored), columns [j_begin, j_end). Order: 8 lane
 *   sums (lane l takes k = l, l + 8, ... below in - in % 8, one FMA each in increasing k), added
 *   as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then the last in % 8 products by FMA in
 *   increasing k.
 *
 * Why this shape: MKL's sgemm at 16 rows re-reads the weights (measured ~2.7x its one-row time
 * on 576 x 3072), while 16 rows are near this CPU's FMA bound with a single pass. nn takes the
 * columns in blocks of JB (the rows' partial sums of a block stay in L1/L2), walks the weight
 * in chunks of KC rows, and for each 16-column panel of a chunk runs every 6-row block over
 * it: 12 accumulators in ymm registers, loaded from and stored to y between chunks (y is the
 * accumulator), so the chunk's panel comes from memory once and from L1 for the other row
 * blocks. nt keeps 4 rows x 3 embedding rows of lane sums in registers; the 3 embedding rows
 * (3 * in floats) stay in L1 for the other row blocks. Measured (benchmarks/RESULTS.md, issue
 * 15 few-row section) 1.2-1.4x faster than torch.mm at 16 rows on SmolLM2's shapes, loaded
 * machine; KC 8..576, JB 64..4096 and prefetching the next chunk were within the noise.
 *
 * The AVX2/FMA path and the portable path (fmaf, the same single rounding as a vector FMA)
 * compute the same bits. Returns 0, or -1 for a bad range.
 */
#pragma GCC optimize("no-fast-math") /* the stated summation order, kept as written */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FR_AVX2 1
#else
#define FR_AVX2 0
#endif

#ifndef JB
#define JB 256 /* columns per block (nn): the rows' accumulators of a block stay in L1/L2 */
#endif
#ifndef KC
#define KC 16 /* weight rows per chunk (nn) */
#endif
#define PANEL 16 /* columns per panel (nn): 2 vectors of 8 */
#define RB 6     /* rows per register block (nn) */
#define RB_NT 4  /* rows per register block (nt) */

/* Columns [j0, j1) of rows [0, nr), weight rows [k0, k1), one scalar FMA at a time. */
static void nn_scalar(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y,
                      int64_t ldy, int64_t nr, int64_t k0, int64_t k1, int64_t j0, int64_t j1) {
    for (int64_t r = 0; r < nr; r++)
        for (int64_t j = j0; j < j1; j++) {
            float acc = k0 ? y[r * ldy + j] : 0.0f;
            for (int64_t k = k0; k < k1; k++) acc = fmaf(x[r * ldx + k], w[k * ldw + j], acc);
            y[r * ldy + j] = acc;
        }
}

#if FR_AVX2
/* NR rows x NV vectors (compile-time constants after inlining) over weight rows [k0, k1) of
 * the panel at w (column j0 already applied): named accumulators, so they stay in registers
 * (12 + 2 weight vectors + a broadcast: 15 of the 16 ymm registers, the classic 6 x 16 AVX2
 * block; a 4 x 24 block needed 16 and GCC re-read the weights from L1 for every row). */
#define NN_LOAD(r, v) c##r##v = first ? z : _mm256_loadu_ps(y + (r) * ldy + 8 * (v))
#define NN_FMA(r)                                                      \
    if (NR > r) {                                                      \
        __m256 xv = _mm256_broadcast_ss(x + (r) * ldx + k);            \
        c##r##0 = _mm256_fmadd_ps(xv, w0, c##r##0);                    \
        if (NV > 1) c##r##1 = _mm256_fmadd_ps(xv, w1, c##r##1);        \
    }
#define NN_ROW_LOAD(r)                                                 \
    if (NR > r) {                                                      \
        NN_LOAD(r, 0);                                                 \
        if (NV > 1) NN_LOAD(r, 1);                                     \
    }
#define NN_ROW_STORE(r)                                                \
    if (NR > r) {                                                      \
        _mm256_storeu_ps(y + (r) * ldy, c##r##0);                      \
        if (NV > 1) _mm256_storeu_ps(y + (r) * ldy + 8, c##r##1);      \
    }
static inline __attribute__((always_inline)) void nn_block(
    const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy,
    const int NR, const int NV, int64_t k0, int64_t k1) {
    __m256 z = _mm256_setzero_ps();
    const int first = k0 == 0;
    __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z;
    __m256 c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
    NN_ROW_LOAD(0) NN_ROW_LOAD(1) NN_ROW_LOAD(2) NN_ROW_LOAD(3) NN_ROW_LOAD(4) NN_ROW_LOAD(5)
    for (int64_t k = k0; k < k1; k++) {
        const float *wk = w + k * ldw;
        __m256 w0 = _mm256_loadu_ps(wk);
        __m256 w1 = NV > 1 ? _mm256_loadu_ps(wk + 8) : z;
        NN_FMA(0) NN_FMA(1) NN_FMA(2) NN_FMA(3) NN_FMA(4) NN_FMA(5)
    }
    NN_ROW_STORE(0) NN_ROW_STORE(1) NN_ROW_STORE(2) NN_ROW_STORE(3) NN_ROW_STORE(4)
    NN_ROW_STORE(5)
}

#define NN_CASE(nr, nv) nn_block(xr, ldx, wp, ldw, yr, ldy, nr, nv, k0, k1)
static void nn_rows(const float *x, int64_t ldx, const float *wp, int64_t ldw, float *y,
                    int64_t ldy, int64_t rows, int nv, int64_t k0, int64_t k1) {
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
        int64_t nr = rows - r0 < RB ? rows - r0 : RB;
        const float *xr = x + r0 * ldx;
        float *yr = y + r0 * ldy;
        switch (nr * 2 + nv - 1) { /* nv is 1 or 2 */
            case 2: NN_CASE(1, 1); break;
            case 3: NN_CASE(1, 2); break;
            case 4: NN_CASE(2, 1); break;
            case 5: NN_CASE(2, 2); break;
            case 6: NN_CASE(3, 1); break;
            case 7: NN_CASE(3, 2); break;
            case 8: NN_CASE(4, 1); break;
            case 9: NN_CASE(4, 2); break;
            case 10: NN_CASE(5, 1); break;
            case 11: NN_CASE(5, 2); break;
            case 12: NN_CASE(6, 1); break;
            default: NN_CASE(6, 2);
        }
    }
}
#endif

static void add_bias(const float *bias, float *y, int64_t ldy, int64_t rows, int64_t j0,
                     int64_t j1) {
    if (!bias) return;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = j0; j < j1; j++) y[r * ldy + j] += bias[j];
}

int pagedkv_fewrow_nn(const float *x, int64_t ldx, const float *w, int64_t ldw,
                      const float *bias, float *y, int64_t ldy, int64_t rows, int64_t in,
                      int64_t out, int64_t j_begin, int64_t j_end) {
    if (rows < 0 || in < 0 || j_begin < 0 || j_end > out || j_begin > j_end || ldx < in ||
        ldw < out || ldy < out)
        return -1;
    if (in == 0) {
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = j_begin; j < j_end; j++) y[r * ldy + j] = 0.0f;
        add_bias(bias, y, ldy, rows, j_begin, j_end);
        return 0;
    }
#if FR_AVX2
    int64_t vec_end = j_begin + (j_end - j_begin) / 8 * 8; /* vector columns [j_begin, vec_end) */
#else
    int64_t vec_end = j_begin;
#endif
#if FR_AVX2
    for (int64_t jb = j_begin; jb < vec_end; jb += JB) {
        int64_t jb_end = vec_end - jb < JB ? vec_end : jb + JB;
        for (int64_t k0 = 0; k0 < in; k0 += KC) {
            int64_t k1 = in - k0 < KC ? in : k0 + KC;
            for (int64_t j = jb; j < jb_end; j += PANEL) {
                int nv = jb_end - j < PANEL ? 1 : 2;
                nn_rows(x, ldx, w + j, ldw, y + j, ldy, rows, nv, k0, k1);
            }
        }
    }
#endif
    for (int64_t k0 = 0; k0 < in; k0 += KC) {
        int64_t k1 = in - k0 < KC ? in : k0 + KC;
        nn_scalar(x, ldx, w, ldw, y, ldy, rows, k0, k1, vec_end, j_end);
    }
    add_bias(bias, y, ldy, rows, j_begin, j_end);
    return 0;
}

/* The products past the last full 8 (k >= k8), added to s in increasing k. */
static inline float nt_tail(float s, const float *xr, const float *ej, int64_t k8, int64_t in) {
    for (int64_t k = k8; k < in; k++) s = fmaf(xr[k], ej[k], s);
    return s;
}

/* ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then the tail products in increasing k. */
static inline float nt_finish(const float *lanes, const float *xr, const float *ej, int64_t k8,
                              int64_t in) {
    float s = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) +
              ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    return nt_tail(s, xr, ej, k8, in);
}

static void nt_scalar(const float *x, int64_t ldx, const float *e, int64_t lde, float *y,
                      int64_t ldy, int64_t rows, int64_t in, int64_t j0, int64_t j1) {
    int64_t k8 = in / 8 * 8;
    for (int64_t j = j0; j < j1; j++)
        for (int64_t r = 0; r < rows; r++) {
            float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t k = 0; k < k8; k += 8)
                for (int l = 0; l < 8; l++)
                    lanes[l] = fmaf(x[r * ldx + k + l], e[j * lde + k + l], lanes[l]);
            y[r * ldy + j] = nt_finish(lanes, x + r * ldx, e + j * lde, k8, in);
        }
}

#if FR_AVX2
/* nt_finish's lane order in registers: (l0+l4, l1+l5, l2+l6, l3+l7), then (.0 + .2, .1 + .3),
 * then .0 + .1. */
static inline float hsum(__m256 v) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

#define NT_FMA(r)                                                      \
    if (NR > r) {                                                      \
        __m256 xv = _mm256_loadu_ps(x + (r) * ldx + k);                \
        c##r##0 = _mm256_fmadd_ps(xv, e0, c##r##0);                    \
        if (NC > 1) c##r##1 = _mm256_fmadd_ps(xv, e1, c##r##1);        \
        if (NC > 2) c##r##2 = _mm256_fmadd_ps(xv, e2, c##r##2);        \
    }
#define NT_OUT1(r, v)                                                  \
    y[(r) * ldy + (v)] = nt_tail(hsum(c##r##v), x + (r) * ldx, e + (v) * lde, k8, in);
#define NT_OUT(r)                                                      \
    if (NR > r) {                                                      \
        NT_OUT1(r, 0)                                                  \
        if (NC > 1) { NT_OUT1(r, 1) }                                  \
        if (NC > 2) { NT_OUT1(r, 2) }                                  \
    }
/* NR rows x NC embedding rows (output columns), y and e offset to the block's first. */
static inline __attribute__((always_inline)) void nt_block(
    const float *x, int64_t ldx, const float *e, int64_t lde, float *y, int64_t ldy,
    const int NR, const int NC, int64_t in) {
    __m256 z = _mm256_setzero_ps();
    __m256 c00 = z, c01 = z, c02 = z, c10 = z, c11 = z, c12 = z;
    __m256 c20 = z, c21 = z, c22 = z, c30 = z, c31 = z, c32 = z;
    int64_t k8 = in / 8 * 8;
    for (int64_t k = 0; k < k8; k += 8) {
        __m256 e0 = _mm256_loadu_ps(e + k);
        __m256 e1 = NC > 1 ? _mm256_loadu_ps(e + lde + k) : z;
        __m256 e2 = NC > 2 ? _mm256_loadu_ps(e + 2 * lde + k) : z;
        NT_FMA(0) NT_FMA(1) NT_FMA(2) NT_FMA(3)
    }
    NT_OUT(0) NT_OUT(1) NT_OUT(2) NT_OUT(3)
}

#define NT_CASE(nr, nc) nt_block(xr, ldx, ej, lde, yr, ldy, nr, nc, in)
static void nt_rows(const float *x, int64_t ldx, const float *ej, int64_t lde, float *y,
                    int64_t ldy, int64_t rows, int nc, int64_t in) {
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

int pagedkv_fewrow_nt(const float *x, int64_t ldx, const float *e, int64_t lde, float *y,
                      int64_t ldy, int64_t rows, int64_t in, int64_t out, int64_t j_begin,
                      int64_t j_end) {
    if (rows < 0 || in < 0 || j_begin < 0 || j_end > out || j_begin > j_end || ldx < in ||
        lde < in || ldy < out)
        return -1;
#if FR_AVX2
    for (int64_t j = j_begin; j < j_end; j += 3) {
        int nc = (int)(j_end - j < 3 ? j_end - j : 3);
        nt_rows(x, ldx, e + j * lde, lde, y + j, ldy, rows, nc, in);
    }
#else
    nt_scalar(x, ldx, e, lde, y, ldy, rows, in, j_begin, j_end);
#endif
    return 0;
}

/* The portable paths, exported so tests can check they give the AVX2 paths' bits. */
int pagedkv_fewrow_nn_portable(const float *x, int64_t ldx, const float *w, int64_t ldw,
                               const float *bias, float *y, int64_t ldy, int64_t rows,
                               int64_t in, int64_t out, int64_t j_begin, int64_t j_end) {
    if (rows < 0 || in < 0 || j_begin < 0 || j_end > out || j_begin > j_end || ldx < in ||
        ldw < out || ldy < out)
        return -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = j_begin; j < j_end; j++) y[r * ldy + j] = 0.0f;
    if (in > 0) nn_scalar(x, ldx, w, ldw, y, ldy, rows, 0, in, j_begin, j_end);
    add_bias(bias, y, ldy, rows, j_begin, j_end);
    return 0;
}

int pagedkv_fewrow_nt_portable(const float *x, int64_t ldx, const float *e, int64_t lde,
                               float *y, int64_t ldy, int64_t rows, int64_t in, int64_t out,
                               int64_t j_begin, int64_t j_end) {
    if (rows < 0 || in < 0 || j_begin < 0 || j_end > out || j_begin > j_end || ldx < in ||
        lde < in || ldy < out)
        return -1;
    nt_scalar(x, ldx, e, lde, y, ldy, rows, in, j_begin, j_end);
    return 0;
}
