#pragma once

// Layer-adaptive KV-cache precision for the TurboQuant types (pyturbo), and the checks of a layer's
// turboq types. K centering is in llama-turboq-center.h.
//
// The layer-adaptive mode picks per-layer K/V types when a KV cache is created. It is a setting of
// the model, the key turboq.layer_adaptive: read when the model loads, from kv_overrides (common's
// --layer-adaptive, whose environment alias is LLAMA_ARG_LAYER_ADAPTIVE; llama-cpp-python's
// kv_overrides) or from the GGUF, 0 when neither has it:
//   0  uniform (default)
//   1  K+V = q8_0 for the first 4 and last 4 layers
//   2  K+V = q8_0 for the last 8 layers
//   3  K = q8_0 for the n_layer/9 layers (at least 1) of largest K gain, read from the weights
//   4  K = turboq4 for the layers that attend over the whole context (every layer of a model
//      without sliding-window layers)
//   5  V = turboq4 at the first 2 and last 2 layers, turboq2 elsewhere (K unchanged)
//   6  V = turboq4 at the last 8 layers, turboq2 elsewhere (K unchanged)
//   7  V = q8_0 at the first 2 and last 2 layers, turboq2 elsewhere (K unchanged)
// On a head size that q8_0's 32-value blocks do not divide (80), a mode's q8_0 is turboq8 in the
// twin the head size calls for (llama_turboq_mode_type_for_head).
// The table is policies[] in llama-turboq.cpp; pyturbo reads it through llama_turboq_layer_policy.

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <vector>

class llama_io_write_i;
class llama_io_read_i;

struct llama_turboq_layer_types {
    ggml_type type_k;
    ggml_type type_v;
};

// row i of the table, for bindings (pyturbo): {mode, n_first, n_last, k_gain_div, k_boundary,
// v_boundary, v_other, full_context}, ggml type ids with -1 for "as requested", full_context 1
// where only the layers without a sliding window are candidates; false past the last row
extern "C" bool llama_turboq_layer_policy(int32_t i, int32_t * out);

// which layers are the mode's boundary layers (out: n_layer values), by llama.cpp's rule, for
// bindings that have each layer's K gain (gains: n_layer values, < 0 for a layer that is no
// candidate: without K, or with a sliding window under a full_context mode; may be NULL for a mode
// that does not rank by it); false for an unknown mode or missing gains
extern "C" bool llama_turboq_boundary_from_gains(int32_t mode, int32_t n_layer, const double * gains, bool * out);

// the type a layer of head size n_embd_head stores for a type that a mode chose (not the requested
// one): q8_0 where its blocks do not divide the head size is turboq8, and a turboq type takes the
// twin of llama_turboq_type_for_head; for bindings (type: a ggml type id)
extern "C" int32_t llama_turboq_mode_type_for_head(int32_t type, uint32_t n_embd_head);

// the type a layer of head size n_embd_head stores for a requested type (-ctk/-ctv): a turboq type
// in the twin of the largest group that divides the head size (llama_turboq_type_for_head, with the
// debug switch TURBOQ_GROUP), any other type itself; for bindings (type: a ggml type id)
extern "C" int32_t llama_turboq_stored_type(int32_t type, uint32_t n_embd_head);

// the released type (a ggml type id) that stores a trellis type's bits in its block size (turboq3
// for turboq3t), which refusals of the trellis type name; -1 for any other type
extern "C" int32_t llama_turboq_trellis_released_type(int32_t type);

// the name of a layer-adaptive mode ("off" for 0, "k4-global" for 4, ...), which the flag takes
// beside its number; NULL for a number that is not a mode
extern "C" const char * llama_turboq_layer_adaptive_name(int32_t mode);

// the key, for tools and bindings that set it ("turboq.layer_adaptive")
extern "C" const char * llama_turboq_layer_adaptive_key(void);

struct llama_model;
struct llama_model_loader;

// reads the model's mode while it loads; throws std::runtime_error for a value that is not a mode
void llama_turboq_load_model_settings(const llama_model_loader & ml, llama_model & model);

// the mode of a cache created for this model (0 for the K-centering calibration's own cache)
int llama_turboq_layer_adaptive_mode(const llama_model & model);

// which layers are the mode's boundary layers (all false for mode 0); throws std::runtime_error
// when the mode ranks layers by K gain and the model's K weights cannot be read
std::vector<bool> llama_turboq_boundary_layers(int mode, const llama_model & model);

// K/V types of a layer under mode, given whether it is a boundary layer and the requested types
llama_turboq_layer_types llama_turboq_layer_types_for(int mode, bool boundary, ggml_type type_k, ggml_type type_v);

// The type a layer of head size n_embd_head stores for a requested `type`: a turboq type's _g64
// twin (64-value groups) where the head size is a multiple of 64 but not of 128, its _g32 twin
// where it is a multiple of 32 but not of 64, its _g16 twin where it is a multiple of 16 but not
// of 32, `type` otherwise
ggml_type llama_turboq_type_for_head(ggml_type type, uint32_t n_embd_head);

// the block size that must divide a layer's head size for a requested cache type: that of
// llama_turboq_type_for_head (16, 32, 64 or 128 for a turboq type)
uint32_t llama_turboq_head_block(ggml_type type, uint32_t n_embd_head);

// lt (a mode's types for the requested ones) with each type fitted to layer il's head sizes:
// llama_turboq_type_for_head for a requested type, llama_turboq_mode_type_for_head for one the
// mode chose; logs the stored types when that changes one. is_mla: the layer caches K alone and its
// attention reads V out of each K row's first n_embd_head_v values, so V is K's type
llama_turboq_layer_types llama_turboq_fit_heads(const llama_turboq_layer_types & lt, const llama_turboq_layer_types & requested,
                                                uint32_t il, uint32_t n_embd_head_k, uint32_t n_embd_head_v, bool is_mla);

// whether dev is an RPC server's device
bool llama_turboq_is_rpc(ggml_backend_dev_t dev);

// throws std::runtime_error, naming the layer, its head size and what works, when a layer whose
// cache takes a _g64, _g32 or _g16 type or a trellis type would have it on a device that does not compute it (`dev`: the layer's
// KV device, NULL when the cache stays on the CPU; asked through supports_op: Vulkan does, CUDA
// built with -DGGML_CUDA_TURBOQ_TWINS=ON), or on an RPC server's layer even with the cache here (its flash attention would run
// on the server, which may not have the type). A device that declines a 128-value type at the
// layer's head size gets a warning: its attention would run on the CPU. n_gqa: query heads per KV head
void llama_turboq_check_layer_device(const llama_turboq_layer_types & lt, ggml_backend_dev_t dev, uint32_t il,
                                     uint32_t n_embd_head_k, uint32_t n_embd_head_v, uint32_t n_gqa);

// logs, after upstream's "block size does not divide n_embd_head" refusal of a turboq `type` for
// layer il, why (128-, 64-, 32- or 16-value groups) and which cache types work for that head size
void llama_turboq_explain_head_size(const char * side, ggml_type type, uint32_t il, uint32_t n_embd_head);

// the released type of a trellis type's bits (turboq3 for turboq3t, turboq2 for turboq2t), which
// the refusals of an experimental type name
const char * llama_turboq_trellis_released(ggml_type type);

// whether this build takes the experimental trellis types as KV cache types (CMake's
// -DPYTURBO_TRELLIS=ON, off by default); bindings ask it rather than keep a copy of the rule
extern "C" bool llama_turboq_trellis_built(void);

// throws std::runtime_error when a layer's types cannot work (head_dim, flash attention off)
void llama_turboq_check_layer_types(const llama_turboq_layer_types & lt, uint32_t il, uint32_t n_embd_head_k,
                                    uint32_t n_embd_head_v, bool v_trans);

// ---- a seeded build (PYTURBO_SIGN_SEED: other rotation signs for every backend; debug) ----

// ggml-base's, declared in ggml/src/ggml-turboq.h (not a public header): the build's seed as
// text, or NULL for the shipped signs
extern "C" const char * ggml_turboq_sign_seed(void);

// throws std::runtime_error when this build is seeded and layer il, with a turboq cache, runs on
// an RPC server, whose build may draw other signs: its turboq ops (with the cache there, or kept
// here by --no-kv-offload) would then mix both and read as noise
void llama_turboq_check_sign_seed(const llama_turboq_layer_types & lt, ggml_backend_dev_t layer_dev, uint32_t il);

// state: a seeded build writes a mark (a magic and its seed) where a turboq layer's K or V type
// goes, and nothing otherwise, so that the shipped format stays as it was
void llama_turboq_write_sign_mark(llama_io_write_i & io, ggml_type type);

// reads a layer's K or V type into type_ref, after the mark if there is one; false with an error
// logged when the layer is turboq and the state's signs (its mark, or none) are not this build's
bool llama_turboq_read_type(llama_io_read_i & io, ggml_type type, uint32_t il, int32_t & type_ref);

// the K-centering calibration (llama-turboq-center.cpp) builds a plain f16 context: while it runs
// on this thread, llama_turboq_layer_adaptive_mode is 0
void llama_turboq_set_calibrating(bool on);
bool llama_turboq_calibrating(void);
