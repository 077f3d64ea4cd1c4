/* What the AMX kernels (bf16_dot.c, prompt_attention.c) share: the tile configuration's
 * layout, the OS permission for the tile data, and the bf16 rounding of their inputs.
 * Included only where AMX-BF16 is compiled in (__AMX_TILE__, __AMX_BF16__, Linux). */
#ifndef PAGEDKV_AMX_H
#define PAGEDKV_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* LDTILECFG's 64-byte operand (palette 1): rows and bytes per row of tiles 0-7. */
typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

static int amx_state = -1; /* -1 unknown, 0 refused, 1 permitted */

/* 1 once the kernel grants this process the tile data (asked once; idempotent). */
static int amx_permitted(void) {
    if (amx_state < 0) {
        unsigned long mask = 0;
        int ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 &&
                 syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &mask) == 0 &&
                 ((mask >> XFEATURE_XTILEDATA) & 1);
        amx_state = ok;
    }
    return amx_state;
}

#endif
