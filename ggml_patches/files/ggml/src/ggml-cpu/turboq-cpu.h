#pragma once

// CPU kernels for the TurboQuant KV-cache types (pyturbo).
//
// Flash attention never leaves the rotated domain: Q is rotated once per row, K.Q is a dot
// product against the centroid values, V is accumulated as centroids and the accumulator is
// rotated back once at the end. That costs one 128-point transform per query row instead of
// one per cached token.

#include "ggml.h"
#include "ggml-cpu.h"

#ifdef __cplusplus
extern "C" {
#endif

// type_traits_cpu: the quantizer (from_float; turboq-quants.c), the same bytes as ggml-base's
// quantize_row_turboq*_0_ref
void quantize_row_turboq2_0(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq3_0(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq4_0(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq8_0(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq2_g64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq3_g64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq4_g64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq8_g64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq2_g32(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq3_g32(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq4_g32(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq8_g32(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq2_g16(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq3_g16(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq4_g16(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq8_g16(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq3_t(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_turboq2_t(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);

// The rotation y = D2.H.D1.x/sqrt(g) of each g-group of x[0..n), in place, and its inverse, with g
// the group of turboq type `type` (128, or 64, 32 and 16 for the _g64, _g32 and _g16 types).
// Flash attention works in the rotated domain: q.k = rotate(q).k_rot and sum(w*v) = unrotate(sum(w*v_rot)).
void ggml_turboq_cpu_rotate  (enum ggml_type type, float * x, int64_t n);
void ggml_turboq_cpu_unrotate(enum ggml_type type, float * x, int64_t n);

// type_traits_cpu: dot products in the original domain (mul_mat with a turboq src0, F32 src1)
void ggml_vec_dot_turboq2_0_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq3_0_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq4_0_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq8_0_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq2_g64_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq3_g64_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq4_g64_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq8_g64_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq2_g32_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq3_g32_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq4_g32_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq8_g32_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq2_g16_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq3_g16_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq4_g16_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq8_g16_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq3_t_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_turboq2_t_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);

// flash attention, rotated domain
typedef void (*ggml_turboq_fa_v_mad_t)(int64_t n, float * GGML_RESTRICT acc, const void * GGML_RESTRICT v, float w);

// from_float-shaped: copies Q and rotates it for a K of type k_type (n a multiple of its group)
ggml_from_float_t      ggml_turboq_fa_rotate_q(enum ggml_type k_type);
// vec_dot-shaped: K row (x) . rotated Q (y)
ggml_vec_dot_t         ggml_turboq_fa_kq_dot(enum ggml_type k_type);
// acc += w * V row, acc in the rotated domain
ggml_turboq_fa_v_mad_t ggml_turboq_fa_v_mad (enum ggml_type v_type);
// a K or V row in the rotated domain, block norms applied (tiled flash attention)
void ggml_turboq_fa_decode_row(enum ggml_type type, const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n);

#ifdef __cplusplus
}
#endif
