#pragma once

// Which architecture's turboq kernels a CPU build takes: arch/<arch>/turboq-kernels.h defines the
// flash-attention primitives it accelerates, each with a TURBOQ_ARCH_<PRIMITIVE> macro, the generic
// versions in turboq-cpu.c filling in the rest; and it may define TURBOQ_ARCH_ENCODE_STEPS, a whole
// set of encoder steps (../ggml-turboq-encode.h, whose generic steps it may name), for the quantizer
// and the rotations in turboq-quants.c. A new architecture adds one such header and one line here. -DGGML_TURBOQ_GENERIC builds the
// generic versions only (for measuring what an arch file gains). Included by turboq-cpu.c and
// turboq-quants.c after ggml-common.h, ggml-turboq-tables.h and simd-mappings.h.

#include <string.h>

// a turboq block's norm, the first field of every layout
static inline float turboq_block_norm(const void * vb) {
    ggml_half h;
    memcpy(&h, vb, sizeof(h));
    return GGML_CPU_FP16_TO_FP32(h);
}

#if !defined(GGML_TURBOQ_GENERIC) && defined(__AVX2__) && defined(__FMA__)
#include "arch/x86/turboq-kernels.h"
#elif !defined(GGML_TURBOQ_GENERIC) && defined(__ARM_NEON) && defined(__aarch64__)
#include "arch/arm/turboq-kernels.h"
#endif
