/* SPECRAY_CPU_QUANT=fast: y = x W^T (+ bias) with int8 activations and VNNI's vpdpbusd, for
 * Q4_0, Q4_1 and Q8_0 weights repacked 16 output rows at a time. Not the float32 path's bits
 * (quant_gemv.c is that); deterministic, and each row of x gives the same bits whatever the
 * number of rows or threads, so a verify row equals its decode row.
 *
 * The rule, per row of x and block b of 32 (as llama.cpp's Q8_1 activations, with a float32 scale):
 *   da = amax / 127, q = rint(x * (127 / amax)), sq = sum(q); a block with amax <= 2^-120
 *   (0, or so small that 127 / amax would overflow) has da = 0 and q = 0
 *   Q8_0: dot = sum((w + 128) * q) - 128 sq     (vpdpbusd takes unsigned weights)
 *   Q4_0: dot = sum(nibble * q) - 8 sq
 *   Q4_1: dot = sum(nibble * q)
 *   acc = fma(float(dot), dw * da, acc); Q4_1 then acc = fma(mw, da * sq, acc)
 * over b in order; y = acc (+ bias). dot is exact in int32 (|dot| <= 32 * 255 * 127).
 *
 * Why repack: one 512-bit vpdpbusd does 64 multiply-adds, but only with its 16 int32 lanes each
 * summing 4 bytes of one output. Lane j holds output row n + j: the 4 activation bytes are the
 * same for all 16 lanes (one embedded broadcast), the 16 scales are one vcvtph2ps, and the sums
 * come out as 16 outputs with no horizontal add. The layout of a group of 16 rows, block by
 * block (the same bytes as the GGUF rows: 16 blocks of each row per block of the group):
 *   Q4_0: d[16] (fp16), then 4 steps of 64 bytes: step i, lane j = row j's nibble bytes 4i..4i+3
 *         (low nibbles: weights 4i..4i+3, high nibbles: 16 + 4i..)
 *   Q4_1: d[16], m[16], then the same 4 steps
 *   Q8_0: d[16], then 8 steps: step i, lane j = row j's bytes 4i..4i+3, each XOR 0x80 (+128)
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_formats.h"

#define FAST_ROWS 16 /* output rows per group: one 512-bit vector of int32 or float lanes */
#define FAST_PASS 4 /* rows of x per pass over a group's blocks, their accumulators in registers */
#define FAST_MIN_AMAX 0x1p-120f /* below this 127 / amax overflows or nearly: the block quantizes to 0 */
#define FAST_STACK_BYTES (32 * 1024) /* the int8 rows up to this size live on the caller's stack */
/* One row of x takes one thread below this many bytes of weight: from memory (200 copies cycled,
 * Q4_1, K = 576, 2026-12-06) one and two threads took the same time at 45 KiB, two were 3% faster
 * at 68 KiB and 18% at 338 KiB. */
#define FAST_PARALLEL_MIN_BYTES (64 * 1024)

/* The formats with a fast kernel, by quant_formats.h's index; -1 where there is none. */
static int fast_format(int ggml_type) {
    for (int f = 0; f < NUM_FORMATS; ++f)
        if (FORMATS[f].ggml_type == ggml_type) return f == Q8_0 || f == Q4_0 || f == Q4_1 ? f : -1;
    return -1;
}

static int scale_bytes(int f) { return f == Q4_1 ? 4 : 2; } /* d (and m) at the front of a block */

/* 1 where this build has a fast kernel for the GGML type, else 0 (quant_kernels.py reads it once). */
int specray_quant_fast_has_kernel(int ggml_type) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return fast_format(ggml_type) >= 0;
#else
    (void)ggml_type;
    return 0;
#endif
}

int specray_quant_fast_available(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

/* GGUF rows [N, K / 32 blocks] to the layout above. Returns 0; -2 for a type without a fast
 * kernel, -3 when K is not a multiple of 32 or N of 16. */
int specray_quant_fast_repack(int ggml_type, const uint8_t *w, uint8_t *out, int64_t N, int64_t K) {
    const int f = fast_format(ggml_type);
    if (f < 0) return -2;
    if (K % BLOCK_SIZE || N % FAST_ROWS) return -3;
    const int bytes = FORMATS[f].block_bytes, head = scale_bytes(f), steps = f == Q8_0 ? 8 : 4;
    const int64_t blocks = K / BLOCK_SIZE;
    for (int64_t g = 0; g < N / FAST_ROWS; ++g)
        for (int64_t b = 0; b < blocks; ++b) {
            uint8_t *o = out + (g * blocks + b) * FAST_ROWS * bytes;
            for (int j = 0; j < FAST_ROWS; ++j) {
                const uint8_t *src = w + ((g * FAST_ROWS + j) * blocks + b) * bytes;
                memcpy(o + 2 * j, src, 2);                                    /* d */
                if (f == Q4_1) memcpy(o + 2 * FAST_ROWS + 2 * j, src + 2, 2); /* m */
                for (int i = 0; i < steps; ++i)
                    for (int t = 0; t < 4; ++t) {
                        const uint8_t q = src[head + 4 * i + t];
                        o[head * FAST_ROWS + (i * FAST_ROWS + j) * 4 + t] = f == Q8_0 ? q ^ 0x80 : q;
                    }
            }
        }
    return 0;
}

/* Rows ids[0..n) of a repacked weight as float32 [n, K]: gguf.quants.dequantize's values (an
 * embedding lookup on a tied head). Returns 0, or the repack's codes. */
int specray_quant_fast_rows(int ggml_type, const uint8_t *w, const int64_t *ids, int64_t n, float *out, int64_t K) {
    const int f = fast_format(ggml_type);
    if (f < 0) return -2;
    if (K % BLOCK_SIZE) return -3;
    const int bytes = FORMATS[f].block_bytes, head = scale_bytes(f), steps = f == Q8_0 ? 8 : 4;
    const int64_t blocks = K / BLOCK_SIZE;
    for (int64_t r = 0; r < n; ++r) {
        const int64_t g = ids[r] / FAST_ROWS, j = ids[r] % FAST_ROWS;
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t *o = w + (g * blocks + b) * FAST_ROWS * bytes;
            uint8_t block[34]; /* the GGUF block back, then quant_gemv.c's dequantizer */
            memcpy(block, o + 2 * j, 2);
            if (f == Q4_1) memcpy(block + 2, o + 2 * FAST_ROWS + 2 * j, 2);
            for (int i = 0; i < steps; ++i)
                for (int t = 0; t < 4; ++t) {
                    const uint8_t q = o[head * FAST_ROWS + (i * FAST_ROWS + j) * 4 + t];
                    block[head + 4 * i + t] = f == Q8_0 ? q ^ 0x80 : q;
                }
            float *y = out + r * K + b * BLOCK_SIZE;
            for (int t = 0; t < BLOCK_SIZE; ++t) {
                const float d = half_to_float(block);
                if (f == Q8_0) {
                    y[t] = d * (float)(int8_t)block[2 + t];
                } else {
                    const int q = t < 16 ? block[head + t] & 15 : block[head + t - 16] >> 4;
                    y[t] = f == Q4_0 ? ((float)q - 8.0f) * d : __builtin_fmaf((float)q, d, half_to_float(block + 2));
                }
            }
        }
    }
    return 0;
}

/* One row of x's blocks as the rule says: q (int8 [K]), da and the offset term per block. */
typedef struct {
    int8_t *q;
    float *da, *s; /* s: da * sq (Q4_1's m term) */
    int32_t *sq;
} act_blocks;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* vcvtps2dq rounds half to even (the default MXCSR), as the rule's rint. */
static void quantize_row(const float *x, int64_t K, act_blocks a) {
    for (int64_t b = 0; b < K / BLOCK_SIZE; ++b) {
        const __m512 lo = _mm512_loadu_ps(x + b * BLOCK_SIZE), hi = _mm512_loadu_ps(x + b * BLOCK_SIZE + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float kept = amax > FAST_MIN_AMAX ? amax : 0.0f;
        const __m512 id = _mm512_set1_ps(kept > 0.0f ? 127.0f / kept : 0.0f);
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, id)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, id));
        _mm_storeu_si128((__m128i *)(a.q + b * BLOCK_SIZE), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(a.q + b * BLOCK_SIZE + 16), _mm512_cvtsepi32_epi8(qhi));
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        a.da[b] = kept / 127.0f;
        a.sq[b] = sum;
        a.s[b] = a.da[b] * (float)sum;
    }
}

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* Outputs [n, n + 16) for R rows of x (R a compile-time constant at each call site). */
static inline __attribute__((always_inline)) void fast_group(int FMT, int R, const act_blocks *a, const uint8_t *w,
                                                             const float *bias, float *y, int64_t n, int64_t N,
                                                             int64_t K) {
    const int64_t blocks = K / BLOCK_SIZE, bytes = FORMATS[FMT].block_bytes * FAST_ROWS;
    const int head = scale_bytes(FMT) * FAST_ROWS;
    const __m512i nib = _mm512_set1_epi8(15);
    __m512 acc[FAST_PASS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t *g = w + n / FAST_ROWS * blocks * bytes;
    for (int64_t b = 0; b < blocks; ++b, g += bytes) {
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
        const __m512 mw = FMT == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 2 * FAST_ROWS)))
                                      : _mm512_setzero_ps();
        __m512i q[8];
        if (FMT == Q8_0) {
            for (int i = 0; i < 8; ++i) q[i] = _mm512_loadu_si512(g + head + 64 * i);
        } else {
            for (int i = 0; i < 4; ++i) {
                const __m512i v = _mm512_loadu_si512(g + head + 64 * i);
                q[2 * i] = _mm512_and_si512(v, nib);
                q[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
            }
        }
        for (int r = 0; r < R; ++r) {
            const int8_t *xq = a[r].q + b * BLOCK_SIZE;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512(); /* two chains: vpdpbusd's latency */
            if (FMT == Q8_0) {
                for (int i = 0; i < 8; i += 2) {
                    s0 = _mm512_dpbusd_epi32(s0, q[i], bcast4(xq + 4 * i));
                    s1 = _mm512_dpbusd_epi32(s1, q[i + 1], bcast4(xq + 4 * i + 4));
                }
            } else {
                for (int i = 0; i < 4; ++i) {
                    s0 = _mm512_dpbusd_epi32(s0, q[2 * i], bcast4(xq + 4 * i));
                    s1 = _mm512_dpbusd_epi32(s1, q[2 * i + 1], bcast4(xq + 16 + 4 * i));
                }
            }
            __m512i dot = _mm512_add_epi32(s0, s1);
            if (FMT != Q4_1) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32((FMT == Q8_0 ? 128 : 8) * a[r].sq[b]));
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a[r].da[b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
            if (FMT == Q4_1) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a[r].s[b]), acc[r]);
        }
    }
    const __m512 bv = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N + n, _mm512_add_ps(acc[r], bv));
}

/* One function per format, so that FMT is a constant inside the OpenMP region (an outlined
 * region takes its captured variables as data, and the format branches would stay in the loop). */
#define FAST_DRIVER(FMT)                                                                                    \
    static void fast_##FMT(const act_blocks *a, const uint8_t *w, const float *bias, float *y, int64_t M,    \
                           int64_t N, int64_t K, int threads) {                                             \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                   \
        for (int64_t n = 0; n < N; n += FAST_ROWS)                                                          \
            for (int64_t m = 0; m < M; m += FAST_PASS) {                                                    \
                switch (M - m < FAST_PASS ? M - m : FAST_PASS) {                                            \
                    case 1: fast_group(FMT, 1, a + m, w, bias, y + m * N, n, N, K); break;                  \
                    case 2: fast_group(FMT, 2, a + m, w, bias, y + m * N, n, N, K); break;                  \
                    case 3: fast_group(FMT, 3, a + m, w, bias, y + m * N, n, N, K); break;                  \
                    default: fast_group(FMT, 4, a + m, w, bias, y + m * N, n, N, K); break;                 \
                }                                                                                           \
            }                                                                                               \
    }
FAST_DRIVER(Q8_0) FAST_DRIVER(Q4_0) FAST_DRIVER(Q4_1)
#endif

/* threads <= 0: one thread for one row below FAST_PARALLEL_MIN_BYTES of weight, else every
 * thread. Returns 0; -1 when M < 1 or scratch could not be had, -2 for a type without a fast
 * kernel (or a machine without VNNI), -3 when K is not a multiple of 32 or N of 16. */
int specray_quant_fast_gemv(int ggml_type, const float *x, const uint8_t *w, const float *bias, float *y, int64_t M,
                            int64_t N, int64_t K, int threads) {
    const int f = fast_format(ggml_type);
    if (f < 0 || !specray_quant_fast_available()) return -2;
    if (K % BLOCK_SIZE || N % FAST_ROWS) return -3;
    if (M < 1) return -1;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const int64_t blocks = K / BLOCK_SIZE;
    const size_t need = M * (sizeof(act_blocks) + K + blocks * (2 * sizeof(float) + sizeof(int32_t)));
    uint64_t on_stack[need <= FAST_STACK_BYTES ? (need + 7) / 8 : 1]; /* a decode step's rows: no malloc */
    act_blocks *a = need <= FAST_STACK_BYTES ? (act_blocks *)on_stack : malloc(need);
    if (!a) return -1;
    int8_t *q = (int8_t *)(a + M);
    float *da = (float *)(q + M * K), *s = da + M * blocks;
    int32_t *sq = (int32_t *)(s + M * blocks);
    for (int64_t m = 0; m < M; ++m) {
        a[m] = (act_blocks){q + m * K, da + m * blocks, s + m * blocks, sq + m * blocks};
        quantize_row(x + m * K, K, a[m]);
    }
    const int all = omp_get_max_threads();
    if (threads <= 0) threads = M == 1 && N / FAST_ROWS * blocks * FAST_ROWS * FORMATS[f].block_bytes <
                                    FAST_PARALLEL_MIN_BYTES ? 1 : all;
    if (threads > all) threads = all;
    if (f == Q8_0) fast_Q8_0(a, w, bias, y, M, N, K, threads);
    else if (f == Q4_0) fast_Q4_0(a, w, bias, y, M, N, K, threads);
    else fast_Q4_1(a, w, bias, y, M, N, K, threads);
    if (need > FAST_STACK_BYTES) free(a);
    return 0;
#else
    (void)x, (void)w, (void)bias, (void)y, (void)threads;
    return -2;
#endif
}
