/* Linear layers in bf16 arithmetic ("matmul precision medium"): bf16 x bf16 products summed
 * in float32, on AMX-BF16 tiles where the CPU has them, for any number of rows.
 *
 * Contract. The activations are rounded to bf16 once per call (round to nearest even; a NaN
 * stays a NaN; a result below bf16's smallest normal becomes a signed zero) and the weights
 * are bf16. A product of two bf16 values is exact in float32 (8 x 8 significant bits), so
 * the only roundings are the sums'. The portable loops (`portable`, any CPU) compute, for
 * every output (r, j):
 *     s = +0; for k = 0, 1, ..., kp - 1 (kp: in rounded up to 32, zero padding):
 *         s = s + xb[r, k] * W[k, j]         (one float32 add, round to nearest even,
 *                                              a subnormal input or sum flushed to zero)
 *     y[r, j] = s (+ bias[j], a float32 add after the sum)
 * which is the order Intel documents for TDPBF16PS (per k pair, the even product, then the
 * odd one). The AMX tiles sum each 32-k step in the hardware's own order, which is not that
 * one bit for bit (measured: 6 of 64 sums over 576 products equal it, 43 a pairwise tree);
 * both are within (kp + 2) * 2^-24 * (|xb| @ |W|) of the exact sum (tested against float64).
 * On either path the order depends neither on the row count nor on the split of columns
 * among threads, so a row's output is the same bits alone or in any batch (batch
 * invariance; tested bit for bit).
 *
 * pagedkv_bf16dot_linear: W [in, out] as pair tiles p [ceil(out / 16)][kp / 2][16][2] bf16,
 *   W[k, j] = p[j / 16][k / 2][j % 16][k % 2], zero-padded past in and out (bf16_dot.py's
 *   PairedWeight packs it): AMX's B ("VNNI") layout, each 16 x 32 tile one contiguous KiB and
 *   each column tile one contiguous stream. A tile of 16 rows of xb times two column tiles
 *   accumulate in four C tiles over all of k (rows in blocks of 32: two A tiles).
 * pagedkv_bf16dot_nt: y = xb @ e^T for e [out, in] bf16 as stored (the tied vocabulary
 *   projection), in a multiple of 32: e's rows are the A operand (16 rows x 32 k read with a
 *   row stride; nt_amx says which rows share a tile) and xb^T, packed per call in the B
 *   layout, the B operand; each C tile is 16 columns x up to 16 rows, written transposed. A
 *   partial last block of e's rows is copied into a zeroed buffer first.
 * pagedkv_bf16dot_mlp: a SwiGLU MLP in one call, gate/up products straight into the down
 *   projection's A tiles (its comment); pagedkv_bf16dot_linear_tiles and _mlp_tiles take the
 *   A tiles already packed (bf16_tiles.h; layer_ops.c's tiled norm writes them).
 *
 * Threads: a call's columns are cut into parts on whole tiles (16 columns) of at least
 * BD_PAR_MIN_MACS multiply-adds, or, for prefill-sized calls on the AMX path (BD_ROWS_LINEAR,
 * BD_ROWS_MLP rows a thread), its rows in whole 32-row blocks; the parts run on the process's
 * OpenMP threads (torch's; see bf16_linear.c); each configures its own tiles and releases
 * them. Returns 0; -1 for a bad shape or stride; -2 when a buffer cannot be allocated; -3 when
 * the AMX path was asked for and cannot run (not built, or the kernel refused the tile-data
 * permission); -4 when the MLP has no exponential yet (pagedkv_bf16dot_silu_init).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_tiles.h" /* the A tiles' layout (XA) and rounding (to_bf16) */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include "amx.h"
#define BD_AMX 1
#else
#define BD_AMX 0
#endif
#ifdef _OPENMP
#include <omp.h>
#define BD_IN_PARALLEL omp_in_parallel()
#else
#define BD_IN_PARALLEL 1
#endif

#define TILE 16     /* columns per tile */
#ifndef BD_PANEL
#define BD_PANEL (1 << 20) /* bytes of weights per column panel (prefill) */
#endif
#define KB 32       /* k per tile step */
#define BD_PAR_MAX 16
#ifndef BD_SPREAD_ROWS
#define BD_SPREAD_ROWS 4
#endif
#ifndef BD_PAR_MIN_MACS
#define BD_PAR_MIN_MACS (1 << 16)
#endif
/* From this many rows per thread a linear (BD_ROWS_LINEAR) or the one-call MLP (BD_ROWS_MLP)
 * cuts its rows among the threads, in whole 32-row blocks, instead of its columns: each thread
 * then reads every weight and only its own rows' activations (the MLP's intermediate rows are
 * written and read by the one thread). Measured on SmolLM2's shapes at 2 threads (30 layers'
 * weights in turn, as a prefill reads them): the MLP at 1,024 rows 5-7% faster, at 768 3%, at
 * 512 even, at 256 and 128 6-14% slower; the o projection 15-20% faster from 256 rows, q/k/v
 * 0-5%. A row's sums do not depend on the cut. */
#ifndef BD_ROWS_LINEAR
#define BD_ROWS_LINEAR 128
#endif
#ifndef BD_ROWS_MLP
#define BD_ROWS_MLP 384
#endif

/* ---- bf16 rounding and the portable loops (the stated order, step by step) ---- */

static inline float widen_daz(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u; /* a subnormal input reads as zero */
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float add_ftz(float s, float p) {
    const float t = s + p;
    return fabsf(t) < 1.17549435e-38f ? copysignf(0.0f, t) : t;
}

/* xa from x: rounded to bf16, zero past in and from rows up to rows_pad. With u (same ldx),
 * from x[i] * u[i] instead: each product a float32 multiplication (one IEEE rounding, as
 * torch.mul's), then rounded to bf16, so a gated call packs what x * u in float32 would. */
static void pack_rows(const float *x, const float *u, int64_t ldx, int64_t rows, int64_t r0,
                      int64_t r1, int64_t in, int64_t kp, uint16_t *xa) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t k0 = 0; k0 < kp; k0 += KB) {
            uint16_t *dst = &XA(xa, kp, r, k0);
            const float *src = x + r * ldx + k0;
            const float *mul = u ? u + r * ldx + k0 : NULL;
            if (r < rows && k0 + KB <= in) {
#ifdef __AVX512F__
                for (int k = 0; k < KB; k += 16) { /* to_bf16 16 lanes at a time, same bits */
                    __m512 v = _mm512_loadu_ps(src + k);
                    if (mul) v = _mm512_mul_ps(v, _mm512_loadu_ps(mul + k));
                    _mm256_storeu_si256((__m256i *)(dst + k), to_bf16_16(v));
                }
#else
                if (mul)
                    for (int k = 0; k < KB; k++) dst[k] = to_bf16(src[k] * mul[k]);
                else
                    for (int k = 0; k < KB; k++) dst[k] = to_bf16(src[k]);
#endif
            } else {
                for (int k = 0; k < KB; k++)
                    dst[k] = r < rows && k0 + k < in
                                 ? to_bf16(mul ? src[k] * mul[k] : src[k])
                                 : 0;
            }
        }
}

/* pack_rows over rows [0, rows_pad), in blocks of 16 rows shared among up to `threads`
 * OpenMP threads from PACK_PAR_ROWS rows (prefill; each element's rounding is its own, so
 * the split changes no bit). */
#define PACK_PAR_ROWS 64
static void pack_tiles(const float *x, const float *u, int64_t ldx, int64_t rows,
                       int64_t rows_pad, int64_t in, int64_t kp, uint16_t *xa, int threads) {
    const int64_t blocks = rows_pad / TILE;
    int parts = rows_pad >= PACK_PAR_ROWS && !BD_IN_PARALLEL ? threads : 1;
    if (parts > blocks) parts = (int)blocks;
    if (parts < 1) parts = 1;
#pragma omp parallel for num_threads(parts) schedule(static) if (parts > 1)
    for (int64_t b = 0; b < blocks; b++)
        pack_rows(x, u, ldx, rows, b * TILE, (b + 1) * TILE, in, kp, xa);
}

static void linear_portable(const uint16_t *xa, int64_t kp, const uint16_t *p,
                            const float *bias, float *y, int64_t ldy, int64_t rows, int64_t j0,
                            int64_t j1) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = j0; j < j1; j++) {
            const uint16_t *col = p + (j / TILE) * kp * TILE + (j % TILE) * 2;
            float s = 0.0f;
            for (int64_t k = 0; k < kp; k += 2) {
                s = add_ftz(s, widen_daz(XA(xa, kp, r, k)) * widen_daz(col[k * TILE]));
                s = add_ftz(s, widen_daz(XA(xa, kp, r, k + 1)) * widen_daz(col[k * TILE + 1]));
            }
            y[r * ldy + j] = bias ? s + bias[j] : s;
        }
}

static void nt_portable(const uint16_t *xa, int64_t kp, const uint16_t *e, int64_t lde,
                        float *y, int64_t ldy, int64_t rows, int64_t j0, int64_t j1) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = j0; j < j1; j++) {
            float s = 0.0f;
            for (int64_t k = 0; k < kp; k++)
                s = add_ftz(s, widen_daz(XA(xa, kp, r, k)) * widen_daz(e[j * lde + k]));
            y[r * ldy + j] = s;
        }
}

/* ---- AMX ---- */
#if BD_AMX

/* Tiles 0-3: C (m x n float32), 4-5: A (m x 32 bf16), 6-7: B (16 pairs x n x 2); m, n <= 16.
 * A TDPBF16PS costs about its rows of A, so a decode step of fewer than 16 rows configures
 * only its rows (m for the linears, n for the head's transposed product) instead of
 * multiplying zero padding: a row's sums are the same either way. */
static void tiles_on(int m, int n) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = (uint16_t)(i < 4 || i >= 6 ? 4 * n : 64);
        c.rows[i] = (uint8_t)(i < 6 ? m : 16);
    }
    _tile_loadconfig(&c);
}

/* C tile `buf` (16 x 16, row-major) into y rows [0, nr), columns [0, nc). */
static void put_tile(const float *buf, const float *bias, float *y, int64_t ldy, int64_t nr,
                     int64_t nc) {
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < nc; c++)
            y[r * ldy + c] = bias ? buf[r * TILE + c] + bias[c] : buf[r * TILE + c];
}

/* The C tile `c` of rows [r0, r0 + nr) and columns [j, j + nc) into y: stored in place when
 * whole (then the bias added), else through `buf`. */
#define PUT(c, r0, nr, j, nc)                                                               \
    do {                                                                                    \
        float *yt = y + (r0) * ldy + (j);                                                   \
        if ((nr) == TILE && (nc) == TILE) {                                                 \
            _tile_stored(c, yt, ldy * 4);                                                   \
            if (bias)                                                                       \
                for (int64_t r = 0; r < TILE; r++)                                          \
                    for (int64_t q = 0; q < TILE; q++) yt[r * ldy + q] += bias[(j) + q];    \
        } else {                                                                            \
            _tile_stored(c, buf, 64);                                                       \
            put_tile(buf, bias ? bias + (j) : NULL, yt, ldy, nr, nc);                       \
        }                                                                                   \
    } while (0)

/* One row tile (A in tile 4) times `nc` (1..2) column tiles (B in 6, 7; C in 0, 1). */
#define ROW1(nc)                                                                            \
    do {                                                                                    \
        _tile_zero(0);                                                                      \
        if ((nc) > 1) _tile_zero(1);                                                        \
        for (int64_t kb = 0; kb < nk; kb++) {                                               \
            _tile_loadd(4, a0 + kb * TILE * KB, 64);                                        \
            _tile_loadd(6, b0 + kb * KB * TILE, 64);                                        \
            if ((nc) > 1) _tile_loadd(7, b0 + kp * TILE + kb * KB * TILE, 64);              \
            _tile_dpbf16ps(0, 4, 6);                                                        \
            if ((nc) > 1) _tile_dpbf16ps(1, 4, 7);                                          \
        }                                                                                   \
        PUT(0, r0, nr0, t * TILE, nc_at(t));                                                \
        if ((nc) > 1) PUT(1, r0, nr0, (t + 1) * TILE, nc_at(t + 1));                        \
    } while (0)

/* Two row tiles (A in 4, 5) times `nc` (1..2) column tiles (B in 6, 7; C in 0..3). Each
 * product is issued as soon as its two tiles are loaded (measured at 1,024 rows, SmolLM2's
 * shapes, with 1 MiB panels: 7-15% faster than four loads then four products, at 1 and 2
 * threads; the same products in the same k order per C tile, so the same bits). */
#define ROW2(nc)                                                                            \
    do {                                                                                    \
        _tile_zero(0);                                                                      \
        _tile_zero(2);                                                                      \
        if ((nc) > 1) _tile_zero(1);                                                        \
        if ((nc) > 1) _tile_zero(3);                                                        \
        for (int64_t kb = 0; kb < nk; kb++) {                                               \
            _tile_loadd(4, a0 + kb * TILE * KB, 64);                                        \
            _tile_loadd(6, b0 + kb * KB * TILE, 64);                                        \
            _tile_dpbf16ps(0, 4, 6);                                                        \
            if ((nc) > 1) _tile_loadd(7, b0 + kp * TILE + kb * KB * TILE, 64);              \
            if ((nc) > 1) _tile_dpbf16ps(1, 4, 7);                                          \
            _tile_loadd(5, a0 + nk * TILE * KB + kb * TILE * KB, 64);                       \
            _tile_dpbf16ps(2, 5, 6);                                                        \
            if ((nc) > 1) _tile_dpbf16ps(3, 5, 7);                                          \
        }                                                                                   \
        PUT(0, r0, nr0, t * TILE, nc_at(t));                                                \
        PUT(2, r0 + TILE, nr1, t * TILE, nc_at(t));                                         \
        if ((nc) > 1) PUT(1, r0, nr0, (t + 1) * TILE, nc_at(t + 1));                        \
        if ((nc) > 1) PUT(3, r0 + TILE, nr1, (t + 1) * TILE, nc_at(t + 1));                 \
    } while (0)

/* Column tiles [t0, t1) of rows [0, rows); xa from pack_tiles (16-row blocks of A tiles).
 * Column tiles run in pairs (two weight streams). Up to 16 rows: one row tile, so each
 * weight tile is read once. More (prefill): panels of column tiles whose weights fit in
 * BD_PANEL bytes (1 MiB, half of this Xeon's L2; 256 KiB was 3-10% slower); within a panel,
 * blocks of 32 rows x 2 column tiles (four C tiles), each 32-row block of activations kept in
 * L1 across the panel's columns. Measured (one thread, 1,024 rows of SmolLM2's shapes): rows
 * outside the columns 1.1-1.2x faster than inside. */
static void linear_amx(const uint16_t *xa, int64_t kp, const uint16_t *p, const float *bias,
                       float *y, int64_t ldy, int64_t rows, int64_t out, int64_t t0,
                       int64_t t1) {
    float buf[TILE * TILE] __attribute__((aligned(64)));
    const int64_t nk = kp / KB;
    int64_t panel = BD_PANEL / (kp * TILE * 2) / 2 * 2;
    if (panel < 2 || rows <= TILE) panel = t1 - t0;
#define nc_at(tt) (out - (tt) * TILE < TILE ? out - (tt) * TILE : TILE)
    tiles_on(rows < TILE ? (int)rows : TILE, TILE);
    for (int64_t p0 = t0; p0 < t1; p0 += panel) {
        const int64_t p1 = p0 + panel < t1 ? p0 + panel : t1;
        for (int64_t r0 = 0; r0 < rows; r0 += 2 * TILE) {
            const uint16_t *a0 = xa + r0 * kp;
            const int64_t nr0 = rows - r0 < TILE ? rows - r0 : TILE;
            const int64_t nr1 = rows - r0 - TILE < TILE ? rows - r0 - TILE : TILE;
            for (int64_t t = p0; t < p1; t += 2) {
                const uint16_t *b0 = p + t * kp * TILE;
                if (nr1 > 0) {
                    if (t + 1 < p1) ROW2(2);
                    else ROW2(1);
                } else if (t + 1 < p1) {
                    ROW1(2);
                } else {
                    ROW1(1);
                }
            }
        }
    }
#undef nc_at
    _tile_release();
}

/* xa as B tiles: xv[g][kp / 2][16][2] for row groups g of 16 (zero past rows). */
static void pack_pairs(const uint16_t *xa, int64_t rows, int64_t kp, uint16_t *xv) {
    const int64_t groups = (rows + TILE - 1) / TILE;
    memset(xv, 0, (size_t)(groups * kp * TILE) * sizeof *xv);
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *g = xv + (r / TILE) * kp * TILE + (r % TILE) * 2;
        for (int64_t k = 0; k < kp; k += 2) {
            g[k * TILE] = XA(xa, kp, r, k);
            g[k * TILE + 1] = XA(xa, kp, r, k + 1);
        }
    }
}

/* The transposed C tile (16 columns x 16 rows) into y rows [0, nr): tile column c is y's
 * column j + c * cs, c < nc. */
static void put_tile_t(const float *buf, float *y, int64_t ldy, int64_t nr, int64_t j,
                       int64_t cs, int64_t nc) {
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < nc; c++) y[r * ldy + j + c * cs] = buf[c * TILE + r];
}

/* Every row of y for the 16 columns whose e rows are a, a + lda, ..., a + 15 * lda (A tiles
 * with row stride lda), written to y's columns j + c * cs, c < nc. */
static void nt_block(const uint16_t *a, int64_t lda, const uint16_t *xv, int64_t kp, float *y,
                     int64_t ldy, int64_t rows, int64_t j, int64_t cs, int64_t nc) {
    float buf[2][TILE * TILE] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < rows; r0 += 2 * TILE) {
        const int two = r0 + TILE < rows;
        const uint16_t *b0 = xv + r0 * kp;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t kb = 0; kb < kp / KB; kb++) {
            _tile_loadd(4, a + kb * KB, lda * 2);
            _tile_loadd(6, b0 + kb * KB * TILE, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
                _tile_loadd(7, b0 + kp * TILE + kb * KB * TILE, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
        }
        _tile_stored(0, buf[0], 64);
        _tile_stored(1, buf[1], 64);
        const int64_t nr0 = rows - r0 < TILE ? rows - r0 : TILE;
        put_tile_t(buf[0], y + r0 * ldy, ldy, nr0, j, cs, nc);
        if (two)
            put_tile_t(buf[1], y + (r0 + TILE) * ldy, ldy,
                       rows - r0 - TILE < TILE ? rows - r0 - TILE : TILE, j, cs, nc);
    }
}

/* Columns [j0, j1) of y = xb @ e^T, xv from pack_pairs, as S = (j1 - j0) / 16 tiles of 16 e
 * rows and a last (j1 - j0) % 16 rows copied into a zeroed tile. Up to BD_SPREAD_ROWS rows a
 * tile's 16 e rows are S apart (tile b: rows j0 + b + c * S), so each row a tile load reads
 * continues where the previous tile's left off: 16 long sequential streams (in a batch-1
 * decode step of SmolLM2, 4.1 ms for the head against 5.3 ms with 16 consecutive rows a
 * tile, 16 short streams restarting each tile). More rows take consecutive e rows: at 16
 * rows the spread tiles measured slower (6.9 ms, and 7.4 with the outputs staged and written
 * as runs, against 5.7; why is not understood). A column's sum does not depend on its tile,
 * so neither do the bits. */
static int nt_amx(const uint16_t *xv, int64_t kp, const uint16_t *e, int64_t lde, float *y,
                  int64_t ldy, int64_t rows, int64_t j0, int64_t j1) {
    const int64_t spread = (j1 - j0) / TILE, tail = (j1 - j0) % TILE;
    tiles_on(TILE, rows < TILE ? (int)rows : TILE);
    if (rows <= BD_SPREAD_ROWS) {
        for (int64_t b = 0; b < spread; b++)
            nt_block(e + (j0 + b) * lde, spread * lde, xv, kp, y, ldy, rows, j0 + b, spread,
                     TILE);
    } else {
        for (int64_t b = 0; b < spread; b++)
            nt_block(e + (j0 + b * TILE) * lde, lde, xv, kp, y, ldy, rows, j0 + b * TILE, 1,
                     TILE);
    }
    if (tail) {
        uint16_t *stage = calloc((size_t)(TILE * kp), sizeof *stage);
        if (!stage) {
            _tile_release();
            return -2;
        }
        const int64_t j = j0 + spread * TILE;
        for (int64_t c = 0; c < tail; c++) memcpy(stage + c * kp, e + (j + c) * lde, kp * 2);
        nt_block(stage, kp, xv, kp, y, ldy, rows, j, 1, tail);
        free(stage);
    }
    _tile_release();
    return 0;
}

/* ---- the SwiGLU MLP in one call: gate/up, SiLU and its product, down ---- */

/* x / (1 + exp(-x)) with exp the 16-lane function pagedkv_bf16dot_silu_init was handed
 * (torch's own Sleef_expf16_u10), the order of torch's AVX-512 SiLU; NULL until then. */
typedef __m512 (*expf16_fn)(__m512);
static expf16_fn mlp_exp16;

/* Rows [0, nr) of a gate C tile g and its up tile u (16 x 16, row-major) into the down
 * projection's A tiles xd (kd: its k) at rows r0.., columns j..j + 15: bf16(silu(g) * u),
 * the float32 product rounded once, as a gated pack_rows of torch.silu's output would. */
static void swiglu_put(const float *g, const float *u, int64_t nr, uint16_t *xd, int64_t kd,
                       int64_t r0, int64_t j) {
    const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
    for (int64_t r = 0; r < nr; r++) {
        const __m512 v = _mm512_load_ps(g + r * TILE);
        const __m512 s = _mm512_div_ps(v, _mm512_add_ps(one, mlp_exp16(_mm512_xor_ps(v, sign))));
        const __m512 act = _mm512_mul_ps(s, _mm512_load_ps(u + r * TILE));
        _mm256_storeu_si256((__m256i *)&XA(xd, kd, r0 + r, j), to_bf16_16(act));
    }
}

/* A 32-row x 16-column block's four C tiles (gate, up for rows r0..; gate, up for rows
 * r0 + 16..), stored, whose SwiGLU is still to be written into xd. */
typedef struct {
    float c[4][TILE * TILE] __attribute__((aligned(64)));
    int64_t nr0, nr1, r0, j, done; /* done: rows of the 32 written so far */
} swiglu_block;

/* The block's rows [done, upto) into xd (swiglu_put's arithmetic, a row at a time). */
static void swiglu_rows(swiglu_block *b, int64_t upto, uint16_t *xd, int64_t kd) {
    for (int64_t r = b->done; r < upto; r++) {
        if (r < TILE && r < b->nr0)
            swiglu_put(b->c[0] + r * TILE, b->c[1] + r * TILE, 1, xd, kd, b->r0 + r, b->j);
        else if (r >= TILE && r - TILE < b->nr1)
            swiglu_put(b->c[2] + (r - TILE) * TILE, b->c[3] + (r - TILE) * TILE, 1, xd, kd,
                       b->r0 + r, b->j);
    }
    if (upto > b->done) b->done = upto;
}

/* Gate tiles [t0, t1) (up tile t's weights `ups` tiles further on) of rows [0, rows): the
 * products of linear_amx's 32-row x 2-tile blocks, gate and up side by side. Each block's C
 * tiles are stored, and their SwiGLU (vector work) is written while the next block's
 * products run on the tiles: a few rows after each k step, so the two units overlap.
 * Panels as in linear_amx. */
static void swiglu_amx(const uint16_t *xa, int64_t kp, const uint16_t *p, int64_t ups,
                       uint16_t *xd, int64_t kd, int64_t rows, int64_t t0, int64_t t1) {
    swiglu_block blk[2];
    swiglu_block *prev = NULL, *cur = &blk[0];
    const int64_t nk = kp / KB, span = ups * kp * TILE;
    int64_t panel = BD_PANEL / (kp * TILE * 2) / 2;
    if (panel < 1 || rows <= TILE) panel = t1 - t0;
    tiles_on(rows < TILE ? (int)rows : TILE, TILE);
    for (int64_t p0 = t0; p0 < t1; p0 += panel) {
        const int64_t p1 = p0 + panel < t1 ? p0 + panel : t1;
        for (int64_t r0 = 0; r0 < rows; r0 += 2 * TILE) {
            const uint16_t *a0 = xa + r0 * kp, *a1 = a0 + nk * TILE * KB;
            const int64_t nr0 = rows - r0 < TILE ? rows - r0 : TILE;
            const int64_t nr1 = rows - r0 - TILE < TILE ? rows - r0 - TILE : TILE;
            for (int64_t t = p0; t < p1; t++) {
                const uint16_t *bg = p + t * kp * TILE, *bu = bg + span;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kb = 0; kb < nk; kb++) {
                    _tile_loadd(4, a0 + kb * TILE * KB, 64);
                    _tile_loadd(6, bg + kb * KB * TILE, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_loadd(7, bu + kb * KB * TILE, 64);
                    _tile_dpbf16ps(1, 4, 7);
                    if (nr1 > 0) {
                        _tile_loadd(5, a1 + kb * TILE * KB, 64);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    if (prev) swiglu_rows(prev, (kb + 1) * 2 * TILE / nk, xd, kd);
                }
                if (prev) swiglu_rows(prev, 2 * TILE, xd, kd);
                _tile_stored(0, cur->c[0], 64);
                _tile_stored(1, cur->c[1], 64);
                _tile_stored(2, cur->c[2], 64);
                _tile_stored(3, cur->c[3], 64);
                cur->nr0 = nr0, cur->nr1 = nr1, cur->r0 = r0, cur->j = t * TILE, cur->done = 0;
                prev = cur;
                cur = cur == &blk[0] ? &blk[1] : &blk[0];
            }
        }
    }
    if (prev) swiglu_rows(prev, 2 * TILE, xd, kd);
    _tile_release();
}

#else
static int amx_permitted(void) { return 0; }
#endif

/* 1 when the AMX paths run here (built with AMX-BF16 and the tile data permitted). */
int pagedkv_bf16dot_amx(void) { return amx_permitted(); }

/* Cut points of `tiles` column tiles into at most `threads` parts; returns the count. */
static int cut_tiles(int64_t macs, int64_t tiles, int threads, int64_t *cuts) {
    int64_t parts = threads < BD_PAR_MAX ? threads : BD_PAR_MAX;
    if (parts > tiles) parts = tiles;
    if (parts > macs / BD_PAR_MIN_MACS) parts = macs / BD_PAR_MIN_MACS;
    if (parts < 1 || BD_IN_PARALLEL) parts = 1;
    for (int64_t q = 0; q <= parts; q++) cuts[q] = (tiles * q + parts / 2) / parts;
    return (int)parts;
}

#if BD_AMX
/* Cut points of `rows` rows into whole 32-row blocks for at most `threads` parts, where a
 * call of that many rows cuts its rows (at least per_thread rows a part, not already in a
 * parallel region); returns the count, 0 where the columns are cut instead. */
static int cut_rows(int64_t rows, int64_t per_thread, int threads, int64_t *cuts) {
    const int64_t blocks = (rows + 2 * TILE - 1) / (2 * TILE);
    int64_t parts = threads < BD_PAR_MAX ? threads : BD_PAR_MAX;
    if (parts > blocks) parts = blocks;
    if (parts < 2 || rows < per_thread * parts || BD_IN_PARALLEL) return 0;
    for (int64_t q = 0; q <= parts; q++) {
        const int64_t r = blocks * q / parts * 2 * TILE;
        cuts[q] = r < rows ? r : rows;
    }
    return (int)parts;
}
#endif

static int bad(int64_t rows, int64_t in, int64_t out, int64_t ldx, int64_t ldy) {
    return rows < 1 || in < 1 || out < 1 || ldx < in || ldy < out;
}

/* y [rows, out] = xb @ W (+ bias) for packed A tiles xb (bf16_tiles.h; k kp), W as pair
 * tiles (the header): the columns cut among the threads. */
static void linear_run(const uint16_t *xb, int64_t kp, const uint16_t *p, const float *bias,
                       float *y, int64_t ldy, int64_t rows, int64_t out, int threads,
                       int portable) {
    const int64_t tiles = (out + TILE - 1) / TILE;
    int64_t cuts[BD_PAR_MAX + 1];
#if BD_AMX
    const int by_rows = portable ? 0 : cut_rows(rows, BD_ROWS_LINEAR, threads, cuts);
    if (by_rows) { /* rows cut: rows r0.. of xb (whole 16-row blocks of tiles) and of y */
#pragma omp parallel for num_threads(by_rows) schedule(static, 1)
        for (int q = 0; q < by_rows; q++)
            linear_amx(xb + cuts[q] * kp, kp, p, bias, y + cuts[q] * ldy, ldy,
                       cuts[q + 1] - cuts[q], out, 0, tiles);
        return;
    }
#endif
    const int parts = cut_tiles(rows * kp * out, tiles, threads, cuts);
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
    for (int q = 0; q < parts; q++) {
        const int64_t j0 = cuts[q] * TILE, j1 = cuts[q + 1] * TILE < out ? cuts[q + 1] * TILE : out;
        if (portable) {
            linear_portable(xb, kp, p, bias, y, ldy, rows, j0, j1);
        } else {
#if BD_AMX
            linear_amx(xb, kp, p, bias, y, ldy, rows, out, cuts[q], cuts[q + 1]);
#endif
        }
    }
}

/* y [rows, out] = bf16(x) @ W (+ bias): pagedkv_bf16dot_linear's body; u non-NULL: the input
 * is x * u (pack_tiles). */
static int linear_entry(const float *x, const float *u, int64_t ldx, const uint16_t *p,
                        const float *bias, float *y, int64_t ldy, int64_t rows, int64_t in,
                        int64_t out, int threads, int portable) {
    if (bad(rows, in, out, ldx, ldy)) return -1;
    if (!portable && !amx_permitted()) return -3;
    const int64_t kp = (in + KB - 1) / KB * KB, rows_pad = (rows + TILE - 1) / TILE * TILE;
    uint16_t *xb = malloc((size_t)(rows_pad * kp) * sizeof *xb);
    if (!xb) return -2;
    pack_tiles(x, u, ldx, rows, rows_pad, in, kp, xb, threads);
    linear_run(xb, kp, p, bias, y, ldy, rows, out, threads, portable);
    free(xb);
    return 0;
}

/* pagedkv_bf16dot_linear from A tiles already packed (bf16_tiles.h: k kp, in rounded up to 32;
 * rows padded to 16 with zeros), as the layer ops' norm writes them: the same bits as the
 * float32 input those tiles round. */
int pagedkv_bf16dot_linear_tiles(const uint16_t *xa, int64_t kp, const uint16_t *p,
                                 const float *bias, float *y, int64_t ldy, int64_t rows,
                                 int64_t in, int64_t out, int threads) {
    if (bad(rows, in, out, in, ldy) || kp != (in + KB - 1) / KB * KB) return -1;
    if (!amx_permitted()) return -3;
    linear_run(xa, kp, p, bias, y, ldy, rows, out, threads, 0);
    return 0;
}

int pagedkv_bf16dot_linear(const float *x, int64_t ldx, const uint16_t *p, const float *bias,
                           float *y, int64_t ldy, int64_t rows, int64_t in, int64_t out,
                           int threads, int portable) {
    return linear_entry(x, NULL, ldx, p, bias, y, ldy, rows, in, out, threads, portable);
}

/* y = bf16(g * u) @ W (+ bias): g and u with one row stride ldx (the gate and up halves of a
 * gate/up output), each product rounded as float32 then to bf16, as linear() of torch.mul's
 * product would be; the product is never stored. */
int pagedkv_bf16dot_linear_gated(const float *g, const float *u, int64_t ldx, const uint16_t *p,
                                 const float *bias, float *y, int64_t ldy, int64_t rows,
                                 int64_t in, int64_t out, int threads, int portable) {
    return linear_entry(g, u, ldx, p, bias, y, ldy, rows, in, out, threads, portable);
}

/* y [rows, out] = bf16(x) @ e^T for e [out, in] bf16 (row stride lde), in % 32 == 0. */
int pagedkv_bf16dot_nt(const float *x, int64_t ldx, const uint16_t *e, int64_t lde, float *y,
                       int64_t ldy, int64_t rows, int64_t in, int64_t out, int threads,
                       int portable) {
    if (bad(rows, in, out, ldx, ldy) || in % KB || lde < in) return -1;
    if (!portable && !amx_permitted()) return -3;
    const int64_t rows_pad = (rows + TILE - 1) / TILE * TILE;
    uint16_t *xb = malloc((size_t)(rows_pad * in) * sizeof *xb * 2);
    if (!xb) return -2;
    pack_tiles(x, NULL, ldx, rows, rows_pad, in, in, xb, threads);
    uint16_t *xv = xb + rows_pad * in;
#if BD_AMX
    if (!portable) pack_pairs(xb, rows, in, xv);
#else
    (void)xv;
#endif
    const int64_t tiles = (out + TILE - 1) / TILE;
    int64_t cuts[BD_PAR_MAX + 1];
    int rcs[BD_PAR_MAX] = {0};
    const int parts = cut_tiles(rows * in * out, tiles, threads, cuts);
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
    for (int q = 0; q < parts; q++) {
        const int64_t j0 = cuts[q] * TILE, j1 = cuts[q + 1] * TILE < out ? cuts[q + 1] * TILE : out;
        if (portable) {
            nt_portable(xb, in, e, lde, y, ldy, rows, j0, j1);
        } else {
#if BD_AMX
            rcs[q] = nt_amx(xv, in, e, lde, y, ldy, rows, j0, j1);
#endif
        }
    }
    free(xb);
    for (int q = 0; q < parts; q++)
        if (rcs[q]) return rcs[q];
    return 0;
}

#if BD_AMX
/* pagedkv_bf16dot_mlp from its packed input xa (k kp): gate/up and SiLU into the down
 * projection's A tiles, then down. 0, or -2 (no memory). */
static int mlp_run(const uint16_t *xa, int64_t kp, const uint16_t *gate_up, const uint16_t *down,
                   float *y, int64_t ldy, int64_t rows, int64_t hidden, int64_t inter,
                   int threads) {
    const int64_t kd = (inter + KB - 1) / KB * KB, rows_pad = (rows + TILE - 1) / TILE * TILE;
    uint16_t *xd = malloc((size_t)(rows_pad * kd) * sizeof *xd);
    if (!xd) return -2;
    if (kd != inter || rows != rows_pad) /* padding, which swiglu_put never writes */
        memset(xd, 0, (size_t)(rows_pad * kd) * sizeof *xd);
    int64_t cuts[BD_PAR_MAX + 1];
    const int by_rows = cut_rows(rows, BD_ROWS_MLP, threads, cuts);
    if (by_rows) { /* rows cut: each part's gate/up, SiLU and down, no barrier between */
#pragma omp parallel for num_threads(by_rows) schedule(static, 1)
        for (int q = 0; q < by_rows; q++) {
            const int64_t r0 = cuts[q], nr = cuts[q + 1] - r0;
            swiglu_amx(xa + r0 * kp, kp, gate_up, inter / TILE, xd + r0 * kd, kd, nr, 0,
                       inter / TILE);
            linear_amx(xd + r0 * kd, kd, down, NULL, y + r0 * ldy, ldy, nr, hidden, 0,
                       (hidden + TILE - 1) / TILE);
        }
        free(xd);
        return 0;
    }
    int parts = cut_tiles(rows * kp * 2 * inter, inter / TILE, threads, cuts);
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
    for (int q = 0; q < parts; q++)
        swiglu_amx(xa, kp, gate_up, inter / TILE, xd, kd, rows, cuts[q], cuts[q + 1]);
    parts = cut_tiles(rows * kd * hidden, (hidden + TILE - 1) / TILE, threads, cuts);
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
    for (int q = 0; q < parts; q++)
        linear_amx(xd, kd, down, NULL, y, ldy, rows, hidden, cuts[q], cuts[q + 1]);
    free(xd);
    return 0;
}
#endif

/* Hands the MLP its exponential (torch's Sleef_expf16_u10, as layer_ops' SiLU takes it): 0,
 * or -1 where this build has no AMX path. */
int pagedkv_bf16dot_silu_init(const void *expf16) {
#if BD_AMX
    mlp_exp16 = (expf16_fn)(uintptr_t)expf16;
    return expf16 ? 0 : -1;
#else
    (void)expf16;
    return -1;
#endif
}

/* y [rows, hidden] = bf16(silu(x Wg) * (x Wu)) @ Wd: Wgu [hidden, 2 * inter] (gate columns,
 * then up) and Wd [inter, hidden] as pair tiles, inter a multiple of 16. The same bits as
 * linear(x, Wgu), torch's SiLU on the gate half (where it runs its 16-lane exp: every
 * element of a row whose width is a multiple of 32), then linear_gated(gate, up, Wd): each
 * sum is the same AMX sum, the SiLU the same IEEE operations. The gate/up outputs are never
 * stored: each 32-row x 16-column block goes straight into the down projection's A tiles
 * (bf16), so the call writes 2 bytes per intermediate value instead of 8, and the down
 * projection packs nothing. -4: no exponential yet (pagedkv_bf16dot_silu_init). */
int pagedkv_bf16dot_mlp(const float *x, int64_t ldx, const uint16_t *gate_up,
                        const uint16_t *down, float *y, int64_t ldy, int64_t rows,
                        int64_t hidden, int64_t inter, int threads) {
    if (bad(rows, hidden, hidden, ldx, ldy) || inter < TILE || inter % TILE) return -1;
    if (!amx_permitted()) return -3;
#if BD_AMX
    if (!mlp_exp16) return -4;
    const int64_t kp = (hidden + KB - 1) / KB * KB, rows_pad = (rows + TILE - 1) / TILE * TILE;
    uint16_t *xa = malloc((size_t)(rows_pad * kp) * sizeof *xa);
    if (!xa) return -2;
    pack_tiles(x, NULL, ldx, rows, rows_pad, hidden, kp, xa, threads);
    const int rc = mlp_run(xa, kp, gate_up, down, y, ldy, rows, hidden, inter, threads);
    free(xa);
    return rc;
#else
    (void)x, (void)gate_up, (void)down, (void)y, (void)threads;
    return -3;
#endif
}

/* pagedkv_bf16dot_mlp from A tiles already packed (as pagedkv_bf16dot_linear_tiles). */
int pagedkv_bf16dot_mlp_tiles(const uint16_t *xa, int64_t kp, const uint16_t *gate_up,
                              const uint16_t *down, float *y, int64_t ldy, int64_t rows,
                              int64_t hidden, int64_t inter, int threads) {
    if (bad(rows, hidden, hidden, hidden, ldy) || inter < TILE || inter % TILE ||
        kp != (hidden + KB - 1) / KB * KB)
        return -1;
    if (!amx_permitted()) return -3;
#if BD_AMX
    if (!mlp_exp16) return -4;
    return mlp_run(xa, kp, gate_up, down, y, ldy, rows, hidden, inter, threads);
#else
    (void)xa, (void)gate_up, (void)down, (void)y, (void)threads;
    return -3;
#endif
}
