// Host API of the TurboQuant KV-cache types (pyturbo) for the CUDA backend: the hooks in
// set-rows.cu, getrows.cu, cpy.cu, convert.cu, fattn.cu and ggml-cuda.cu call these.
// Kernels: turboq.cu (+ device helpers in turboq-device.cuh, flash attention in fattn-turboq.cuh).
#pragma once

#include "common.cuh"

// ---- host API (turboq.cu) ----

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

// flash attention: applies when K or V is turboq; supported for the combinations in fattn-turboq.cuh
bool ggml_cuda_turboq_fa_applies(const ggml_tensor * dst);
bool ggml_cuda_turboq_fa_supported(const ggml_tensor * dst);
void ggml_cuda_turboq_flash_attn_ext(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

