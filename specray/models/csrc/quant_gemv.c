/* y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for 1..32 float32 rows of x, with W kept in
 * its GGUF blocks (row-major: output row n is K / block_size consecutive blocks).
 *
 * One driver and a table of formats (DESIGN.md): each format says how big a block is and how
 * it dequantizes (quant_formats.h); the driver dequantizes each block in registers and
 * accumulates exactly as small_gemm.c does on the dequantized float32 weight: lane j of one
 * 16-lane accumulator per output adds x[k] * w[k] (one FMA) for k = j, j + 16, j + 32, ... in
 * order, then lane_sum's fixed tree, then + bias (or + 0.0f). Every GGUF dequantization here
 * is d * q, exact in float32 (an fp16 scale has 11 significant bits, q at most 8), plus at
 * most one rounding (Q4_1 / Q5_1's "+ m"; fma(q, d, m) rounds the same exact d * q + m once,
 * as numpy's (d * q) + m does), so the weights are bit for bit gguf.quants.dequantize's and
 * the outputs bit for bit small_gemm's on them, at every row count and thread count.
 * A block of 32 is two of small_gemm's 16-float steps and K is a multiple of 32: no tail.
 */
#include <omp.h>
#include <stdint.h>

#include "quant_formats.h"
#include "vec.h"

#define QUANT_MAX_ROWS 32 /* small_gemm's limit (SMALL_GEMM_MAX_ROWS) */
#define QUANT_ROW_BLOCK 8 /* rows of x per pass over the rows of w: accumulators in registers */
#define QUANT_MAX_COLUMNS 8 /* rows of w per pass (quant_rows) */
/* One row of x takes one thread below this much float32 weight: measured from memory with the
 * next pass prefetched (16:13 UTC 2026-12-06), two threads read 576 x 576 Q4_1 at 11.6 GB/s
 * against one's 7.2, 320 x 576 at 6.8 against 6.0, and 192 x 576 at 4.6 against 5.3 (small_gemm's
 * 1.5 MiB, which this was, kept SmolLM2's o projection on one thread). */
#define QUANT_PARALLEL_MIN_BYTES (0.5 * 1024 * 1024)

/* The bytes of the next pass (the C rows after this pass's, contiguous), `step` bytes per block
 * of this pass: a pass reads C rows block by block, C streams a row apart, and the hardware
 * prefetcher did not follow them from memory once rows were long (down, K = 1536: 5.2 GB/s
 * from memory on one thread against 9.4 with this, the same as rows of K = 576; measured in a C
 * harness, 16:10 UTC 2026-12-06). Read one pass ahead in order, memory sees one sequential
 * stream. Past the weight's end the prefetches fetch nothing that matters (they never fault). */
static inline __attribute__((always_inline)) void prefetch_next_pass(const uint8_t *next, int64_t at, int step) {
    for (int off = 0; off < step + 63; off += 64) __builtin_prefetch(next + at + off);
}

#if defined(__AVX512F__)
/* One block of 32 weights of C rows of w (lo, hi) into the M x C accumulators: small_gemm's
 * FMAs, lane for lane. */
static inline __attribute__((always_inline)) void accumulate(int C, int M, const float *x, int64_t K,
                                                             const vec *lo, const vec *hi,
                                                             vec acc[QUANT_ROW_BLOCK][QUANT_MAX_COLUMNS]) {
    for (int m = 0; m < M; ++m) {
        const vec xl = load(x + m * K), xh = load(x + m * K + LANES);
        for (int c = 0; c < C; ++c) {
            acc[m][c] += xl * lo[c];
            acc[m][c] += xh * hi[c];
        }
    }
}

/* Outputs n .. n + C - 1 for M rows of x (C, M compile-time constants at each call site):
 * each block dequantized once for all M rows, small_gemm's FMAs lane for lane. C rows of w at
 * a time because one output's sum is one chain of dependent FMAs (small_gemm's order), and a
 * block of 32 quantized weights is only 18-34 bytes: one chain would read 20 bytes per two
 * FMA latencies (~4 GB/s measured for Q4_1); C independent chains keep C times that in flight.
 * A K-quant's super-block is made ready once per row of w (kquant_prepare), then its 8 chunks
 * run unrolled, so each chunk's offsets and shifts are constants. */
static inline __attribute__((always_inline)) void quant_rows(
        int FMT, int C, int M, const float *x, const uint8_t *w, const float *bias, float *y,
        int64_t n, int64_t N, int64_t K) {
    vec acc[QUANT_ROW_BLOCK][QUANT_MAX_COLUMNS];
    const uint8_t *wr[QUANT_MAX_COLUMNS];
    const int64_t bytes = FORMATS[FMT].block_bytes, per_block = FORMATS[FMT].block_weights;
    const int64_t row_bytes = (K / per_block) * bytes;
    for (int c = 0; c < C; ++c) wr[c] = w + (n + c) * row_bytes;
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < C; ++c) acc[m][c] = (vec){0};
    const uint8_t *next = w + (n + C) * row_bytes;
    vec lo[QUANT_MAX_COLUMNS], hi[QUANT_MAX_COLUMNS];
    if (FMT == Q4_K || FMT == Q6_K) {
        kquant_block kb[QUANT_MAX_COLUMNS];
        for (int64_t k = 0; k < K; k += per_block) {
            const int64_t at = k / per_block * bytes;
            prefetch_next_pass(next, C * at, C * bytes);
            for (int c = 0; c < C; ++c) kquant_prepare(FMT, wr[c] + at, &kb[c]);
            /* Q6_K (210 bytes a super-block) also asks for each row's super-block after next:
             * 1.1x on down's shape and 1.3x on mid-llama's LM head (32000 x 1024) from memory
             * (interleaved A/B, three and two pairs, 12-07 01:58); Q4_K, compute-bound, did
             * not move, as in fast mode (quant_fast.c) */
            if (FMT == Q6_K && k + 2 * per_block < K)
                for (int c = 0; c < C; ++c)
                    for (int off = 0; off < bytes; off += 64) __builtin_prefetch(wr[c] + at + 2 * bytes + off);
#pragma GCC unroll 8
            for (int chunk = 0; chunk < 8; ++chunk) {
                for (int c = 0; c < C; ++c) dequantize_k(FMT, wr[c] + at, chunk, &kb[c], &lo[c], &hi[c]);
                accumulate(C, M, x + k + BLOCK_SIZE * chunk, K, lo, hi, acc);
            }
        }
    } else {
        for (int64_t k = 0; k < K; k += BLOCK_SIZE) {
            const int64_t at = k / BLOCK_SIZE * bytes;
            prefetch_next_pass(next, C * at, C * bytes);
            for (int c = 0; c < C; ++c) dequantize(FMT, wr[c] + at, &lo[c], &hi[c]);
            accumulate(C, M, x + k, K, lo, hi, acc);
        }
    }
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < C; ++c) y[m * N + n + c] = lane_sum(acc[m][c]) + (bias ? bias[n + c] : 0.0f);
}

#else
/* The same on 8-float quarters of each block (quant_formats.h), for machines without AVX-512. */
static inline __attribute__((always_inline)) void quant_rows(
        int FMT, int C, int M, const float *x, const uint8_t *w, const float *bias, float *y,
        int64_t n, int64_t N, int64_t K) {
    /* each 16-lane accumulator as two 8-lane halves, as small_gemm's column_halves: lanes 0-7
     * and 8-15 add the same products in the same order, and half_lane_sum(lo + hi) is lane_sum */
    half_vec lo[QUANT_ROW_BLOCK][QUANT_MAX_COLUMNS], hi[QUANT_ROW_BLOCK][QUANT_MAX_COLUMNS];
    const uint8_t *wr[QUANT_MAX_COLUMNS];
    const int64_t bytes = FORMATS[FMT].block_bytes, per_block = FORMATS[FMT].block_weights;
    const int64_t row_bytes = (K / per_block) * bytes;
    for (int c = 0; c < C; ++c) wr[c] = w + (n + c) * row_bytes;
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < C; ++c) lo[m][c] = hi[m][c] = (half_vec){0};
    const uint8_t *next = w + (n + C) * row_bytes;
    for (int64_t k = 0; k < K; k += BLOCK_SIZE) {
        const int64_t at = k / per_block * bytes;
        const int chunk = (int)(k % per_block / BLOCK_SIZE);
        if (!chunk) prefetch_next_pass(next, C * at, C * bytes);
        half_vec wq[QUANT_MAX_COLUMNS][4];
        for (int c = 0; c < C; ++c) {
            if (FMT == Q4_K || FMT == Q6_K) dequantize8_k(FMT, wr[c] + at, chunk, wq[c]);
            else dequantize8(FMT, wr[c] + at, wq[c]);
        }
        for (int m = 0; m < M; ++m) {
            const float *xm = x + m * K + k;
            const half_vec x0 = load_half(xm), x1 = load_half(xm + 8), x2 = load_half(xm + 16), x3 = load_half(xm + 24);
            for (int c = 0; c < C; ++c) {
                lo[m][c] += x0 * wq[c][0];
                hi[m][c] += x1 * wq[c][1];
                lo[m][c] += x2 * wq[c][2];
                hi[m][c] += x3 * wq[c][3];
            }
        }
    }
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < C; ++c)
            y[m * N + n + c] = half_lane_sum(lo[m][c] + hi[m][c]) + (bias ? bias[n + c] : 0.0f);
}

#endif

/* Outputs n .. n + C - 1 for all M rows of x, QUANT_ROW_BLOCK rows at a time. */
static inline __attribute__((always_inline)) void quant_block(
        int FMT, int C, const float *x, const uint8_t *w, const float *bias, float *y,
        int64_t n, int64_t M, int64_t N, int64_t K) {
    for (int64_t m = 0; m < M; m += QUANT_ROW_BLOCK) {
        const float *xm = x + m * K;
        float *ym = y + m * N;
        switch (M - m < QUANT_ROW_BLOCK ? M - m : QUANT_ROW_BLOCK) {
            case 1: quant_rows(FMT, C, 1, xm, w, bias, ym, n, N, K); break;
            case 2: quant_rows(FMT, C, 2, xm, w, bias, ym, n, N, K); break;
            case 3: quant_rows(FMT, C, 3, xm, w, bias, ym, n, N, K); break;
            case 4: quant_rows(FMT, C, 4, xm, w, bias, ym, n, N, K); break;
            case 5: quant_rows(FMT, C, 5, xm, w, bias, ym, n, N, K); break;
            case 6: quant_rows(FMT, C, 6, xm, w, bias, ym, n, N, K); break;
            case 7: quant_rows(FMT, C, 7, xm, w, bias, ym, n, N, K); break;
            default: quant_rows(FMT, C, 8, xm, w, bias, ym, n, N, K); break;
        }
    }
}

/* C rows of w per pass for M rows of x: the M x C accumulators, 2 C dequantized vectors and the
 * rows of x must stay in registers. AVX-512's 32: 8 at one row, 4 at two, else 2 (at most 16
 * accumulators: 8 rows of x per pass); measured against 4 at one row and 1 past four rows, on
 * SmolLM2's shapes, two threads from memory (2026-12-06): 1.04-1.06x at one row, 1.03-1.58x at
 * 5-8 rows. AVX2's 16 (each accumulator two 8-float halves): 4 up to 2 rows, 2 up to 4, else 1. */
static inline int columns_for(int64_t M) {
#if defined(__AVX512F__)
    return M == 1 ? 8 : M <= 2 ? 4 : 2;
#else
    return M <= 2 ? 4 : M <= 4 ? 2 : 1;
#endif
}

/* The driver, one instance per format: C rows of w per step, split statically over threads as
 * small_gemm does, the last N % C outputs one by one. */
#define PASS(FMT, C)                                                                                      \
    do {                                                                                                  \
        const int64_t full = N - N % (C);                                                                 \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                 \
        for (int64_t n = 0; n < full; n += (C)) quant_block(FMT, (C), x, w, bias, y, n, M, N, K);         \
        for (int64_t n = full; n < N; ++n) quant_block(FMT, 1, x, w, bias, y, n, M, N, K);                \
    } while (0)
#define DRIVER(FMT)                                                                                           \
    static void gemv_##FMT(const float *x, const uint8_t *w, const float *bias, float *y, int64_t M, int64_t N, \
                           int64_t K, int threads) {                                                          \
        switch (columns_for(M)) {                                                                             \
            case 8: PASS(FMT, 8); break;                                                                      \
            case 4: PASS(FMT, 4); break;                                                                      \
            case 2: PASS(FMT, 2); break;                                                                      \
            default: PASS(FMT, 1); break;                                                                     \
        }                                                                                                     \
    }
DRIVER(Q8_0) DRIVER(Q4_0) DRIVER(Q4_1) DRIVER(Q5_0) DRIVER(Q5_1) DRIVER(BF16) DRIVER(Q4_K) DRIVER(Q6_K) DRIVER(MXFP4)

typedef void (*quant_fn)(const float *, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t, int);

static const quant_fn DRIVERS[] = {[Q8_0] = gemv_Q8_0, [Q4_0] = gemv_Q4_0, [Q4_1] = gemv_Q4_1,
                                   [Q5_0] = gemv_Q5_0, [Q5_1] = gemv_Q5_1, [BF16] = gemv_BF16,
                                   [Q4_K] = gemv_Q4_K, [Q6_K] = gemv_Q6_K, [MXFP4] = gemv_MXFP4};

static int find_format(int ggml_type) {
    for (int i = 0; i < NUM_FORMATS; ++i)
        if (FORMATS[i].ggml_type == ggml_type) return i;
    return -1;
}

int specray_quant_max_rows(void) { return QUANT_MAX_ROWS; }

/* The table row for a GGML type: 0 with its block size and bytes, -2 when it has no kernel. */
int specray_quant_format(int ggml_type, int *block_size, int *block_bytes) {
    const int f = find_format(ggml_type);
    if (f < 0) return -2;
    *block_size = FORMATS[f].block_weights;
    *block_bytes = FORMATS[f].block_bytes;
    return 0;
}

/* threads <= 0: one thread for one row below QUANT_PARALLEL_MIN_BYTES of float32 weight, else
 * every thread; otherwise capped at OpenMP's maximum. Returns 0; -1 when M is out of
 * range, -2 for a type without a kernel, -3 when K is not a multiple of the block size. */
int specray_quant_fast_gemv(int ggml_type, const float *x, const uint8_t *w, const float *bias, float *y, int64_t M,
                            int64_t N, int64_t K, int threads);

/* A type with QUANT_FAST_BIT set is a weight repacked for SPECRAY_CPU_QUANT=fast (quant_fast.c):
 * the fused decode layers pass their weights' types here, so both modes take one call. */
#define QUANT_FAST_BIT (1 << 16)

int specray_quant_gemv(int ggml_type, const float *x, const uint8_t *w, const float *bias, float *y, int64_t M,
                       int64_t N, int64_t K, int threads) {
    if (ggml_type & QUANT_FAST_BIT) return specray_quant_fast_gemv(ggml_type & ~QUANT_FAST_BIT, x, w, bias, y, M, N, K, threads);
    if (M < 1 || M > QUANT_MAX_ROWS) return -1;
    const int f = find_format(ggml_type);
    if (f < 0) return -2;
    if (K % FORMATS[f].block_weights) return -3;
    const int all = omp_get_max_threads();
    if (threads <= 0) {
        /* on the float32 weight's size, as small_gemm: the time goes into dequantizing and
         * FMAs, which scale with the weights, not the bytes read */
        const double work = (double)N * K * sizeof(float);
        threads = M == 1 && work < QUANT_PARALLEL_MIN_BYTES ? 1 : all;
    }
    if (threads > all) threads = all;
    DRIVERS[f](x, w, bias, y, M, N, K, threads);
    return 0;
}

/* Rows [0, N) of W as float32 (out: N x K, row-major): the values gguf.quants.dequantize gives,
 * from the same dequantize() the GEMV runs (prefill's weight panels, quant_weight.py), the
 * rows split over threads. Returns 0; -2 for a type without a kernel, -3 when K is not a
 * multiple of the block size. */
/* Fewer weights than this dequantize on the calling thread: a decode step's embedding row (one
 * row, ~1 us of work) took ~50 us inside the engine when it woke the OpenMP team (12-07). */
#define DEQUANTIZE_PARALLEL_MIN (64 * 1024)

/* One block as stored (32 weights, or a K-quant's super-block of 256) into o. */
static inline __attribute__((always_inline)) void dequantize_block(int FMT, const uint8_t *b, float *o) {
#if defined(__AVX512F__)
    vec lo, hi;
    if (FMT == Q4_K || FMT == Q6_K) {
        kquant_block kb;
        kquant_prepare(FMT, b, &kb);
        for (int chunk = 0; chunk < 8; ++chunk) {
            dequantize_k(FMT, b, chunk, &kb, &lo, &hi);
            memcpy(o + BLOCK_SIZE * chunk, &lo, sizeof lo);
            memcpy(o + BLOCK_SIZE * chunk + LANES, &hi, sizeof hi);
        }
        return;
    }
    dequantize(FMT, b, &lo, &hi);
    memcpy(o, &lo, sizeof lo);
    memcpy(o + LANES, &hi, sizeof hi);
#else
    half_vec q[4];
    for (int chunk = 0; chunk < FORMATS[FMT].block_weights / BLOCK_SIZE; ++chunk) {
        if (FMT == Q4_K || FMT == Q6_K) dequantize8_k(FMT, b, chunk, q);
        else dequantize8(FMT, b, q);
        for (int i = 0; i < 4; ++i) memcpy(o + BLOCK_SIZE * chunk + i * LANES / 2, &q[i], sizeof q[i]);
    }
#endif
}
#define DEQUANTIZER(FMT)                                                                             \
    static void dequantize_##FMT(const uint8_t *w, float *out, int64_t N, int64_t K) {               \
        const int64_t per_block = FORMATS[FMT].block_weights, bytes = FORMATS[FMT].block_bytes;      \
        const int64_t row_bytes = K / per_block * bytes;                                             \
        _Pragma("omp parallel for schedule(static) if (N * K >= DEQUANTIZE_PARALLEL_MIN)")           \
        for (int64_t n = 0; n < N; ++n)                                                              \
            for (int64_t k = 0; k < K; k += per_block)                                               \
                dequantize_block(FMT, w + n * row_bytes + k / per_block * bytes, out + n * K + k);   \
    }
DEQUANTIZER(Q8_0) DEQUANTIZER(Q4_0) DEQUANTIZER(Q4_1) DEQUANTIZER(Q5_0) DEQUANTIZER(Q5_1) DEQUANTIZER(BF16)
DEQUANTIZER(Q4_K) DEQUANTIZER(Q6_K) DEQUANTIZER(MXFP4)

typedef void (*dequantize_fn)(const uint8_t *, float *, int64_t, int64_t);
static const dequantize_fn DEQUANTIZERS[] = {[Q8_0] = dequantize_Q8_0, [Q4_0] = dequantize_Q4_0,
                                             [Q4_1] = dequantize_Q4_1, [Q5_0] = dequantize_Q5_0,
                                             [Q5_1] = dequantize_Q5_1, [BF16] = dequantize_BF16,
                                             [Q4_K] = dequantize_Q4_K, [Q6_K] = dequantize_Q6_K,
                                             [MXFP4] = dequantize_MXFP4};

int specray_quant_dequantize(int ggml_type, const uint8_t *w, float *out, int64_t N, int64_t K) {
    const int f = find_format(ggml_type);
    if (f < 0) return -2;
    if (K % FORMATS[f].block_weights) return -3;
    DEQUANTIZERS[f](w, out, N, K);
    return 0;
}
