/* Weight-only int8 linear layer for a few rows: y[r, j] = scale[j] * sum_k x[r, k] * w[k, j]
 * (+ bias[j]), for columns j in [j_begin, j_end).
 *
 * w is int8 packed in column tiles, [ceil(out / TILE_J), in, TILE_J] (tile t holds columns
 * t*TILE_J.. for every k, zero beyond out), so one tile is one contiguous run of in*TILE_J
 * bytes: reading the transposed [in, out] matrix a tile at a time strides across pages and ran
 * at ~2 GB/s. scale [out] float32 (one per output channel, symmetric), x [rows, ldx] and
 * y [rows, ldy] float32. Columns [t_begin*TILE_J, min(t_end*TILE_J, out)) are computed.
 *
 * Why this shape: at 1-2 rows a linear layer is bound by reading its weights (tiles_avx2: 4
 * tiles side by side at one row, so 8 FMA chains and 4 prefetched streams), from ~4 rows by the
 * float32 FMAs (AVX2 has no int8 x float dot product). The loop
 * order keeps a tile of TILE_J columns x up to ROW_BLOCK rows of accumulators in registers and
 * walks k; each int8 weight is converted to float once per row block and used by every row
 * of the block. Row blocks after the first re-read the tile (in x TILE_J bytes, 9-25 KB for
 * SmolLM2) from L1/L2, not memory, so every weight byte comes from memory once per call.
 * The per-channel scale is applied once per output, after the sum.
 *
 * Summation order: for every (r, j) the products are added in increasing k (AVX2: one fused
 * multiply-add each), whatever the row count or the split of tiles among threads, then
 * fmaf(sum, scale[j], bias[j]) (sum * scale[j] without a bias), so a row's output does not
 * depend on the other rows of the call.
 *
 * Returns 0, or -1 for a bad range.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QL_AVX2 1
#else
#define QL_AVX2 0
#endif
#if QL_AVX2 && defined(__AVX512F__)
#define QL_AVX512 1 /* one zmm holds a whole tile's 16 columns (see tiles_avx512) */
#else
#define QL_AVX512 0
#endif

#define TILE_J 16
#define ROW_BLOCK 6 /* tile_avx2 names 6 rows of accumulators */

/* The scale and the bias: one explicit fused multiply-add (fmaf), so the result does not depend
 * on whether the compiler contracts a product and a sum (GCC's default -ffp-contract=fast did
 * so in one inlined copy of `v = acc * scale; v + bias` and not in another: the one-row and the
 * multi-row outputs with a bias differed in the last bit before). */
static inline void finish(const float *acc, const float *scale, const float *bias, float *y,
                          int64_t j0, int64_t nj) {
    for (int64_t j = 0; j < nj; j++)
        y[j0 + j] = bias ? fmaf(acc[j], scale[j0 + j], bias[j0 + j]) : acc[j] * scale[j0 + j];
}

#if !QL_AVX2
/* One tile (wt: in x TILE_J bytes) for rows [0, nr), plain C (CPUs without AVX2). */
static void tile_scalar(const float *x, int64_t ldx, const int8_t *wt, const float *scale,
                        const float *bias, float *y, int64_t ldy, int64_t nr, int64_t in,
                        int64_t j0, int64_t nj) {
    float acc[TILE_J];
    for (int64_t r = 0; r < nr; r++) {
        for (int j = 0; j < TILE_J; j++) acc[j] = 0.0f;
        for (int64_t k = 0; k < in; k++) {
            float xv = x[r * ldx + k];
            for (int j = 0; j < TILE_J; j++) acc[j] += xv * (float)wt[k * TILE_J + j];
        }
        finish(acc, scale, bias, y + r * ldy, j0, nj);
    }
}
#endif

#if QL_AVX2
static inline __m256 load8(const int8_t *p) {
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

/* NR rows (a compile-time constant after inlining) over one tile: 2 x NR accumulators (12 at
 * most), two weight vectors and a broadcast stay in the 16 ymm registers (an even/odd-k split to hide
 * the FMA latency at one row spilled at four rows, and would make the order row-dependent).
 * The accumulators are named variables, not an array: a variant of this loop that read the
 * weights through a second pointer made GCC 12 keep the __m256 arrays in memory (one store per
 * FMA, half speed); with names they stay in registers whatever the variant (for this source GCC
 * 12 emits the same inner loop as for the array form). 16 rows are compute bound: on 576 x 3072
 * one row takes ~0.09 ms (bandwidth), 16 rows ~0.6-1.0 ms, about torch.mm's fp32 time or less.
 * Dequantizing each tile once into a float32 buffer and running the row blocks over it was
 * tried and measured no faster (the int8 conversions are not the bottleneck). */
#define QL_ROW(r)                                                         \
    if (nr > r) {                                                         \
        __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);                 \
        c##r##a = _mm256_fmadd_ps(xv, w0, c##r##a);                       \
        c##r##b = _mm256_fmadd_ps(xv, w1, c##r##b);                       \
    }
#define QL_OUT(r)                                                         \
    if (nr > r) {                                                         \
        _mm256_storeu_ps(acc, c##r##a);                                   \
        _mm256_storeu_ps(acc + 8, c##r##b);                               \
        finish(acc, scale, bias, y + r * ldy, j0, nj);                    \
    }
static inline __attribute__((always_inline)) void tile_avx2(
    const float *x, int64_t ldx, const int8_t *wt, const float *scale, const float *bias,
    float *y, int64_t ldy, const int nr, int64_t in, int64_t j0, int64_t nj) {
    __m256 z = _mm256_setzero_ps();
    __m256 c0a = z, c0b = z, c1a = z, c1b = z, c2a = z, c2b = z;
    __m256 c3a = z, c3b = z, c4a = z, c4b = z, c5a = z, c5b = z;
    for (int64_t k = 0; k < in; k++) {
        __m256 w0 = load8(wt + k * TILE_J), w1 = load8(wt + k * TILE_J + 8);
        QL_ROW(0) QL_ROW(1) QL_ROW(2) QL_ROW(3) QL_ROW(4) QL_ROW(5)
    }
    float acc[TILE_J];
    QL_OUT(0) QL_OUT(1) QL_OUT(2) QL_OUT(3) QL_OUT(4) QL_OUT(5)
}

/* NT adjacent tiles (wt, wt + in*TILE_J, ...; NT = 2 or 4) for NR <= 2 rows: with one row,
 * one tile gives only two FMA chains, so the kernel waited on the FMA latency (~6.6 GB/s
 * measured); four tiles give eight chains (2 x 4 at two rows with two tiles). Each output's
 * order is unchanged (increasing k). Each tile's stream prefetches the same k of the tile NT
 * ahead (the next call of this function), once per 64-byte line (every fourth k): measured
 * 10-30% faster than prefetching 1 KB ahead within the tile, out of cache (the hardware
 * prefetcher alone does not keep up with four streams). A prefetch past the weight's end is
 * harmless (prefetches never fault). */
#define QT_FMA(t)                                                                  \
    if (NT > t) {                                                                  \
        const int8_t *wk = wt + (t) * in * TILE_J + k * TILE_J;                    \
        __m256 w0 = load8(wk), w1 = load8(wk + 8);                                 \
        c0##t##a = _mm256_fmadd_ps(x0, w0, c0##t##a);                              \
        c0##t##b = _mm256_fmadd_ps(x0, w1, c0##t##b);                              \
        if (NR > 1) {                                                              \
            c1##t##a = _mm256_fmadd_ps(x1, w0, c1##t##a);                          \
            c1##t##b = _mm256_fmadd_ps(x1, w1, c1##t##b);                          \
        }                                                                          \
    }
#define QT_PF(t)                                                                   \
    if (NT > t)                                                                    \
        _mm_prefetch((const char *)((uintptr_t)wt + ((t) + NT) * in * TILE_J + k * TILE_J), _MM_HINT_T0);
#define QT_OUT(r, t)                                                               \
    if (NR > r && NT > t) {                                                        \
        _mm256_storeu_ps(acc, c##r##t##a);                                         \
        _mm256_storeu_ps(acc + 8, c##r##t##b);                                     \
        int64_t jt = j0 + (t) * TILE_J, left = nj - (t) * TILE_J;                  \
        finish(acc, scale, bias, y + (r) * ldy, jt, left < TILE_J ? left : TILE_J); \
    }
static inline __attribute__((always_inline)) void tiles_avx2(
    const float *x, int64_t ldx, const int8_t *wt, const float *scale, const float *bias,
    float *y, int64_t ldy, const int NR, const int NT, int64_t in, int64_t j0, int64_t nj) {
    __m256 z = _mm256_setzero_ps();
    __m256 c00a = z, c00b = z, c01a = z, c01b = z, c02a = z, c02b = z, c03a = z, c03b = z;
    __m256 c10a = z, c10b = z, c11a = z, c11b = z, c12a = z, c12b = z, c13a = z, c13b = z;
    for (int64_t k = 0; k < in; k++) {
        if ((k & 3) == 0) { QT_PF(0) QT_PF(1) QT_PF(2) QT_PF(3) }
        __m256 x0 = _mm256_broadcast_ss(x + k);
        __m256 x1 = NR > 1 ? _mm256_broadcast_ss(x + ldx + k) : z;
        QT_FMA(0) QT_FMA(1) QT_FMA(2) QT_FMA(3)
    }
    float acc[TILE_J];
    QT_OUT(0, 0) QT_OUT(0, 1) QT_OUT(0, 2) QT_OUT(0, 3)
    QT_OUT(1, 0) QT_OUT(1, 1) QT_OUT(1, 2) QT_OUT(1, 3)
}
#undef QT_FMA
#undef QT_PF
#undef QT_OUT
#endif

#if QL_AVX512
/* AVX-512: one tile's 16 columns are one zmm, so a k step of a tile is one 16-byte load,
 * one widening (vpmovsxbd), one conversion and one FMA where AVX2 needs two of each: the
 * one-row kernel was bound by the widening, not by memory (RESULTS.md, helper step1). Each
 * output still adds its products in increasing k with one fused multiply-add each, so every
 * output has the AVX2 path's bits. NT tiles (8 at one row: 8 FMA chains hide the latency of
 * the two 512-bit FMA ports; 4 at two rows) x NR <= 2 rows; the same prefetch as tiles_avx2
 * (one line of the tile NT ahead per 4 k). */
static inline __m512 load16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#define QZ_FMA(t)                                                                  \
    if (NT > t) {                                                                  \
        __m512 wv = load16(wt + (t) * in * TILE_J + k * TILE_J);                   \
        c0##t = _mm512_fmadd_ps(x0, wv, c0##t);                                    \
        if (NR > 1) c1##t = _mm512_fmadd_ps(x1, wv, c1##t);                        \
    }
#define QZ_PF(t)                                                                   \
    if (NT > t)                                                                    \
        _mm_prefetch((const char *)((uintptr_t)wt + ((t) + NT) * in * TILE_J + k * TILE_J), _MM_HINT_T0);
#define QZ_OUT(r, t)                                                               \
    if (NR > r && NT > t) {                                                        \
        _mm512_storeu_ps(acc, c##r##t);                                            \
        int64_t jt = j0 + (t) * TILE_J, left = nj - (t) * TILE_J;                  \
        if (left > 0) finish(acc, scale, bias, y + (r) * ldy, jt, left < TILE_J ? left : TILE_J); \
    }
static inline __attribute__((always_inline)) void tiles_avx512(
    const float *x, int64_t ldx, const int8_t *wt, const float *scale, const float *bias,
    float *y, int64_t ldy, const int NR, const int NT, int64_t in, int64_t j0, int64_t nj) {
    __m512 z = _mm512_setzero_ps();
    __m512 c00 = z, c01 = z, c02 = z, c03 = z, c04 = z, c05 = z, c06 = z, c07 = z;
    __m512 c10 = z, c11 = z, c12 = z, c13 = z, c14 = z, c15 = z, c16 = z, c17 = z; /* NR 2: NT <= 4 */
    for (int64_t k = 0; k < in; k++) {
        if ((k & 3) == 0) { QZ_PF(0) QZ_PF(1) QZ_PF(2) QZ_PF(3) QZ_PF(4) QZ_PF(5) QZ_PF(6) QZ_PF(7) }
        __m512 x0 = _mm512_set1_ps(x[k]);
        __m512 x1 = NR > 1 ? _mm512_set1_ps(x[ldx + k]) : z;
        QZ_FMA(0) QZ_FMA(1) QZ_FMA(2) QZ_FMA(3) QZ_FMA(4) QZ_FMA(5) QZ_FMA(6) QZ_FMA(7)
    }
    float acc[TILE_J];
    QZ_OUT(0, 0) QZ_OUT(0, 1) QZ_OUT(0, 2) QZ_OUT(0, 3) QZ_OUT(0, 4) QZ_OUT(0, 5)
    QZ_OUT(0, 6) QZ_OUT(0, 7) QZ_OUT(1, 0) QZ_OUT(1, 1) QZ_OUT(1, 2) QZ_OUT(1, 3)
}
#undef QZ_FMA
#undef QZ_PF
#undef QZ_OUT

/* NR <= ROW_BLOCK rows over two adjacent tiles (NT = 1 or 2): 2 x 6 zmm accumulators, the
 * two weight vectors converted once per k for all the rows (tile_avx2's loop, 32 columns). */
#define QR_ROW(r)                                                         \
    if (nr > r) {                                                         \
        __m512 xv = _mm512_set1_ps(x[(r) * ldx + k]);                     \
        c##r##a = _mm512_fmadd_ps(xv, w0, c##r##a);                       \
        if (NT > 1) c##r##b = _mm512_fmadd_ps(xv, w1, c##r##b);           \
    }
#define QR_OUT(r)                                                         \
    if (nr > r) {                                                         \
        _mm512_storeu_ps(acc, c##r##a);                                   \
        finish(acc, scale, bias, y + (r) * ldy, j0, nj < TILE_J ? nj : TILE_J); \
        if (NT > 1 && nj > TILE_J) {                                      \
            _mm512_storeu_ps(acc, c##r##b);                               \
            finish(acc, scale, bias, y + (r) * ldy, j0 + TILE_J, nj - TILE_J); \
        }                                                                 \
    }
static inline __attribute__((always_inline)) void tile_avx512(
    const float *x, int64_t ldx, const int8_t *wt, const float *scale, const float *bias,
    float *y, int64_t ldy, const int nr, const int NT, int64_t in, int64_t j0, int64_t nj) {
    __m512 z = _mm512_setzero_ps();
    __m512 c0a = z, c0b = z, c1a = z, c1b = z, c2a = z, c2b = z;
    __m512 c3a = z, c3b = z, c4a = z, c4b = z, c5a = z, c5b = z;
    for (int64_t k = 0; k < in; k++) {
        __m512 w0 = load16(wt + k * TILE_J);
        __m512 w1 = NT > 1 ? load16(wt + in * TILE_J + k * TILE_J) : z;
        QR_ROW(0) QR_ROW(1) QR_ROW(2) QR_ROW(3) QR_ROW(4) QR_ROW(5)
    }
    float acc[TILE_J];
    QR_OUT(0) QR_OUT(1) QR_OUT(2) QR_OUT(3) QR_OUT(4) QR_OUT(5)
}
#undef QR_ROW
#undef QR_OUT

/* Rows [0, nr) of tiles [t, t + nt) (nt = 1 or 2), nr <= ROW_BLOCK. */
static void rowblock_avx512(const float *x, int64_t ldx, const int8_t *wt, const float *scale,
                            const float *bias, float *y, int64_t ldy, int64_t nr, int nt,
                            int64_t in, int64_t j0, int64_t nj) {
#define QR_CASE(n)                                                                          \
    case n:                                                                                 \
        if (nt > 1) tile_avx512(x, ldx, wt, scale, bias, y, ldy, n, 2, in, j0, nj);         \
        else tile_avx512(x, ldx, wt, scale, bias, y, ldy, n, 1, in, j0, nj);                \
        break;
    switch (nr) {
        QR_CASE(1) QR_CASE(2) QR_CASE(3) QR_CASE(4) QR_CASE(5)
        default: QR_CASE(6)
    }
#undef QR_CASE
}
#endif

/* 2: this build has the AVX-512 tiles, 1: the AVX2 ones, 0: only the portable loops. */
int pagedkv_qlinear_isa(void) { return QL_AVX512 ? 2 : QL_AVX2; }

int pagedkv_qlinear_i8(const float *x, int64_t ldx, const int8_t *w, const float *scale,
                       const float *bias, float *y, int64_t ldy, int64_t rows, int64_t in,
                       int64_t out, int64_t t_begin, int64_t t_end) {
    int64_t tiles = (out + TILE_J - 1) / TILE_J;
    if (rows < 0 || in < 0 || t_begin < 0 || t_end > tiles || t_begin > t_end || ldx < in ||
        ldy < out)
        return -1;
#if QL_AVX512
    for (int64_t t = t_begin; t < t_end;) {
        const int8_t *wt = w + t * in * TILE_J;
        int64_t j0 = t * TILE_J;
        if (rows <= 2) { /* 8 (one row) or 4 (two rows) tiles a step, then fewer at the end */
            int64_t nt = rows == 1 ? 8 : 4;
            while (nt > t_end - t) nt >>= 1;
            int64_t njt = out - j0 < nt * TILE_J ? out - j0 : nt * TILE_J;
#define QZ_CALL(NR, NT) tiles_avx512(x, ldx, wt, scale, bias, y, ldy, NR, NT, in, j0, njt)
            if (rows == 1) {
                if (nt == 8) QZ_CALL(1, 8); else if (nt == 4) QZ_CALL(1, 4);
                else if (nt == 2) QZ_CALL(1, 2); else QZ_CALL(1, 1);
            } else if (rows == 2) {
                if (nt == 4) QZ_CALL(2, 4); else if (nt == 2) QZ_CALL(2, 2); else QZ_CALL(2, 1);
            }
#undef QZ_CALL
            t += rows ? nt : t_end - t;
            continue;
        }
        int nt = t + 2 <= t_end ? 2 : 1;
        int64_t njt = out - j0 < nt * TILE_J ? out - j0 : nt * TILE_J;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
            int64_t nr = rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK;
            rowblock_avx512(x + r0 * ldx, ldx, wt, scale, bias, y + r0 * ldy, ldy, nr, nt, in,
                            j0, njt);
        }
        t += nt;
    }
    return 0;
#endif
    for (int64_t t = t_begin; t < t_end; t++) {
        const int8_t *wt = w + t * in * TILE_J;
        int64_t j0 = t * TILE_J, nj = out - j0 < TILE_J ? out - j0 : TILE_J;
#if QL_AVX2
        int64_t nt = rows == 1 ? 4 : 2; /* tiles per streaming step (tiles_avx2) */
        if (rows <= 2 && t + nt <= t_end) { /* columns j0 .. j0 + nt*TILE_J */
            int64_t njt = out - j0 < nt * TILE_J ? out - j0 : nt * TILE_J;
            if (rows == 1) tiles_avx2(x, ldx, wt, scale, bias, y, ldy, 1, 4, in, j0, njt);
            else tiles_avx2(x, ldx, wt, scale, bias, y, ldy, 2, 2, in, j0, njt);
            t += nt - 1;
            continue;
        }
#endif
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
            int64_t nr = rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK;
            const float *xr = x + r0 * ldx;
            float *yr = y + r0 * ldy;
#if QL_AVX2
            switch (nr) {
                case 1: tile_avx2(xr, ldx, wt, scale, bias, yr, ldy, 1, in, j0, nj); break;
                case 2: tile_avx2(xr, ldx, wt, scale, bias, yr, ldy, 2, in, j0, nj); break;
                case 3: tile_avx2(xr, ldx, wt, scale, bias, yr, ldy, 3, in, j0, nj); break;
                case 4: tile_avx2(xr, ldx, wt, scale, bias, yr, ldy, 4, in, j0, nj); break;
                case 5: tile_avx2(xr, ldx, wt, scale, bias, yr, ldy, 5, in, j0, nj); break;
                default: tile_avx2(xr, ldx, wt, scale, bias, yr, ldy, 6, in, j0, nj);
            }
#else
            tile_scalar(xr, ldx, wt, scale, bias, yr, ldy, nr, in, j0, nj);
#endif
        }
    }
    return 0;
}

/* ---- One call over all tiles, split among threads (pagedkv_qlinear_i8_par) ----
 *
 * Built with -fopenmp (qlinear.py's first flag set), the parts run on the process's OpenMP
 * threads: torch's, which is loaded first and whose soname (libgomp.so.1) the dynamic linker
 * reuses, so no second pool competes with torch's for the cores (a Python worker per part
 * cost tens of microseconds, so a batch-1 step split almost nothing). The parts are runs of
 * about equal numbers of tiles, of QL_PAR_MIN_MACS multiply-adds or more each; every output is
 * the same whatever the split. Without OpenMP this runs
 * the whole range on the calling thread (the wrapper then splits on Python workers). */
#ifdef _OPENMP
#include <omp.h>
#endif
#define QL_PAR_MAX 8
#ifndef QL_PAR_MIN_MACS
#define QL_PAR_MIN_MACS (1 << 15)
#endif

int pagedkv_qlinear_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int pagedkv_qlinear_i8_par(const float *x, int64_t ldx, const int8_t *w, const float *scale,
                           const float *bias, float *y, int64_t ldy, int64_t rows, int64_t in,
                           int64_t out, int threads) {
    const int64_t tiles = (out + TILE_J - 1) / TILE_J;
    int64_t parts = threads < QL_PAR_MAX ? threads : QL_PAR_MAX;
    if (parts > tiles) parts = tiles;
    if (parts > rows * tiles * TILE_J * in / QL_PAR_MIN_MACS)
        parts = rows * tiles * TILE_J * in / QL_PAR_MIN_MACS;
#ifdef _OPENMP
    if (omp_in_parallel()) parts = 1;
#else
    parts = 1;
#endif
    if (parts <= 1)
        return pagedkv_qlinear_i8(x, ldx, w, scale, bias, y, ldy, rows, in, out, 0, tiles);
    int64_t cuts[QL_PAR_MAX + 1];
    int rcs[QL_PAR_MAX] = {0};
    for (int64_t p = 0; p <= parts; p++) cuts[p] = (tiles * p * 2 + parts) / (2 * parts);
#pragma omp parallel for num_threads((int)parts) schedule(static, 1)
    for (int64_t p = 0; p < parts; p++)
        rcs[p] = pagedkv_qlinear_i8(x, ldx, w, scale, bias, y, ldy, rows, in, out, cuts[p],
                                    cuts[p + 1]);
    for (int64_t p = 0; p < parts; p++)
        if (rcs[p]) return rcs[p];
    return 0;
}
