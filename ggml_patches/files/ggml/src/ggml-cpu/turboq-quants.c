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

#define TURBOQ_DEFINE_QUANTIZE_ROW(N, SUF, TYPE)                                                             \
    void quantize_row_turboq##N##SUF(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {     \
        turboq_quantize_row_with(turboq_steps_for(TYPE, &turboq_cpu_steps), TYPE, x, y, k);                  \
    }

TURBOQ_DEFINE_QUANTIZE_ROW(2, _0, GGML_TYPE_TURBOQ2_0)
TURBOQ_DEFINE_QUANTIZE_ROW(3, _0, GGML_TYPE_TURBOQ3_0)
TURBOQ_DEFINE_QUANTIZE_ROW(4, _0, GGML_TYPE_TURBOQ4_0)
TURBOQ_DEFINE_QUANTIZE_ROW(8, _0, GGML_TYPE_TURBOQ8_0)
TURBOQ_DEFINE_QUANTIZE_ROW(2, _g64, GGML_TYPE_TURBOQ2_G64)
TURBOQ_DEFINE_QUANTIZE_ROW(3, _g64, GGML_TYPE_TURBOQ3_G64)
TURBOQ_DEFINE_QUANTIZE_ROW(4, _g64, GGML_TYPE_TURBOQ4_G64)
TURBOQ_DEFINE_QUANTIZE_ROW(8, _g64, GGML_TYPE_TURBOQ8_G64)
TURBOQ_DEFINE_QUANTIZE_ROW(2, _g32, GGML_TYPE_TURBOQ2_G32)
TURBOQ_DEFINE_QUANTIZE_ROW(3, _g32, GGML_TYPE_TURBOQ3_G32)
TURBOQ_DEFINE_QUANTIZE_ROW(4, _g32, GGML_TYPE_TURBOQ4_G32)
TURBOQ_DEFINE_QUANTIZE_ROW(8, _g32, GGML_TYPE_TURBOQ8_G32)
TURBOQ_DEFINE_QUANTIZE_ROW(2, _g16, GGML_TYPE_TURBOQ2_G16)
TURBOQ_DEFINE_QUANTIZE_ROW(3, _g16, GGML_TYPE_TURBOQ3_G16)
TURBOQ_DEFINE_QUANTIZE_ROW(4, _g16, GGML_TYPE_TURBOQ4_G16)
TURBOQ_DEFINE_QUANTIZE_ROW(8, _g16, GGML_TYPE_TURBOQ8_G16)
TURBOQ_DEFINE_QUANTIZE_ROW(3, _t, GGML_TYPE_TURBOQ3_T)
TURBOQ_DEFINE_QUANTIZE_ROW(2, _t, GGML_TYPE_TURBOQ2_T)

void ggml_turboq_cpu_rotate(enum ggml_type type, float * x, int64_t n) {
    const struct turboq_encode_steps * st = turboq_steps_for(type, &turboq_cpu_steps);
    const float * s1;
    const float * s2;
    ggml_turboq_signs(&s1, &s2);
    for (int64_t i = 0; i + st->group <= n; i += st->group) {
        turboq_rotate_group_with(st, x + i, s1, s2);
    }
}

void ggml_turboq_cpu_unrotate(enum ggml_type type, float * x, int64_t n) {
    const struct turboq_encode_steps * st = turboq_steps_for(type, &turboq_cpu_steps);
    const float * s1;
    const float * s2;
    ggml_turboq_signs(&s1, &s2);
    for (int64_t i = 0; i + st->group <= n; i += st->group) {
        turboq_unrotate_group_with(st, x + i, 1.0f, s1, s2);
    }
}

static void turboq_fa_rotate_q(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t n) {
    memcpy(y, x, n*sizeof(float));
    ggml_turboq_cpu_rotate(GGML_TYPE_TURBOQ2_0, (float *) y, n);
}

static void turboq_fa_rotate_q_g64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t n) {
    memcpy(y, x, n*sizeof(float));
    ggml_turboq_cpu_rotate(GGML_TYPE_TURBOQ2_G64, (float *) y, n);
}
static void turboq_fa_rotate_q_g32(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t n) {
    memcpy(y, x, n*sizeof(float));
    ggml_turboq_cpu_rotate(GGML_TYPE_TURBOQ2_G32, (float *) y, n);
}
static void turboq_fa_rotate_q_g16(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t n) {
    memcpy(y, x, n*sizeof(float));
    ggml_turboq_cpu_rotate(GGML_TYPE_TURBOQ2_G16, (float *) y, n);
}

ggml_from_float_t ggml_turboq_fa_rotate_q(enum ggml_type k_type) {
    const int g = ggml_turboq_group(k_type);
    return g == TURBOQ_GROUP ? turboq_fa_rotate_q : g == QK_TURBOQ_G64 ? turboq_fa_rotate_q_g64
         : g == QK_TURBOQ_G32 ? turboq_fa_rotate_q_g32 : g == QK_TURBOQ_G16 ? turboq_fa_rotate_q_g16 : NULL;
}
