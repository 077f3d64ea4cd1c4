/* bf16 A tiles: the activation layout of the AMX linear kernels (bf16_dot.c), shared with the
 * layer ops that write it directly (layer_ops.c's norm), so that both round and place a
 * value the same way.
 *
 * Layout: xa[ceil(rows / 16)][kp / 32][16][32] bf16 for rows of `in` values, kp = in rounded up
 * to 32: row r, k at XA(xa, kp, r, k), each 16 x 32 tile one contiguous KiB (one tile load).
 * Padding (k in [in, kp), rows up to a multiple of 16) is zero.
 *
 * Rounding (to_bf16): round to nearest even; a NaN stays a NaN (quieted); a result below bf16's
 * smallest normal becomes a signed zero (AMX reads subnormal inputs as zero anyway). */
#ifndef PAGEDKV_BF16_TILES_H
#define PAGEDKV_BF16_TILES_H

#include <stdint.h>
#include <string.h>

#define XA(xa, kp, r, k) \
    (xa)[((r) / 16 * ((kp) / 32) + (k) / 32) * 512 + (r) % 16 * 32 + (k) % 32]

static inline uint16_t to_bf16(float f) { /* branch-free, so the packing loops vectorize */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    uint32_t r = u + 0x7fffu + ((u >> 16) & 1u);
    r = (r & 0x7f800000u) ? r : (r & 0x80000000u); /* below the smallest normal: signed 0 */
    return (uint16_t)(nan ? ((u >> 16) | 0x40u) : (r >> 16));
}

/* Row r of xa = src[0 .. in) rounded, zeros from in to kp (src NULL: all zeros). */
static inline void xa_put_row(uint16_t *xa, int64_t kp, int64_t r, const float *src,
                              int64_t in) {
    for (int64_t k0 = 0; k0 < kp; k0 += 32) {
        uint16_t *dst = &XA(xa, kp, r, k0);
        if (src && k0 + 32 <= in) {
            for (int k = 0; k < 32; k++) dst[k] = to_bf16(src[k0 + k]);
        } else {
            for (int k = 0; k < 32; k++) dst[k] = src && k0 + k < in ? to_bf16(src[k0 + k]) : 0;
        }
    }
}

#ifdef __AVX512F__
#include <immintrin.h>

/* to_bf16 of 16 lanes (the same function: nearest even, a NaN quieted, a result below the
 * smallest normal a signed zero), as 16 bf16 values. */
static inline __m256i to_bf16_16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f), e = _mm512_set1_epi32(0x7f800000);
    const __mmask16 nan =
        _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), e);
    __m512i r = _mm512_add_epi32(
        u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                            _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    const __mmask16 tiny = _mm512_testn_epi32_mask(r, e);
    r = _mm512_mask_and_epi32(r, tiny, r, _mm512_set1_epi32((int)0x80000000u));
    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

#endif

#endif
