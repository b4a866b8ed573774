/* Fused CPU kernels for the small, per-layer steps of decoding, where torch's cost is the
 * number of ops (each a dispatch, an allocation and an OpenMP fork) rather than the work:
 *
 * - specray_rms_norm: y = w * (x / sqrt(mean(x^2) + eps)), float32, one row at a time.
 * - specray_paged_attention: attention of each sequence's queries to its cached keys read
 *   in place from the paged pool (no gather, no copies), GQA by indexing the kv head,
 *   causal or not, with a one-pass (online) softmax in float32.
 * - specray_rope_store_kv: RoPE of q and k and the store of k and v into the pool.
 *
 * Each output is computed by one thread in a fixed order, so results do not depend on the
 * thread count (ranks computing the same thing agree bit for bit).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define MAX_HEAD_DIM 512 /* one head's accumulator lives on the stack */

int specray_max_head_dim(void) { return MAX_HEAD_DIM; }

/* sum of a[i] * b[i] over n floats: 16 lane sums, then the lanes, then the tail */
static inline float dot(const float *a, const float *b, int64_t n) {
    vec acc = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) acc += load(a + i) * load(b + i);
    float s = lane_sum(acc);
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

void specray_rms_norm(const float *x, const float *weight, float *y, int64_t rows, int64_t dim, float eps) {
    #pragma omp parallel for schedule(static) if (rows > 8)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        float inv = 1.0f / sqrtf(dot(xr, xr, dim) / (float)dim + eps);
        for (int64_t i = 0; i < dim; ++i) yr[i] = weight[i] * (xr[i] * inv);
    }
}

/* q, out: [N, heads, dim]; pool layer: [num_blocks, 2, kv_heads, block_size, dim];
 * block_tables: [S, width]; seq i has query_lens[i] rows starting at row q_starts[i], and
 * context_lens[i] keys; query j of it sits at position context_lens[i] - query_lens[i] + j
 * and, when causal, sees keys up to that position (else all context_lens[i] keys). */
void specray_paged_attention(const float *q, const float *pool, const int64_t *block_tables, int64_t width,
                             const int64_t *context_lens, const int64_t *query_lens, const int64_t *q_starts,
                             int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t block_size, int64_t dim,
                             float scale, int causal, float *out) {
    const int64_t group = heads / kv_heads;
    const int64_t page = 2 * kv_heads * block_size * dim; /* floats per block */
    #pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; ++s) {
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t kvh = h / group, ctx = context_lens[s], n = query_lens[s];
            const int64_t *table = block_tables + s * width;
            float acc[MAX_HEAD_DIM]; /* the caller checks dim <= MAX_HEAD_DIM */
            for (int64_t j = 0; j < n; ++j) {
                const float *qv = q + ((q_starts[s] + j) * heads + h) * dim;
                const int64_t visible = causal ? ctx - n + j + 1 : ctx;
                float max = -INFINITY, sum = 0.0f;
                for (int64_t d = 0; d < dim; ++d) acc[d] = 0.0f;
                for (int64_t t = 0; t < visible; ++t) {
                    const float *base = pool + table[t / block_size] * page + (kvh * block_size + t % block_size) * dim;
                    const float *k = base, *v = base + kv_heads * block_size * dim;
                    float score = dot(qv, k, dim) * scale;
                    if (score > max) { /* rescale what was summed under the old max */
                        float c = expf(max - score);
                        sum *= c;
                        for (int64_t d = 0; d < dim; ++d) acc[d] *= c;
                        max = score;
                    }
                    float p = expf(score - max);
                    sum += p;
                    for (int64_t d = 0; d < dim; ++d) acc[d] += p * v[d];
                }
                float *o = out + ((q_starts[s] + j) * heads + h) * dim;
                for (int64_t d = 0; d < dim; ++d) o[d] = acc[d] / sum;
            }
        }
    }
}

/* RoPE (rotate-half convention) of q and k, and the store of k and v into the pool, in one
 * pass over a fused qkv projection row [q heads | k heads | v heads] x dim per token.
 * out = x * cos + rotate_half(x) * sin, with the product and the sum rounded separately as
 * torch (and transformers) compute it: no fused multiply-add here. */
__attribute__((optimize("fp-contract=off")))
void specray_rope_store_kv(const float *qkv, const float *cos, const float *sin, int64_t rows, int64_t heads,
                           int64_t kv_heads, int64_t dim, float *q_out, float *k_out, float *pool,
                           const int64_t *slots, int64_t block_size) {
    const int64_t half = dim / 2, row_size = (heads + 2 * kv_heads) * dim;
    const int64_t page = 2 * kv_heads * block_size * dim;
    for (int64_t r = 0; r < rows; ++r) {
        const float *x = qkv + r * row_size, *c = cos + r * dim, *s = sin + r * dim;
        const int64_t block = slots[r] / block_size, offset = slots[r] % block_size;
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
            const float *xh = x + h * dim;
            float *o = h < heads ? q_out + (r * heads + h) * dim : k_out + (r * kv_heads + h - heads) * dim;
            for (int64_t i = 0; i < half; ++i) {
                float a = xh[i] * c[i], b = -xh[i + half] * s[i];
                o[i] = a + b;
            }
            for (int64_t i = half; i < dim; ++i) {
                float a = xh[i] * c[i], b = xh[i - half] * s[i];
                o[i] = a + b;
            }
            if (h >= heads) { /* k: into the pool next to its v */
                const int64_t kvh = h - heads;
                float *dst = pool + block * page + (kvh * block_size + offset) * dim;
                memcpy(dst, o, dim * sizeof(float));
                memcpy(dst + kv_heads * block_size * dim, x + (heads + kv_heads + kvh) * dim, dim * sizeof(float));
            }
        }
    }
}
