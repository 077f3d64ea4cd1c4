/* Weight-only int8 linear layer for a few rows: y[r, j] = scale[j] * sum_k x[r, k] * w[k, j]
 * (+ bias[j]), for columns j in [j_begin, j_end).
 *
 * w is int8 packed in column tiles, [ceil(out / TILE_J), in, TILE_J] (tile t holds columns
 * t*TILE_J.. for every k, zero beyond out), so one tile is one contiguous run of in*TILE_J
 * bytes: reading the transposed [in, out] matrix a tile at a time strides across pages and ran
 * at ~2 GB/s. scale [out] float32 (one per output channel, symmetric), x [rows, ldx] and
 * y [rows, ldy] float32. Columns [t_begin*TILE_J, min(t_end*TILE_J, out)) are computed.
 *
 * Why this shape: at batch 1..~32 a linear layer is bound by reading its weights, so the loop
 * order keeps a tile of TILE_J columns x up to ROW_BLOCK rows of accumulators in registers and
 * walks k; each int8 weight is converted to float once per row block and used by every row
 * of the block. Row blocks after the first re-read the tile (in x TILE_J bytes, 9-25 KB for
 * SmolLM2) from L1/L2, not memory, so every weight byte comes from memory once per call.
 * The per-channel scale is applied once per output, after the sum.
 *
 * Summation order: for every (r, j) the products are added in increasing k (AVX2: one fused
 * multiply-add each), whatever the row count or the split of tiles among threads, so a row's
 * output does not depend on the other rows of the call.
 *
 * Returns 0, or -1 for a bad range.
 */
#include <stddef.h>
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QL_AVX2 1
#else
#define QL_AVX2 0
#endif

#define TILE_J 16
#define ROW_BLOCK 6 /* tile_avx2 names 6 rows of accumulators */

static inline void finish(const float *acc, const float *scale, const float *bias, float *y,
                          int64_t j0, int64_t nj) {
    for (int64_t j = 0; j < nj; j++) {
        float v = acc[j] * scale[j0 + j];
        y[j0 + j] = bias ? v + bias[j0 + j] : v;
    }
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

/* Two adjacent tiles (wt, wt + in*TILE_J) for NR <= 2 rows: with one row, one tile gives only
 * two FMA chains, so the kernel waited on the FMA latency (~6.6 GB/s measured); two tiles
 * give four (eight at two rows). Each output's order is unchanged (increasing k). */
static inline __attribute__((always_inline)) void tile2_avx2(
    const float *x, int64_t ldx, const int8_t *wt, const float *scale, const float *bias,
    float *y, int64_t ldy, const int nr, int64_t in, int64_t j0, int64_t nj) {
    const int8_t *wu = wt + in * TILE_J;
    __m256 z = _mm256_setzero_ps();
    __m256 c0a = z, c0b = z, c0c = z, c0d = z, c1a = z, c1b = z, c1c = z, c1d = z;
    for (int64_t k = 0; k < in; k++) {
        const int8_t *w = wt + k * TILE_J, *u = wu + k * TILE_J;
        __m256 w0 = load8(w), w1 = load8(w + 8), w2 = load8(u), w3 = load8(u + 8);
        __m256 xv = _mm256_broadcast_ss(x + k);
        c0a = _mm256_fmadd_ps(xv, w0, c0a);
        c0b = _mm256_fmadd_ps(xv, w1, c0b);
        c0c = _mm256_fmadd_ps(xv, w2, c0c);
        c0d = _mm256_fmadd_ps(xv, w3, c0d);
        if (nr > 1) {
            xv = _mm256_broadcast_ss(x + ldx + k);
            c1a = _mm256_fmadd_ps(xv, w0, c1a);
            c1b = _mm256_fmadd_ps(xv, w1, c1b);
            c1c = _mm256_fmadd_ps(xv, w2, c1c);
            c1d = _mm256_fmadd_ps(xv, w3, c1d);
        }
    }
    float acc[2 * TILE_J];
    for (int r = 0; r < nr; r++) {
        _mm256_storeu_ps(acc, r ? c1a : c0a);
        _mm256_storeu_ps(acc + 8, r ? c1b : c0b);
        _mm256_storeu_ps(acc + 16, r ? c1c : c0c);
        _mm256_storeu_ps(acc + 24, r ? c1d : c0d);
        finish(acc, scale, bias, y + r * ldy, j0, TILE_J);
        finish(acc + TILE_J, scale, bias, y + r * ldy, j0 + TILE_J, nj - TILE_J);
    }
}
#endif

int pagedkv_qlinear_i8(const float *x, int64_t ldx, const int8_t *w, const float *scale,
                       const float *bias, float *y, int64_t ldy, int64_t rows, int64_t in,
                       int64_t out, int64_t t_begin, int64_t t_end) {
    int64_t tiles = (out + TILE_J - 1) / TILE_J;
    if (rows < 0 || in < 0 || t_begin < 0 || t_end > tiles || t_begin > t_end || ldx < in ||
        ldy < out)
        return -1;
    for (int64_t t = t_begin; t < t_end; t++) {
        const int8_t *wt = w + t * in * TILE_J;
        int64_t j0 = t * TILE_J, nj = out - j0 < TILE_J ? out - j0 : TILE_J;
#if QL_AVX2
        if (rows <= 2 && t + 1 < t_end) {  /* a pair of tiles: columns j0 .. j0 + 2*TILE_J */
            int64_t nj2 = out - j0 < 2 * TILE_J ? out - j0 : 2 * TILE_J;
            if (rows == 1) tile2_avx2(x, ldx, wt, scale, bias, y, ldy, 1, in, j0, nj2);
            else if (rows == 2) tile2_avx2(x, ldx, wt, scale, bias, y, ldy, 2, in, j0, nj2);
            t++;
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
