#pragma once

// Layer-adaptive KV-cache precision for the TurboQuant types (pyturbo).
//
// TURBO_LAYER_ADAPTIVE picks per-layer K/V types when a KV cache is created:
//   0  uniform (default)
//   1  K+V = q8_0 for the first 4 and last 4 layers
//   2  K+V = q8_0 for the last 8 layers
//   3  K = q8_0 for the n_layer/9 layers (at least 1) of largest K gain, read from the weights
//   5  V = turboq4 at the first 2 and last 2 layers, turboq2 elsewhere (K unchanged)
//   6  V = turboq4 at the last 8 layers, turboq2 elsewhere (K unchanged)
//   7  V = q8_0 at the first 2 and last 2 layers, turboq2 elsewhere (K unchanged)
// The table is policies[] in llama-turboq.cpp; pyturbo reads it through llama_turboq_layer_policy.

#include "ggml.h"

#include <cstdint>
#include <vector>

struct llama_turboq_layer_types {
    ggml_type type_k;
    ggml_type type_v;
};

// row i of the table, for bindings (pyturbo): {mode, n_first, n_last, k_gain_div, k_boundary,
// v_boundary, v_other}, ggml type ids with -1 for "as requested"; false past the last row
extern "C" bool llama_turboq_layer_policy(int32_t i, int32_t * out);

// the mode from TURBO_LAYER_ADAPTIVE (0 when unset); throws std::runtime_error for an invalid value
int llama_turboq_layer_adaptive_mode();

struct llama_model;

// which layers are the mode's boundary layers (all false for mode 0); throws std::runtime_error
// when the mode ranks layers by K gain and the model's K weights cannot be read
std::vector<bool> llama_turboq_boundary_layers(int mode, const llama_model & model);

// K/V types of a layer under mode, given whether it is a boundary layer and the requested types
llama_turboq_layer_types llama_turboq_layer_types_for(int mode, bool boundary, ggml_type type_k, ggml_type type_v);

// throws std::runtime_error when a layer's types cannot work (head_dim, flash attention off)
void llama_turboq_check_layer_types(const llama_turboq_layer_types & lt, uint32_t il, uint32_t n_embd_head_k,
                                    uint32_t n_embd_head_v, bool v_trans);

// ---- K centering ----
//
// A turboq K cache stores k - mu instead of k, with mu a per-layer mean of K (one value per
// K channel of all KV heads). Attention does not change: q.(k - mu) = q.k - q.mu shifts every
// logit of one query by the same amount, and softmax ignores that. The quantization error
// does change: it scales with ||k - mu|| rather than ||k||, and K of real models carries a
// large common component (on Gemma 3 270M 24-75% of ||k||^2 per layer).
//
// mu is the mean of the first ubatch written into the empty cache, fixed from then on, so every
// key that a query can see shares it. It lives in the cache buffer as [mu (n_embd_k_gqa floats),
// ready] where ready = 0 until that write; a cache that becomes empty again (clear, whole-state
// restore, removal of its last cell) is re-armed. The K-shift adds mu
// back around RoPE; a saved state carries mu, and a sequence restored next to other sequences
// with another mu has its K rows re-centered.

class  llama_io_write_i;
class  llama_io_read_i;

// whether layers with this K type keep a mean (turboq K; TURBOQ_K_CENTER=0 turns it off)
bool llama_turboq_k_centering(ggml_type type_k);

// the per-layer [mu, ready] tensor, created in the cache's context
ggml_tensor * llama_turboq_new_k_mean(ggml_context * ctx, int64_t n_embd_k_gqa, const char * tag, uint32_t il);

// graph: k_cur [n_embd_k_gqa, n_tokens] -> k_cur - mu, fixing mu from this ubatch when not ready
ggml_tensor * llama_turboq_center_k(ggml_context * ctx, ggml_tensor * k_cur, ggml_tensor * k_mean);

// the n_cols channels from `offset` of each head's mu (head size n_embd_head) as [n_cols, n_head_kv, 1]:
// the part that the K-shift's RoPE view covers, to add back around it
ggml_tensor * llama_turboq_k_mean_heads(ggml_context * ctx, ggml_tensor * k_mean, int64_t n_cols, int64_t n_head_kv,
                                        int64_t n_embd_head, int64_t offset);

// state: the mean record written before a layer's K rows
void llama_turboq_write_k_mean(llama_io_write_i & io, ggml_tensor * k_mean);

// reads the record and the layer's K rows (runs of cells [from, to) of k, row size k_size_row);
// false with an error logged when the record is missing or corrupt
bool llama_turboq_read_k_rows(llama_io_read_i & io, ggml_tensor * k_mean, ggml_tensor * k, size_t k_size_row,
                              const uint32_t * run_from, const uint32_t * run_to, size_t n_runs, uint32_t il);

// ---- sequence state files (llama-server slot files) ----
//
// llama.cpp's state format carries no checksum: a flipped byte in a count can restore as
// garbage, and a flipped byte in K/V data silently changes the cache. A sequence state file
// written here ends with a record {"TQCK", CRC-32 of every byte before it}; a file whose record
// does not match is refused. A file without the record (another build) is read as before.

// appends the record to a file just written; false (with an error logged) on an I/O error
bool llama_turboq_seq_file_seal(const char * path);

// 1: the record is there and matches; 0: no record; -1: the record does not match (logged)
int llama_turboq_seq_file_check(const char * path);

