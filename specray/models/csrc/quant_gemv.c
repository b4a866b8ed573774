/* y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for 1..32 float32 rows of x, with W kept in
 * its GGUF blocks (row-major: output row n is K / block_size consecutive blocks).
 *
 * One driver and a table of formats (DESIGN.md): each format says how big a block is and how
 * it dequantizes to two 16-float vectors; the driver dequantizes each block in registers and
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
#include <string.h>

#include "vec.h"

#define QUANT_MAX_ROWS 32 /* small_gemm's limit (SMALL_GEMM_MAX_ROWS) */
#define QUANT_ROW_BLOCK 8 /* rows of x per pass over a row of w: accumulators in registers */
#define QUANT_PARALLEL_MIN_BYTES (1.5 * 1024 * 1024) /* small_gemm's one-thread rule, on the bytes read */

typedef uint8_t bytes16 __attribute__((vector_size(16)));
typedef int8_t sbytes16 __attribute__((vector_size(16)));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t uvec __attribute__((vector_size(LANES * sizeof(uint32_t))));

/* IEEE half to float, exact (subnormal halves become normal floats). */
static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | mant << 13; /* inf, nan */
    } else if (exp) {
        bits = sign | (exp + 112) << 23 | mant << 13;
    } else { /* zero or subnormal: mant * 2^-24, exact in float */
        float f = (float)mant * 0x1p-24f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline bytes16 load16(const uint8_t *p) {
    bytes16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The formats: a block's 32 weights as lo (weights 0-15) and hi (16-31), as ggml lays them out. */
enum { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 };

/* The fifth bit of each weight of a Q5 block: bit j of qh for weight j. */
static inline void q5_high_bits(const uint8_t *qh_bytes, ivec *lo, ivec *hi) {
    const uvec shift = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    uint32_t qh;
    memcpy(&qh, qh_bytes, sizeof qh); /* little-endian, as ggml writes it */
    const uvec all = (uvec){0} + qh;
    *lo = (ivec)(((all >> shift) & 1) << 4);
    *hi = (ivec)(((all >> (shift + 16)) & 1) << 4);
}

static inline __attribute__((always_inline)) void dequantize(int FMT, const uint8_t *b, vec *lo, vec *hi) {
    const float d = half_to_float(b);
    if (FMT == Q8_0) { /* half d, int8 q[32]: d * q */
        sbytes16 q0, q1;
        memcpy(&q0, b + 2, 16);
        memcpy(&q1, b + 18, 16);
        *lo = __builtin_convertvector(q0, vec) * d;
        *hi = __builtin_convertvector(q1, vec) * d;
    } else if (FMT == Q4_0) { /* half d, nibbles (low: 0-15, high: 16-31): d * (q - 8) */
        const bytes16 q = load16(b + 2);
        *lo = (__builtin_convertvector(q & 15, vec) - 8.0f) * d;
        *hi = (__builtin_convertvector(q >> 4, vec) - 8.0f) * d;
    } else if (FMT == Q4_1) { /* half d, half m, nibbles: d * q + m */
        const float m = half_to_float(b + 2);
        const bytes16 q = load16(b + 4);
        *lo = __builtin_convertvector(q & 15, vec) * d + m;
        *hi = __builtin_convertvector(q >> 4, vec) * d + m;
    } else { /* Q5_0: half d, qh[4], nibbles: d * (q - 16); Q5_1: half d, half m, qh[4], nibbles: d * q + m */
        const uint8_t *qh = b + (FMT == Q5_0 ? 2 : 4);
        const bytes16 q = load16(qh + 4);
        ivec h0, h1;
        q5_high_bits(qh, &h0, &h1);
        const vec q0 = __builtin_convertvector(__builtin_convertvector(q & 15, ivec) | h0, vec);
        const vec q1 = __builtin_convertvector(__builtin_convertvector(q >> 4, ivec) | h1, vec);
        if (FMT == Q5_0) {
            *lo = (q0 - 16.0f) * d;
            *hi = (q1 - 16.0f) * d;
        } else {
            const float m = half_to_float(b + 2);
            *lo = q0 * d + m;
            *hi = q1 * d + m;
        }
    }
}

/* The table of formats: GGML type id (ggml.h's enum ggml_type) and bytes per block of BLOCK_SIZE
 * weights; how each dequantizes is dequantize() above, its driver DRIVERS below. */
#define BLOCK_SIZE 32
static const struct {
    int ggml_type, block_bytes;
} FORMATS[] = {[Q8_0] = {8, 34}, [Q4_0] = {2, 18}, [Q4_1] = {3, 20}, [Q5_0] = {6, 22}, [Q5_1] = {7, 24}};
#define NUM_FORMATS ((int)(sizeof FORMATS / sizeof FORMATS[0]))

/* Output n for M rows of x (M a compile-time constant at each call site): each block
 * dequantized once for all M rows, small_gemm's FMAs lane for lane. */
static inline __attribute__((always_inline)) void quant_row(
        int FMT, int M, const float *x, const uint8_t *w, const float *bias, float *y,
        int64_t n, int64_t N, int64_t K) {
    vec acc[QUANT_ROW_BLOCK];
    for (int m = 0; m < M; ++m) acc[m] = (vec){0};
    const uint8_t *wr = w + n * (K / BLOCK_SIZE) * FORMATS[FMT].block_bytes;
    for (int64_t k = 0; k < K; k += BLOCK_SIZE, wr += FORMATS[FMT].block_bytes) {
        vec lo, hi;
        dequantize(FMT, wr, &lo, &hi);
        for (int m = 0; m < M; ++m) {
            acc[m] += load(x + m * K + k) * lo;
            acc[m] += load(x + m * K + k + LANES) * hi;
        }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = lane_sum(acc[m]) + (bias ? bias[n] : 0.0f);
}

/* The driver, one instance per format: outputs split statically over threads, as small_gemm. */
#define DRIVER(FMT)                                                                                           \
    static void gemv_##FMT(const float *x, const uint8_t *w, const float *bias, float *y, int64_t M, int64_t N, \
                           int64_t K, int threads) {                                                          \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                     \
        for (int64_t n = 0; n < N; ++n) {                                                                     \
            for (int64_t m = 0; m < M; m += QUANT_ROW_BLOCK) {                                                \
                const float *xm = x + m * K;                                                                  \
                float *ym = y + m * N;                                                                        \
                switch (M - m < QUANT_ROW_BLOCK ? M - m : QUANT_ROW_BLOCK) {                                  \
                    case 1: quant_row(FMT, 1, xm, w, bias, ym, n, N, K); break;                               \
                    case 2: quant_row(FMT, 2, xm, w, bias, ym, n, N, K); break;                               \
                    case 3: quant_row(FMT, 3, xm, w, bias, ym, n, N, K); break;                               \
                    case 4: quant_row(FMT, 4, xm, w, bias, ym, n, N, K); break;                               \
                    case 5: quant_row(FMT, 5, xm, w, bias, ym, n, N, K); break;                               \
                    case 6: quant_row(FMT, 6, xm, w, bias, ym, n, N, K); break;                               \
                    case 7: quant_row(FMT, 7, xm, w, bias, ym, n, N, K); break;                               \
                    default: quant_row(FMT, 8, xm, w, bias, ym, n, N, K); break;                              \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }
DRIVER(Q8_0) DRIVER(Q4_0) DRIVER(Q4_1) DRIVER(Q5_0) DRIVER(Q5_1)

typedef void (*quant_fn)(const float *, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t, int);

static const quant_fn DRIVERS[] = {[Q8_0] = gemv_Q8_0, [Q4_0] = gemv_Q4_0, [Q4_1] = gemv_Q4_1,
                                   [Q5_0] = gemv_Q5_0, [Q5_1] = gemv_Q5_1};

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
    *block_size = BLOCK_SIZE;
    *block_bytes = FORMATS[f].block_bytes;
    return 0;
}

/* threads <= 0: small_gemm's rule on the bytes read (one thread for one row below 1.5 MiB,
 * else every thread); otherwise capped at OpenMP's maximum. Returns 0; -1 when M is out of
 * range, -2 for a type without a kernel, -3 when K is not a multiple of the block size. */
int specray_quant_gemv(int ggml_type, const float *x, const uint8_t *w, const float *bias, float *y, int64_t M,
                       int64_t N, int64_t K, int threads) {
    if (M < 1 || M > QUANT_MAX_ROWS) return -1;
    const int f = find_format(ggml_type);
    if (f < 0) return -2;
    if (K % BLOCK_SIZE) return -3;
    const int all = omp_get_max_threads();
    if (threads <= 0) {
        const double bytes = (double)N * (K / BLOCK_SIZE) * FORMATS[f].block_bytes;
        threads = M == 1 && bytes < QUANT_PARALLEL_MIN_BYTES ? 1 : all;
    }
    if (threads > all) threads = all;
    DRIVERS[f](x, w, bias, y, M, N, K, threads);
    return 0;
}
