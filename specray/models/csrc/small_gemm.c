/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias) in float32, for the rows of a decode or verify step
 * (1 <= M <= SMALL_GEMM_MAX_ROWS).
 *
 * At a few rows a linear layer is bound by reading w once from memory, so the kernel is a
 * stream over w: each thread takes a contiguous range of w's rows (OpenMP static schedule)
 * and reads C rows of w at a time, every 16-float slice of each FMA'd into one accumulator
 * per (row of x, row of w) while the rows of x sit in L1/L2. Past 8 rows of x the same C rows
 * of w serve every block of 8 rows of x, so w is read from memory once whatever M is.
 *
 * How a call streams w (its plan: C, a software prefetch or not, how many threads) is chosen
 * per row count and weight size from measurements (benchmarks/bench_gemv.py,
 * docs/cpu-kernels.md); see specray_small_gemm at the end.
 *
 * specray builds it on the machine that runs it (-march=native; vectors in vec.h). Each
 * output is summed in the same fixed order (16 lane sums over k, the lanes as a fixed tree,
 * the tail, then the bias) whatever the plan, the number of threads and the number of rows:
 * every rank computing the same product gets the same bits, and a row gets the same bits
 * alone as in a batch (a verify step's row as the plain decode step's).
 */
#include <omp.h>
#include <stdint.h>

#include "vec.h"

#define SMALL_GEMM_MAX_ROWS 32 /* from 16 to 32 rows still ahead of panel_gemm (docs/cpu-kernels.md) */
#define ROW_BLOCK 8 /* rows of x per pass over C rows of w: M x C accumulators in registers */
#define PREFETCH_FLOATS 1024 /* 4 KB ahead in each row of w being read (the old plan) */

/* Below this a batch-1 GEMV runs on one thread (SmolLM2's o_proj, 1.27 MiB, does; its qkv,
 * 2.11 MiB, does not): docs/cpu-kernels.md */
#define PARALLEL_MIN_BYTES (1.5 * 1024 * 1024)

/* The software prefetch of a plan: none, the old plan's into L1 (prefetcht0) 4 KB ahead, or
 * into L2 only (prefetcht1) L2_PREFETCH_FLOATS ahead. */
enum { NO_PREFETCH, L1_PREFETCH, L2_PREFETCH };
#define L2_PREFETCH_FLOATS 1024 /* 4 KB ahead */

static inline __attribute__((always_inline)) void prefetch(int PF, const float *p) {
    if (PF == L1_PREFETCH) __builtin_prefetch(p + PREFETCH_FLOATS, 0, 3);
    if (PF == L2_PREFETCH) __builtin_prefetch(p + L2_PREFETCH_FLOATS, 0, 2);
}

/* Outputs n .. n + C - 1 for M rows of x. C, M and PF are compile-time constants at every
 * call site (see block below), so the M x C accumulators live in registers. */
static inline __attribute__((always_inline)) void columns(
        int C, int M, int PF, const float *x, const float *w, const float *bias, float *y,
        int64_t n, int64_t N, int64_t K) {
    vec acc[ROW_BLOCK][4];
    const float *wr[4];
    for (int c = 0; c < C; ++c) wr[c] = w + (n + c) * K;
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < C; ++c) acc[m][c] = (vec){0};
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        vec wv[4];
        for (int c = 0; c < C; ++c) {
            prefetch(PF, wr[c] + k);
            wv[c] = load(wr[c] + k);
        }
        for (int m = 0; m < M; ++m) {
            vec xv = load(x + m * K + k);
            for (int c = 0; c < C; ++c) acc[m][c] += xv * wv[c];
        }
    }
    for (int m = 0; m < M; ++m) {
        for (int c = 0; c < C; ++c) {
            float s = lane_sum(acc[m][c]);
            for (int64_t t = k; t < K; ++t) s += x[m * K + t] * wr[c][t]; /* K not a multiple of 16 */
            y[m * N + n + c] = s + (bias ? bias[n + c] : 0.0f);
        }
    }
}

/* One row of w (output n) for M rows of x, each 16-lane accumulator held as two 8-lane
 * halves: the same FMAs lane for lane and lane_sum's first step (lanes 0-7 + lanes 8-15) as
 * columns(1, ...), so the same bits. Where 16-float FMAs run as two 8-float halves
 * (AMD Zen 4's AVX-512), 8-float FMAs issue more freely: 15-25% more FMAs a cycle measured
 * at 4-8 rows of x (docs/cpu-kernels.md), where this loop, not memory, was the limit. */
static inline __attribute__((always_inline)) void column_halves(
        int M, int PF, const float *x, const float *w, const float *bias, float *y,
        int64_t n, int64_t N, int64_t K) {
    half_vec lo[ROW_BLOCK], hi[ROW_BLOCK];
    const float *wr = w + n * K;
    for (int m = 0; m < M; ++m) lo[m] = hi[m] = (half_vec){0};
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        prefetch(PF, wr + k);
        const half_vec wl = load_half(wr + k), wh = load_half(wr + k + LANES / 2);
        for (int m = 0; m < M; ++m) {
            lo[m] += load_half(x + m * K + k) * wl;
            hi[m] += load_half(x + m * K + k + LANES / 2) * wh;
        }
    }
    for (int m = 0; m < M; ++m) {
        float s = half_lane_sum(lo[m] + hi[m]);
        for (int64_t t = k; t < K; ++t) s += x[m * K + t] * wr[t];
        y[m * N + n] = s + (bias ? bias[n] : 0.0f);
    }
}

/* Rows of x longer than L1 holds (SmolLM2's down_proj: 6 rows of 1536 floats, 36 KB, against
 * 32 KB of L1) come from L2 on every load. Then each thread takes CHUNK_GROUP rows of w at a
 * time and walks K in chunks of X_CHUNK_BYTES of x: every row of w of the group over one
 * chunk, its accumulators saved and restored between chunks. Each lane still sums k in
 * order, so the bits are column_halves'. */
#define X_CHUNK_BYTES (16 * 1024)
#define X_IN_L1_BYTES (24 * 1024) /* more rows of x than this take the chunks (measured: 24 KB did better without) */
#define CHUNK_GROUP 16

static inline __attribute__((always_inline)) void chunk_of_rows(
        int M, int PF, const float *x, const float *w, half_vec (*acc)[2 * ROW_BLOCK], int64_t n0, int64_t n1,
        int64_t K, int64_t k0, int64_t k1) {
    for (int64_t n = n0; n < n1; ++n) {
        half_vec lo[ROW_BLOCK], hi[ROW_BLOCK];
        half_vec *a = acc[n - n0];
        for (int m = 0; m < M; ++m) lo[m] = a[2 * m], hi[m] = a[2 * m + 1];
        const float *wr = w + n * K;
        /* what is read after this row's chunk: the next row's, or after the group's last row
         * the first row's next chunk */
        const float *next = n + 1 < n1 ? wr + K : w + n0 * K + (k1 - k0);
        for (int64_t k = k0; k < k1; k += LANES) {
            if (PF == L2_PREFETCH) __builtin_prefetch(next + k, 0, 2);
            const half_vec wl = load_half(wr + k), wh = load_half(wr + k + LANES / 2);
            for (int m = 0; m < M; ++m) {
                lo[m] += load_half(x + m * K + k) * wl;
                hi[m] += load_half(x + m * K + k + LANES / 2) * wh;
            }
        }
        for (int m = 0; m < M; ++m) a[2 * m] = lo[m], a[2 * m + 1] = hi[m];
    }
}

static inline __attribute__((always_inline)) void chunked_halves(
        int M, int PF, const float *x, const float *w, const float *bias, float *y, int64_t n0, int64_t n1,
        int64_t N, int64_t K) {
    half_vec acc[CHUNK_GROUP][2 * ROW_BLOCK];
    for (int64_t r = 0; r < n1 - n0; ++r)
        for (int m = 0; m < 2 * M; ++m) acc[r][m] = (half_vec){0};
    const int64_t full = K - K % LANES;
    int64_t step = X_CHUNK_BYTES / (M * (int64_t)sizeof(float)) / LANES * LANES;
    if (step < LANES) step = LANES;
    for (int64_t k0 = 0; k0 < full; k0 += step)
        chunk_of_rows(M, PF, x, w, acc, n0, n1, K, k0, k0 + step < full ? k0 + step : full);
    for (int64_t n = n0; n < n1; ++n) {
        const float *wr = w + n * K;
        for (int m = 0; m < M; ++m) {
            float s = half_lane_sum(acc[n - n0][2 * m] + acc[n - n0][2 * m + 1]);
            for (int64_t t = full; t < K; ++t) s += x[m * K + t] * wr[t];
            y[m * N + n] = s + (bias ? bias[n] : 0.0f);
        }
    }
}

#define CHUNKED(PF)                                                                                      \
    static void chunked_##PF(const float *x, const float *w, const float *bias, float *y, int64_t M,      \
                             int64_t N, int64_t K, int threads) {                                        \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                \
        for (int64_t n = 0; n < N; n += CHUNK_GROUP) {                                                   \
            const int64_t end = n + CHUNK_GROUP < N ? n + CHUNK_GROUP : N;                               \
            for (int64_t m = 0; m < M; m += ROW_BLOCK) {                                                 \
                const float *xm = x + m * K;                                                             \
                float *ym = y + m * N;                                                                   \
                switch (M - m < ROW_BLOCK ? M - m : ROW_BLOCK) {                                         \
                    case 1: chunked_halves(1, PF, xm, w, bias, ym, n, end, N, K); break;                 \
                    case 2: chunked_halves(2, PF, xm, w, bias, ym, n, end, N, K); break;                 \
                    case 3: chunked_halves(3, PF, xm, w, bias, ym, n, end, N, K); break;                 \
                    case 4: chunked_halves(4, PF, xm, w, bias, ym, n, end, N, K); break;                 \
                    case 5: chunked_halves(5, PF, xm, w, bias, ym, n, end, N, K); break;                 \
                    case 6: chunked_halves(6, PF, xm, w, bias, ym, n, end, N, K); break;                 \
                    case 7: chunked_halves(7, PF, xm, w, bias, ym, n, end, N, K); break;                 \
                    default: chunked_halves(8, PF, xm, w, bias, ym, n, end, N, K); break;                \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }
CHUNKED(0) CHUNKED(1) CHUNKED(2)

/* Outputs n .. n + C - 1 for all M rows of x, ROW_BLOCK rows at a time (HALVES: C is 1,
 * column_halves' loop). */
static inline __attribute__((always_inline)) void block(
        int C, int PF, int HALVES, const float *x, const float *w, const float *bias, float *y,
        int64_t n, int64_t M, int64_t N, int64_t K) {
    for (int64_t m = 0; m < M; m += ROW_BLOCK) {
        const float *xm = x + m * K;
        float *ym = y + m * N;
        const int64_t rows = M - m < ROW_BLOCK ? M - m : ROW_BLOCK;
#define ROWS_CASE(R)                                                  \
    case R:                                                           \
        if (HALVES) column_halves(R, PF, xm, w, bias, ym, n, N, K);   \
        else columns(C, R, PF, xm, w, bias, ym, n, N, K);             \
        break;
        switch (rows) {
            ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7)
            default: ROWS_CASE(8)
        }
#undef ROWS_CASE
    }
}

/* C rows of w per step over `threads` threads; the last N % C outputs one by one. */
#define GROUPED(C, PF, HALVES)                                                                       \
    static void grouped_##C##_##PF##_##HALVES(const float *x, const float *w, const float *bias, float *y, \
                                              int64_t M, int64_t N, int64_t K, int threads) {       \
        const int64_t full = N - N % (C);                                                           \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                          \
        for (int64_t n = 0; n < full; n += (C)) block((C), (PF), (HALVES), x, w, bias, y, n, M, N, K); \
        for (int64_t n = full; n < N; ++n) block(1, (PF), (HALVES), x, w, bias, y, n, M, N, K);     \
    }
GROUPED(1, 0, 0) GROUPED(1, 1, 0) GROUPED(1, 2, 0) GROUPED(1, 0, 1) GROUPED(1, 1, 1) GROUPED(1, 2, 1)
GROUPED(2, 0, 0) GROUPED(2, 1, 0) GROUPED(2, 2, 0) GROUPED(4, 0, 0) GROUPED(4, 1, 0) GROUPED(4, 2, 0)

int specray_small_gemm_max_rows(void) { return SMALL_GEMM_MAX_ROWS; }

typedef void (*grouped_fn)(const float *, const float *, const float *, float *, int64_t, int64_t, int64_t, int);

/* Any plan: rows_of_w 1, 2 or 4; prefetch 0 (none), 1 (L1, 4 KB ahead) or 2 (L2); halves 0,
 * 1 (8-float FMAs) or 2 (the same in chunks of K), with one row of w only; threads >= 1 (capped at OpenMP's maximum).
 * Every plan gives the same bits. Returns 0, -1 when M is out of range, -3 for a bad plan. */
int specray_small_gemm_plan(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                            int64_t K, int rows_of_w, int prefetch, int threads, int halves) {
    static const grouped_fn plans[3][3][3] = { /* [rows of w: 1, 2, 4][prefetch][halves: no, yes, in K chunks] */
        {{grouped_1_0_0, grouped_1_0_1, chunked_0}, {grouped_1_1_0, grouped_1_1_1, chunked_1},
         {grouped_1_2_0, grouped_1_2_1, chunked_2}},
        {{grouped_2_0_0, NULL, NULL}, {grouped_2_1_0, NULL, NULL}, {grouped_2_2_0, NULL, NULL}},
        {{grouped_4_0_0, NULL, NULL}, {grouped_4_1_0, NULL, NULL}, {grouped_4_2_0, NULL, NULL}},
    };
    if (M < 1 || M > SMALL_GEMM_MAX_ROWS) return -1;
    const int c = rows_of_w == 1 ? 0 : rows_of_w == 2 ? 1 : rows_of_w == 4 ? 2 : -1;
    if (c < 0 || threads < 1 || prefetch < 0 || prefetch > 2 || halves < 0 || halves > 2 || !plans[c][prefetch][halves])
        return -3;
    if (threads > omp_get_max_threads()) threads = omp_get_max_threads();
    plans[c][prefetch][halves](x, w, bias, y, M, N, K, threads);
    return 0;
}

/* Which plans specray_small_gemm runs: the tuned ones, or for benchmarks, which run them
 * beside the tuned ones in one process, issue 18's first plan (four rows of w up to 4 rows of
 * x, two beyond, the L1 prefetch, every thread) or the plans before the verify-step work (the
 * tuned batch-1 GEMV, the first plan at 2+ rows). Speed only: the bits are the same. */
enum { TUNED_PLANS, FIRST_PLAN, PLANS_BEFORE_VERIFY_WORK };
static int plans_in_use = TUNED_PLANS;

void specray_small_gemm_use_plans(int which) { plans_in_use = which; }

void specray_small_gemm_use_old_plan(int on) { plans_in_use = on ? FIRST_PLAN : TUNED_PLANS; }

int specray_small_gemm(const float *x, const float *w, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K) {
    const int all = omp_get_max_threads();
    if (plans_in_use == FIRST_PLAN || (plans_in_use == PLANS_BEFORE_VERIFY_WORK && M > 1))
        return specray_small_gemm_plan(x, w, bias, y, M, N, K, M <= 4 ? 4 : 2, L1_PREFETCH, all, 0);
    /* 2+ rows (docs/cpu-kernels.md, "Verify steps (2-8 rows)"): the weight prefetched into L2,
     * which the loop's FMAs (M per 16 floats of w) would otherwise leave waiting on memory;
     * up to 8 rows one row of w at a time, in chunks of K where the rows of x overflow L1;
     * past 8 rows, two rows of w share each load of x. */
    if (M > ROW_BLOCK) return specray_small_gemm_plan(x, w, bias, y, M, N, K, 2, L2_PREFETCH, all, 0);
    if (M > 1) {
        const int halves = (double)M * K * sizeof(float) > X_IN_L1_BYTES ? 2 : 1;
        return specray_small_gemm_plan(x, w, bias, y, M, N, K, 1, L2_PREFETCH, all, halves);
    }
    /* M = 1: one row of w at a time, no software prefetch: one sequential stream per thread,
     * which the hardware prefetcher follows, read at 1.2-2.2x the old plan's speed on every
     * shape measured. Small weights on one thread: a parallel region waits for its slowest
     * thread, and on a shared box a descheduled thread costs milliseconds against a call of
     * tens of microseconds. */
    const int threads = (double)N * K * sizeof(float) < PARALLEL_MIN_BYTES ? 1 : all;
    return specray_small_gemm_plan(x, w, bias, y, M, N, K, 1, NO_PREFETCH, threads, 0);
}
