#pragma once

// Each sequence's most recent positions kept exact beside a quantized KV cache (pyturbo, issue 21).
//
// The model setting turboq.exact_window = W (common's --kv-exact-window, whose environment alias is
// LLAMA_ARG_KV_EXACT_WINDOW; llama-cpp-python's kv_overrides) keeps, for every layer whose K or V is
// quantized, the rows of each sequence's last cap = W + M positions in F16, in a ring beside the
// cache: slot seq*cap + pos%cap, plus one slot that takes the rows no slot keeps. Every token is
// still quantized into the cache. A query reads the last W positions of its sequence (itself
// included) exact, from the ring or from its own ubatch, and the cache's copies of those rows are
// hidden from it (ggml-fa-exact.h); older positions are read as stored. The M extra positions, the
// margin (turboq.exact_window_margin, common's --kv-exact-window-margin; default 16), keep a full
// window after up to M of the newest positions are removed again (speculative decoding's rollback
// of rejected drafts, at most --spec-draft-n-max of them; a prompt reused up to a few tokens before
// its end). A rollback past the margin leaves the window short until the context is processed again
// (llama_turboq_window_can_continue), so a margin of 0 saves the rows where nothing is rolled back.
//
// Each layer reads its ring before its ubatch's rows are written into it. Which slot holds which
// position is host bookkeeping, updated when a ubatch's inputs are set (its graph is about to run),
// never when a ubatch is only placed on trial. Removing positions drops their rows; shifting them
// (seq_add, seq_div) drops them too, as their K carries the old rotation, and they are read as
// stored until the window has moved past them. A token with several sequences keeps its row for
// the first of them only. Saved state carries the rows after the cache's own, under a mark; a cache
// without a window writes nothing, so older states stay valid, and a state whose window does not
// match the cache's is refused.
//
// Where the cache lives on a device (a GPU, an RPC server), the attention cannot take the rows
// beside the cache (ggml-fa-exact.h is the CPU backend's): each layer reads its window through a
// copy instead, the cache's rows converted to F16 with the exact ones after them, padded to 256
// rows with hidden zeros (CUDA's fastest kernels want that multiple), under one mask whose rows
// span both. That costs the converted copy per layer and graph, so the CPU keeps the rows beside;
// the debug switch TURBOQ_WINDOW_COPY=1 takes the copy there too (what the tests compare).
// Refused: models whose tokens share positions (M-RoPE, several positions per token), models with
// recurrent layers (their attention input is built elsewhere), caches without flash attention and
// caches that borrow another cache's cells.

#include "llama.h"
#include "llama-turboq-tail.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

class llama_io_write_i;
class llama_io_read_i;
struct llama_file;
struct llama_memory_i;
class llama_kv_cells;
struct llama_model;
struct llama_ubatch;

// the keys ("turboq.exact_window", "turboq.exact_window_margin")
extern "C" const char * llama_turboq_exact_window_key(void);
extern "C" const char * llama_turboq_exact_window_margin_key(void);

// the largest window (and margin) in positions, 4096: the rows cost F16 memory per sequence and
// layer, and a longer window is no longer a window; common and the bindings ask for it
extern "C" int32_t llama_turboq_exact_window_max(void);

struct llama_model_loader;

// reads the model's window and margin while it loads: from kv_overrides, else the GGUF, else 0 and
// 16; throws std::runtime_error for a value that is not 0..llama_turboq_exact_window_max()
void llama_turboq_load_exact_window(const llama_model_loader & ml, llama_model & model);

// whether ctx's caches hold exact rows for positions [n_past - W, n_past) of seq, so that decoding
// can continue after them as if they had just been processed; true without a window. llama-server
// asks before it reuses a cached prompt, and processes the prompt again when this is false.
extern "C" bool llama_turboq_window_can_continue(struct llama_context * ctx, llama_seq_id seq, llama_pos n_past);

// the window's positions of ctx's model (0: none), and the rows kept per sequence for a window of w
// positions and a margin of m (w + m: what a cache's bytes count; m < 0: the default margin)
extern "C" int32_t  llama_turboq_exact_window(const struct llama_context * ctx);
extern "C" uint32_t llama_turboq_exact_window_rows(uint32_t w, int32_t m);

class llama_turboq_window {
public:
    static constexpr uint32_t default_margin = 16;

    // the window of a cache of model (nullptr when the model sets none); throws std::runtime_error
    // for a cache it cannot serve
    static std::unique_ptr<llama_turboq_window> make(const llama_model & model, uint32_t n_seq_max, bool v_trans,
                                                     bool shares_cells);

    llama_turboq_window(uint32_t w, uint32_t margin, uint32_t n_seq);

    // a layer of the cache (ikv, model layer il): rings in ctx (on buft) when K or V is quantized; a
    // buft outside host memory makes every layer read its window through the copy
    void add_layer(ggml_context * ctx, uint32_t ikv, int32_t il, ggml_type type_k, ggml_type type_v,
                   int64_t n_embd_k_gqa, int64_t n_embd_v_gqa, ggml_backend_buffer_type_t buft, const char * name_tag);

    bool     empty()                 const;  // no layer keeps rows
    bool     has_layer(uint32_t ikv) const;
    uint32_t w_size()                const { return w; }
    uint32_t margin_size()           const { return cap - w; }

    // graph: the masks ([n_kv, n_tps, 1, ns] as kq_mask, then the exact rows' [rows + n_tokens, n_tps,
    // 1, ns], as one F16 input; through the copy, one [n_kv + exact_cols, n_tps, 1, ns] whose rows
    // span both), the ring slot of each ubatch row ([n_tokens] I64), and the order in which the
    // ring's slots are read ([rows] I32)
    ggml_tensor * new_mask(ggml_context * ctx, const ggml_tensor * kq_mask) const;
    ggml_tensor * new_write_idxs(ggml_context * ctx, int64_t n_tokens) const;
    ggml_tensor * new_order(ggml_context * ctx) const;

    // a layer's exact rows: the ring as it was before the ubatch, its held rows by sequence and
    // position, followed by the ubatch's own rows; k_stored [n_embd_head_k*n_head_kv, n_tokens] as
    // the cache takes K (turboq_stored_k), v_cur [n_embd_head_v, n_head_kv, n_tokens]. Through the
    // copy they come as rows to append (llama_turboq_exact_append), padded to exact_cols.
    llama_turboq_exact_rows layer_rows(ggml_context * ctx, uint32_t ikv, ggml_tensor * mask, const ggml_tensor * kq_mask,
                                       ggml_tensor * order, int64_t n_embd_head_k, ggml_tensor * k_stored,
                                       ggml_tensor * v_cur) const;

    // graph: the ubatch's rows into the layer's rings, once its attention has read them
    ggml_tensor * write_k(ggml_context * ctx, uint32_t ikv, ggml_tensor * k_stored, ggml_tensor * idxs) const;
    ggml_tensor * write_v(ggml_context * ctx, uint32_t ikv, ggml_tensor * v_cur, ggml_tensor * idxs) const;

    // fills the inputs for ubatch and records the rows that its graph writes; fill_mask fills the
    // tensor it is given as the cache's kq_mask; v_cells, seq_to_stream: the cache's
    void set_input(ggml_tensor * mask, ggml_tensor * idxs, ggml_tensor * order, const ggml_tensor * kq_mask,
                   const std::function<void(ggml_tensor *)> & fill_mask, const llama_ubatch * ubatch,
                   const std::vector<llama_kv_cells> & v_cells, const std::vector<uint32_t> & seq_to_stream);

    // the cache's sequence operations (seq < 0: every sequence; p1 < 0: to the end)
    void clear();
    void seq_rm     (llama_seq_id seq, llama_pos p0, llama_pos p1);
    void seq_cp     (llama_seq_id src, llama_seq_id dst, llama_pos p0, llama_pos p1, bool dst_emptied);
    void seq_keep   (llama_seq_id seq);
    void seq_shifted(llama_seq_id seq, llama_pos p0, llama_pos p1);

    bool can_continue(llama_seq_id seq, llama_pos n_past) const;

    // after the cache's own state (seq < 0: every sequence); state_read throws on a mismatch
    void state_write(llama_io_write_i & io, llama_seq_id seq) const;
    void state_read (llama_io_read_i  & io, llama_seq_id seq);

    // a state saved with a window, read where there is none: its window section follows what the
    // cache read (in an iswa pair it stands where the second cache's stream count should be), and
    // is refused naming the window instead of as a size or stream-count mismatch. refuse_rest
    // throws when `rest` (n bytes) starts with a window section, after dropping what the restore
    // wrote to mem (seq < 0: all of it); refuse_stream_count throws when the stream count read
    // was a window section's mark
    static void refuse_rest(llama_memory_i * mem, llama_seq_id seq, const void * rest, size_t n);
    static void refuse_rest(llama_memory_i * mem, llama_seq_id seq, llama_file & file, size_t n);
    static void refuse_stream_count(llama_io_read_i & io, uint32_t n_stream_read);

    bool reads_copy() const { return copy; }

private:
    uint32_t w;
    uint32_t cap;
    uint32_t n_seq;
    bool     copy;  // each layer reads its window through the copy (see above)

    // the exact columns of a query's mask row beside n_kv of the cache's: the ring's rows and the
    // ubatch's, and through the copy the hidden rows that pad the whole to a multiple of 256
    int64_t exact_cols(int64_t n_kv, int64_t n_tokens) const;

    uint32_t rows() const { return n_seq*cap + 1; }
    uint32_t trash() const { return n_seq*cap; }
    uint32_t slot(llama_seq_id seq, llama_pos pos) const { return (uint32_t) seq*cap + (uint32_t) pos % cap; }

    std::vector<ggml_tensor *> k;  // by the cache's layer: F16 [n_embd_k_gqa, rows()], nullptr without rows
    std::vector<ggml_tensor *> v;
    std::vector<llama_pos> held;   // [n_seq*cap]: the position a slot holds, -1 for none

    void copy_row(ggml_tensor * t, uint32_t from, uint32_t to) const;
};
