/* The weight layout of the SPECRAY_CPU_QUANT=fast kernels (quant_fast.c): GGUF rows regrouped 16
 * output rows at a time, the same bytes in another order (Q8_0's quants also flipped to
 * unsigned), so weight memory does not change.
 *
 * A group of 16 rows is stored block by block (a K-quant's super-block of 256 is one block). Each
 * block's bytes are cut into segments (the table below); the group's block holds the segments in
 * the table's order, each as [unit][row][bytes of one unit]: unit u of rows 0..15 side by side.
 * With 4-byte units, one 64-byte load is then 4 quant bytes of each of 16 rows, the operand of one
 * vpdpbusd whose lane j is output row j; with 2-byte units (fp16 scales), one 32-byte load is the
 * 16 rows' scale, one vcvtph2ps; with 1-byte units (a K-quant's scales), 16 bytes per scale.
 *   Q8_0: d | 32 quants (+128)                                   -> d at 0, step i at 32 + 64 i
 *   Q4_0: d | 16 nibble bytes                                     -> d at 0, step i at 32 + 64 i
 *   Q4_1: d | m | 16 nibble bytes                                 -> d 0, m 32, step i at 64 + 64 i
 *   Q5_0: d | qh (4 bytes: one unit) | 16 nibble bytes            -> d 0, qh 32, step i at 96 + 64 i
 *   Q5_1: d | m | qh | 16 nibble bytes                            -> d 0, m 32, qh 64, step i at
 *         128 + 64 i
 *   Q4_K: d | dmin | 12 scale bytes | 128 nibble bytes             -> d 0, dmin 32, scale byte s at
 *         64 + 16 s, step i at 256 + 64 i (sub-blocks 2p and 2p + 1 share steps 8p .. 8p + 7)
 *   Q6_K: d (bytes 208..) | 16 int8 scales (192..) | then per half h of 128 weights, in the order
 *         the kernel reads them: qh (128 + 32 h ..) | ql (64 h ..)
 *         -> d 0, scale s at 32 + 16 s; half h at 288 + 1536 h: qh step i at + 64 i, ql step i
 *         at + 512 + 64 i. (ql and qh apart, as GGUF has them, read from memory at half the
 *         speed: 5.6 against 23 GB/s from L2 on one thread, 2026-12-06.) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_fast.h"

typedef struct {
    int16_t at, bytes, unit; /* where in the GGUF block, how many bytes, bytes per unit */
    uint8_t flip;            /* XORed into every byte (Q8_0's int8 quants to vpdpbusd's unsigned) */
} segment;

#define MAX_SEGMENTS 6
static const struct {
    int num;
    segment seg[MAX_SEGMENTS];
} LAYOUT[] = {
    [Q8_0] = {2, {{0, 2, 2, 0}, {2, 32, 4, 0x80}}},
    [Q4_0] = {2, {{0, 2, 2, 0}, {2, 16, 4, 0}}},
    [Q4_1] = {3, {{0, 2, 2, 0}, {2, 2, 2, 0}, {4, 16, 4, 0}}},
    [Q5_0] = {3, {{0, 2, 2, 0}, {2, 4, 4, 0}, {6, 16, 4, 0}}},
    [Q5_1] = {4, {{0, 2, 2, 0}, {2, 2, 2, 0}, {4, 4, 4, 0}, {8, 16, 4, 0}}},
    [Q4_K] = {4, {{0, 2, 2, 0}, {2, 2, 2, 0}, {4, 12, 1, 0}, {16, 128, 4, 0}}},
    [Q6_K] = {6, {{208, 2, 2, 0}, {192, 16, 1, 0}, {128, 32, 4, 0}, {0, 64, 4, 0}, {160, 32, 4, 0}, {64, 64, 4, 0}}},
};

/* Row j's GGUF block `row` and the group's block `group`, copied one way or the other. */
static void move_block(int f, uint8_t *group, uint8_t *row, int j, int to_group) {
    int base = 0;
    for (int s = 0; s < LAYOUT[f].num; ++s) {
        const segment g = LAYOUT[f].seg[s];
        for (int e = 0; e < g.bytes; ++e) {
            uint8_t *packed = group + base + (e / g.unit * FAST_ROWS + j) * g.unit + e % g.unit;
            if (to_group) *packed = row[g.at + e] ^ g.flip;
            else row[g.at + e] = *packed ^ g.flip;
        }
        base += g.bytes * FAST_ROWS;
    }
}

/* GGUF rows [N, K / block weights blocks] to the layout above. Returns 0; -2 for a type without
 * a fast kernel, -3 when K is not a multiple of its block or N of 16. */
int specray_quant_fast_repack(int ggml_type, const uint8_t *w, uint8_t *out, int64_t N, int64_t K) {
    const int f = fast_format(ggml_type);
    if (f < 0) return -2;
    if (K % FORMATS[f].block_weights || N % FAST_ROWS) return -3;
    const int64_t bytes = FORMATS[f].block_bytes, blocks = K / FORMATS[f].block_weights;
    for (int64_t g = 0; g < N / FAST_ROWS; ++g)
        for (int64_t b = 0; b < blocks; ++b)
            for (int j = 0; j < FAST_ROWS; ++j)
                move_block(f, out + (g * blocks + b) * FAST_ROWS * bytes,
                           (uint8_t *)w + ((g * FAST_ROWS + j) * blocks + b) * bytes, j, 1);
    return 0;
}

int specray_quant_dequantize(int ggml_type, const uint8_t *w, float *out, int64_t N, int64_t K);
int64_t specray_first_bad_id(const int64_t *ids, int64_t n, int64_t N); /* quant_rows.c */

/* Rows ids[0..n) of a repacked [N, K] weight as float32 [n, K]: each row's GGUF blocks put back,
 * then quant_gemv.c's dequantizer (gguf.quants.dequantize's values: an embedding lookup on a tied
 * head). Returns 0, -1 without memory, the repack's codes, or -4 for an id outside [0, N)
 * (nothing written). */
int specray_quant_fast_rows(int ggml_type, const uint8_t *w, const int64_t *ids, int64_t n, int64_t N, float *out,
                            int64_t K) {
    const int f = fast_format(ggml_type);
    if (f < 0) return -2;
    if (K % FORMATS[f].block_weights) return -3;
    if (specray_first_bad_id(ids, n, N) >= 0) return -4;
    const int64_t bytes = FORMATS[f].block_bytes, blocks = K / FORMATS[f].block_weights;
    uint8_t on_stack[4096]; /* a decode step's embedding row (K up to ~3600 at Q8_0): no malloc */
    const int64_t need = blocks * bytes;
    uint8_t *row = need <= (int64_t)sizeof on_stack ? on_stack : malloc(need);
    if (!row) return -1;
    for (int64_t r = 0; r < n; ++r) {
        const int64_t g = ids[r] / FAST_ROWS;
        for (int64_t b = 0; b < blocks; ++b)
            move_block(f, (uint8_t *)w + (g * blocks + b) * FAST_ROWS * bytes, row + b * bytes, (int)(ids[r] % FAST_ROWS), 0);
        specray_quant_dequantize(ggml_type, row, out + r * K, 1, K);
    }
    if (row != on_stack) free(row);
    return 0;
}
