/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias) in float32, for the rows of a decode or verify step
 * (1 <= M <= SMALL_GEMM_MAX_ROWS).
 *
 * At a few rows a linear layer is bound by reading w once from memory. On the 2-core CI
 * box BLAS's GEMV (torch.mv, F.linear at one row) reads w at 9-16 GB/s, and MKL and oneDNN
 * read it at 8-12 GB/s at 4-8 rows; streaming it a row at a time read it at 22-35 GB/s
 * (docs/cpu-kernels.md, with what is still open about the batch-1 case).
 *
 * Each thread takes a contiguous range of w's rows (OpenMP static schedule over torch's
 * threads) and streams it: four rows of w at a time up to 4 rows of x (M = 1 included), two
 * beyond, every 16-float slice FMA'd into one accumulator per
 * (row of x, row of w), with a software prefetch ahead of each stream. Past 8 rows of x the
 * same C rows of w serve every block of 8 rows of x while they sit in L1/L2, so w is read
 * from memory once whatever M is.
 *
 * specray builds it on the machine that runs it (-march=native; vectors in vec.h). Each
 * output is summed in the same fixed order (16 lane sums over k, the lanes as a fixed tree,
 * the tail, then the bias) whatever the number of threads, the number of rows and the
 * column grouping: every rank computing the same product gets the same bits, and a row gets
 * the same bits alone as in a batch.
 */
#include <stdint.h>

#include "vec.h"

#define SMALL_GEMM_MAX_ROWS 32 /* from 16 to 32 rows still ahead of panel_gemm (docs/cpu-kernels.md) */
#define ROW_BLOCK 8 /* rows of x per pass over C rows of w: M x C accumulators in registers */
#define PREFETCH_FLOATS 1024 /* 4 KB ahead in each row of w being read */

/* Outputs n .. n + C - 1 for M rows of x. C and M are compile-time constants at every call
 * site (see block below), so the M x C accumulators live in registers. */
static inline __attribute__((always_inline)) void columns(
        int C, int M, const float *x, const float *w, const float *bias, float *y,
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
            /* the hardware prefetcher alone leaves the loads waiting: ask ahead */
            __builtin_prefetch(wr[c] + k + PREFETCH_FLOATS);
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
        int C, const float *x, const float *w, const float *bias, float *y,
        int64_t n, int64_t M, int64_t N, int64_t K) {
    for (int64_t m = 0; m < M; m += ROW_BLOCK) {
        const float *xm = x + m * K;
        float *ym = y + m * N;
        switch (M - m < ROW_BLOCK ? M - m : ROW_BLOCK) {
            case 1: columns(C, 1, xm, w, bias, ym, n, N, K); break;
            case 2: columns(C, 2, xm, w, bias, ym, n, N, K); break;
            case 3: columns(C, 3, xm, w, bias, ym, n, N, K); break;
            case 4: columns(C, 4, xm, w, bias, ym, n, N, K); break;
            case 5: columns(C, 5, xm, w, bias, ym, n, N, K); break;
            case 6: columns(C, 6, xm, w, bias, ym, n, N, K); break;
            case 7: columns(C, 7, xm, w, bias, ym, n, N, K); break;
            default: columns(C, 8, xm, w, bias, ym, n, N, K); break;
        }
    }
}

/* C rows of w per step (4 up to 4 rows of x; 2 beyond, at most 16 accumulators); the last
 * N % C outputs one by one. */
#define GROUPED(C)                                                                            \
    static void grouped_##C(const float *x, const float *w, const float *bias, float *y,     \
                            int64_t M, int64_t N, int64_t K) {                               \
        const int64_t full = N - N % (C);                                                    \
        _Pragma("omp parallel for schedule(static)")                                         \
        for (int64_t n = 0; n < full; n += (C)) block((C), x, w, bias, y, n, M, N, K);       \
        for (int64_t n = full; n < N; ++n) block(1, x, w, bias, y, n, M, N, K);              \
    }
GROUPED(2) GROUPED(4)

int specray_small_gemm_max_rows(void) { return SMALL_GEMM_MAX_ROWS; }

/* Returns 0 on success, -1 when M is out of range (the caller then uses another path). */
int specray_small_gemm(const float *x, const float *w, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K) {
    if (M < 1 || M > SMALL_GEMM_MAX_ROWS) return -1;
    /* M = 1 too takes four rows of w at a time: one row at a time (grouped_1) measured 0.13-1.3x
     * BLAS at load 3-5, four at a time 1.4-2x at load 2.4 (docs/cpu-kernels.md) */
    if (M <= 4) grouped_4(x, w, bias, y, M, N, K);
    else grouped_2(x, w, bias, y, M, N, K);
    return 0;
}
