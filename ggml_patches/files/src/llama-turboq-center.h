#pragma once

// K centering and channel scale for turboq K caches (pyturbo).

#include "ggml.h"

#include <cstdint>

// A turboq K cache stores (k - mu)*s instead of k, and attention reads it with q/s:
//   - mu is a per-layer mean of K (one value per K channel of all KV heads). q.(k - mu) shifts
//     every logit of one query by the same amount, which softmax ignores; the quantization error
//     then scales with ||k - mu|| rather than ||k||, and K of real models carries a large common
//     component (on Gemma 3 270M 24-75% of ||k||^2 per layer).
//   - s is a per-channel scale (q/s . (k - mu)*s is unchanged) that moves the error to the
//     channels where q is small: s_c = (E[q_c^2]/E[(k_c - mu_c)^2])^(1/4), one value per RoPE pair.
//
// Both are properties of the model: statistics of a fixed calibration text, computed once per
// loaded model with an f16 cache, before the first context with a turboq K is built (K as the
// cache stores it and Q as attention reads it, both after RoPE). mu is fitted to the positions a
// sequence of the context spans (n_ctx_seq), not to the calibration's 512: each RoPE pair's mean
// is turned back to position 0 and averaged over that span, so a pair that turns a lot over the
// context gets no mean.
// Neither depends on what a context has processed, so a request's answer does not depend on
// other requests, slots or restarts. They live in the cache buffer (one tensor per layer: mu,
// then s); the K-shift undoes them around RoPE, and a saved state carries them, so a state is
// restored only into a cache with the same ones. The model key turboq.k_center=false turns both
// off (llama_turboq_k_center_key), TURBOQ_K_BALANCE=0 the scale (debug).
//
// The calibration's statistics are kept on disk, in pyturbo's cache directory (k-calibration/, one
// file per model file and build), and read back by the next load of the same model: a load then
// costs a digest of the model file (about 0.2 s per GB) instead of the prefill. The file's key
// holds everything the statistics depend on (the model's bytes and overrides, the devices and
// kernels that run the calibration, its version, text and length), so a cached and a fresh
// calibration give the same bits; a file that does not match, or is damaged, is recomputed. The
// key, the format and the directory are described in llama-turboq-center.cpp ("the calibration
// cache"). The model's files are noted when it loads (llama_turboq_load_k_center), because the
// loader, which has them, is gone when the first context calibrates.
//
// A seeded build's states (PYTURBO_SIGN_SEED) are marked where each turboq layer's type is written,
// not here (llama_turboq_write_sign_mark, llama-turboq.h), so that caches without K centering are
// marked too.

class  llama_io_write_i;
class  llama_io_read_i;
struct llama_context_params;
struct llama_model;
struct llama_memory_i;

// the model key of K centering (bool, default true): off, a turboq K cache is stored as it comes,
// without the mean or the channel scale (for comparisons, and for a model where they do not help)
extern "C" const char * llama_turboq_k_center_key(void);

// reads the key (kv_overrides, else the GGUF) into the model when it loads, and notes the model's
// files and overrides for the calibration cache; throws on a bad value
struct llama_model_loader;
void llama_turboq_load_k_center(const llama_model_loader & ml, llama_model & model);

// whether the model's layers with this K type keep a mean and scale (a turboq K, centering on)
bool llama_turboq_k_centering(const llama_model & model, ggml_type type_k);

// computes the model's K means and scales once (no-op when done, off, or for a model without
// weights), or reads them from the calibration cache; params are the context's, for its threads
// and offload settings. A model that cannot be calibrated (no vocabulary, a decode failure) gets no
// centering (mu = 0, s = 1) and a warning. Logs one line: read from the cache (its path) or
// computed (why not read, and where it was saved), and the time.
void llama_turboq_calibrate_k_means(llama_model & model, const llama_context_params & params);

// the per-layer tensor: 2*n_embd_k_gqa floats, mu then s, created in the cache's context
ggml_tensor * llama_turboq_new_k_mean(ggml_context * ctx, int64_t n_embd_k_gqa, const char * tag, uint32_t il);

// writes layer il's mu and s for sequences of `span` positions into k_mean, from the model's
// calibration (mu = 0, s = 1 when there is none)
void llama_turboq_load_k_mean(const llama_model & model, ggml_tensor * k_mean, uint32_t il, uint32_t span);

// fits the K means of a context's caches to the positions a sequence spans (its n_ctx_seq)
void llama_turboq_set_k_span(llama_memory_i * mem, uint32_t n_pos);

// graph: k_cur [n_embd_k_gqa, n_tokens] -> (k_cur - mu)*s
ggml_tensor * llama_turboq_center_k(ggml_context * ctx, ggml_tensor * k_cur, ggml_tensor * k_mean);

// graph: q_cur [n_embd_head, n_head, n_tokens] -> q_cur/s (each query head by its KV head's s)
ggml_tensor * llama_turboq_scale_q(ggml_context * ctx, ggml_tensor * q_cur, ggml_tensor * k_mean);

// the n_cols channels from `offset` of each head's mu (part 0) or s (part 1), head size
// n_embd_head, as [n_cols, n_head_kv, 1]: the part that the K-shift's RoPE view covers
ggml_tensor * llama_turboq_k_mean_heads(ggml_context * ctx, ggml_tensor * k_mean, int64_t n_cols, int64_t n_head_kv,
                                        int64_t n_embd_head, int64_t offset, int part);

// state: the record (mu and s) written before a layer's K rows
void llama_turboq_write_k_mean(llama_io_write_i & io, ggml_tensor * k_mean);

// reads the record before a layer's K rows; false with an error logged when it is missing, corrupt,
// or not this cache's mu and s (the rows would then be read against the wrong ones)
bool llama_turboq_read_k_mean(llama_io_read_i & io, ggml_tensor * k_mean, uint32_t il);
