#pragma once

// Flash attention over exact rows beside a quantized cache's (pyturbo, issue 21).
//
// A quantized KV cache may keep some rows at full precision as well: each sequence's most recent
// positions, or its first ones (the attention sinks). A GGML_OP_FLASH_ATTN_EXT node then reads
// them through three more sources, and its softmax runs over the cache's visible rows and the
// visible exact ones together:
//   k    [DK, n_exact, n_head_kv, 1 or the node's K ne[3]]  F16 or F32, as the cache takes K before
//        it quantizes it (centered and scaled where the cache does so; not rotated)
//   v    [DV, n_exact, n_head_kv, the same]                  F16 or F32
//   mask [n_exact, >= n_queries, 1 or n_head, 1 or Q's ne[3]] F16, as the node's own mask: which
//        exact rows each query sees (and their ALiBi distances)
// The node's own mask must hide the cached copy of every row that a query reads exact. F32 rows
// are rounded to F16 as they are read, so that a row reads the same wherever it is held.
//
// Only the CPU backend computes such a node (fattn-tiled-q.cpp); the Vulkan and CUDA backends
// refuse it in supports_op. The sources are set before the node enters a graph.

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { GGML_FA_EXACT_K = 5, GGML_FA_EXACT_V = 6, GGML_FA_EXACT_MASK = 7 };

static inline void ggml_flash_attn_ext_set_exact(struct ggml_tensor * fa, struct ggml_tensor * k,
                                                 struct ggml_tensor * v, struct ggml_tensor * mask) {
    GGML_ASSERT(fa->op == GGML_OP_FLASH_ATTN_EXT && k && v && mask);
    fa->src[GGML_FA_EXACT_K]    = k;
    fa->src[GGML_FA_EXACT_V]    = v;
    fa->src[GGML_FA_EXACT_MASK] = mask;
}

static inline const struct ggml_tensor * ggml_flash_attn_ext_exact_k(const struct ggml_tensor * fa) {
    return fa->op == GGML_OP_FLASH_ATTN_EXT ? fa->src[GGML_FA_EXACT_K] : NULL;
}
static inline const struct ggml_tensor * ggml_flash_attn_ext_exact_v(const struct ggml_tensor * fa) {
    return fa->op == GGML_OP_FLASH_ATTN_EXT ? fa->src[GGML_FA_EXACT_V] : NULL;
}
static inline const struct ggml_tensor * ggml_flash_attn_ext_exact_mask(const struct ggml_tensor * fa) {
    return fa->op == GGML_OP_FLASH_ATTN_EXT ? fa->src[GGML_FA_EXACT_MASK] : NULL;
}

#ifdef __cplusplus
}
#endif
