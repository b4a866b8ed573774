/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias) in float32 for many rows of x (verify batches,
 * prefill), reading w in place: the one copy of a weight the model keeps.
 *
 * BLAS repacks the whole weight on every call (that is why specray used to keep a second,
 * oneDNN-packed copy of every weight). Here each thread packs only a panel of PANEL rows of
 * w at a time, into a buffer of its own laid out [K][PANEL] (a few hundred KB: L2), and
 * then runs the whole of x against it: for each k one PANEL-float slice of the panel, times
 * x[m, k] broadcast, into ROWS_PER_PASS x PANEL_VECS vector accumulators (24 of the 32
 * registers).
 * w is read from memory once, x from cache once per panel.
 *
 * Each output sums x[m, k] * w[n, k] in k order, then adds the bias: the same bits whatever
 * the thread count.
 */
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

/* 6 rows x 4 vectors (24 accumulators) measured ahead of 12 x 2 and 8 x 3 at 32 and 128
 * rows on SmolLM2's and mid-llama's shapes */
#define PANEL_VECS 4
#define ROWS_PER_PASS 6
#define PANEL (PANEL_VECS * LANES) /* rows of w per packed panel */

/* Outputs [n, n + valid) of R rows of x against one packed panel; R is a compile-time
 * constant at each call site (see pass below), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void panel_rows(
        int R, const float *x, const float *panel, const float *bias, float *y,
        int64_t n, int64_t valid, int64_t N, int64_t K) {
    vec acc[ROWS_PER_PASS][PANEL_VECS];
    for (int r = 0; r < R; ++r)
        for (int v = 0; v < PANEL_VECS; ++v) acc[r][v] = (vec){0};
    for (int64_t k = 0; k < K; ++k) {
        vec wv[PANEL_VECS];
        for (int v = 0; v < PANEL_VECS; ++v) wv[v] = load(panel + k * PANEL + v * LANES);
        for (int r = 0; r < R; ++r) {
            const vec xv = x[r * K + k] + (vec){0}; /* broadcast */
            for (int v = 0; v < PANEL_VECS; ++v) acc[r][v] += xv * wv[v];
        }
    }
    for (int r = 0; r < R; ++r) {
        float *yr = y + r * N + n;
        for (int64_t j = 0; j < valid; ++j) yr[j] = acc[r][j / LANES][j % LANES] + (bias ? bias[n + j] : 0.0f);
    }
}

static void pass(int64_t rows, const float *x, const float *panel, const float *bias, float *y,
                 int64_t n, int64_t valid, int64_t N, int64_t K) {
    switch (rows) {
#define CASE(R) case R: panel_rows(R, x, panel, bias, y, n, valid, N, K); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5)
        default: panel_rows(ROWS_PER_PASS, x, panel, bias, y, n, valid, N, K); break;
#undef CASE
    }
}

/* rows [n, n + valid) of w into panel[k][j], zero past valid */
static void pack_panel(const float *w, int64_t n, int64_t valid, int64_t K, float *panel) {
    for (int64_t j = valid; j < PANEL; ++j)
        for (int64_t k = 0; k < K; ++k) panel[k * PANEL + j] = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += 64) /* 64 columns of every row: 16 KB, stays in L1 */
        for (int64_t j = 0; j < valid; ++j) {
            const float *row = w + (n + j) * K;
            const int64_t end = k0 + 64 < K ? k0 + 64 : K;
            for (int64_t k = k0; k < end; ++k) panel[k * PANEL + j] = row[k];
        }
}

/* Returns 0, or -1 when a thread could not get its panel buffer. */
int specray_panel_gemm(const float *x, const float *w, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
    int failed = 0;
    #pragma omp parallel
    {
        float *panel = aligned_alloc(64, (size_t)K * PANEL * sizeof(float) + 64);
        if (!panel) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; ++p) {
            if (!panel) continue;
            const int64_t n = p * PANEL, valid = N - n < PANEL ? N - n : PANEL;
            pack_panel(w, n, valid, K, panel);
            for (int64_t m = 0; m < M; m += ROWS_PER_PASS) {
                const int64_t rows = M - m < ROWS_PER_PASS ? M - m : ROWS_PER_PASS;
                pass(rows, x + m * K, panel, bias, y + m * N, n, valid, N, K);
            }
        }
        free(panel);
    }
    return failed ? -1 : 0;
}
