/* A recorded run of native kernel calls, replayed by one call from Python (step_program.py).
 *
 * A batch-1 decode step of a 30-layer model makes ~300 calls into the kernels of this
 * directory (the linear layers, the norms, RoPE with the K/V write, decode attention), each
 * one a ctypes call with its Python around it: ~1-2 us apiece. Their arguments are the same
 * from step to step (buffers allocated once per step size) but for a few words patched per
 * step (the attention's block tables). Here a segment of such calls, recorded once, runs in
 * one call.
 *
 * Each call is a pk_call: the kernel's address (taken from its own library), which prototype
 * it has (PK_*: the kernels' exact C signatures, declared below, SiLU's among them), its
 * integer and pointer arguments in order (w) and its float arguments in order (f). A call is
 * made through a pointer of exactly its kernel's type, so nothing here depends on the calling
 * convention.
 * The kernels run in order; the first that returns non-zero stops the run, and its index is
 * reported (the calls before it have run, as they would have from Python). No call is made
 * for an unknown kind (-1 at its index).
 */
#include <stdint.h>

typedef struct {
    int64_t kind;     /* PK_* */
    const void *fn;   /* the kernel */
    const int64_t *w; /* integer and pointer arguments, in order */
    const float *f;   /* float arguments, in order */
} pk_call;

enum {
    PK_Q8_PAR = 1,     /* ggml_q8act.c  pagedkv_q8_linear_f32_par */
    PK_BF16DOT,        /* bf16_dot.c    pagedkv_bf16dot_linear */
    PK_BF16DOT_GATED,  /* bf16_dot.c    pagedkv_bf16dot_linear_gated */
    PK_BF16_TILED,     /* bf16_linear.c pagedkv_bf16_tiled */
    PK_BF16_TILED_PAR, /* bf16_linear.c pagedkv_bf16_tiled_par */
    PK_GGML,           /* ggml_qlinear.c pagedkv_ggml_qlinear */
    PK_GGML_PAR,       /* ggml_qlinear.c pagedkv_ggml_qlinear_par */
    PK_I8,             /* qlinear.c     pagedkv_qlinear_i8 */
    PK_I8_PAR,         /* qlinear.c     pagedkv_qlinear_i8_par */
    PK_NORM,           /* layer_ops.c   pagedkv_rms_norm_f32 */
    PK_ADD_NORM,       /* layer_ops.c   pagedkv_add_rms_norm_f32 */
    PK_ROPE_F32,       /* layer_ops.c   pagedkv_rope_write_f32 */
    PK_ROPE_BF16,      /* layer_ops.c   pagedkv_rope_write_bf16kv */
    PK_DECODE_F32,     /* paged_decode.c pagedkv_decode_f32 */
    PK_DECODE_BF16,    /* paged_decode.c pagedkv_decode_bf16kv */
    PK_DECODE_F32_PAR, /* paged_decode.c pagedkv_decode_f32_par */
    PK_DECODE_BF16_PAR, /* paged_decode.c pagedkv_decode_bf16kv_par */
    PK_SILU,           /* layer_ops.c   pagedkv_silu_f32 */
    PK_BF16DOT_MLP     /* bf16_dot.c    pagedkv_bf16dot_mlp */
};

typedef int64_t I;
typedef const float *CF;
typedef const uint16_t *CH;
typedef const uint8_t *CB;
typedef const int64_t *CI;
typedef int (*q8_par_t)(int, int, CF, I, CB, CF, float *, I, I, I, I, int);
typedef int (*bf16dot_t)(CF, I, CH, CF, float *, I, I, I, I, int, int);
typedef int (*bf16dot_gated_t)(CF, CF, I, CH, CF, float *, I, I, I, I, int, int);
typedef int (*bf16_tiled_t)(CF, I, CH, CF, float *, I, I, I, I, I, I);
typedef int (*bf16_tiled_par_t)(CF, I, CH, CF, float *, I, I, I, I, int);
typedef int (*ggml_t)(int, CF, I, CB, CF, float *, I, I, I, I, I, I, int);
typedef int (*ggml_par_t)(int, CF, I, CB, CF, float *, I, I, I, I, int);
typedef int (*i8_t)(CF, I, const int8_t *, CF, CF, float *, I, I, I, I, I, I);
typedef int (*i8_par_t)(CF, I, const int8_t *, CF, CF, float *, I, I, I, I, int);
typedef int (*norm_t)(CF, I, CF, float *, I, I, float, I);
typedef int (*add_norm_t)(float *, CF, I, CF, float *, I, I, float, I);
typedef int (*rope_f32_t)(CF, CF, CF, CI, float *, float *, float *, I, I, I, I, I, CF, CF,
                          float, I);
typedef int (*rope_bf16_t)(CF, CF, CF, CI, float *, uint16_t *, uint16_t *, I, I, I, I, I, CF,
                           CF, float, I);
typedef int (*dec_f32_t)(CF, float *, CF, CF, CI, CI, CI, I, I, I, I, I, I, I, float);
typedef int (*dec_bf16_t)(CF, float *, CH, CH, CI, CI, CI, I, I, I, I, I, I, I, float);
typedef int (*dec_f32_par_t)(CF, float *, CF, CF, CI, CI, CI, I, I, I, I, I, I, I, float, int);
typedef int (*dec_bf16_par_t)(CF, float *, CH, CH, CI, CI, CI, I, I, I, I, I, I, I, float, int);
typedef int (*silu_t)(float *, I, CF, I, float *, I, I, I);
typedef int (*bf16dot_mlp_t)(CF, I, CH, CH, float *, I, I, I, I, int);

#define P(t, i) ((t)(intptr_t)w[i])

static int run_one(const pk_call *c) {
    const int64_t *w = c->w;
    const float *f = c->f;
    switch (c->kind) {
    case PK_Q8_PAR:
        return ((q8_par_t)c->fn)((int)w[0], (int)w[1], P(CF, 2), w[3], P(CB, 4), P(CF, 5),
                                 P(float *, 6), w[7], w[8], w[9], w[10], (int)w[11]);
    case PK_BF16DOT:
        return ((bf16dot_t)c->fn)(P(CF, 0), w[1], P(CH, 2), P(CF, 3), P(float *, 4), w[5],
                                  w[6], w[7], w[8], (int)w[9], (int)w[10]);
    case PK_BF16DOT_GATED:
        return ((bf16dot_gated_t)c->fn)(P(CF, 0), P(CF, 1), w[2], P(CH, 3), P(CF, 4),
                                        P(float *, 5), w[6], w[7], w[8], w[9], (int)w[10],
                                        (int)w[11]);
    case PK_BF16_TILED:
        return ((bf16_tiled_t)c->fn)(P(CF, 0), w[1], P(CH, 2), P(CF, 3), P(float *, 4), w[5],
                                     w[6], w[7], w[8], w[9], w[10]);
    case PK_BF16_TILED_PAR:
        return ((bf16_tiled_par_t)c->fn)(P(CF, 0), w[1], P(CH, 2), P(CF, 3), P(float *, 4),
                                         w[5], w[6], w[7], w[8], (int)w[9]);
    case PK_GGML:
        return ((ggml_t)c->fn)((int)w[0], P(CF, 1), w[2], P(CB, 3), P(CF, 4), P(float *, 5),
                               w[6], w[7], w[8], w[9], w[10], w[11], (int)w[12]);
    case PK_GGML_PAR:
        return ((ggml_par_t)c->fn)((int)w[0], P(CF, 1), w[2], P(CB, 3), P(CF, 4),
                                   P(float *, 5), w[6], w[7], w[8], w[9], (int)w[10]);
    case PK_I8:
        return ((i8_t)c->fn)(P(CF, 0), w[1], P(const int8_t *, 2), P(CF, 3), P(CF, 4),
                             P(float *, 5), w[6], w[7], w[8], w[9], w[10], w[11]);
    case PK_I8_PAR:
        return ((i8_par_t)c->fn)(P(CF, 0), w[1], P(const int8_t *, 2), P(CF, 3), P(CF, 4),
                                 P(float *, 5), w[6], w[7], w[8], w[9], (int)w[10]);
    case PK_NORM:
        return ((norm_t)c->fn)(P(CF, 0), w[1], P(CF, 2), P(float *, 3), w[4], w[5], f[0], w[6]);
    case PK_ADD_NORM:
        return ((add_norm_t)c->fn)(P(float *, 0), P(CF, 1), w[2], P(CF, 3), P(float *, 4), w[5],
                                   w[6], f[0], w[7]);
    case PK_ROPE_F32:
        return ((rope_f32_t)c->fn)(P(CF, 0), P(CF, 1), P(CF, 2), P(CI, 3), P(float *, 4),
                                   P(float *, 5), P(float *, 6), w[7], w[8], w[9], w[10], w[11],
                                   P(CF, 12), P(CF, 13), f[0], w[14]);
    case PK_ROPE_BF16:
        return ((rope_bf16_t)c->fn)(P(CF, 0), P(CF, 1), P(CF, 2), P(CI, 3), P(float *, 4),
                                    P(uint16_t *, 5), P(uint16_t *, 6), w[7], w[8], w[9], w[10],
                                    w[11], P(CF, 12), P(CF, 13), f[0], w[14]);
    case PK_DECODE_F32:
        return ((dec_f32_t)c->fn)(P(CF, 0), P(float *, 1), P(CF, 2), P(CF, 3), P(CI, 4),
                                  P(CI, 5), P(CI, 6), w[7], w[8], w[9], w[10], w[11], w[12],
                                  w[13], f[0]);
    case PK_DECODE_BF16:
        return ((dec_bf16_t)c->fn)(P(CF, 0), P(float *, 1), P(CH, 2), P(CH, 3), P(CI, 4),
                                   P(CI, 5), P(CI, 6), w[7], w[8], w[9], w[10], w[11], w[12],
                                   w[13], f[0]);
    case PK_DECODE_F32_PAR:
        return ((dec_f32_par_t)c->fn)(P(CF, 0), P(float *, 1), P(CF, 2), P(CF, 3), P(CI, 4),
                                      P(CI, 5), P(CI, 6), w[7], w[8], w[9], w[10], w[11],
                                      w[12], w[13], f[0], (int)w[14]);
    case PK_DECODE_BF16_PAR:
        return ((dec_bf16_par_t)c->fn)(P(CF, 0), P(float *, 1), P(CH, 2), P(CH, 3), P(CI, 4),
                                       P(CI, 5), P(CI, 6), w[7], w[8], w[9], w[10], w[11],
                                       w[12], w[13], f[0], (int)w[14]);
    case PK_SILU:
        return ((silu_t)c->fn)(P(float *, 0), w[1], P(CF, 2), w[3], P(float *, 4), w[5], w[6],
                               w[7]);
    case PK_BF16DOT_MLP:
        return ((bf16dot_mlp_t)c->fn)(P(CF, 0), w[1], P(CH, 2), P(CH, 3), P(float *, 4), w[5],
                                      w[6], w[7], w[8], (int)w[9]);
    default:
        return -1;
    }
}

/* The number of integer/pointer and float arguments of kind `kind` (-1: unknown), so the
 * Python side checks each recorded call against the prototype it will be made through. */
int pagedkv_program_arity(int64_t kind, int64_t *num_words, int64_t *num_floats) {
    static const int64_t words[] = {0, 12, 11, 12, 11, 10, 13, 11, 12, 11, 7, 8, 15, 15, 14,
                                    14, 15, 15, 8, 10};
    static const int64_t floats[] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0};
    if (kind < PK_Q8_PAR || kind > PK_BF16DOT_MLP) return -1;
    *num_words = words[kind];
    *num_floats = floats[kind];
    return 0;
}

/* Run calls[0 .. n) in order. Returns 0, or the first non-zero result; then *failed is the
 * index of the call that returned it (the calls after it are not made). */
int pagedkv_run_program(const pk_call *calls, int64_t n, int64_t *failed) {
    for (int64_t i = 0; i < n; i++) {
        const int rc = run_one(calls + i);
        if (rc) {
            *failed = i;
            return rc;
        }
    }
    return 0;
}
