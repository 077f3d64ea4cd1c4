/* IEEE half -> float, exact (subnormals, inf, nan included): the portable kernels' scale
 * conversion, the same value F16C's vcvtph2ps gives. Shared by ggml_qlinear.c and ggml_q8act.c
 * (native_build keys a library's cache entry on the headers next to its source too). */
#ifndef PAGEDKV_GGML_F16_H
#define PAGEDKV_GGML_F16_H
#include <stdint.h>
#include <string.h>

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif
