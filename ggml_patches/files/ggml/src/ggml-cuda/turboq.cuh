// Host API of the TurboQuant KV-cache types (pyturbo) for the CUDA backend: the hooks in
// set-rows.cu, getrows.cu, cpy.cu, convert.cu, fattn.cu and ggml-cuda.cu call these.
// Kernels: turboq.cu (+ device helpers in turboq-device.cuh, flash attention in fattn-turboq.cuh).
#pragma once

#include "common.cuh"

// ---- host API (turboq.cu) ----

// the turboq types this backend takes: the 128-value ones, and the _g64/_g32 twins where the
// build option -DGGML_CUDA_TURBOQ_TWINS=ON is on (turboq.cu says why)
bool ggml_cuda_turboq_type(ggml_type type);

void ggml_cuda_turboq_set_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
void ggml_cuda_turboq_get_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
// src0 -> src1 where either side is turboq (the other one F32 or F16)
void ggml_cuda_turboq_cpy(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, ggml_tensor * src1);

bool ggml_cuda_turboq_set_rows_supported(const ggml_tensor * op);
bool ggml_cuda_turboq_get_rows_supported(const ggml_tensor * op);
bool ggml_cuda_turboq_cpy_supported(const ggml_tensor * src0, const ggml_tensor * src1);

// contiguous dequantization (convert.cu); nullptr for other types
void (*ggml_cuda_turboq_get_to_fp32(ggml_type type))(const void * x, float * y, int64_t k, cudaStream_t stream);
void (*ggml_cuda_turboq_get_to_fp16(ggml_type type))(const void * x, half  * y, int64_t k, cudaStream_t stream);

void (*ggml_cuda_turboq_get_to_fp16_nc(ggml_type type))(const void * x, half * y,
    int64_t ne00, int64_t ne01, int64_t ne02, int64_t ne03, int64_t s01, int64_t s02, int64_t s03, cudaStream_t stream);

// Flash attention with turboq K and/or V takes one of two paths (chosen in fattn.cu):
//   - the packed-block kernel (fattn-turboq.cuh), in the rotated domain, for batches of up to
//     TQ_FA_PACKED_MAX_BATCH queries and wherever no mainline kernel applies;
//   - larger batches: the mainline kernels (tensor cores), after converting K/V to f16 in the
//     original domain with the converters above, as mainline does for q8_0/q4_0 caches.
#define TQ_FA_PACKED_MAX_BATCH 8
bool ggml_cuda_turboq_fa_applies(const ggml_tensor * dst);
bool ggml_cuda_turboq_fa_supported(const ggml_tensor * dst);
bool ggml_cuda_turboq_fa_prefers_packed(const ggml_tensor * dst);
void ggml_cuda_turboq_flash_attn_ext(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

