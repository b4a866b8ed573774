/* Fused CPU kernels for the small, per-layer steps of decoding, where torch's cost is the
 * number of ops (each a dispatch, an allocation and an OpenMP fork) rather than the work:
 *
 * - specray_rms_norm: y = w * (x / sqrt(mean(x^2) + eps)), float32, one row at a time.
 * - specray_paged_attention: attention of each sequence's queries to its cached keys read
 *   in place from the paged pool (no gather, no copies), GQA by indexing the kv head,
 *   causal or not, with an online softmax in float32 updated once per tile of 16 keys;
 *   ``_extra``: the same, non-causal, with more keys per sequence outside the pool.
 * - specray_rope_store_kv: RoPE of q and k and the store of k and v into the pool (or none).
 * - specray_rms_norm_heads: Qwen3's per-head q/k norm, in place in a fused projection.
 * - specray_argmax_rows: torch.argmax's index per row (greedy sampling and verification).
 *
 * Each output is computed by one thread in a fixed order, so results do not depend on the
 * thread count (ranks computing the same thing agree bit for bit).
 */
#include <math.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
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

static inline void rms_norm_row(const float *x, const float *weight, float *y, int64_t dim, float eps) {
    float inv = 1.0f / sqrtf(dot(x, x, dim) / (float)dim + eps);
    for (int64_t i = 0; i < dim; ++i) y[i] = weight[i] * (x[i] * inv);
}

void specray_rms_norm(const float *x, const float *weight, float *y, int64_t rows, int64_t dim, float eps) {
    #pragma omp parallel for schedule(static) if (rows > 8)
    for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * dim, weight, y + r * dim, dim, eps);
}

/* In place, heads first .. first + count - 1 of every row of x [rows, heads_per_row, dim]:
 * a per-head RMSNorm (Qwen3's q_norm / k_norm) on a fused projection, as specray_rms_norm. */
void specray_rms_norm_heads(float *x, const float *weight, int64_t rows, int64_t heads_per_row, int64_t first,
                            int64_t count, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = first; h < first + count; ++h) {
            float *xh = x + (r * heads_per_row + h) * dim;
            rms_norm_row(xh, weight, xh, dim, eps);
        }
}

#define KEY_TILE LANES /* keys scored before one softmax update: one vector of scores */
_Static_assert(LANES == 16, "tile_scores' reduction tree and lane_max are written for 16 lanes");
#define QUERY_BLOCK 16  /* queries of one kv head that share each loaded key tile */

typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

static inline vec blend(ivec mask, vec yes, vec no) { /* C has no vector ?: */
    return (vec)(((ivec)yes & mask) | ((ivec)no & ~mask));
}

/* exp of every lane, for x <= 0 (scores minus their maximum): 2^k * e^r with
 * r = x - k ln 2 in [-ln2/2, ln2/2] and a degree-6 polynomial for e^r (relative error
 * ~2e-7). Inputs below -87 give ~1e-38 instead of 0: negligible next to the maximum's 1. */
static inline vec exp_nonpositive(vec x) {
    const vec lo = x - x - 87.0f;
    x = blend(x < lo, lo, x);
    const vec shifter = x - x + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    vec k = (x * 1.44269504f + shifter) - shifter;
    vec r = x - k * 0.693359375f + k * 2.12194440e-4f; /* ln 2 = 0.693359375 - 2.12194440e-4 */
    vec p = r * (1.0f / 720) + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    ivec bits = (__builtin_convertvector(k, ivec) + 127) << 23;
    vec scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* SiLU(gate) * up over rows of a fused [gate | up] projection (inter floats each half):
 * act[r, i] = g / (1 + e^-g) * u, 16 at a time with exp_nonpositive's polynomial (e^-g
 * clamped to [e^-87, e^88]; the few floats past a multiple of 16 in a padded vector), so
 * every element goes through the same arithmetic whatever its row, the row count and the
 * thread count. Within a few float32 ulps of torch's silu (tests/test_fused_decode.py). */
static inline vec silu_mul(vec g, vec u) {
    vec e = -g;
    const vec hi = e - e + 88.0f;
    e = exp_nonpositive(blend(e > hi, hi, e)); /* valid up to 88 (2^127) as well */
    return g / (1.0f + e) * u;
}

void specray_silu_mul(const float *gate_up, float *act, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *a = act + r * inter;
        int64_t i = 0;
        for (; i + LANES <= inter; i += LANES) store(a + i, silu_mul(load(g + i), load(u + i)));
        if (i < inter) { /* the tail, padded with zeros */
            vec gv = {0}, uv = {0};
            memcpy(&gv, g + i, (inter - i) * sizeof(float));
            memcpy(&uv, u + i, (inter - i) * sizeof(float));
            const vec out = silu_mul(gv, uv);
            memcpy(a + i, &out, (inter - i) * sizeof(float));
        }
    }
}

/* Halve every group of lanes of a and of b (group = 16 >> level lanes, adding its two
 * halves) and place a's halved groups before b's: four levels turn 16 vectors of partial
 * sums into one vector of their 16 totals, in order. */
#define HALVE(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__))
static inline vec combine1(vec a, vec b) {
    return HALVE(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           HALVE(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
static inline vec combine2(vec a, vec b) {
    return HALVE(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           HALVE(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
static inline vec combine3(vec a, vec b) {
    return HALVE(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           HALVE(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
static inline vec combine4(vec a, vec b) {
    return HALVE(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           HALVE(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* The scores q.k of KEY_TILE keys as one vector: one running sum per key, the query's
 * chunk of LANES floats loaded once for all of them, then the 16 sums reduced together. */
static inline vec tile_scores(const float *qv, const float *const *keys, int64_t dim) {
    vec part[KEY_TILE];
    if (dim % LANES) { /* odd head sizes: one dot product per key */
        for (int t = 0; t < KEY_TILE; ++t) part[t] = (vec){dot(qv, keys[t], dim)};
    } else {
        for (int t = 0; t < KEY_TILE; ++t) part[t] = (vec){0};
        for (int64_t d = 0; d < dim; d += LANES) {
            const vec qd = load(qv + d);
            for (int t = 0; t < KEY_TILE; ++t) part[t] += qd * load(keys[t] + d);
        }
    }
    vec l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; ++i) l1[i] = combine1(part[2 * i], part[2 * i + 1]);
    for (int i = 0; i < 4; ++i) l2[i] = combine2(l1[2 * i], l1[2 * i + 1]);
    for (int i = 0; i < 2; ++i) l3[i] = combine3(l2[2 * i], l2[2 * i + 1]);
    return combine4(l3[0], l3[1]);
}

static inline vec vmax(vec a, vec b) { return blend(a > b, a, b); }

static inline float lane_max(vec v) {
    v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

/* One query's online softmax over the first ``count`` keys of a tile: score the whole tile
 * as one vector (the caller pads the key pointers to KEY_TILE; lanes past count are
 * masked), rescale what was summed under the old maximum once per tile (not once per key),
 * then add the weighted values, the accumulator held in registers across the tile. */
static inline void attend_tile(const float *qv, const float *const *keys, const float *const *values,
                               int64_t count, int64_t dim, float scale, float *max, float *sum, float *acc) {
    static const vec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const ivec valid = lane < (float)count;
    const vec scores = blend(valid, tile_scores(qv, keys, dim) * scale, lane - INFINITY);
    const float tile_max = lane_max(scores);
    if (tile_max > *max) {
        const float c = expf(*max - tile_max); /* 0 on the first tile: max is -inf */
        *sum *= c;
        for (int64_t d = 0; d < dim; ++d) acc[d] *= c;
        *max = tile_max;
    }
    const vec p = blend(valid, exp_nonpositive(scores - *max), lane - lane); /* masked keys weigh 0 */
    *sum += lane_sum(p);
    if (dim % LANES) {
        for (int t = 0; t < KEY_TILE; ++t)
            for (int64_t d = 0; d < dim; ++d) acc[d] += p[t] * values[t][d];
        return;
    }
    for (int64_t d = 0; d < dim; d += LANES) {
        vec a = load(acc + d);
        for (int t = 0; t < KEY_TILE; ++t) a += p[t] * load(values[t] + d);
        store(acc + d, a);
    }
}

/* q, out: [N, heads, dim]; pool layer: [num_blocks, 2, kv_heads, block_size, dim];
 * block_tables: [S, width]; seq i has query_lens[i] rows starting at row q_starts[i], and
 * context_lens[i] keys; query j of it sits at position context_lens[i] - query_lens[i] + j
 * and, when causal, sees keys up to that position (else all context_lens[i] keys).
 *
 * One work item is one block of the queries of a (sequence, kv head) (every row times the
 * heads of the GQA group), which walks the keys in tiles of KEY_TILE tokens, so each key and
 * value is loaded from memory once per block of queries and then read from L1. Blocks hold
 * QUERY_BLOCK queries, fewer where there would be fewer than two items a thread (a single
 * sequence's verify rows over SmolLM2's 3 kv heads: 3 items on 2 threads, one thread doing
 * two of them). A query's sums do not depend on the others in its block (lanes past what it
 * sees weigh 0), so neither do its bits. */
static int64_t queries_per_block(const int64_t *query_lens, int64_t num_seqs, int64_t kv_heads, int64_t group) {
    int64_t most = 0;
    for (int64_t s = 0; s < num_seqs; ++s) most = query_lens[s] * group > most ? query_lens[s] * group : most;
    const int64_t items = num_seqs * kv_heads, wanted = 2 * (int64_t)omp_get_max_threads();
    if (items >= wanted || most <= 1) return QUERY_BLOCK;
    const int64_t splits = (wanted + items - 1) / items, size = (most + splits - 1) / splits;
    return size < QUERY_BLOCK ? size : QUERY_BLOCK;
}

/* specray_paged_attention with extra_n more keys per sequence after its context, read from
 * extra_k / extra_v ([S * extra_n, kv_heads, dim], contiguous) instead of the pool: DFlash's
 * query block, whose own K/V are computed in the step and never stored. Not causal: every
 * query sees its context_lens[s] pool keys, then all extra_n keys (extra_n = 0: the pool only). */
void specray_paged_attention_extra(const float *q, const float *pool, const int64_t *block_tables, int64_t width,
                                   const int64_t *context_lens, const int64_t *query_lens, const int64_t *q_starts,
                                   int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t block_size,
                                   int64_t dim, float scale, int causal, const float *extra_k,
                                   const float *extra_v, int64_t extra_n, float *out) {
    const int64_t group = heads / kv_heads;
    const int64_t page = 2 * kv_heads * block_size * dim; /* floats per block */
    const int64_t v_offset = kv_heads * block_size * dim;
    const int64_t block = queries_per_block(query_lens, num_seqs, kv_heads, group);
    int64_t num_blocks = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t b = (query_lens[s] * group + block - 1) / block;
        num_blocks = b > num_blocks ? b : num_blocks;
    }
    /* kv heads innermost: threads taking consecutive items read different kv heads' keys. A
     * decode step reads the cache from memory (the weights streamed since the last step evicted
     * it); two threads on the two query blocks of one kv head missed on the same lines at once:
     * SmolLM2's 30 layers at 384 cached tokens took 2.38 ms that way, 1.88 ms this way (same bits;
     * 16:20 UTC 2026-12-06, pools cycled beyond L3). Prefetching tiles ahead did not help. */
    #pragma omp parallel for collapse(3) schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; ++s) {
        for (int64_t b = 0; b < num_blocks; ++b) {
            for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
                const int64_t ctx = context_lens[s], n = query_lens[s], num_queries = n * group;
                const int64_t *table = block_tables + s * width;
                const int64_t first = b * block;
                if (first >= num_queries) continue;
                const int64_t count = min64(block, num_queries - first);
                const float *qs[QUERY_BLOCK];
                float *outs[QUERY_BLOCK], max[QUERY_BLOCK], sum[QUERY_BLOCK];
                float acc[QUERY_BLOCK][MAX_HEAD_DIM]; /* the caller checks dim <= MAX_HEAD_DIM */
                int64_t visible[QUERY_BLOCK], limit = 0;
                for (int64_t i = 0; i < count; ++i) {
                    const int64_t j = (first + i) / group, h = kvh * group + (first + i) % group;
                    const int64_t row = ((q_starts[s] + j) * heads + h) * dim;
                    qs[i] = q + row;
                    outs[i] = out + row;
                    visible[i] = causal ? ctx - n + j + 1 : ctx + extra_n;
                    limit = visible[i] > limit ? visible[i] : limit;
                    max[i] = -INFINITY;
                    sum[i] = 0.0f;
                    for (int64_t d = 0; d < dim; ++d) acc[i][d] = 0.0f;
                }
                for (int64_t t0 = 0; t0 < limit; t0 += KEY_TILE) {
                    const int64_t tile = min64(KEY_TILE, limit - t0);
                    const float *keys[KEY_TILE], *values[KEY_TILE];
                    for (int64_t t = 0; t < KEY_TILE; ++t) { /* past the keys: the tile's first again, weighed 0 */
                        const int64_t pos = t < tile ? t0 + t : t0;
                        if (pos < ctx) {
                            keys[t] = pool + table[pos / block_size] * page + (kvh * block_size + pos % block_size) * dim;
                            values[t] = keys[t] + v_offset;
                        } else { /* an extra key: row pos - ctx of this sequence's */
                            const int64_t row = ((s * extra_n + pos - ctx) * kv_heads + kvh) * dim;
                            keys[t] = extra_k + row;
                            values[t] = extra_v + row;
                        }
                    }
                    for (int64_t i = 0; i < count; ++i) {
                        const int64_t seen = min64(tile, visible[i] - t0); /* causal: a prefix of the tile */
                        if (seen > 0) attend_tile(qs[i], keys, values, seen, dim, scale, &max[i], &sum[i], acc[i]);
                    }
                }
                for (int64_t i = 0; i < count; ++i)
                    for (int64_t d = 0; d < dim; ++d) outs[i][d] = acc[i][d] / sum[i];
            }
        }
    }
}

void specray_paged_attention(const float *q, const float *pool, const int64_t *block_tables, int64_t width,
                             const int64_t *context_lens, const int64_t *query_lens, const int64_t *q_starts,
                             int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t block_size, int64_t dim,
                             float scale, int causal, float *out) {
    specray_paged_attention_extra(q, pool, block_tables, width, context_lens, query_lens, q_starts, num_seqs, heads,
                                  kv_heads, block_size, dim, scale, causal, NULL, NULL, 0, out);
}

/* RoPE (rotate-half convention) of q and k, and the store of k and v into the pool, in one
 * pass over a fused qkv projection row [q heads | k heads | v heads] x dim per token. cos and
 * sin hold one row per token, or with positions the whole tables, row positions[r] for token r
 * (the fused layers: no gather of the step's rows before the call).
 * out = x * cos + rotate_half(x) * sin, with the product and the sum rounded separately as
 * torch (and transformers) compute it: no fused multiply-add here. */
__attribute__((optimize("fp-contract=off")))
void specray_rope_store_kv(const float *qkv, const float *cos, const float *sin, const int64_t *positions,
                           int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, float *q_out, float *k_out,
                           float *pool, const int64_t *slots, int64_t block_size) {
    const int64_t half = dim / 2, row_size = (heads + 2 * kv_heads) * dim;
    const int64_t page = 2 * kv_heads * block_size * dim;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = positions ? positions[r] : r;
        const float *x = qkv + r * row_size, *c = cos + at * dim, *s = sin + at * dim;
        const int64_t block = pool ? slots[r] / block_size : 0, offset = pool ? slots[r] % block_size : 0;
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
            if (h >= heads && pool) { /* k: into the pool next to its v (no pool: q and k only) */
                const int64_t kvh = h - heads;
                float *dst = pool + block * page + (kvh * block_size + offset) * dim;
                memcpy(dst, o, dim * sizeof(float));
                memcpy(dst + kv_heads * block_size * dim, x + (heads + kv_heads + kvh) * dim, dim * sizeof(float));
            }
        }
    }
}

/* The index of each row's maximum, as torch.argmax gives it: the first of equal maxima (-0.0
 * and +0.0 are equal), and the first NaN where a row has one (torch ranks NaN above every
 * number). 16 lanes keep their own first maximum (a strictly greater value replaces it), then
 * the lanes' best, ties to the smaller index. torch's CPU argmax took ~48 us over SmolLM2's
 * 49152 logits, on one thread or two (12-07 02:40); this one reads them once. */
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t i = 0, best = 0;
    float best_value = x[0];
#if defined(__AVX512F__)
    if (n >= LANES && n <= INT32_MAX) {
        __m512 value = _mm512_loadu_ps(x);
        __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), at = index;
        __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
        for (i = LANES; i + LANES <= n; i += LANES) {
            const __m512 v = _mm512_loadu_ps(x + i);
            const __mmask16 greater = _mm512_cmp_ps_mask(v, value, _CMP_GT_OQ);
            at = _mm512_add_epi32(at, _mm512_set1_epi32(LANES));
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            value = _mm512_mask_mov_ps(value, greater, v);
            index = _mm512_mask_mov_epi32(index, greater, at);
        }
        if (nan)
            for (int64_t j = 0;; ++j)
                if (x[j] != x[j]) return j;
        float values[LANES];
        int32_t indices[LANES];
        _mm512_storeu_ps(values, value);
        _mm512_storeu_si512(indices, index);
        best_value = values[0], best = indices[0];
        for (int l = 1; l < LANES; ++l)
            if (values[l] > best_value || (values[l] == best_value && indices[l] < best))
                best_value = values[l], best = indices[l];
    }
#endif
    for (; i < n; ++i) { /* the tail (or every value): no NaN before i */
        if (x[i] != x[i]) return i;
        if (x[i] > best_value) best_value = x[i], best = i;
    }
    return best;
}

void specray_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * n, n);
}
