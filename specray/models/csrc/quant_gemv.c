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
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define QUANT_MAX_ROWS 32 /* small_gemm's limit (SMALL_GEMM_MAX_ROWS) */
#define QUANT_ROW_BLOCK 8 /* rows of x per pass over the rows of w: accumulators in registers */
#define QUANT_MAX_COLUMNS 4 /* rows of w per pass (quant_rows) */
#define QUANT_PARALLEL_MIN_BYTES (1.5 * 1024 * 1024) /* small_gemm's one-thread rule (PARALLEL_MIN_BYTES) */

typedef uint8_t bytes16 __attribute__((vector_size(16)));
typedef int8_t sbytes16 __attribute__((vector_size(16)));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t uvec __attribute__((vector_size(LANES * sizeof(uint32_t))));

/* IEEE half to float, exact (subnormal halves become normal floats): F16C's vcvtph2ps where
 * the machine has it (the bit arithmetic below cost about half of a Q4_1 block's time). */
static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
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

/* 16 bytes to 16 floats (exact). GCC 12 widens a byte vector to floats lane by lane
 * (vpinsrd, measured 5-10x slower than float32), so the x86 widening instructions are
 * named where the machine has them; the generic form serves the others. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline ivec unsigned_to_ivec(bytes16 q) { return (ivec)_mm512_cvtepu8_epi32((__m128i)q); }
static inline ivec signed_to_ivec(sbytes16 q) { return (ivec)_mm512_cvtepi8_epi32((__m128i)q); }
#elif defined(__AVX2__)
#include <immintrin.h>
static inline ivec two_halves(__m256i lo, __m256i hi) {
    ivec v;
    memcpy(&v, &lo, sizeof lo);
    memcpy((char *)&v + sizeof lo, &hi, sizeof hi);
    return v;
}
static inline ivec unsigned_to_ivec(bytes16 q) {
    return two_halves(_mm256_cvtepu8_epi32((__m128i)q), _mm256_cvtepu8_epi32(_mm_srli_si128((__m128i)q, 8)));
}
static inline ivec signed_to_ivec(sbytes16 q) {
    return two_halves(_mm256_cvtepi8_epi32((__m128i)q), _mm256_cvtepi8_epi32(_mm_srli_si128((__m128i)q, 8)));
}
#else
static inline ivec unsigned_to_ivec(bytes16 q) { return __builtin_convertvector(q, ivec); }
static inline ivec signed_to_ivec(sbytes16 q) { return __builtin_convertvector(q, ivec); }
#endif
static inline vec unsigned_to_vec(bytes16 q) { return __builtin_convertvector(unsigned_to_ivec(q), vec); }
static inline vec signed_to_vec(sbytes16 q) { return __builtin_convertvector(signed_to_ivec(q), vec); }

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
        *lo = signed_to_vec(q0) * d;
        *hi = signed_to_vec(q1) * d;
    } else if (FMT == Q4_0) { /* half d, nibbles (low: 0-15, high: 16-31): d * (q - 8) */
        const ivec q = unsigned_to_ivec(load16(b + 2)); /* nibbles split in int32 lanes: x86 has no byte shift */
        *lo = (__builtin_convertvector(q & 15, vec) - 8.0f) * d;
        *hi = (__builtin_convertvector(q >> 4, vec) - 8.0f) * d;
    } else if (FMT == Q4_1) { /* half d, half m, nibbles: d * q + m */
        const float m = half_to_float(b + 2);
        const ivec q = unsigned_to_ivec(load16(b + 4));
        *lo = __builtin_convertvector(q & 15, vec) * d + m;
        *hi = __builtin_convertvector(q >> 4, vec) * d + m;
    } else { /* Q5_0: half d, qh[4], nibbles: d * (q - 16); Q5_1: half d, half m, qh[4], nibbles: d * q + m */
        const uint8_t *qh = b + (FMT == Q5_0 ? 2 : 4);
        const ivec q = unsigned_to_ivec(load16(qh + 4));
        ivec h0, h1;
        q5_high_bits(qh, &h0, &h1);
        const vec q0 = __builtin_convertvector((q & 15) | h0, vec);
        const vec q1 = __builtin_convertvector((q >> 4) | h1, vec);
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

/* Outputs n .. n + C - 1 for M rows of x (C, M compile-time constants at each call site):
 * each block dequantized once for all M rows, small_gemm's FMAs lane for lane. C rows of w at
 * a time because one output's sum is one chain of dependent FMAs (small_gemm's order), and a
 * block of 32 quantized weights is only 18-34 bytes: one chain would read 20 bytes per two
 * FMA latencies (~4 GB/s measured for Q4_1); C independent chains keep C times that in flight. */
static inline __attribute__((always_inline)) void quant_rows(
        int FMT, int C, int M, const float *x, const uint8_t *w, const float *bias, float *y,
        int64_t n, int64_t N, int64_t K) {
    vec acc[QUANT_ROW_BLOCK][QUANT_MAX_COLUMNS];
    const uint8_t *wr[QUANT_MAX_COLUMNS];
    const int64_t row_bytes = (K / BLOCK_SIZE) * FORMATS[FMT].block_bytes;
    for (int c = 0; c < C; ++c) wr[c] = w + (n + c) * row_bytes;
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < C; ++c) acc[m][c] = (vec){0};
    for (int64_t k = 0, at = 0; k < K; k += BLOCK_SIZE, at += FORMATS[FMT].block_bytes) {
        vec lo[QUANT_MAX_COLUMNS], hi[QUANT_MAX_COLUMNS];
        for (int c = 0; c < C; ++c) dequantize(FMT, wr[c] + at, &lo[c], &hi[c]);
        for (int m = 0; m < M; ++m) {
            const vec xl = load(x + m * K + k), xh = load(x + m * K + k + LANES);
            for (int c = 0; c < C; ++c) {
                acc[m][c] += xl * lo[c];
                acc[m][c] += xh * hi[c];
            }
        }
    }
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < C; ++c) y[m * N + n + c] = lane_sum(acc[m][c]) + (bias ? bias[n + c] : 0.0f);
}

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
 * rows of x must stay in registers (32 on AVX-512): 4 up to 2 rows, 2 up to 4, else 1 (M chains). */
static inline int columns_for(int64_t M) { return M <= 2 ? 4 : M <= 4 ? 2 : 1; }

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
            case 4: PASS(FMT, 4); break;                                                                      \
            case 2: PASS(FMT, 2); break;                                                                      \
            default: PASS(FMT, 1); break;                                                                     \
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

/* threads <= 0: small_gemm's rule (one thread for one row below 1.5 MiB of float32 weight,
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
        /* on the float32 weight's size, as small_gemm: the time goes into dequantizing and
         * FMAs, which scale with the weights, not the bytes read */
        const double work = (double)N * K * sizeof(float);
        threads = M == 1 && work < QUANT_PARALLEL_MIN_BYTES ? 1 : all;
    }
    if (threads > all) threads = all;
    DRIVERS[f](x, w, bias, y, M, N, K, threads);
    return 0;
}
