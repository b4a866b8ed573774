/* The GGUF block formats of quant_gemv.c: the table (GGML type id, bytes per block of 32) and how
 * a block dequantizes, exactly as gguf.quants.dequantize does (see quant_gemv.c for why it is
 * exact). Two forms of the same values: 16-float halves of a block where the machine has
 * AVX-512, 8-float quarters elsewhere (AVX2: GCC keeps 16-float vectors in memory around the
 * AVX2 widening instructions, 0.7 GB/s of Q4_1 measured; the quarters read 6.4). On this Zen 4
 * (512-bit ops as two 256-bit halves) the 16-float form was as fast for Q4_1 and 30% faster for
 * Q8_0 from L2 (docs/cpu-kernels.md). */
#ifndef SPECRAY_QUANT_FORMATS_H
#define SPECRAY_QUANT_FORMATS_H

#include <stdint.h>
#include <string.h>

#include "vec.h"
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

/* The formats: a block's 32 weights as lo (weights 0-15) and hi (16-31), as ggml lays them out.
 * BF16 has no blocks in GGUF (one weight, 2 bytes); its "block" here is 32 weights, 64 bytes, so
 * the driver takes it when K is a multiple of 32 (the loader keeps float32 otherwise). */
enum { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16, Q4_K, Q6_K, MXFP4 };

/* The table of formats: GGML type id (ggml.h's enum ggml_type), bytes per block as stored and the
 * weights it holds (32, or a K-quant's super-block of 256); the kernels take 32 weights at a time
 * (chunk c of a super-block: weights 32c .. 32c + 31); how each dequantizes is dequantize() (or
 * dequantize8()) below, its driver in quant_gemv.c. */
#define BLOCK_SIZE 32
static const struct {
    int ggml_type, block_bytes, block_weights;
} FORMATS[] = {[Q8_0] = {8, 34, 32}, [Q4_0] = {2, 18, 32}, [Q4_1] = {3, 20, 32}, [Q5_0] = {6, 22, 32},
               [Q5_1] = {7, 24, 32}, [BF16] = {30, 64, 32}, [Q4_K] = {12, 144, 256}, [Q6_K] = {14, 210, 256},
               [MXFP4] = {39, 17, 32}};
#define NUM_FORMATS ((int)(sizeof FORMATS / sizeof FORMATS[0]))

/* MXFP4 (OCP microscaling, gpt-oss's experts): an E8M0 exponent byte, then 16 bytes of 4-bit E2M1
 * codes laid out as Q4_0's nibbles. gguf.quants.MXFP4 doubles the E2M1 values into small integers
 * and halves the scale: a weight is e8m0_half(e) * MXFP4_VALUES[q], a power of two (2^(e - 128),
 * subnormal for e < 2) times an integer of at most 4 bits, exact in float32 unless it overflows,
 * where numpy's product and this one are both inf (e >= 254). */
static const float MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Q4_K's 6-bit scale and min of sub-block j (gguf.quants.Q4_K.get_scale_min): 12 bytes, the
 * high two bits of sub-blocks 4-7 kept in the top bits of bytes 0-7. */
static inline void q4k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* The K-quants, chunk c of a super-block, as gguf.quants does it in float32:
 *   Q4_K: (d * sc) * q - dmin * m, d * sc and dmin * m exact (11 x 6 bits), (d * sc) * q exact
 *         (17 x 4 bits): one rounding, fma(q, d * sc, -(dmin * m)) rounds it the same;
 *         sub-block c's nibbles: the low (c even) or high (c odd) halves of bytes 32 (c / 2) ..
 *   Q6_K: (d * sc) * (q - 32) with sc int8 per 16 weights: d * sc exact (11 x 8 bits), the
 *         product with a 6-bit q rounds once, here too; q's low 4 bits from ql, top 2 from qh. */
static inline void kquant_chunk(int FMT, const uint8_t *b, int c, float out[BLOCK_SIZE]) {
    if (FMT == Q4_K) {
        int sc, m;
        q4k_scale_min(b + 4, c, &sc, &m);
        const float dsc = half_to_float(b) * (float)sc, dm = half_to_float(b + 2) * (float)m;
        const uint8_t *qs = b + 16 + 32 * (c / 2);
        for (int i = 0; i < BLOCK_SIZE; ++i) out[i] = __builtin_fmaf((float)((qs[i] >> (4 * (c % 2))) & 15), dsc, -dm);
    } else { /* Q6_K: ql[128], qh[64], scales[16] (int8), d */
        const uint8_t *ql = b + 64 * (c / 4) + 32 * (c % 2), *qh = b + 128 + 32 * (c / 4);
        const int ql_shift = 4 * ((c % 4) / 2), qh_shift = 2 * (c % 4);
        const float d = half_to_float(b + 208);
        for (int i = 0; i < BLOCK_SIZE; ++i) {
            const int q = (((ql[i] >> ql_shift) & 15) | (((qh[i] >> qh_shift) & 3) << 4)) - 32;
            out[i] = (d * (float)(int8_t)b[192 + 2 * c + i / 16]) * (float)q;
        }
    }
}

#if defined(__AVX512F__)
/* 16 bytes to 16 int32 lanes (exact): GCC 12 widens a byte vector lane by lane (vpinsrd,
 * measured 5-10x slower than float32), so the AVX-512 widening instructions are named. */
static inline ivec unsigned_to_ivec(bytes16 q) { return (ivec)_mm512_cvtepu8_epi32((__m128i)q); }
static inline ivec signed_to_ivec(sbytes16 q) { return (ivec)_mm512_cvtepi8_epi32((__m128i)q); }
static inline vec unsigned_to_vec(bytes16 q) { return __builtin_convertvector(unsigned_to_ivec(q), vec); }
static inline vec signed_to_vec(sbytes16 q) { return __builtin_convertvector(signed_to_ivec(q), vec); }

/* The 4-bit formats pick each weight from its block's 16 values (q = 0..15 dequantized once, the
 * same operation on the same operands, so the same bits): vpermps reads only the low 4 bits of
 * each index, so the low nibbles need no mask. 12% fewer cycles per Q4_1 block than converting
 * every nibble (a C harness from L2, 16:07 UTC 2026-12-06: 6.65 against 7.56 cycles). */
static inline __attribute__((always_inline)) void nibbles_from_table(const uint8_t *qs, __m512 table, vec *lo, vec *hi) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    *lo = (vec)_mm512_permutexvar_ps(q, table);
    *hi = (vec)_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
}

/* The same for the 5-bit formats, 32 values: the nibble picks from `low` (q = 0..15) and, where
 * the weight's bit of qh (bit j for weight j: a mask as it stands) is set, from `high` (16..31).
 * Against building q with 16 variable shifts a half (the 8-float form still does): Q5_0 1.5-2.2x
 * and Q5_1 ~1.3x the GB/s (one row, two threads, from memory, three interleaved pairs, 12-07 02:05). */
static inline __attribute__((always_inline)) void nibbles_from_tables(const uint8_t *qs, uint32_t fifth, __m512 low,
                                                                      __m512 high, vec *lo, vec *hi) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs)), q4 = _mm512_srli_epi32(q, 4);
    *lo = (vec)_mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(q, low), (__mmask16)fifth, q, high);
    *hi = (vec)_mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(q4, low), (__mmask16)(fifth >> 16), q4, high);
}

/* A K-quant super-block made ready once per row (the driver keeps one per row of w for its 8
 * chunks): Q4_K's 8 sub-blocks' d * sc (scale[0..7]) and -(dmin * m) (scale[8..15]); Q6_K's
 * 16 sub-blocks' d * sc and its 256 values q - 32 in chunk order. Vector ops throughout: done
 * one scale at a time, the scales took about as long as the chunks (exact Q4_K read 11.5 GB/s
 * against Q4_1's 21). */
typedef struct {
    float scale[16];
    int8_t q[256]; /* Q6_K only */
} kquant_block;

static inline __attribute__((always_inline)) void kquant_prepare(int FMT, const uint8_t *b, kquant_block *kb) {
    if (FMT == Q4_K) {
        /* q4k_scale_min for j = 0..7 at once, sc in bytes 0-7 and m in bytes 8-15: j < 4 takes
         * the byte's low 6 bits; j >= 4 a nibble of bytes 8-11 (sc: low, m: high) with the
         * top two bits of byte j - 4 (sc) or j (m) as bits 4-5 */
        const __m128i s = _mm_loadu_si128((const __m128i *)(b + 4)); /* 12 scale bytes, 4 unused */
        const __m128i own = _mm_shuffle_epi8(s, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
        const __m128i top = _mm_shuffle_epi8(s, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
        const __m128i own_keep = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
        const __m128i high_keep = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
        const __m128i v = _mm_or_si128(_mm_or_si128(_mm_and_si128(own, own_keep),
                                                    _mm_and_si128(_mm_srli_epi16(own, 4), high_keep)),
                                       _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));
        /* d for lanes 0-7, -dmin for 8-15: -(dmin * m) is (-dmin) * m, bit for bit */
        int32_t halves;
        memcpy(&halves, b, sizeof halves);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(halves));
        const __m512 by = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                                _mm512_castps128_ps512(dm));
        const __m512 negate_upper = (__m512)_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, INT32_MIN, INT32_MIN, INT32_MIN,
                                                              INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN);
        _mm512_storeu_ps(kb->scale, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)),
                                                  _mm512_xor_ps(by, negate_upper)));
        return;
    }
    /* Q6_K: ql[128], qh[64], scales[16] (int8), d; each half of the super-block (128 weights)
     * has 64 bytes of ql and 32 of qh; its chunk j (0-3) takes ql[32 (j % 2) ..]'s low (j < 2) or
     * high nibbles and bits 2j, 2j + 1 of qh as bits 4-5 (kquant_chunk). 16-bit shifts: the bits
     * a byte takes from its neighbour are masked off. */
    const vec d = (vec){0} + half_to_float(b + 208);
    _mm512_storeu_ps(kb->scale, (__m512)(signed_to_vec((sbytes16)load16(b + 192)) * d));
    const __m256i nibble = _mm256_set1_epi8(15), two_bits = _mm256_set1_epi8(0x30), zero = _mm256_set1_epi8(32);
    for (int half = 0; half < 2; ++half) {
        const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
        const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
        const __m256i q[4] = {
            _mm256_or_si256(_mm256_and_si256(l0, nibble), _mm256_and_si256(_mm256_slli_epi16(h, 4), two_bits)),
            _mm256_or_si256(_mm256_and_si256(l1, nibble), _mm256_and_si256(_mm256_slli_epi16(h, 2), two_bits)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), nibble), _mm256_and_si256(h, two_bits)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), nibble),
                            _mm256_and_si256(_mm256_srli_epi16(h, 2), two_bits))};
        for (int j = 0; j < 4; ++j)
            _mm256_storeu_si256((__m256i *)(kb->q + 128 * half + 32 * j), _mm256_sub_epi8(q[j], zero));
    }
}

/* The K-quants in vectors, chunk c of a super-block made ready by kquant_prepare: the same
 * operations as kquant_chunk (so the same bits). */
static inline __attribute__((always_inline)) void dequantize_k(int FMT, const uint8_t *b, int c, const kquant_block *kb,
                                                               vec *lo, vec *hi) {
    if (FMT == Q4_K) { /* the sub-block's 16 values, then each nibble picks one (as Q4_1) */
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(kb->scale[c]), _mm512_set1_ps(kb->scale[8 + c]));
        const uint8_t *qs = b + 16 + 32 * (c / 2);
        __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
        __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)));
        if (c % 2) {
            q0 = _mm512_srli_epi32(q0, 4);
            q1 = _mm512_srli_epi32(q1, 4);
        }
        *lo = (vec)_mm512_permutexvar_ps(q0, table);
        *hi = (vec)_mm512_permutexvar_ps(q1, table);
        return;
    }
    const uint8_t *q = (const uint8_t *)kb->q + 32 * c;
    *lo = signed_to_vec((sbytes16)load16(q)) * kb->scale[2 * c];
    *hi = signed_to_vec((sbytes16)load16(q + 16)) * kb->scale[2 * c + 1];
}

static inline __attribute__((always_inline)) void dequantize(int FMT, const uint8_t *b, vec *lo, vec *hi) {
    if (FMT == BF16) { /* the top 16 bits of a float32: exact */
        *lo = (vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b)), 16);
        *hi = (vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 32))), 16);
        return;
    }
    if (FMT == MXFP4) { /* the block's 16 values (each product exact), then each nibble picks one */
        nibbles_from_table(b + 1, _mm512_mul_ps(_mm512_loadu_ps(MXFP4_VALUES), _mm512_set1_ps(e8m0_half(b[0]))), lo, hi);
        return;
    }
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (FMT == Q4_1) { /* half d, half m, nibbles: d * q + m; d and m converted together */
        const __m128 dm = _mm_cvtph_ps(_mm_loadu_si128((const __m128i *)b)); /* lanes 2, 3: nibbles, unused */
        const __m512 m = _mm512_permutexvar_ps(_mm512_set1_epi32(1), _mm512_castps128_ps512(dm));
        nibbles_from_table(b + 4, _mm512_fmadd_ps(iota, _mm512_broadcastss_ps(dm), m), lo, hi);
        return;
    }
    const float d = half_to_float(b);
    if (FMT == Q4_0) { /* half d, nibbles (low: 0-15, high: 16-31): d * (q - 8) */
        nibbles_from_table(b + 2, (__m512)(((vec)iota - 8.0f) * d), lo, hi);
        return;
    }
    if (FMT == Q8_0) { /* half d, int8 q[32]: d * q */
        sbytes16 q0, q1;
        memcpy(&q0, b + 2, 16);
        memcpy(&q1, b + 18, 16);
        *lo = signed_to_vec(q0) * d;
        *hi = signed_to_vec(q1) * d;
    } else { /* Q5_0: half d, qh[4], nibbles: d * (q - 16); Q5_1: half d, half m, qh[4], nibbles: d * q + m;
              * d * (q - 16) and d * q are exact, d * q + m one rounding: the table's values are
              * those of every other way of computing them */
        const uint8_t *qh = b + (FMT == Q5_0 ? 2 : 4);
        uint32_t fifth;
        memcpy(&fifth, qh, sizeof fifth); /* little-endian, as ggml writes it */
        const __m512 sixteen = _mm512_set1_ps(16.0f);
        __m512 low, high;
        if (FMT == Q5_0) {
            low = (__m512)(((vec)iota - 16.0f) * d);
            high = (__m512)((vec)iota * d);
        } else {
            const __m512 dv = _mm512_set1_ps(d), m = _mm512_set1_ps(half_to_float(b + 2));
            low = _mm512_fmadd_ps(iota, dv, m);
            high = _mm512_fmadd_ps(_mm512_add_ps(iota, sixteen), dv, m);
        }
        nibbles_from_tables(qh + 4, fifth, low, high, lo, hi);
    }
}

#else
/* The same block as four 8-float quarters w[0..3] (weights 0-7, 8-15, 16-23, 24-31): 256-bit ops. */
typedef int32_t half_ivec __attribute__((vector_size(LANES / 2 * sizeof(int32_t))));
typedef uint32_t half_uvec __attribute__((vector_size(LANES / 2 * sizeof(uint32_t))));
#if defined(__AVX2__) /* vpmovzxbd / vpmovsxbd from 8 bytes */
static inline half_ivec widen8_u(const uint8_t *p) { return (half_ivec)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline half_ivec widen8_s(const uint8_t *p) { return (half_ivec)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#else
typedef uint8_t bytes8 __attribute__((vector_size(8)));
typedef int8_t sbytes8 __attribute__((vector_size(8)));
static inline half_ivec widen8_u(const uint8_t *p) { bytes8 v; memcpy(&v, p, 8); return __builtin_convertvector(v, half_ivec); }
static inline half_ivec widen8_s(const uint8_t *p) { sbytes8 v; memcpy(&v, p, 8); return __builtin_convertvector(v, half_ivec); }
#endif

static inline __attribute__((always_inline)) void dequantize8(int FMT, const uint8_t *b, half_vec w[4]) {
    if (FMT == BF16) { /* the top 16 bits of a float32: exact */
        typedef uint16_t u16x8 __attribute__((vector_size(16)));
        for (int i = 0; i < 4; ++i) {
            u16x8 v;
            memcpy(&v, b + 16 * i, sizeof v);
            const half_uvec bits = __builtin_convertvector(v, half_uvec) << 16;
            memcpy(&w[i], &bits, sizeof bits);
        }
        return;
    }
    if (FMT == MXFP4) { /* weights 0-15 from the low nibbles, 16-31 from the high ones */
        const float d = e8m0_half(b[0]);
        float out[BLOCK_SIZE];
        for (int i = 0; i < BLOCK_SIZE; ++i) out[i] = MXFP4_VALUES[(b[1 + i % 16] >> (4 * (i / 16))) & 15] * d;
        for (int i = 0; i < 4; ++i) memcpy(&w[i], out + 8 * i, sizeof w[i]);
        return;
    }
    const float d = half_to_float(b);
    if (FMT == Q8_0) {
        for (int i = 0; i < 4; ++i) w[i] = __builtin_convertvector(widen8_s(b + 2 + 8 * i), half_vec) * d;
        return;
    }
    const int qs_at = FMT == Q4_0 ? 2 : FMT == Q4_1 ? 4 : FMT == Q5_0 ? 6 : 8;
    const half_ivec a = widen8_u(b + qs_at), c = widen8_u(b + qs_at + 8);
    half_ivec q[4] = {a & 15, c & 15, a >> 4, c >> 4};
    if (FMT == Q5_0 || FMT == Q5_1) {
        uint32_t qh;
        memcpy(&qh, b + qs_at - 4, sizeof qh);
        const half_uvec shift = {0, 1, 2, 3, 4, 5, 6, 7}, all = (half_uvec){0} + qh;
        for (int i = 0; i < 4; ++i) q[i] |= (half_ivec)(((all >> (shift + 8 * i)) & 1) << 4);
    }
    if (FMT == Q4_0 || FMT == Q5_0) {
        const float zero = FMT == Q4_0 ? 8.0f : 16.0f;
        for (int i = 0; i < 4; ++i) w[i] = (__builtin_convertvector(q[i], half_vec) - zero) * d;
    } else {
        const float m = half_to_float(b + 2);
        for (int i = 0; i < 4; ++i) w[i] = __builtin_convertvector(q[i], half_vec) * d + m;
    }
}

/* The K-quants on machines without AVX-512: kquant_chunk's scalar values (the same bits), by quarters. */
static inline void dequantize8_k(int FMT, const uint8_t *b, int c, half_vec w[4]) {
    float out[BLOCK_SIZE];
    kquant_chunk(FMT, b, c, out);
    for (int i = 0; i < 4; ++i) memcpy(&w[i], out + 8 * i, sizeof w[i]);
}

#endif

#endif
