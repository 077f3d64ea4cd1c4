/* Decode attention straight from pagedkv's paged, head-major KV pool.
 *
 * One query token per sequence; grouped-query attention (each KV head serves `group`
 * consecutive query heads). For every (sequence, KV head) the kernel walks the sequence's
 * block table once, reading each 16-row K and V block of that head from the pool a single
 * time for all the group's queries, with an online (per-block) softmax. Nothing is gathered:
 * torch's path copies the blocks into a padded batch first and SDPA reads that copy again.
 *
 * Layouts (float32, contiguous):
 *   q, out     [num_seqs, num_heads, head_dim]
 *   k_pool     [num_kv_heads, num_blocks, block_size, head_dim]   (v_pool the same)
 *   tables     [num_seqs, table_stride] block ids; row s holds ceil(lens[s] / block_size) ids
 *   lens       [num_seqs] context lengths (>= 1), the query's own position included
 *   starts     [num_seqs] or NULL: positions of the first block not attended (a sliding
 *              window that begins inside it; 0 <= starts[s] < min(lens[s], block_size)).
 *              The table then begins at the window's first block and lens counts from it.
 *
 * Returns 0, or -1 when a block id is out of range, a length is not positive or a start is
 * out of range (nothing
 * meaningful is written then; the caller raises). Compiled (not linked) with -ffast-math for
 * vectorised expf: the code never produces infinities or NaNs for finite inputs (the running
 * max starts at -FLT_MAX, not -inf).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 64
#define MAX_BLOCK 256
#define MAX_HEAD_DIM 512

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float part[16] = {0};
    int64_t x = 0;
    for (; x + 16 <= n; x += 16)
        for (int t = 0; t < 16; ++t) part[t] += a[x + t] * b[x + t];
    float sum = 0.0f;
    for (int t = 0; t < 16; ++t) sum += part[t];
    for (; x < n; ++x) sum += a[x] * b[x];
    return sum;
}

int pagedkv_decode_f32(const float *restrict q, float *restrict out,
                       const float *restrict k_pool, const float *restrict v_pool,
                       const int64_t *restrict tables, const int64_t *restrict lens,
                       const int64_t *restrict starts, int64_t num_seqs, int64_t table_stride, int64_t num_heads,
                       int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                       int64_t head_dim, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t d = head_dim;
    if (group > MAX_GROUP || block_size > MAX_BLOCK || d > MAX_HEAD_DIM) return -2;
    float scores[MAX_GROUP * MAX_BLOCK];
    float acc[MAX_GROUP * MAX_HEAD_DIM];
    float run_max[MAX_GROUP], run_sum[MAX_GROUP];
    const int64_t block_elems = block_size * d;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t len = lens[s];
        const int64_t first = starts ? starts[s] : 0;
        if (len <= 0 || first < 0 || first >= len || first >= block_size) return -1;
        const int64_t nblk = (len + block_size - 1) / block_size;
        const int64_t *table = tables + s * table_stride;
        for (int64_t b = 0; b < nblk; ++b)
            if (table[b] < 0 || table[b] >= num_blocks) return -1;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const float *qh = q + (s * num_heads + h * group) * d;
            const float *kh = k_pool + h * num_blocks * block_elems;
            const float *vh = v_pool + h * num_blocks * block_elems;
            for (int64_t i = 0; i < group; ++i) {
                run_max[i] = -FLT_MAX;
                run_sum[i] = 0.0f;
            }
            memset(acc, 0, sizeof(float) * group * d);
            for (int64_t b = 0; b < nblk; ++b) {
                const float *kb = kh + table[b] * block_elems;
                const float *vb = vh + table[b] * block_elems;
                if (b + 1 < nblk) { /* the next block is elsewhere: start fetching it */
                    const float *kn = kh + table[b + 1] * block_elems;
                    const float *vn = vh + table[b + 1] * block_elems;
                    for (int64_t off = 0; off < block_elems; off += 16) {
                        __builtin_prefetch(kn + off);
                        __builtin_prefetch(vn + off);
                    }
                }
                const int64_t n = (b + 1 < nblk) ? block_size : len - b * block_size;
                const int64_t j0 = b ? 0 : first; /* rows before the window are skipped */
                for (int64_t i = 0; i < group; ++i) {
                    const float *qi = qh + i * d;
                    float *sc = scores + i * block_size;
                    float block_max = -FLT_MAX;
                    for (int64_t j = j0; j < n; ++j) {
                        sc[j] = dot(qi, kb + j * d, d) * scale;
                        block_max = sc[j] > block_max ? sc[j] : block_max;
                    }
                    const float new_max = block_max > run_max[i] ? block_max : run_max[i];
                    const float corr = expf(run_max[i] - new_max);
                    float *ai = acc + i * d;
                    if (corr != 1.0f) {
                        run_sum[i] *= corr;
                        for (int64_t x = 0; x < d; ++x) ai[x] *= corr;
                    }
                    for (int64_t j = j0; j < n; ++j) sc[j] = expf(sc[j] - new_max);
                    for (int64_t j = j0; j < n; ++j) {
                        const float p = sc[j];
                        const float *vj = vb + j * d;
                        run_sum[i] += p;
                        for (int64_t x = 0; x < d; ++x) ai[x] += p * vj[x];
                    }
                    run_max[i] = new_max;
                }
            }
            float *oh = out + (s * num_heads + h * group) * d;
            for (int64_t i = 0; i < group; ++i) {
                const float inv = 1.0f / run_sum[i];
                for (int64_t x = 0; x < d; ++x) oh[i * d + x] = acc[i * d + x] * inv;
            }
        }
    }
    return 0;
}
