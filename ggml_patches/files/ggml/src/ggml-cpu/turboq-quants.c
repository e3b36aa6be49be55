// The CPU backend's turboq quantizer (its type traits' from_float, so SET_ROWS and CPY) and the
// rotations of flash attention (Q in, the V sum out) (pyturbo): ggml-base's encoder (../ggml-turboq-encode.h) with
// this architecture's steps, so that it writes the bytes quantize_row_turboq*_0_ref writes. Built
// with -ffp-contract=off, as ggml-turboq.c is.

#define GGML_COMMON_DECL_C
#include "ggml-common.h"

#include "turboq-cpu.h"
#include "simd-mappings.h"
#include "../ggml-turboq-encode.h"
#include "turboq-kernels.h"

#include <string.h>

#ifdef TURBOQ_ARCH_ENCODE_STEPS
static const struct turboq_encode_steps turboq_cpu_steps = TURBOQ_ARCH_ENCODE_STEPS;
#else
#define turboq_cpu_steps turboq_generic_steps
#endif

#define TURBOQ_DEFINE_QUANTIZE_ROW(N)                                                                       \
    void quantize_row_turboq##N##_0(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {     \
        turboq_quantize_row_with(&turboq_cpu_steps, GGML_TYPE_TURBOQ##N##_0, x, y, k);                      \
    }

TURBOQ_DEFINE_QUANTIZE_ROW(2)
TURBOQ_DEFINE_QUANTIZE_ROW(3)
TURBOQ_DEFINE_QUANTIZE_ROW(4)
TURBOQ_DEFINE_QUANTIZE_ROW(8)

void ggml_turboq_cpu_rotate(float * x, int64_t n) {
    const float * s1;
    const float * s2;
    ggml_turboq_signs(&s1, &s2);
    for (int64_t i = 0; i + TURBOQ_GROUP <= n; i += TURBOQ_GROUP) {
        turboq_rotate_group_with(&turboq_cpu_steps, x + i, s1, s2);
    }
}

void ggml_turboq_cpu_unrotate(float * x, int64_t n) {
    const float * s1;
    const float * s2;
    ggml_turboq_signs(&s1, &s2);
    for (int64_t i = 0; i + TURBOQ_GROUP <= n; i += TURBOQ_GROUP) {
        turboq_unrotate_group_with(&turboq_cpu_steps, x + i, 1.0f, s1, s2);
    }
}

void ggml_turboq_fa_rotate_q(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t n) {
    memcpy(y, x, n*sizeof(float));
    ggml_turboq_cpu_rotate((float *) y, n);
}
