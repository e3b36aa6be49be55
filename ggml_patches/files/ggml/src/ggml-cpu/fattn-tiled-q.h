#pragma once

// Tiled CPU flash attention for K/V caches outside upstream's tiled path (pyturbo).
//
// Upstream tiles only f16/f32 caches with K and V of one type; every other cache (turboq,
// q8_0, q4_0, f16 K with turboq V, ...) took the one-row path, which decodes each cached row
// again for every query row and every head of a GQA group.

#include "ggml.h"
#include "ggml-cpu-impl.h"

#ifdef __cplusplus
extern "C" {
#endif

// whether dst (a GGML_OP_FLASH_ATTN_EXT node) takes this path; TURBOQ_FA_TILED=0 turns it off
bool   ggml_fa_tiled_q_supported(const struct ggml_tensor * dst);
// work buffer bytes the path needs with n_threads threads (0 when it is not taken)
size_t ggml_fa_tiled_q_work_size(const struct ggml_tensor * dst, int n_threads);
void   ggml_fa_tiled_q_compute  (const struct ggml_compute_params * params, struct ggml_tensor * dst);

#ifdef __cplusplus
}
#endif
