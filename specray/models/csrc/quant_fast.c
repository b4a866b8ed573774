/* SPECRAY_CPU_QUANT=fast: y = x W^T (+ bias) with int8 activations and VNNI's vpdpbusd, for
 * every format of quant_formats.h but BF16, the weights repacked 16 output rows at a time
 * (quant_fast_layout.c).
 * Not the float32 path's bits (quant_gemv.c is that); deterministic, and each row of x gives the
 * same bits whatever the number of rows or threads, so a verify row equals its decode row.
 *
 * The rule, per row of x and block b of 32 (as llama.cpp's Q8_1 activations, with a float32 scale):
 *   da = amax / 127, q = rint(x * (127 / amax)), sq = sum(q) (sq_lo, sq_hi: over its two halves of
 *   16); a block with amax <= 2^-120 (0, or so small that 127 / amax would overflow) has da = 0
 *   and q = 0. Then, over the weight's blocks of 32 in order (a K-quant's sub-blocks):
 *   Q8_0: dot = sum((w + 128) * q) - 128 sq     (vpdpbusd takes unsigned weights)
 *   Q4_0: dot = sum(nibble * q) - 8 sq
 *   Q4_1: dot = sum(nibble * q)                  dw = d, mw = m
 *   Q5_0: dot = sum(q5 * q) - 16 sq              (q5 = nibble | the weight's qh bit << 4)
 *   Q5_1: dot = sum(q5 * q)                      dw = d, mw = m
 *   Q4_K: dot = sum(nibble * q)                  dw = d * sc, mw = -(dmin * m) (both exact)
 *   Q6_K: dot = sc_lo (sum_lo(u * q) - 32 sq_lo) + sc_hi (sum_hi(u * q) - 32 sq_hi), u = q6 + 32
 *         in 0..63 and sc the int8 scale of each half; dw = d
 *   acc = fma(float(dot), dw * da, acc); Q4_1, Q5_1 and Q4_K then acc = fma(mw, da * sq, acc)
 * and y = acc (+ bias). dot is exact in int32 and float(dot) exact in float32 (|dot| < 2^24:
 * at most 32 * 255 * 127, or Q6_K's 2 * 128 * 16 * 32 * 127).
 *
 * Why repack: one 512-bit vpdpbusd does 64 multiply-adds, but only with its 16 int32 lanes each
 * summing 4 bytes of one output. Lane j holds output row n + j: the 4 activation bytes are the
 * same for all 16 lanes (one embedded broadcast), the 16 scales are one vcvtph2ps, and the sums
 * come out as 16 outputs with no horizontal add. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_fast.h"

#define FAST_PASS 4 /* rows of x per pass over a group's blocks, their accumulators in registers */
#define FAST_MIN_AMAX 0x1p-120f /* below this 127 / amax overflows or nearly: the block quantizes to 0 */
#define FAST_STACK_BYTES (32 * 1024) /* the int8 rows up to this size live on the caller's stack */
/* One row of x takes one thread below this many bytes of weight: from memory (200 copies cycled,
 * Q4_1, K = 576, 2026-12-06) one and two threads took the same time at 45 KiB, two were 3% faster
 * at 68 KiB and 18% at 338 KiB. */
#define FAST_PARALLEL_MIN_BYTES (64 * 1024)

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

/* One row of x's blocks as the rule says: q (int8 [K]), da and the offset term per block. */
typedef struct {
    int8_t *q;
    float *da, *s; /* s: da * sq (the m term of Q4_1, Q5_1 and Q4_K) */
    int32_t *sq, *sq_half; /* sq_half: 2 per block, over weights 0-15 and 16-31 (Q6_K's scales) */
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
        a.sq_half[2 * b] = _mm512_reduce_add_epi32(qlo);
        a.sq_half[2 * b + 1] = _mm512_reduce_add_epi32(qhi);
        const int32_t sum = a.sq_half[2 * b] + a.sq_half[2 * b + 1];
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

/* Q4_K's 6-bit scales and mins of its 8 sub-blocks for a group's 16 rows, from the 12 scale
 * bytes laid out [byte][row] (gguf.quants.Q4_K.get_scale_min, 16 rows at once; the 16-bit shifts
 * carry bits across bytes only where the masks drop them). */
static inline void q4k_scales16(const uint8_t *packed, __m128i sc[8], __m128i m[8]) {
    __m128i s[12];
    for (int k = 0; k < 12; ++k) s[k] = _mm_loadu_si128((const __m128i *)(packed + 16 * k));
    const __m128i low6 = _mm_set1_epi8(63), low4 = _mm_set1_epi8(15), top2 = _mm_set1_epi8(0x30);
    for (int j = 0; j < 4; ++j) {
        sc[j] = _mm_and_si128(s[j], low6);
        m[j] = _mm_and_si128(s[j + 4], low6);
        sc[j + 4] = _mm_or_si128(_mm_and_si128(s[j + 8], low4), _mm_and_si128(_mm_srli_epi16(s[j], 2), top2));
        m[j + 4] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(s[j + 8], 4), low4),
                                _mm_and_si128(_mm_srli_epi16(s[j + 4], 2), top2));
    }
}

static inline __m512 bytes_to_ps(__m128i v, int is_signed) {
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}

/* The K-quants' outputs [n, n + 16) for R rows of x: super-block by super-block, its 8
 * sub-blocks of 32 weights each one block of the activations (quant_fast_layout.c's offsets). */
static inline __attribute__((always_inline)) void fast_kgroup(int FMT, int R, const act_blocks *a, const uint8_t *w,
                                                              const float *bias, float *y, int64_t n, int64_t N,
                                                              int64_t K) {
    const int64_t supers = K / 256, bytes = FORMATS[FMT].block_bytes * FAST_ROWS;
    const __m512i nib = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3);
    __m512 acc[FAST_PASS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t *g = w + n / FAST_ROWS * supers * bytes;
    for (int64_t sb = 0; sb < supers; ++sb, g += bytes) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
        __m128i sc[8], mins[8];
        if (FMT == Q4_K) q4k_scales16(g + 64, sc, mins);
        for (int c = 0; c < 8; ++c) {
            const int64_t blk = sb * 8 + c;
            if (FMT == Q6_K) /* an eighth of the super-block after next per sub-block (1.3x from
                                * memory; a prefetch past the weight does not fault) */
                for (int64_t at = c * bytes / 8; at < (c + 1) * bytes / 8; at += 64)
                    _mm_prefetch((const char *)g + 2 * bytes + at, _MM_HINT_T0);
            __m512i q[8];
            __m512 dw, mw = _mm512_setzero_ps();
            __m512i sc_lo = _mm512_setzero_si512(), sc_hi = _mm512_setzero_si512();
            if (FMT == Q4_K) { /* sub-blocks 2p and 2p + 1: the low and high nibbles of steps 8p .. */
                const uint8_t *qs = g + 256 + 64 * 8 * (c / 2);
                const __m128i shift = _mm_cvtsi32_si128(4 * (c % 2));
                for (int i = 0; i < 8; ++i) q[i] = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(qs + 64 * i), shift), nib);
                const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 32)));
                dw = _mm512_mul_ps(d, bytes_to_ps(sc[c], 0));
                mw = _mm512_mul_ps(dmin, _mm512_sub_ps(_mm512_setzero_ps(), bytes_to_ps(mins[c], 0)));
            } else { /* Q6_K: the low 4 bits from ql, the top 2 from qh, as gguf's chunk c */
                const uint8_t *qh = g + 288 + 1536 * (c / 4), *ql = qh + 512 + 64 * 8 * (c % 2);
                const __m128i lshift = _mm_cvtsi32_si128(4 * ((c % 4) / 2)), hshift = _mm_cvtsi32_si128(2 * (c % 4));
                for (int i = 0; i < 8; ++i) {
                    const __m512i low = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(ql + 64 * i), lshift), nib);
                    const __m512i top = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(qh + 64 * i), hshift), two);
                    q[i] = _mm512_or_si512(low, _mm512_slli_epi16(top, 4));
                }
                dw = d;
                sc_lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(g + 32 + 16 * (2 * c))));
                sc_hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(g + 32 + 16 * (2 * c + 1))));
            }
            for (int r = 0; r < R; ++r) {
                const int8_t *xq = a[r].q + blk * BLOCK_SIZE;
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512(); /* weights 0-15, 16-31 */
                for (int i = 0; i < 4; ++i) {
                    s0 = _mm512_dpbusd_epi32(s0, q[i], bcast4(xq + 4 * i));
                    s1 = _mm512_dpbusd_epi32(s1, q[i + 4], bcast4(xq + 16 + 4 * i));
                }
                __m512i dot;
                if (FMT == Q4_K) {
                    dot = _mm512_add_epi32(s0, s1);
                } else {
                    s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(32 * a[r].sq_half[2 * blk]));
                    s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(32 * a[r].sq_half[2 * blk + 1]));
                    dot = _mm512_add_epi32(_mm512_mullo_epi32(s0, sc_lo), _mm512_mullo_epi32(s1, sc_hi));
                }
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(a[r].da[blk])), acc[r]);
                if (FMT == Q4_K) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a[r].s[blk]), acc[r]);
            }
        }
    }
    const __m512 bv = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N + n, _mm512_add_ps(acc[r], bv));
}

/* Outputs [n, n + 16) for R rows of x (R a compile-time constant at each call site). */
static inline __attribute__((always_inline)) void fast_group(int FMT, int R, const act_blocks *a, const uint8_t *w,
                                                             const float *bias, float *y, int64_t n, int64_t N,
                                                             int64_t K) {
    if (FMT == Q4_K || FMT == Q6_K) {
        fast_kgroup(FMT, R, a, w, bias, y, n, N, K);
        return;
    }
    const int64_t blocks = K / BLOCK_SIZE, bytes = FORMATS[FMT].block_bytes * FAST_ROWS;
    const int has_m = FMT == Q4_1 || FMT == Q5_1, has_qh = FMT == Q5_0 || FMT == Q5_1;
    const int qh_at = 32 * (1 + has_m), head = qh_at + 64 * has_qh; /* d (and m): 16 fp16 each; qh: 16 x 4 */
    const __m512i nib = _mm512_set1_epi8(15);
    /* a Q5 weight's fifth bits: entry t (4 bits of qh) holds 0x10 in byte b where bit b of t is
     * set; vpermd reads only the low 4 bits of each index, so qh >> s needs no mask */
    const __m512i spread = _mm512_setr_epi32(0x00000000, 0x00000010, 0x00001000, 0x00001010, 0x00100000, 0x00100010,
                                             0x00101000, 0x00101010, 0x10000000, 0x10000010, 0x10001000, 0x10001010,
                                             0x10100000, 0x10100010, 0x10101000, 0x10101010);
    __m512 acc[FAST_PASS];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t *g = w + n / FAST_ROWS * blocks * bytes;
    for (int64_t b = 0; b < blocks; ++b, g += bytes) {
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)g));
        const __m512 mw = has_m ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 2 * FAST_ROWS)))
                                : _mm512_setzero_ps();
        __m512i q[8];
        if (FMT == Q8_0) {
            for (int i = 0; i < 8; ++i) q[i] = _mm512_loadu_si512(g + head + 64 * i);
        } else { /* step i: bytes 4i .. 4i + 3 of each row's nibbles, weights 4i .. and 16 + 4i .. */
            const __m512i qh = has_qh ? _mm512_loadu_si512(g + qh_at) : _mm512_setzero_si512();
            for (int i = 0; i < 4; ++i) {
                const __m512i v = _mm512_loadu_si512(g + head + 64 * i);
                q[2 * i] = _mm512_and_si512(v, nib);
                q[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                if (has_qh) { /* weights 4i .. 4i + 3 take qh's bits 4i .., weights 16 + 4i .. bits 16 + 4i .. */
                    const __m512i low_bits = _mm512_permutexvar_epi32(_mm512_srli_epi32(qh, 4 * i), spread);
                    const __m512i high_bits = _mm512_permutexvar_epi32(_mm512_srli_epi32(qh, 16 + 4 * i), spread);
                    q[2 * i] = _mm512_or_si512(q[2 * i], low_bits);
                    q[2 * i + 1] = _mm512_or_si512(q[2 * i + 1], high_bits);
                }
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
            const int zero = FMT == Q8_0 ? 128 : FMT == Q5_0 ? 16 : 8; /* the weights' offset (not Q4_1, Q5_1) */
            if (!has_m) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(zero * a[r].sq[b]));
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a[r].da[b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
            if (has_m) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a[r].s[b]), acc[r]);
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
FAST_DRIVER(Q8_0) FAST_DRIVER(Q4_0) FAST_DRIVER(Q4_1) FAST_DRIVER(Q5_0) FAST_DRIVER(Q5_1) FAST_DRIVER(Q4_K)
FAST_DRIVER(Q6_K)
#endif

/* threads <= 0: one thread for one row below FAST_PARALLEL_MIN_BYTES of weight, else every
 * thread. Returns 0; -1 when M < 1 or scratch could not be had, -2 for a type without a fast
 * kernel (or a machine without VNNI), -3 when K is not a multiple of 32 or N of 16. */
int specray_quant_fast_gemv(int ggml_type, const float *x, const uint8_t *w, const float *bias, float *y, int64_t M,
                            int64_t N, int64_t K, int threads) {
    const int f = fast_format(ggml_type);
    if (f < 0 || !specray_quant_fast_available()) return -2;
    if (K % FORMATS[f].block_weights || N % FAST_ROWS) return -3;
    if (M < 1) return -1;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    const int64_t blocks = K / BLOCK_SIZE;
    const size_t need = M * (sizeof(act_blocks) + K + blocks * (2 * sizeof(float) + 3 * sizeof(int32_t)));
    uint64_t on_stack[need <= FAST_STACK_BYTES ? (need + 7) / 8 : 1]; /* a decode step's rows: no malloc */
    act_blocks *a = need <= FAST_STACK_BYTES ? (act_blocks *)on_stack : malloc(need);
    if (!a) return -1;
    int8_t *q = (int8_t *)(a + M);
    float *da = (float *)(q + M * K), *s = da + M * blocks;
    int32_t *sq = (int32_t *)(s + M * blocks), *sq_half = sq + M * blocks;
    for (int64_t m = 0; m < M; ++m) {
        a[m] = (act_blocks){q + m * K, da + m * blocks, s + m * blocks, sq + m * blocks, sq_half + 2 * m * blocks};
        quantize_row(x + m * K, K, a[m]);
    }
    const int all = omp_get_max_threads();
    const int64_t weight_bytes = N * (K / FORMATS[f].block_weights) * FORMATS[f].block_bytes;
    if (threads <= 0) threads = M == 1 && weight_bytes < FAST_PARALLEL_MIN_BYTES ? 1 : all;
    if (threads > all) threads = all;
    if (f == Q8_0) fast_Q8_0(a, w, bias, y, M, N, K, threads);
    else if (f == Q4_0) fast_Q4_0(a, w, bias, y, M, N, K, threads);
    else if (f == Q4_1) fast_Q4_1(a, w, bias, y, M, N, K, threads);
    else if (f == Q5_0) fast_Q5_0(a, w, bias, y, M, N, K, threads);
    else if (f == Q5_1) fast_Q5_1(a, w, bias, y, M, N, K, threads);
    else if (f == Q4_K) fast_Q4_K(a, w, bias, y, M, N, K, threads);
    else fast_Q6_K(a, w, bias, y, M, N, K, threads);
    if (need > FAST_STACK_BYTES) free(a);
    return 0;
#else
    (void)x, (void)w, (void)bias, (void)y, (void)threads;
    return -2;
#endif
}
