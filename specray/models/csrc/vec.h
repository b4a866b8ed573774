/* 16-float vectors for specray's CPU kernels (GCC vector extensions: the compiler maps them
 * to AVX-512, AVX2 or NEON for the machine it builds on). */
#ifndef SPECRAY_VEC_H
#define SPECRAY_VEC_H

#include <string.h>

#define LANES 16

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float half_vec __attribute__((vector_size(LANES / 2 * sizeof(float))));
typedef float quarter_vec __attribute__((vector_size(LANES / 4 * sizeof(float))));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline half_vec load_half(const float *p) {
    half_vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* lane_sum after its first step: lanes 0-7 already added to lanes 8-15 */
static inline float half_lane_sum(half_vec h) {
    quarter_vec q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* The 16 lanes summed as a tree (8 + 8, 4 + 4, then four scalars): a fixed order, and a
 * few shuffles instead of 15 dependent scalar adds. */
static inline float lane_sum(vec v) {
    return half_lane_sum(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

#endif
