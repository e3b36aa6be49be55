#pragma once

// AArch64 NEON kernels for the turboq CPU paths, included by ggml-cpu/turboq-cpu.c, which has the
// generic versions and the contract of each primitive. Block decoding is not here: the generic
// turboqN_decode calls ggml_turboq_decode_rotated in ggml-base, whose unpacking and centroid
// lookup (TBL on the byte image of the table) are NEON already on AArch64.

#include <arm_neon.h>

#define TURBOQ_ARCH_DOT128   1
#define TURBOQ_ARCH_MAD128   1
#define TURBOQ_ARCH_SCALE128 1

// four independent FMA chains hide the FMLA latency; the lanes are summed at the end
static inline float turboq_dot128(const float * GGML_RESTRICT a, const float * GGML_RESTRICT b) {
    float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (int i = 0; i < TURBOQ_GROUP; i += 16) {
        acc0 = vfmaq_f32(acc0, vld1q_f32(a + i +  0), vld1q_f32(b + i +  0));
        acc1 = vfmaq_f32(acc1, vld1q_f32(a + i +  4), vld1q_f32(b + i +  4));
        acc2 = vfmaq_f32(acc2, vld1q_f32(a + i +  8), vld1q_f32(b + i +  8));
        acc3 = vfmaq_f32(acc3, vld1q_f32(a + i + 12), vld1q_f32(b + i + 12));
    }
    return vaddvq_f32(vaddq_f32(vaddq_f32(acc0, acc1), vaddq_f32(acc2, acc3)));
}

static inline void turboq_mad128(float * GGML_RESTRICT acc, const float * GGML_RESTRICT x, float w) {
    for (int i = 0; i < TURBOQ_GROUP; i += 4) {
        vst1q_f32(acc + i, vfmaq_n_f32(vld1q_f32(acc + i), vld1q_f32(x + i), w));
    }
}

static inline void turboq_scale128(float * GGML_RESTRICT x, float w) {
    for (int i = 0; i < TURBOQ_GROUP; i += 4) {
        vst1q_f32(x + i, vmulq_n_f32(vld1q_f32(x + i), w));
    }
}
