/* The decode and verify step of a dense Llama-style layer in two calls, the tensor-parallel
 * all-reduces between them staying with the caller (see fused_decode.py):
 *
 *   attention block: x += delta (+ bias)   the previous MLP's reduced output, if any
 *                    h = rms_norm(x); qkv = h Wqkv^T (+ b); RoPE; k, v into the pool;
 *                    o = paged_attention(q); out = o Wo^T        (this rank's partial sum)
 *   MLP block:       x += delta (+ bias)   the attention's reduced output (+ o_proj's bias)
 *                    h = rms_norm(x); g, u = h Wgu^T; out = (silu(g) * u) Wdown^T
 *
 * and specray_dense_layers runs every layer with both blocks in one call where there is no
 * all-reduce (a tensor-parallel group of one), specray_dense_layers_capture the same with copies
 * of the residual stream after given layers. specray_eagle3_attention_block is the attention
 * block of EAGLE-3's layer, whose q/k/v read two normed inputs side by side. The steps are the
 * kernels of small_gemm.c and decode_ops.c, called in the order the torch path runs them, on
 * scratch of this call.
 *
 * Each of the four weights has a GGML type in the layer table: 0 (F32) runs small_gemm on a
 * float32 weight, a quantized type runs quant_gemv.c on its blocks, which gives small_gemm's
 * bits on the dequantized weight, so a model kept in GGUF blocks takes this path unchanged
 * (SPECRAY_CPU_QUANT=fast marks its repacked weights' types, and quant_gemv.c hands them on).
 */
#include <stdint.h>
#include <stdlib.h>

void specray_rms_norm(const float *x, const float *weight, float *y, int64_t rows, int64_t dim, float eps);
int specray_small_gemm(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K);
int specray_quant_gemv(int ggml_type, const float *x, const uint8_t *w, const float *bias, float *y, int64_t M,
                       int64_t N, int64_t K, int threads);
void specray_rope_store_kv(const float *qkv, const float *cos, const float *sin, const int64_t *positions,
                           int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, float *q_out, float *k_out,
                           float *pool, const int64_t *slots, int64_t block_size);
void specray_silu_mul(const float *gate_up, float *act, int64_t rows, int64_t inter);
void specray_paged_attention(const float *q, const float *pool, const int64_t *block_tables, int64_t width,
                             const int64_t *context_lens, const int64_t *query_lens, const int64_t *q_starts,
                             int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t block_size, int64_t dim,
                             float scale, int causal, float *out);

/* One layer's tensors, as addresses (NULL: no such bias), then its weights' GGML types; then
 * the further parts of a fused weight whose parts have different types (llama.cpp's mixes
 * quantize v, or up, apart): QKV_N1 the rows of q/k/v's first part (0: one part, the rest
 * unused), QKV_N2 of its second, its second and third parts' addresses and types; the same
 * for gate/up's two. */
enum { INPUT_NORM, QKV_W, QKV_B, O_W, O_B, POST_NORM, GATE_UP_W, DOWN_W, POOL,
       QKV_T, O_T, GATE_UP_T, DOWN_T,
       QKV_N1, QKV_N2, QKV_W2, QKV_T2, QKV_W3, QKV_T3, GATE_UP_N1, GATE_UP_W2, GATE_UP_T2, NUM_LAYER_PTRS };
/* The step's shape. */
enum { ROWS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK_SIZE, NUM_SEQS, WIDTH, CAUSAL, NUM_SHAPE };
/* The step's metadata, as addresses: the RoPE tables cos, sin [positions, HEAD_DIM] float, row
 * POSITIONS[r] for row r; the rest int64. */
enum { COS, SIN, POSITIONS, SLOTS, BLOCK_TABLES, CONTEXT_LENS, QUERY_LENS, Q_STARTS, NUM_STEP_PTRS };

#define F(p) ((float *)(intptr_t)(p))

/* -DSPECRAY_PROFILE: seconds spent in each step of the blocks, summed over calls (for
 * benchmarks/profile_cpu_step.py; the shipped build has no timers). */
enum { P_ADD, P_NORM, P_QKV, P_ROPE, P_ATTN, P_O, P_GATE_UP, P_SILU, P_DOWN, NUM_PROFILE };
#ifdef SPECRAY_PROFILE
#include <time.h>
static double profile_s[NUM_PROFILE];
static double profile_t0;
static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
#define TICK() (profile_t0 = now_s())
#define TOCK(what) (profile_s[what] += now_s() - profile_t0, profile_t0 = now_s())
int specray_profile_read(double *out, int reset) {
    for (int i = 0; i < NUM_PROFILE; ++i) {
        out[i] = profile_s[i];
        if (reset) profile_s[i] = 0;
    }
    return NUM_PROFILE;
}
#else
#define TICK() ((void)0)
#define TOCK(what) ((void)0)
#endif

/* x W^T (+ bias) for W of GGML type `type` (0: float32); non-zero past either kernel's rows. */
static int gemm(int64_t type, const float *x, int64_t w, const float *bias, float *y, int64_t M, int64_t N,
                int64_t K) {
    if (type == 0) return specray_small_gemm(x, F(w), bias, y, M, N, K);
    return specray_quant_gemv((int)type, x, (const uint8_t *)(intptr_t)w, bias, y, M, N, K, 0);
}

/* A fused weight in up to three parts (w, t, rows): one gemm where it is one part; else each
 * part into `part` (scratch of M x N floats), then its columns of y (+ its slice of the bias). */
static int gemm_parts(const int64_t *w, const int64_t *t, const int64_t *rows, int parts, const float *x,
                      const float *bias, float *y, int64_t M, int64_t N, int64_t K, float *part) {
    if (parts == 1) return gemm(t[0], x, w[0], bias, y, M, N, K);
    int rc = 0;
    for (int i = 0, start = 0; i < parts && !rc; start += rows[i], ++i) {
        rc = gemm(t[i], x, w[i], bias ? bias + start : NULL, part, M, rows[i], K);
        for (int64_t m = 0; m < M && !rc; ++m)
            for (int64_t n = 0; n < rows[i]; ++n) y[m * N + start + n] = part[m * rows[i] + n];
    }
    return rc;
}

static int qkv_gemm(const int64_t *layer, const float *x, float *y, int64_t M, int64_t N, int64_t K, float *part) {
    const int64_t n1 = layer[QKV_N1], n2 = layer[QKV_N2];
    const int64_t w[3] = {layer[QKV_W], layer[QKV_W2], layer[QKV_W3]}, t[3] = {layer[QKV_T], layer[QKV_T2], layer[QKV_T3]};
    const int64_t rows[3] = {n1, n2, N - n1 - n2};
    return gemm_parts(w, t, n1 ? rows : &N, n1 ? 3 : 1, x, F(layer[QKV_B]), y, M, N, K, part);
}

static int gate_up_gemm(const int64_t *layer, const float *x, float *y, int64_t M, int64_t N, int64_t K, float *part) {
    const int64_t n1 = layer[GATE_UP_N1];
    const int64_t w[2] = {layer[GATE_UP_W], layer[GATE_UP_W2]}, t[2] = {layer[GATE_UP_T], layer[GATE_UP_T2]};
    const int64_t rows[2] = {n1, N - n1};
    return gemm_parts(w, t, n1 ? rows : &N, n1 ? 2 : 1, x, NULL, y, M, N, K, part);
}

/* Scratch, in floats, of attend (qkv, q, k, o and a fused q/k/v's part) and of each block (its
 * normed input first; EAGLE-3's reads 2H-wide rows and keeps one more H for the norm). One call
 * through every layer allocates the largest once, on a page boundary, and runs each block on
 * it. Blocks that took their own from malloc at every layer got whatever the heap's free lists
 * held: after an adaptive engine's start-up probe (large batches, freed) its decode steps ran
 * 5-11% slower than a plain engine's at four rows, the same kernel on the same weights, and the
 * one allocation made a plain engine's decode steps 7-14% faster at 4 and 8 rows (12-08,
 * benchmarks/ab_engines.py: docs/cpu-kernels.md "One scratch a call"). */
static int64_t attend_floats(const int64_t *shape) {
    const int64_t heads = shape[HEADS], kv = shape[KV_HEADS], dim = shape[HEAD_DIM];
    return shape[ROWS] * (2 * (heads + 2 * kv) * dim + 2 * heads * dim + kv * dim);
}
static int64_t attention_floats(const int64_t *shape) { return shape[ROWS] * shape[HIDDEN] + attend_floats(shape); }
static int64_t eagle3_attention_floats(const int64_t *shape) {
    return 3 * shape[ROWS] * shape[HIDDEN] + attend_floats(shape);
}
static int64_t mlp_floats(const int64_t *shape) { return shape[ROWS] * (shape[HIDDEN] + 5 * shape[INTER]); }

/* Scratch of n floats on a 4 KiB boundary (a fixed layout relative to the page, whatever the
 * heap held), or NULL. */
static float *scratch_of(int64_t n) {
    const size_t bytes = ((size_t)n * sizeof(float) + 4095) & ~(size_t)4095;
    return aligned_alloc(4096, bytes ? bytes : 4096);
}

static void add_delta(float *x, const float *delta, const float *bias, int64_t rows, int64_t hidden) {
    if (!delta) return;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < hidden; ++i) /* (delta + bias) first: the torch path adds the bias to the reduced sum */
            x[r * hidden + i] += bias ? delta[r * hidden + i] + bias[i] : delta[r * hidden + i];
}

/* q/k/v from the normed input h [M, K] (K: the hidden size, or EAGLE-3's 2H); RoPE; k and v
 * into the pool; paged attention; out = o Wo^T (this rank's partial sum). Returns 0, -1 when
 * scratch could not be had, -2 when the rows are past the GEMVs' limit. */
static int attend(const int64_t *layer, const int64_t *shape, const int64_t *step, float scale, const float *h,
                  int64_t K, float *out, float *work) {
    const int64_t M = shape[ROWS], H = shape[HIDDEN], heads = shape[HEADS], kv = shape[KV_HEADS];
    const int64_t dim = shape[HEAD_DIM], qkv_size = (heads + 2 * kv) * dim;
    float *qkv = work, *q = qkv + M * qkv_size, *k = q + M * heads * dim, *o = k + M * kv * dim;
    float *part = o + M * heads * dim;
    TICK();
    int rc = qkv_gemm(layer, h, qkv, M, qkv_size, K, part);
    TOCK(P_QKV);
    if (!rc) {
        float *pool = F(layer[POOL]);
        specray_rope_store_kv(qkv, F(step[COS]), F(step[SIN]), (const int64_t *)step[POSITIONS], M, heads, kv, dim,
                              q, k, pool, (const int64_t *)step[SLOTS], shape[BLOCK_SIZE]);
        TOCK(P_ROPE);
        specray_paged_attention(q, pool, (const int64_t *)step[BLOCK_TABLES], shape[WIDTH],
                                (const int64_t *)step[CONTEXT_LENS], (const int64_t *)step[QUERY_LENS],
                                (const int64_t *)step[Q_STARTS], shape[NUM_SEQS], heads, kv, shape[BLOCK_SIZE],
                                dim, scale, (int)shape[CAUSAL], o);
        TOCK(P_ATTN);
        rc = gemm(layer[O_T], o, layer[O_W], NULL, out, M, H, heads * dim);
        TOCK(P_O);
    }
    return rc ? -2 : 0;
}

static int attention_block(const int64_t *layer, const int64_t *shape, const int64_t *step, float eps, float scale,
                           float *x, const float *delta, const float *delta_bias, float *out, float *work) {
    const int64_t M = shape[ROWS], H = shape[HIDDEN];
    float *h = work;
    TICK();
    add_delta(x, delta, delta_bias, M, H);
    TOCK(P_ADD);
    specray_rms_norm(x, F(layer[INPUT_NORM]), h, M, H, eps);
    TOCK(P_NORM);
    return attend(layer, shape, step, scale, h, H, out, h + M * H);
}

/* Returns 0, -1 when scratch could not be had, -2 when the rows are past the GEMVs' limit. */
int specray_attention_block(const int64_t *layer, const int64_t *shape, const int64_t *step, float eps,
                            float scale, float *x, const float *delta, const float *delta_bias, float *out) {
    float *work = scratch_of(attention_floats(shape));
    if (!work) return -1;
    const int rc = attention_block(layer, shape, step, eps, scale, x, delta, delta_bias, out, work);
    free(work);
    return rc;
}

/* EAGLE-3's attention block (models/drafters/eagle3.py): q/k/v read the 2H-wide rows
 * [rms_norm(emb) (layer[INPUT_NORM]); rms_norm(x) (hidden_norm)], the embedding first. On
 * return x holds the layer's residual: x as given, or its norm where norm_residual (EAGLE-3's
 * norm_before_residual). Returns as specray_attention_block. */
int specray_eagle3_attention_block(const int64_t *layer, const int64_t *shape, const int64_t *step, float eps,
                                   float scale, const float *emb, const float *hidden_norm, int norm_residual,
                                   float *x, float *out) {
    const int64_t M = shape[ROWS], H = shape[HIDDEN];
    float *h = scratch_of(eagle3_attention_floats(shape));
    if (!h) return -1;
    float *normed = h + M * 2 * H;
    TICK();
    specray_rms_norm(emb, F(layer[INPUT_NORM]), normed, M, H, eps);
    for (int64_t r = 0; r < M; ++r)
        for (int64_t i = 0; i < H; ++i) h[r * 2 * H + i] = normed[r * H + i];
    specray_rms_norm(x, hidden_norm, normed, M, H, eps);
    for (int64_t r = 0; r < M; ++r)
        for (int64_t i = 0; i < H; ++i) h[r * 2 * H + H + i] = normed[r * H + i];
    if (norm_residual)
        for (int64_t i = 0; i < M * H; ++i) x[i] = normed[i];
    TOCK(P_NORM);
    const int rc = attend(layer, shape, step, scale, h, 2 * H, out, h + 3 * M * H);
    free(h);
    return rc;
}

static int mlp_block(const int64_t *layer, const int64_t *shape, float eps, float *x, const float *delta,
                     const float *delta_bias, float *out, float *work) {
    const int64_t M = shape[ROWS], H = shape[HIDDEN], I = shape[INTER];
    float *h = work, *gate_up = h + M * H, *act = gate_up + 2 * M * I, *part = act + M * I;
    TICK();
    add_delta(x, delta, delta_bias, M, H);
    TOCK(P_ADD);
    specray_rms_norm(x, F(layer[POST_NORM]), h, M, H, eps);
    TOCK(P_NORM);
    int rc = gate_up_gemm(layer, h, gate_up, M, 2 * I, H, part);
    TOCK(P_GATE_UP);
    if (!rc) {
        specray_silu_mul(gate_up, act, M, I);
        TOCK(P_SILU);
        rc = gemm(layer[DOWN_T], act, layer[DOWN_W], NULL, out, M, H, I);
        TOCK(P_DOWN);
    }
    return rc ? -2 : 0;
}

int specray_mlp_block(const int64_t *layer, const int64_t *shape, float eps, float *x, const float *delta,
                      const float *delta_bias, float *out) {
    float *work = scratch_of(mlp_floats(shape));
    if (!work) return -1;
    const int rc = mlp_block(layer, shape, eps, x, delta, delta_bias, out, work);
    free(work);
    return rc;
}

/* Every layer, both blocks, no all-reduce between them (a group of one); on return x holds
 * the residual stream after the last layer. scratch: [2, ROWS, HIDDEN] floats. With captures
 * (a drafter's features), captured[j] [ROWS, HIDDEN] gets the residual stream after layer
 * capture_at[j] (increasing), x + that layer's MLP output: the bits x holds there once the
 * next layer adds it, so one call serves a feature-conditioned drafter's step (a call per run
 * of layers between captures cost 1-2% of a SmolLM2 decode step, 12-07). */
int specray_dense_layers_capture(int64_t num_layers, const int64_t *layers, const int64_t *shape,
                                 const int64_t *step, float eps, float scale, float *x, float *scratch,
                                 int64_t num_captures, const int64_t *capture_at, float *captured) {
    const int64_t size = shape[ROWS] * shape[HIDDEN];
    const int64_t attention = attention_floats(shape), mlp_work = mlp_floats(shape);
    float *attn = scratch, *mlp = scratch + size;
    float *work = scratch_of(attention > mlp_work ? attention : mlp_work);
    if (!work) return -1;
    int64_t j = 0;
    for (int64_t l = 0; l < num_layers; ++l) {
        const int64_t *layer = layers + l * NUM_LAYER_PTRS;
        int rc = attention_block(layer, shape, step, eps, scale, x, l ? mlp : NULL, NULL, attn, work);
        if (!rc) rc = mlp_block(layer, shape, eps, x, attn, F(layer[O_B]), mlp, work);
        if (rc) {
            free(work);
            return rc;
        }
        if (j < num_captures && capture_at[j] == l) {
            float *out = captured + j++ * size;
            for (int64_t i = 0; i < size; ++i) out[i] = x[i] + mlp[i];
        }
    }
    free(work);
    add_delta(x, mlp, NULL, shape[ROWS], shape[HIDDEN]);
    return j == num_captures ? 0 : -3;
}

int specray_dense_layers(int64_t num_layers, const int64_t *layers, const int64_t *shape, const int64_t *step,
                         float eps, float scale, float *x, float *scratch) {
    return specray_dense_layers_capture(num_layers, layers, shape, step, eps, scale, x, scratch, 0, NULL, NULL);
}
