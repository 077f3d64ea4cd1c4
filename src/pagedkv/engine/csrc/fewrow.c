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
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FR_AVX2 1
#else
#define FR_AVX2 0
#endif
#if FR_AVX2 && defined(__AVX512F__) && defined(__AVX512VL__)
#define FR_AVX512 1 /* the AVX-512 blocks below; the AVX2 ones are then not compiled */
#else
#define FR_AVX512 0
#endif

#ifndef JB
#define JB 256 /* columns per block (nn): the rows' accumulators of a block stay in L1/L2 */
#endif
#ifndef KC
#define KC 16 /* weight rows per chunk (nn) */
#endif
#ifndef NZ_JB
#define NZ_JB 6144 /* columns per block (nn, AVX-512): whole rows of the weight, so that */
#endif             /* each chunk streams KC full rows; the accumulators (rows x NZ_JB) in L2 */
#ifndef NZ_KC
#define NZ_KC 32 /* weight rows per chunk (nn, AVX-512) */
#endif
#ifndef NZ_PF
#define NZ_PF 48 /* prefetch the next panel along each weight row (floats; 0: none) */
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

#if FR_AVX2 && !FR_AVX512
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

#if FR_AVX512
/* AVX-512: NR (<= 8) rows x NV (<= 3) vectors of 16 columns over weight rows [k0, k1), the
 * last vector masked to `mlast` (a panel narrower than 48 columns: no scalar tail). 24
 * accumulators + 3 weight vectors + a broadcast: 28 of the 32 zmm registers; per k, 3 weight
 * loads and 8 broadcasts for 24 FMAs. Each output is still one FMA per k in increasing k
 * (the accumulator loaded from y between chunks), so the bits equal the AVX2 and portable
 * paths'. */
#define NZ_ROWS 8
#define NZ_PANEL 48
#define NZ_LOAD(r, v)                                                          \
    c##r##v = first ? z : _mm512_maskz_loadu_ps(m##v, y + (r) * ldy + 16 * (v))
#define NZ_ROW_LOAD(r)                                                         \
    if (NR > r) {                                                              \
        NZ_LOAD(r, 0);                                                         \
        if (NV > 1) NZ_LOAD(r, 1);                                             \
        if (NV > 2) NZ_LOAD(r, 2);                                             \
    }
#define NZ_FMA(r)                                                              \
    if (NR > r) {                                                              \
        __m512 xv = _mm512_set1_ps(x[(r) * ldx + k]);                          \
        c##r##0 = _mm512_fmadd_ps(xv, w0, c##r##0);                            \
        if (NV > 1) c##r##1 = _mm512_fmadd_ps(xv, w1, c##r##1);                \
        if (NV > 2) c##r##2 = _mm512_fmadd_ps(xv, w2, c##r##2);                \
    }
#define NZ_ROW_STORE(r)                                                        \
    if (NR > r) {                                                              \
        _mm512_mask_storeu_ps(y + (r) * ldy, m0, c##r##0);                     \
        if (NV > 1) _mm512_mask_storeu_ps(y + (r) * ldy + 16, m1, c##r##1);    \
        if (NV > 2) _mm512_mask_storeu_ps(y + (r) * ldy + 32, m2, c##r##2);    \
    }
#define NZ_ROWS_DO(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)
static inline __attribute__((always_inline)) void nz_block(
    const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy,
    const int NR, const int NV, __mmask16 mlast, int64_t k0, int64_t k1, int pf) {
    const __mmask16 m0 = NV == 1 ? mlast : 0xFFFF, m1 = NV == 2 ? mlast : 0xFFFF, m2 = mlast;
    const __m512 z = _mm512_setzero_ps();
    const int first = k0 == 0;
    __m512 c00 = z, c01 = z, c02 = z, c10 = z, c11 = z, c12 = z, c20 = z, c21 = z, c22 = z;
    __m512 c30 = z, c31 = z, c32 = z, c40 = z, c41 = z, c42 = z, c50 = z, c51 = z, c52 = z;
    __m512 c60 = z, c61 = z, c62 = z, c70 = z, c71 = z, c72 = z;
    NZ_ROWS_DO(NZ_ROW_LOAD)
    for (int64_t k = k0; k < k1; k++) {
        const float *wk = w + k * ldw;
        __m512 w0 = _mm512_maskz_loadu_ps(m0, wk);
        __m512 w1 = NV > 1 ? _mm512_maskz_loadu_ps(m1, wk + 16) : z;
        __m512 w2 = NV > 2 ? _mm512_maskz_loadu_ps(m2, wk + 32) : z;
        if (NZ_PF && pf) {
            _mm_prefetch((const char *)(wk + NZ_PF), _MM_HINT_T0);
            _mm_prefetch((const char *)(wk + NZ_PF + 16), _MM_HINT_T0);
            _mm_prefetch((const char *)(wk + NZ_PF + 32), _MM_HINT_T0);
        }

        NZ_ROWS_DO(NZ_FMA)
    }
    NZ_ROWS_DO(NZ_ROW_STORE)
}

#define NZ_CASE(nr)                                                            \
    case nr:                                                                   \
        if (nv == 1) nz_block(xr, ldx, wp, ldw, yr, ldy, nr, 1, mlast, k0, k1, b == 0); \
        else if (nv == 2) nz_block(xr, ldx, wp, ldw, yr, ldy, nr, 2, mlast, k0, k1, b == 0); \
        else nz_block(xr, ldx, wp, ldw, yr, ldy, nr, 3, mlast, k0, k1, b == 0);      \
        break;
/* Every row over one panel of `cols` (1..48) columns; the rows split into blocks of at most
 * 8, as even as possible (16 rows: 8 + 8; 12: 6 + 6), which changes no bits. */
static void nz_rows(const float *x, int64_t ldx, const float *wp, int64_t ldw, float *y,
                    int64_t ldy, int64_t rows, int64_t cols, int64_t k0, int64_t k1) {
    int nv = (int)((cols + 15) / 16);
    __mmask16 mlast = cols % 16 ? (__mmask16)((1u << (cols % 16)) - 1) : (__mmask16)0xFFFF;
    int64_t blocks = (rows + NZ_ROWS - 1) / NZ_ROWS;
    for (int64_t b = 0, r0 = 0; b < blocks; b++) {
        int64_t nr = (rows - r0) / (blocks - b) + ((rows - r0) % (blocks - b) != 0);
        const float *xr = x + r0 * ldx;
        float *yr = y + r0 * ldy;
        switch (nr) {
            NZ_CASE(1) NZ_CASE(2) NZ_CASE(3) NZ_CASE(4) NZ_CASE(5) NZ_CASE(6) NZ_CASE(7)
            default: NZ_CASE(8)
        }
        r0 += nr;
    }
}

/* Columns [j_begin, j_end) of every row: blocks of NZ_JB columns, chunks of NZ_KC weight
 * rows, panels of 48 columns (the last of a block masked). */
static void nn_avx512(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y,
                      int64_t ldy, int64_t rows, int64_t in, int64_t j_begin, int64_t j_end) {
    for (int64_t jb = j_begin; jb < j_end; jb += NZ_JB) {
        int64_t jb_end = j_end - jb < NZ_JB ? j_end : jb + NZ_JB;
        for (int64_t k0 = 0; k0 < in; k0 += NZ_KC) {
            int64_t k1 = in - k0 < NZ_KC ? in : k0 + NZ_KC;
            for (int64_t j = jb; j < jb_end; j += NZ_PANEL) {
                int64_t cols = jb_end - j < NZ_PANEL ? jb_end - j : NZ_PANEL;
                nz_rows(x, ldx, w + j, ldw, y + j, ldy, rows, cols, k0, k1);
            }
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
#if FR_AVX512
    nn_avx512(x, ldx, w, ldw, y, ldy, rows, in, j_begin, j_end);
    int64_t vec_end = j_end; /* every column vectorised (masked panels) */
#elif FR_AVX2
    int64_t vec_end = j_begin + (j_end - j_begin) / 8 * 8; /* vector columns [j_begin, vec_end) */
#else
    int64_t vec_end = j_begin;
#endif
#if FR_AVX2 && !FR_AVX512
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
#endif

#if FR_AVX2 && !FR_AVX512
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

#if FR_AVX512
/* nt, AVX-512: the rows go in pairs. One zmm holds x[r, k..k+8) | x[r+1, k..k+8) (packed once
 * per call into `xp`, pair p at xp + p * 2 * k8, its k-th 8 at + 2 * k), an embedding row's
 * k..k+8 is broadcast to both halves, and each accumulator's two 8-lane halves are exactly the
 * AVX2 path's lane sums of (r, j) and (r + 1, j): the same bits, twice the lanes per FMA.
 * A block: NP (<= 4) pairs x NC (<= 4) embedding rows, 16 accumulators + 4 + 4 registers. */
#define NTZ_PAIRS 4
#define NTZ_COLS 4
#ifndef NTZ_HINT
#define NTZ_HINT _MM_HINT_T1 /* into L2: 8 rows ahead, T0 measured 10% slower */
#endif
#ifndef NTZ_PF
#define NTZ_PF 8 /* prefetch the embedding rows 8 ahead (0: none) */
#endif
static inline __m256 ntz_high(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* hsum's tree for the 16 halves of a[0..3], b[0..3] at once: the result's element 4L + m is
 * the sum of half L % 2 of v[2m + L / 2], v = a[0..3], b[0..3] (the same additions in the
 * same order as hsum: lo + hi 128 bits, then .0 + .2 and .1 + .3, then their sum). */
static inline __m512 ntz_reduce8(const __m512 *a, const __m512 *b) {
    const __m512 v[8] = {a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]};
    __m512 s1[4], s2[2];
    for (int m = 0; m < 4; m++) /* 128-bit lanes [v0.g0, v0.g1, v1.g0, v1.g1], 4 partials each */
        s1[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int n = 0; n < 2; n++) /* per lane: [c.0 + c.2, c.1 + c.3, d.0 + d.2, d.1 + d.3] */
        s2[n] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * n], s1[2 * n + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(s1[2 * n], s1[2 * n + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __attribute__((always_inline)) void ntz_block(
    const float *xp, const float *x, int64_t ldx, const float *e, int64_t lde, float *y,
    int64_t ldy, int64_t rows_left, const int NP, const int NC, int64_t in, int pf) {
    const int64_t k8 = in / 8 * 8, ps = 2 * k8;
    __m512 acc[NTZ_PAIRS][NTZ_COLS];
#pragma GCC unroll 4
    for (int p = 0; p < NP; p++)
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) acc[p][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k8; k += 8) {
        __m512 ev[NTZ_COLS], xv[NTZ_PAIRS];
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++)
            ev[c] = _mm512_castpd_ps(
                _mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(e + c * lde + k))));
        if (NTZ_PF && pf)
#pragma GCC unroll 4
            for (int c = 0; c < NC; c++)
                _mm_prefetch((const char *)(e + (c + NTZ_PF) * lde + k), NTZ_HINT);
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++) xv[p] = _mm512_loadu_ps(xp + p * ps + 2 * k);
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++)
#pragma GCC unroll 4
            for (int c = 0; c < NC; c++) acc[p][c] = _mm512_fmadd_ps(xv[p], ev[c], acc[p][c]);
    }
    if (NP == NTZ_PAIRS && NC == NTZ_COLS) { /* a full block: 8 accumulators at a time */
        for (int s = 0; s < 2; s++) {
            float r[16];
            _mm512_storeu_ps(r, ntz_reduce8(acc[2 * s], acc[2 * s + 1]));
            for (int i = 0; i < 16; i++) { /* r[4L + m] is (pair 2s + q / 4, column q % 4), */
                int L = i / 4, q = 2 * (i % 4) + L / 2; /* half L % 2, for q = 2m + L / 2 */
                int64_t row = 2 * (2 * s + q / 4) + L % 2;
                if (row < rows_left)
                    y[row * ldy + q % 4] =
                        nt_tail(r[i], x + row * ldx, e + (q % 4) * lde, k8, in);
            }
        }
        return;
    }
#pragma GCC unroll 4
    for (int p = 0; p < NP; p++)
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) {
            const float *ej = e + c * lde, *x0 = x + 2 * p * ldx;
            y[2 * p * ldy + c] = nt_tail(hsum(_mm512_castps512_ps256(acc[p][c])), x0, ej, k8, in);
            if (2 * p + 1 < rows_left)
                y[(2 * p + 1) * ldy + c] = nt_tail(hsum(ntz_high(acc[p][c])), x0 + ldx, ej, k8, in);
        }
}

/* x's rows in pairs (the module comment above); an odd last row is paired with itself. */
static void ntz_pack(const float *x, int64_t ldx, int64_t rows, int64_t k8, float *xp) {
    for (int64_t p = 0; p < (rows + 1) / 2; p++) {
        const float *x0 = x + 2 * p * ldx, *x1 = 2 * p + 1 < rows ? x0 + ldx : x0;
        float *dst = xp + p * 2 * k8;
        for (int64_t k = 0; k < k8; k += 8)
            for (int l = 0; l < 8; l++) {
                dst[2 * k + l] = x0[k + l];
                dst[2 * k + 8 + l] = x1[k + l];
            }
    }
}

#define NTZ_CASE(np, nc) ntz_block(xb, xr, ldx, ej, lde, yr, ldy, rows - 2 * p0, np, nc, in, b == 0)
/* Columns [j0, j1) of every row, NC embedding rows at a time over every block of pairs. */
static void ntz_cols(const float *xp, const float *x, int64_t ldx, const float *e, int64_t lde,
                     float *y, int64_t ldy, int64_t rows, int64_t in, int64_t j0, int64_t j1) {
    int64_t pairs = (rows + 1) / 2, blocks = (pairs + NTZ_PAIRS - 1) / NTZ_PAIRS;
    for (int64_t j = j0; j < j1; j += NTZ_COLS) {
        int nc = (int)(j1 - j < NTZ_COLS ? j1 - j : NTZ_COLS);
        const float *ej = e + j * lde;
        for (int64_t b = 0, p0 = 0; b < blocks; b++) {
            int64_t np = (pairs - p0) / (blocks - b) + ((pairs - p0) % (blocks - b) != 0);
            const float *xb = xp + p0 * 2 * (in / 8 * 8), *xr = x + 2 * p0 * ldx;
            float *yr = y + 2 * p0 * ldy + j;
            switch ((np - 1) * 4 + nc) {
                case 1: NTZ_CASE(1, 1); break;
                case 2: NTZ_CASE(1, 2); break;
                case 3: NTZ_CASE(1, 3); break;
                case 4: NTZ_CASE(1, 4); break;
                case 5: NTZ_CASE(2, 1); break;
                case 6: NTZ_CASE(2, 2); break;
                case 7: NTZ_CASE(2, 3); break;
                case 8: NTZ_CASE(2, 4); break;
                case 9: NTZ_CASE(3, 1); break;
                case 10: NTZ_CASE(3, 2); break;
                case 11: NTZ_CASE(3, 3); break;
                case 12: NTZ_CASE(3, 4); break;
                case 13: NTZ_CASE(4, 1); break;
                case 14: NTZ_CASE(4, 2); break;
                case 15: NTZ_CASE(4, 3); break;
                default: NTZ_CASE(4, 4);
            }
            p0 += np;
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
#if FR_AVX512
    int64_t k8 = in / 8 * 8;
    float *xp = rows > 0 && k8 > 0 ? malloc((size_t)((rows + 1) / 2 * 2 * k8) * sizeof(float)) : NULL;
    if (xp) {
        ntz_pack(x, ldx, rows, k8, xp);
        ntz_cols(xp, x, ldx, e, lde, y, ldy, rows, in, j_begin, j_end);
        free(xp);
    } else { /* no memory for the packed rows, or nothing to pack: the same bits, scalar */
        nt_scalar(x, ldx, e, lde, y, ldy, rows, in, j_begin, j_end);
    }
#elif FR_AVX2
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

/* The vector path this build runs: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (portable). */
int pagedkv_fewrow_vector_bits(void) { return FR_AVX512 ? 512 : FR_AVX2 ? 256 : 0; }
