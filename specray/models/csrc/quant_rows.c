/* Single rows of a weight kept in GGUF blocks, as float32: an embedding lookup (a decode step
 * reads one row of the token embedding). The values are quant_gemv.c's dequantizer's, which are
 * gguf.quants.dequantize's; the ids are checked here, before anything is written, so the caller
 * makes no pass over them of its own. */
#include <stdint.h>

int specray_quant_format(int ggml_type, int *block_size, int *block_bytes);
int specray_quant_dequantize(int ggml_type, const uint8_t *w, float *out, int64_t N, int64_t K);

/* The index of the first id outside [0, N), or -1 when every id is a row. */
int64_t specray_first_bad_id(const int64_t *ids, int64_t n, int64_t N) {
    for (int64_t r = 0; r < n; ++r)
        if (ids[r] < 0 || ids[r] >= N) return r;
    return -1;
}

/* out[r] = row ids[r] of the [N, K] weight w (GGUF rows). Returns 0; -2 for a type without a
 * kernel, -3 for K not a multiple of its block, -4 for an id outside [0, N) (nothing written). */
int specray_quant_rows(int ggml_type, const uint8_t *w, const int64_t *ids, int64_t n, int64_t N, float *out,
                       int64_t K) {
    int block_size, block_bytes;
    if (specray_quant_format(ggml_type, &block_size, &block_bytes)) return -2;
    if (K % block_size) return -3;
    if (specray_first_bad_id(ids, n, N) >= 0) return -4;
    const int64_t row_bytes = K / block_size * block_bytes;
    for (int64_t r = 0; r < n; ++r) specray_quant_dequantize(ggml_type, w + ids[r] * row_bytes, out + r * K, 1, K);
    return 0;
}
