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
            if (PF) __builtin_prefetch(wr[c] + k + PREFETCH_FLOATS);
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

/* Outputs n .. n + C - 1 for all M rows of x, ROW_BLOCK rows at a time. */
static inline __attribute__((always_inline)) void block(
        int C, int PF, const float *x, const float *w, const float *bias, float *y,
        int64_t n, int64_t M, int64_t N, int64_t K) {
    for (int64_t m = 0; m < M; m += ROW_BLOCK) {
        const float *xm = x + m * K;
        float *ym = y + m * N;
        switch (M - m < ROW_BLOCK ? M - m : ROW_BLOCK) {
            case 1: columns(C, 1, PF, xm, w, bias, ym, n, N, K); break;
            case 2: columns(C, 2, PF, xm, w, bias, ym, n, N, K); break;
            case 3: columns(C, 3, PF, xm, w, bias, ym, n, N, K); break;
            case 4: columns(C, 4, PF, xm, w, bias, ym, n, N, K); break;
            case 5: columns(C, 5, PF, xm, w, bias, ym, n, N, K); break;
            case 6: columns(C, 6, PF, xm, w, bias, ym, n, N, K); break;
            case 7: columns(C, 7, PF, xm, w, bias, ym, n, N, K); break;
            default: columns(C, 8, PF, xm, w, bias, ym, n, N, K); break;
        }
    }
}

/* C rows of w per step over `threads` threads; the last N % C outputs one by one. */
#define GROUPED(C, PF)                                                                        \
    static void grouped_##C##_##PF(const float *x, const float *w, const float *bias, float *y, \
                                   int64_t M, int64_t N, int64_t K, int threads) {          \
        const int64_t full = N - N % (C);                                                    \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                   \
        for (int64_t n = 0; n < full; n += (C)) block((C), (PF), x, w, bias, y, n, M, N, K); \
        for (int64_t n = full; n < N; ++n) block(1, (PF), x, w, bias, y, n, M, N, K);        \
    }
GROUPED(1, 0) GROUPED(2, 0) GROUPED(4, 0) GROUPED(1, 1) GROUPED(2, 1) GROUPED(4, 1)

int specray_small_gemm_max_rows(void) { return SMALL_GEMM_MAX_ROWS; }

/* Any plan: rows_of_w 1, 2 or 4; prefetch 0 or 1; threads >= 1 (capped at OpenMP's maximum).
 * Every plan gives the same bits. Returns 0, -1 when M is out of range, -3 for a bad plan. */
int specray_small_gemm_plan(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                            int64_t K, int rows_of_w, int prefetch, int threads) {
    if (M < 1 || M > SMALL_GEMM_MAX_ROWS) return -1;
    if (threads < 1 || (prefetch != 0 && prefetch != 1)) return -3;
    if (threads > omp_get_max_threads()) threads = omp_get_max_threads();
    switch (rows_of_w * 2 + prefetch) {
        case 2: grouped_1_0(x, w, bias, y, M, N, K, threads); return 0;
        case 3: grouped_1_1(x, w, bias, y, M, N, K, threads); return 0;
        case 4: grouped_2_0(x, w, bias, y, M, N, K, threads); return 0;
        case 5: grouped_2_1(x, w, bias, y, M, N, K, threads); return 0;
        case 8: grouped_4_0(x, w, bias, y, M, N, K, threads); return 0;
        case 9: grouped_4_1(x, w, bias, y, M, N, K, threads); return 0;
        default: return -3;
    }
}

/* The plan of issue 18's first version (four rows of w up to 4 rows of x, two beyond, a
 * prefetch, every thread), kept so benchmarks can run it beside the tuned one in one process
 * (specray_small_gemm_use_old_plan). Speed only: the bits are the same. */
static int old_plan = 0;

void specray_small_gemm_use_old_plan(int on) { old_plan = on != 0; }

int specray_small_gemm(const float *x, const float *w, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K) {
    const int all = omp_get_max_threads();
    if (old_plan || M > 1) return specray_small_gemm_plan(x, w, bias, y, M, N, K, M <= 4 ? 4 : 2, 1, all);
    /* M = 1: one row of w at a time, no software prefetch: one sequential stream per thread,
     * which the hardware prefetcher follows, read at 1.2-2.2x the old plan's speed on every
     * shape measured. (At 4-8 rows of x the old plan's prefetch still pays: docs/cpu-kernels.md.)
     * Small weights on one thread: a parallel region waits for its slowest thread, and on a
     * shared box a descheduled thread costs milliseconds against a call of tens of microseconds. */
    const int threads = (double)N * K * sizeof(float) < PARALLEL_MIN_BYTES ? 1 : all;
    return specray_small_gemm_plan(x, w, bias, y, M, N, K, 1, 0, threads);
}
