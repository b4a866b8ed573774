/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias) in float32, for the few rows of a decode or verify
 * step (M <= SMALL_GEMM_MAX_ROWS).
 *
 * At a few rows a linear layer is bound by reading w once from memory. On the 2-core CI
 * box, MKL and oneDNN read w at 8-12 GB/s at 4-8 rows, against ~18 GB/s for a plain
 * streaming read. This kernel reads the rows of w once, four or two at a time, and FMAs
 * every 16-float slice into one accumulator per (row of x, row of w) (measured over
 * mid-llama's layer weights at 8 rows: 22 ms against oneDNN's 29-31 ms).
 *
 * specray builds it on the machine that runs it (-march=native; vectors in vec.h). Each
 * output is summed in a fixed order (16 lane sums over k, then the lanes as a fixed tree),
 * whatever the number of threads, so every rank computing the same product gets the same
 * bits.
 */
#include <stdint.h>

#include "vec.h"

#define SMALL_GEMM_MAX_ROWS 8
#define PREFETCH_FLOATS 1024 /* 4 KB ahead in each row of w being read */

/* Outputs n .. n + C - 1 for all M rows. C and M are compile-time constants at every call
 * site (see ROWS below), so the M x C accumulators live in registers. */
static inline __attribute__((always_inline)) void columns(
        int C, int M, const float *x, const float *w, const float *bias, float *y,
        int64_t n, int64_t N, int64_t K) {
    vec acc[SMALL_GEMM_MAX_ROWS][4];
    const float *wr[4];
    for (int c = 0; c < C; ++c) wr[c] = w + (n + c) * K;
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < C; ++c) acc[m][c] = (vec){0};
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        vec wv[4];
        for (int c = 0; c < C; ++c) {
            /* the hardware prefetcher alone leaves the loads waiting at a few rows: ask ahead */
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

/* Four rows of w at a time up to 4 rows of x, two beyond (at most 16 accumulators); the
 * last N % C outputs one by one. Every output sums the same way whatever C is. */
#define ROWS(M)                                                                              \
    static void rows_##M(const float *x, const float *w, const float *bias, float *y,       \
                         int64_t N, int64_t K) {                                             \
        enum { C = (M) <= 4 ? 4 : 2 };                                                       \
        const int64_t full = N - N % C;                                                      \
        _Pragma("omp parallel for schedule(static)")                                         \
        for (int64_t n = 0; n < full; n += C) columns(C, M, x, w, bias, y, n, N, K);         \
        for (int64_t n = full; n < N; ++n) columns(1, M, x, w, bias, y, n, N, K);            \
    }
ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)

int specray_small_gemm_max_rows(void) { return SMALL_GEMM_MAX_ROWS; }

/* Returns 0 on success, -1 when M is out of range (the caller then uses another path). */
int specray_small_gemm(const float *x, const float *w, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K) {
    switch (M) {
        case 1: rows_1(x, w, bias, y, N, K); return 0;
        case 2: rows_2(x, w, bias, y, N, K); return 0;
        case 3: rows_3(x, w, bias, y, N, K); return 0;
        case 4: rows_4(x, w, bias, y, N, K); return 0;
        case 5: rows_5(x, w, bias, y, N, K); return 0;
        case 6: rows_6(x, w, bias, y, N, K); return 0;
        case 7: rows_7(x, w, bias, y, N, K); return 0;
        case 8: rows_8(x, w, bias, y, N, K); return 0;
        default: return -1;
    }
}
