#pragma once

// A recent-token window kept exact, measured end to end (pyturbo, issue 21; debug switch
// TURBOQ_EXACT_TAIL=W). The K/V lab ranks "the last W tokens of each sequence in f16" as the largest
// quality lever; this confirms it through the whole model before a ring buffer is built for it.
//
// Each query of a ubatch reads the keys and values of the last W positions of its own sequence
// (itself included) at full precision, and all older ones as the cache stores them. Only the
// current ubatch's rows are at hand, so a query among the first W-1 of a ubatch reads the part of
// its window that came in an earlier ubatch as stored: with one ubatch per chunk (perplexity with
// -b = -ub = -c) every window is exact, and at decode only the query's own row is. It applies to
// layers whose K or V is quantized (any type, so that q4_0 can be measured with the same window)
// in a cache with one stream, with flash attention (elsewhere it warns once and reads every row as
// stored), and not in hybrid (recurrent + attention) models. Each such layer's flash attention reads
// the ubatch's own rows as exact rows beside its cache (ggml-fa-exact.h; CPU only), under a mask
// that hides a windowed key's stored copy and shows its exact one: a measurement, not a product
// path, which would keep the rows of earlier ubatches too.

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <functional>
#include <vector>

struct llama_ubatch;

// W from TURBOQ_EXACT_TAIL (read once); 0 when unset: off
int32_t llama_turboq_exact_tail();

// S from TURBOQ_EXACT_SINK (read once): the first S positions of each sequence are read exact too
// (the lab's "sink token exact"), by the queries of the ubatch that holds them; 0 when unset
int32_t llama_turboq_exact_sink();

// the masks for layers that read the window exact, as one tensor of [n_kv + n_tokens, n_tokens] F16
// values: the cache's mask [n_kv, n_tokens] followed by the exact rows' [n_tokens, n_tokens];
// nullptr when both switches are off, kq_mask has more than one stream or is not flash
// attention's (F16)
ggml_tensor * llama_turboq_tail_new_mask(ggml_context * ctx, const ggml_tensor * kq_mask);

// the cache's mask as fill_mask writes it into a tensor described by kq_mask_desc (the graph's own
// may be unallocated, when every layer reads another), in host memory of our own; host_buffer: a
// host buffer for fill_mask's check
std::vector<uint8_t> llama_turboq_mask_copy(const ggml_tensor * kq_mask_desc, ggml_backend_buffer_t host_buffer,
                                            const std::function<void(ggml_tensor *)> & fill_mask);

// fills dst from the ubatch's kq_mask, which fill_mask writes into the tensor it is given (the
// graph's own may be unallocated, when every layer reads this one), and k_idxs (filled: the cells
// the ubatch's rows were stored in)
void llama_turboq_tail_set_mask(ggml_tensor * dst, const ggml_tensor * kq_mask, const ggml_tensor * k_idxs,
                                const llama_ubatch * ubatch, const std::function<void(ggml_tensor *)> & fill_mask);

// whether a layer with this K and V reads the window exact
bool llama_turboq_tail_layer(const ggml_tensor * k, const ggml_tensor * v);

// a layer's exact rows (ggml-fa-exact.h), K as the cache takes it before quantization, their mask,
// and the mask over the cache's rows that the layer reads instead of the cache's own (these
// switches' and the exact window's, llama-turboq-window.h)
struct llama_turboq_exact_rows {
    ggml_tensor * k          = nullptr;
    ggml_tensor * v          = nullptr;
    ggml_tensor * mask       = nullptr;
    ggml_tensor * cache_mask = nullptr;
    // the window read through a copy (llama-turboq-window.h): k and v are F16 rows to append to the
    // cache's, [n_embd_head, n_head_kv, rows] as the cache's views come, cache_mask spans both, and
    // mask is null
    bool append = false;
};

// k_stored [n_embd_head*n_head_kv, n_tokens] (turboq_stored_k), v_cur [n_embd_head, n_head_kv, n_tokens]
llama_turboq_exact_rows llama_turboq_tail_rows_new(ggml_context * ctx, ggml_tensor * tail_mask,
                                                  ggml_tensor * k_stored, ggml_tensor * v_cur);

// rows to append (rows.append): k and v, the cache's views [n_embd_head, n_head_kv, n_kv, n_stream],
// become each stream's rows converted to F16 followed by the exact ones, which rows then no longer
// holds; nothing otherwise
void llama_turboq_exact_append(ggml_context * ctx, llama_turboq_exact_rows & rows, ggml_tensor *& k, ggml_tensor *& v);

// gives a flash-attention node, as build_attn_mha makes it, the exact rows; nothing when rows is
// null (llm_graph_context::turboq_exact)
void llama_turboq_tail_attach(ggml_tensor * fa, const llama_turboq_exact_rows * rows);
