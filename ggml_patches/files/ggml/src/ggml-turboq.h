#pragma once

// TurboQuant KV-cache codec (pyturbo): 128-value groups, randomized Walsh-Hadamard rotation,
// fixed Lloyd-Max codebooks (turboq2/3/4) or a uniform 256-level grid (turboq8).
// Block layouts are in ggml-common.h; the algorithm and its exact float order in ggml-turboq.c
// and ggml-turboq-encode.h.

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

GGML_API void quantize_row_turboq2_0_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_turboq3_0_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_turboq4_0_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_turboq8_0_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);

// to the original (unrotated) domain
GGML_API void dequantize_row_turboq2_0(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq3_0(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq4_0(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq8_0(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);

GGML_API size_t quantize_turboq2_0(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_turboq3_0(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_turboq4_0(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_turboq8_0(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);

// the _g64 types: the same on 64-value groups
GGML_API void quantize_row_turboq2_g64_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_turboq3_g64_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_turboq4_g64_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_turboq8_g64_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq2_g64(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq3_g64(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq4_g64(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq8_g64(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API size_t quantize_turboq2_g64(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_turboq3_g64(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_turboq4_g64(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_turboq8_g64(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
// the _g32 types: the same on 32-value groups
GGML_API void quantize_row_turboq2_g32_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_turboq3_g32_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_turboq4_g32_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_turboq8_g32_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq2_g32(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq3_g32(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq4_g32(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq8_g32(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API size_t quantize_turboq2_g32(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_turboq3_g32(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_turboq4_g32(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_turboq8_g32(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
// the _g16 types: the same on 16-value groups
GGML_API void quantize_row_turboq2_g16_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_turboq3_g16_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_turboq4_g16_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_turboq8_g16_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq2_g16(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq3_g16(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq4_g16(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq8_g16(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API size_t quantize_turboq2_g16(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_turboq3_g16(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_turboq4_g16(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_turboq8_g16(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);

// the trellis types (turboq3t, turboq2t): 128-value groups, values read through a 64-state trellis
GGML_API void quantize_row_turboq3_t_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void quantize_row_turboq2_t_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq3_t(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API void dequantize_row_turboq2_t(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);
GGML_API size_t quantize_turboq3_t(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);
GGML_API size_t quantize_turboq2_t(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix);

// The seed of a build configured with PYTURBO_SIGN_SEED (a debug option: other rotation signs, for
// every backend of that build), as text, or NULL for the shipped signs.
GGML_API const char * ggml_turboq_sign_seed(void);

// The rotation's signs D1 (s1) and D2 (s2), 128 values each: the generated tables'.
GGML_API void ggml_turboq_signs(const float ** s1, const float ** s2);

// Rotated-domain decode of one block: out[i] = centroid[idx_i] (unscaled), ggml_turboq_group(type)
// values; returns the block norm.
GGML_API float ggml_turboq_decode_rotated(enum ggml_type type, const void * GGML_RESTRICT block, float * GGML_RESTRICT out);

#ifdef __cplusplus
}
#endif
