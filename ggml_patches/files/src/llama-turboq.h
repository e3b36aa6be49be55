#pragma once

// Layer-adaptive KV-cache precision for the TurboQuant types (pyturbo).
//
// TURBO_LAYER_ADAPTIVE picks per-layer K/V types when a KV cache is created:
//   0  uniform (default)
//   1  K+V = q8_0 for the first 4 and last 4 layers
//   2  K+V = q8_0 for the last 8 layers
//   5  V = turboq4 at the first 2 and last 2 layers, turboq2 elsewhere (K unchanged)
//   6  V = turboq4 at the last 8 layers, turboq2 elsewhere (K unchanged)
//   7  V = q8_0 at the first 2 and last 2 layers, turboq2 elsewhere (K unchanged)

#include "ggml.h"

#include <cstdint>

struct llama_turboq_layer_types {
    ggml_type type_k;
    ggml_type type_v;
};

// the mode from TURBO_LAYER_ADAPTIVE (0 when unset); throws std::runtime_error for an invalid value
int llama_turboq_layer_adaptive_mode();

// K/V types of layer il (of n_layer) under mode, given the cache's requested types
llama_turboq_layer_types llama_turboq_layer_types_for(int mode, uint32_t il, uint32_t n_layer, ggml_type type_k, ggml_type type_v);

// throws std::runtime_error when a layer's types cannot work (head_dim, flash attention off)
void llama_turboq_check_layer_types(const llama_turboq_layer_types & lt, uint32_t il, uint32_t n_embd_head_k,
                                    uint32_t n_embd_head_v, bool v_trans);
