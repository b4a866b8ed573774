/* What quant_fast.c (the SPECRAY_CPU_QUANT=fast kernels) and quant_fast_layout.c (their weight
 * layout) share: the rows per group, and which formats have a fast kernel. */
#ifndef SPECRAY_QUANT_FAST_H
#define SPECRAY_QUANT_FAST_H

#include "quant_formats.h"

#define FAST_ROWS 16 /* output rows per group: one 512-bit vector of int32 or float lanes */

/* quant_formats.h's index of a format with a fast kernel (all but BF16 and MXFP4, which keep their
 * exact kernels in fast mode); -1 for any other type. */
static inline int fast_format(int ggml_type) {
    for (int f = 0; f < NUM_FORMATS; ++f)
        if (FORMATS[f].ggml_type == ggml_type)
            return f != BF16 && f != MXFP4 ? f : -1;
    return -1;
}

#endif
