/* The argument checks both prompt kernels make before any work (prompt_attention.c,
 * prompt_attention_f32.c). Plain C: they run on builds without either kernel too, so a bad
 * call answers -1 (bad arguments) there rather than -3 (not built). */
#ifndef PAGEDKV_PROMPT_ARGS_H
#define PAGEDKV_PROMPT_ARGS_H

#include <stdint.h>

#define MAX_D 256 /* the largest head_dim */

/* The first position a chunk from pos0 reads: its first row's window start (0 without one). */
static inline int64_t window_start(int64_t pos0, int64_t window) {
    return window > 0 && pos0 + 1 > window ? pos0 + 1 - window : 0;
}

/* 0 when the arguments both kernels share are valid (head_dim a multiple of head_align, at
 * most MAX_D) and the table's entries from the chunk's first window through its last
 * position are block ids below num_blocks; -1 otherwise. */
static inline int prompt_args(int64_t n, int64_t pos0, int64_t window, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t head_align,
                              int64_t ldq, int64_t ldo, const int64_t *table,
                              int64_t num_blocks, int64_t block_size) {
    if (n < 1 || pos0 < 0 || window < 0 || num_kv_heads < 1 || num_heads % num_kv_heads ||
        head_dim % head_align || head_dim > MAX_D || block_size < 1 ||
        ldq < num_heads * head_dim || ldo < num_heads * head_dim)
        return -1;
    const int64_t last = (pos0 + n + block_size - 1) / block_size;
    for (int64_t b = window_start(pos0, window) / block_size; b < last; b++)
        if (table[b] < 0 || table[b] >= num_blocks) return -1;
    return 0;
}

#endif
