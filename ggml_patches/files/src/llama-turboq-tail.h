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
// stored), and not in hybrid (recurrent + attention) models. Each such layer attends over an f16
// copy of its cache (dequantized per graph) followed by the ubatch's own rows, under a mask that
// hides a windowed key's stored copy and shows its exact one: slow and memory-hungry, a
// measurement, not a product path.

#include "ggml.h"

#include <cstdint>
#include <functional>

struct llama_ubatch;

// W from TURBOQ_EXACT_TAIL (read once); 0 when unset: off
int32_t llama_turboq_exact_tail();

// S from TURBOQ_EXACT_SINK (read once): the first S positions of each sequence are read exact too
// (the lab's "sink token exact"), by the queries of the ubatch that holds them; 0 when unset
int32_t llama_turboq_exact_sink();

// the mask for layers that read the window exact: [n_kv + n_tokens, n_tokens] of kq_mask's type;
// nullptr when both switches are off, kq_mask has more than one stream or is not flash
// attention's (F16)
ggml_tensor * llama_turboq_tail_new_mask(ggml_context * ctx, const ggml_tensor * kq_mask);

// fills dst from the ubatch's kq_mask, which fill_mask writes into the tensor it is given (the
// graph's own may be unallocated, when every layer reads this one), and k_idxs (filled: the cells
// the ubatch's rows were stored in)
void llama_turboq_tail_set_mask(ggml_tensor * dst, const ggml_tensor * kq_mask, const ggml_tensor * k_idxs,
                                const llama_ubatch * ubatch, const std::function<void(ggml_tensor *)> & fill_mask);

// whether a layer with this K and V reads the window exact
bool llama_turboq_tail_layer(const ggml_tensor * k, const ggml_tensor * v);

// graph: the cache's view [n_embd_head, n_head_kv, n_kv, 1] as f16, followed by the ubatch's rows
// cur (n_embd_head*n_head_kv values per token, as the cache would store them before quantization)
ggml_tensor * llama_turboq_tail_concat(ggml_context * ctx, ggml_tensor * cache_view, ggml_tensor * cur);
