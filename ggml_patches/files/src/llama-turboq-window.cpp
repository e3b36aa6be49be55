#include "llama-turboq-window.h"

#include "llama-arch.h"
#include "llama-batch.h"
#include "llama-context.h"
#include "llama-impl.h"
#include "llama-io.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kv-cells.h"
#include "llama-mmap.h"
#include "llama-model.h"
#include "llama-model-loader.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <limits>
#include <tuple>
#include <unordered_map>

int32_t llama_turboq_exact_window_max(void) {
    return 4096;
}

const char * llama_turboq_exact_window_key(void) {
    return "turboq.exact_window";
}

const char * llama_turboq_exact_window_margin_key(void) {
    return "turboq.exact_window_margin";
}

// a number of positions, 0..llama_turboq_exact_window_max(), from kv_overrides, else the GGUF, else dflt
static int64_t load_positions(const llama_model_loader & ml, const char * key, const char * what, int64_t dflt) {
    int64_t n = dflt;
    const auto it = ml.kv_overrides.find(key);
    if (it != ml.kv_overrides.end()) {
        if (it->second.tag != LLAMA_KV_OVERRIDE_TYPE_INT) {
            throw std::runtime_error(std::string(key) + ": the override must be an int (a number of positions)");
        }
        n = it->second.val_i64;
    } else if (const int64_t id = gguf_find_key(ml.metadata, key); id >= 0) {
        if (gguf_get_kv_type(ml.metadata, id) != GGUF_TYPE_INT32 && gguf_get_kv_type(ml.metadata, id) != GGUF_TYPE_UINT32) {
            throw std::runtime_error(std::string(key) + " in the GGUF must be a 32-bit integer (a number of positions)");
        }
        n = gguf_get_kv_type(ml.metadata, id) == GGUF_TYPE_INT32 ? gguf_get_val_i32(ml.metadata, id) : gguf_get_val_u32(ml.metadata, id);
    }
    if (n < 0 || n > llama_turboq_exact_window_max()) {
        throw std::runtime_error(std::string(key) + "=" + std::to_string(n) + ": " + what + " is 0 to " +
                                 std::to_string(llama_turboq_exact_window_max()) + " positions");
    }
    return n;
}

void llama_turboq_load_exact_window(const llama_model_loader & ml, llama_model & model) {
    model.turboq_exact_window = (int) load_positions(ml, llama_turboq_exact_window_key(), "the exact window (0: off)", 0);
    model.turboq_exact_window_margin = (int) load_positions(ml, llama_turboq_exact_window_margin_key(),
                                                            "the exact window's margin", llama_turboq_window::default_margin);
}

std::unique_ptr<llama_turboq_window> llama_turboq_window::make(const llama_model & model, uint32_t n_seq_max,
                                                               bool v_trans, bool shares_cells) {
    const int64_t w = model.turboq_exact_window;
    if (w <= 0) {
        return nullptr;
    }
    const std::string key = llama_turboq_exact_window_key();
    if (v_trans) {
        throw std::runtime_error(key + "=" + std::to_string(w) + ": the exact window needs flash attention (-fa on)");
    }
    if (llm_arch_is_hybrid(model.arch) || llm_arch_is_recurrent(model.arch)) {
        throw std::runtime_error(key + "=" + std::to_string(w) + ": not for models with recurrent layers, whose "
                                 "attention layers do not read the exact window yet");
    }
    if (model.hparams.is_mla()) {
        throw std::runtime_error(key + "=" + std::to_string(w) + ": not for MLA models, whose attention reads V "
                                 "through K's latent rows");
    }
    if (model.hparams.n_pos_per_embd() > 1) {
        throw std::runtime_error(key + "=" + std::to_string(w) + ": this model's tokens share positions (M-RoPE), "
                                 "which the exact window keys its rows by");
    }
    if (shares_cells) {
        throw std::runtime_error(key + "=" + std::to_string(w) + ": not for a cache that borrows another cache's cells");
    }
    const int64_t m = model.turboq_exact_window_margin < 0 ? default_margin : model.turboq_exact_window_margin;
    return std::make_unique<llama_turboq_window>((uint32_t) w, (uint32_t) m, n_seq_max);
}

static bool copy_forced() {
    const char * env = std::getenv("TURBOQ_WINDOW_COPY");  // debug: the copy on the CPU too
    return env && std::strcmp(env, "0") != 0;
}

llama_turboq_window::llama_turboq_window(uint32_t w, uint32_t margin, uint32_t n_seq) :
    w(w), cap(w + margin), n_seq(n_seq), copy(copy_forced()), held((size_t) n_seq*(w + margin), -1) {
}

int64_t llama_turboq_window::exact_cols(int64_t n_kv, int64_t n_tokens) const {
    const int64_t n_exact = rows() + n_tokens;
    return copy ? GGML_PAD(n_kv + n_exact, 256) - n_kv : n_exact;
}

void llama_turboq_window::add_layer(ggml_context * ctx, uint32_t ikv, int32_t il, ggml_type type_k, ggml_type type_v,
                                    int64_t n_embd_k_gqa, int64_t n_embd_v_gqa, ggml_backend_buffer_type_t buft,
                                    const char * name_tag) {
    if (k.size() <= ikv) {
        k.resize(ikv + 1, nullptr);
        v.resize(ikv + 1, nullptr);
    }
    if (!ggml_is_quantized(type_k) && !ggml_is_quantized(type_v)) {
        return;  // the layer's cache is exact already
    }
    if (!ggml_backend_buft_is_host(buft) && !copy) {
        copy = true;
        LLAMA_LOG_INFO("%s: %s=%u: layer %d's KV cache is on %s, so each layer reads its window after an F16 copy "
                       "of its cache's rows\n", __func__, llama_turboq_exact_window_key(), w, il, ggml_backend_buft_name(buft));
    }
    k[ikv] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_embd_k_gqa, rows());
    v[ikv] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_embd_v_gqa, rows());
    ggml_format_name(k[ikv], "cache_%sk_window_l%d", name_tag, il);
    ggml_format_name(v[ikv], "cache_%sv_window_l%d", name_tag, il);
}

bool llama_turboq_window::empty() const {
    return std::none_of(k.begin(), k.end(), [](const ggml_tensor * t) { return t != nullptr; });
}

bool llama_turboq_window::has_layer(uint32_t ikv) const {
    return ikv < k.size() && k[ikv] != nullptr;
}

ggml_tensor * llama_turboq_window::new_mask(ggml_context * ctx, const ggml_tensor * kq_mask) const {
    if (kq_mask == nullptr || kq_mask->type != GGML_TYPE_F16) {
        // flash attention turned off after the cache was made (-fa auto): the rows are read as stored
        static bool warned = false;
        if (!warned) {
            warned = true;
            LLAMA_LOG_WARN("%s: %s=%u: flash attention is off, so the exact window is not read (-fa on)\n", __func__,
                           llama_turboq_exact_window_key(), w);
        }
        return nullptr;
    }
    const int64_t n_kv = kq_mask->ne[0], n_tps = kq_mask->ne[1], ns = kq_mask->ne[3];
    ggml_tensor * res = ggml_new_tensor_1d(ctx, GGML_TYPE_F16, (n_kv + exact_cols(n_kv, n_tps*ns))*n_tps*ns);
    ggml_set_input(res);
    ggml_set_name(res, "attn_inp_kq_mask_turboq_window");
    return res;
}

ggml_tensor * llama_turboq_window::new_write_idxs(ggml_context * ctx, int64_t n_tokens) const {
    ggml_tensor * res = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_tokens);
    ggml_set_input(res);
    ggml_set_name(res, "attn_inp_turboq_window_idxs");
    return res;
}

ggml_tensor * llama_turboq_window::new_order(ggml_context * ctx) const {
    ggml_tensor * res = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, rows());
    ggml_set_input(res);
    ggml_set_name(res, "attn_inp_turboq_window_order");
    return res;
}

llama_turboq_exact_rows llama_turboq_window::layer_rows(ggml_context * ctx, uint32_t ikv, ggml_tensor * mask,
                                                        const ggml_tensor * kq_mask, ggml_tensor * order,
                                                        int64_t n_embd_head_k, ggml_tensor * k_stored,
                                                        ggml_tensor * v_cur) const {
    const int64_t n_kv = kq_mask->ne[0], n_tps = kq_mask->ne[1], ns = kq_mask->ne[3];
    const int64_t n_tokens = n_tps*ns;
    const int64_t n_exact  = rows() + n_tokens;
    const int64_t n_head   = v_cur->ne[1];
    const int64_t n_cols   = exact_cols(n_kv, n_tokens);
    const size_t  es       = ggml_element_size(mask);
    GGML_ASSERT(k_stored->ne[1] == n_tokens && ggml_nelements(mask) == (n_kv + n_cols)*n_tokens);

    // the ring's rows in position order (order), so that a window reads its rows in the same order
    // whether they come from the ring or from the ubatch, and gives the same bits either way; as F32
    // (get_rows' output), which the attention rounds through F16 as the ring holds them
    llama_turboq_exact_rows r;
    const auto cont = [&](ggml_tensor * t) { return ggml_is_contiguous(t) ? t : ggml_cont(ctx, t); };
    ggml_tensor * rk = ggml_reshape_3d(ctx, ggml_get_rows(ctx, k[ikv], order), n_embd_head_k, n_head, rows());
    ggml_tensor * ck = ggml_reshape_3d(ctx, cont(k_stored), n_embd_head_k, n_head, n_tokens);
    ggml_tensor * ek = ggml_concat(ctx, rk, ck, 2);

    const int64_t n_embd_head_v = v_cur->ne[0];
    ggml_tensor * rv = ggml_reshape_3d(ctx, ggml_get_rows(ctx, v[ikv], order), n_embd_head_v, n_head, rows());
    ggml_tensor * ev = ggml_concat(ctx, rv, cont(v_cur), 2);

    if (copy) {
        // rounded to F16 as the ring holds them, the same rounding as the rows beside take
        const int pad = (int) (n_cols - n_exact);
        r.k = ggml_cast(ctx, pad ? ggml_pad(ctx, ek, 0, 0, pad, 0) : ek, GGML_TYPE_F16);
        r.v = ggml_cast(ctx, pad ? ggml_pad(ctx, ev, 0, 0, pad, 0) : ev, GGML_TYPE_F16);
        r.cache_mask = ggml_view_4d(ctx, mask, n_kv + n_cols, n_tps, 1, ns, (n_kv + n_cols)*es, (n_kv + n_cols)*n_tps*es,
                                    (n_kv + n_cols)*n_tps*es, 0);
        r.append = true;
        return r;
    }
    r.k = ggml_permute(ctx, ek, 0, 2, 1, 3);
    r.v = ggml_permute(ctx, ev, 0, 2, 1, 3);

    r.cache_mask = ggml_view_4d(ctx, mask, n_kv, n_tps, 1, ns, n_kv*es, n_kv*n_tps*es, n_kv*n_tps*es, 0);
    r.mask       = ggml_view_4d(ctx, mask, n_exact, n_tps, 1, ns, n_exact*es, n_exact*n_tps*es, n_exact*n_tps*es,
                                n_kv*n_tokens*es);
    return r;
}

ggml_tensor * llama_turboq_window::write_k(ggml_context * ctx, uint32_t ikv, ggml_tensor * k_stored, ggml_tensor * idxs) const {
    return ggml_set_rows(ctx, k[ikv], k_stored, idxs);
}

ggml_tensor * llama_turboq_window::write_v(ggml_context * ctx, uint32_t ikv, ggml_tensor * v_cur, ggml_tensor * idxs) const {
    // the heads of a row lie contiguously (as cpy_v takes them)
    GGML_ASSERT(ggml_row_size(v_cur->type, v_cur->ne[0]) == v_cur->nb[1]);
    ggml_tensor * rows_v = ggml_view_2d(ctx, v_cur, v_cur->ne[0]*v_cur->ne[1], v_cur->ne[2], v_cur->nb[2], 0);
    return ggml_set_rows(ctx, v[ikv], rows_v, idxs);
}

void llama_turboq_window::set_input(ggml_tensor * mask, ggml_tensor * idxs, ggml_tensor * order, const ggml_tensor * kq_mask_desc,
                                    const std::function<void(ggml_tensor *)> & fill_mask, const llama_ubatch * ubatch,
                                    const std::vector<llama_kv_cells> & v_cells, const std::vector<uint32_t> & seq_to_stream) {
    GGML_ASSERT(ggml_backend_buffer_is_host(mask->buffer) && ggml_backend_buffer_is_host(idxs->buffer) &&
                ggml_backend_buffer_is_host(order->buffer) && order->ne[0] == rows());
    GGML_ASSERT(mask->type == GGML_TYPE_F16 && kq_mask_desc->type == GGML_TYPE_F16 && ggml_is_contiguous(kq_mask_desc));

    const std::vector<uint8_t> scratch = llama_turboq_mask_copy(kq_mask_desc, mask->buffer, fill_mask);
    const ggml_fp16_t * kq = (const ggml_fp16_t *) scratch.data();

    const int64_t n_kv = kq_mask_desc->ne[0], n_tps = kq_mask_desc->ne[1], ns = kq_mask_desc->ne[3];
    const int64_t n_tokens = ubatch->n_tokens;
    const int64_t n_cols   = exact_cols(n_kv, n_tokens);
    GGML_ASSERT(n_tps*ns == n_tokens && ggml_nelements(mask) == (n_kv + n_cols)*n_tokens && idxs->ne[0] == n_tokens);

    // a query's row of the cache's mask and of the exact rows' (one row spanning both through the copy)
    ggml_fp16_t * cache_mask = (ggml_fp16_t *) mask->data;
    ggml_fp16_t * exact_mask = copy ? cache_mask + n_kv : cache_mask + n_kv*n_tokens;
    const int64_t cache_step = copy ? n_kv + n_cols : n_kv;
    const int64_t exact_step = copy ? n_kv + n_cols : n_cols;
    const ggml_fp16_t drop = ggml_fp32_to_fp16(-INFINITY);
    std::fill(cache_mask, cache_mask + (n_kv + n_cols)*n_tokens, drop);
    for (int64_t i = 0; i < n_tokens; ++i) {
        std::memcpy(cache_mask + i*cache_step, kq + i*n_kv, n_kv*sizeof(ggml_fp16_t));
    }

    // the ring's slots as the graph reads them: the held ones by sequence and position, then the rest
    std::vector<uint32_t> slots(rows());
    for (uint32_t sl = 0; sl < rows(); ++sl) {
        slots[sl] = sl;
    }
    const auto key_of = [&](uint32_t sl) {
        return sl < trash() && held[sl] >= 0 ? std::make_tuple(0, sl/cap, (int64_t) held[sl]) : std::make_tuple(1, sl, (int64_t) 0);
    };
    std::sort(slots.begin(), slots.end(), [&](uint32_t a, uint32_t b) { return key_of(a) < key_of(b); });
    std::vector<int64_t> row_of(rows());
    int32_t * ord = (int32_t *) order->data;
    for (uint32_t i = 0; i < rows(); ++i) {
        ord[i] = (int32_t) slots[i];
        row_of[slots[i]] = i;
    }

    // the ubatch's own rows, by (sequence, position)
    const auto key = [](llama_seq_id s, llama_pos p) { return ((uint64_t) (uint32_t) s << 32) | (uint32_t) p; };
    std::unordered_map<uint64_t, int64_t> in_ubatch;
    for (int64_t j = 0; j < n_tokens; ++j) {
        for (int32_t k = 0; k < ubatch->n_seq_id[j]; ++k) {
            in_ubatch[key(ubatch->seq_id[j][k], ubatch->pos[j])] = j;
        }
    }

    // a windowed position's stored copy is hidden from a query that sees it, and its exact copy
    // shown with the same mask value, from the ubatch or else from the ring as it was before it
    for (int64_t i = 0; i < n_tokens; ++i) {
        const llama_seq_id seq = ubatch->seq_id[i][0];
        const llama_pos    p   = ubatch->pos[i];
        const auto & cells = v_cells.at(seq_to_stream.at(seq));
        ggml_fp16_t * crow = cache_mask + i*cache_step;
        ggml_fp16_t * erow = exact_mask + i*exact_step;
        for (int64_t c = 0; c < n_kv && c < (int64_t) cells.size(); ++c) {
            if (crow[c] == drop || cells.is_empty(c)) {
                continue;
            }
            const llama_pos q = cells.pos_get(c);
            if (q > p || (int64_t) q <= (int64_t) p - w || !cells.seq_has(c, seq)) {
                continue;
            }
            int64_t e = -1;
            if (const auto it = in_ubatch.find(key(seq, q)); it != in_ubatch.end()) {
                e = rows() + it->second;
            } else if ((uint32_t) seq < n_seq && held[slot(seq, q)] == q) {
                e = row_of[slot(seq, q)];
            } else {
                // a token of several sequences keeps its row under the first of them: the cell's
                for (uint32_t s = 0; s < n_seq && e < 0; ++s) {
                    if (cells.seq_has(c, (llama_seq_id) s) && held[slot(s, q)] == q) {
                        e = row_of[slot(s, q)];
                    }
                }
            }
            if (e >= 0) {
                erow[e] = crow[c];
                crow[c] = drop;
            }
        }
    }

    // each slot takes the newest of the ubatch's rows that fall on it (a token with several
    // sequences: the first one's), the others go to the trash slot
    int64_t * widx = (int64_t *) idxs->data;
    std::unordered_map<uint32_t, int64_t> newest;
    for (int64_t j = 0; j < n_tokens; ++j) {
        widx[j] = trash();
        const llama_seq_id seq = ubatch->seq_id[j][0];
        if (seq < 0 || (uint32_t) seq >= n_seq || ubatch->pos[j] < 0) {
            continue;
        }
        const uint32_t sl = slot(seq, ubatch->pos[j]);
        const auto it = newest.find(sl);
        if (it == newest.end() || ubatch->pos[it->second] < ubatch->pos[j]) {
            newest[sl] = j;
        }
    }
    for (const auto & [sl, j] : newest) {
        widx[j] = sl;
        held[sl] = ubatch->pos[j];
    }
}

void llama_turboq_window::clear() {
    std::fill(held.begin(), held.end(), -1);
}

void llama_turboq_window::seq_rm(llama_seq_id seq, llama_pos p0, llama_pos p1) {
    if (p0 < 0) {
        p0 = 0;
    }
    if (p1 < 0) {
        p1 = std::numeric_limits<llama_pos>::max();
    }
    for (uint32_t s = 0; s < n_seq; ++s) {
        if (seq >= 0 && (uint32_t) seq != s) {
            continue;
        }
        for (uint32_t j = 0; j < cap; ++j) {
            llama_pos & h = held[s*cap + j];
            if (h >= p0 && h < p1) {
                h = -1;
            }
        }
    }
}

void llama_turboq_window::copy_row(ggml_tensor * t, uint32_t from, uint32_t to) const {
    std::vector<uint8_t> row(t->nb[1]);
    ggml_backend_tensor_get(t, row.data(), from*t->nb[1], t->nb[1]);
    ggml_backend_tensor_set(t, row.data(), to*t->nb[1], t->nb[1]);
}

void llama_turboq_window::seq_cp(llama_seq_id src, llama_seq_id dst, llama_pos p0, llama_pos p1, bool dst_emptied) {
    if (src == dst || src < 0 || dst < 0 || (uint32_t) src >= n_seq || (uint32_t) dst >= n_seq) {
        return;
    }
    // dst's old rows at the copied positions (or all of them, when its cells were emptied) are
    // another text's: a slot that src does not hold must not keep them
    seq_rm(dst, dst_emptied ? -1 : p0, dst_emptied ? -1 : p1);
    if (p0 < 0) {
        p0 = 0;
    }
    if (p1 < 0) {
        p1 = std::numeric_limits<llama_pos>::max();
    }
    for (uint32_t j = 0; j < cap; ++j) {
        const llama_pos h = held[src*cap + j];
        if (h < p0 || h >= p1) {
            continue;
        }
        for (size_t l = 0; l < k.size(); ++l) {
            if (k[l]) {
                copy_row(k[l], src*cap + j, dst*cap + j);
                copy_row(v[l], src*cap + j, dst*cap + j);
            }
        }
        held[dst*cap + j] = h;
    }
}

void llama_turboq_window::seq_keep(llama_seq_id seq) {
    for (uint32_t s = 0; s < n_seq; ++s) {
        if ((uint32_t) seq != s) {
            std::fill(held.begin() + s*cap, held.begin() + (s + 1)*cap, -1);
        }
    }
}

void llama_turboq_window::seq_shifted(llama_seq_id seq, llama_pos p0, llama_pos p1) {
    seq_rm(seq, p0, p1);
}

bool llama_turboq_window::can_continue(llama_seq_id seq, llama_pos n_past) const {
    if (seq < 0 || (uint32_t) seq >= n_seq) {
        return n_past <= 0;
    }
    for (llama_pos q = std::max<llama_pos>(0, n_past - (llama_pos) w); q < n_past; ++q) {
        if (held[slot(seq, q)] != q) {
            return false;
        }
    }
    return true;
}

static constexpr uint32_t window_mark = 0x4e575154;  // "TQWN"

void llama_turboq_window::state_write(llama_io_write_i & io, llama_seq_id seq) const {
    std::vector<uint32_t> layers;
    for (uint32_t l = 0; l < k.size(); ++l) {
        if (k[l]) {
            layers.push_back(l);
        }
    }
    const uint32_t head[4] = { window_mark, w, cap, (uint32_t) layers.size() };
    io.write(head, sizeof(head));
    for (uint32_t l : layers) {
        const uint64_t sizes[2] = { k[l]->nb[1], v[l]->nb[1] };
        io.write(sizes, sizeof(sizes));
    }
    std::vector<uint32_t> slots;
    for (uint32_t sl = 0; sl < n_seq*cap; ++sl) {
        if (held[sl] >= 0 && (seq < 0 || sl/cap == (uint32_t) seq)) {
            slots.push_back(sl);
        }
    }
    const uint32_t n = (uint32_t) slots.size();
    io.write(&n, sizeof(n));
    for (uint32_t sl : slots) {
        const int32_t entry[2] = { (int32_t) (sl/cap), held[sl] };
        io.write(entry, sizeof(entry));
        for (uint32_t l : layers) {
            io.write_tensor(k[l], sl*k[l]->nb[1], k[l]->nb[1]);
            io.write_tensor(v[l], sl*v[l]->nb[1], v[l]->nb[1]);
        }
    }
}

void llama_turboq_window::state_read(llama_io_read_i & io, llama_seq_id seq) {
    const std::string what = std::string("failed to restore the exact window (") + llama_turboq_exact_window_key() + "=" +
                             std::to_string(w) + "): ";
    uint32_t head[4];
    io.read(head, sizeof(head));
    if (head[0] != window_mark) {
        throw std::runtime_error(what + "the state was saved without an exact window");
    }
    std::vector<uint32_t> layers;
    for (uint32_t l = 0; l < k.size(); ++l) {
        if (k[l]) {
            layers.push_back(l);
        }
    }
    if (head[1] != w || head[2] != cap || head[3] != layers.size()) {
        throw std::runtime_error(what + "the state's window is " + std::to_string(head[1]) + " positions and a margin of " +
                                 std::to_string(head[2] - std::min(head[1], head[2])) + " over " + std::to_string(head[3]) +
                                 " layers, this cache's " + std::to_string(w) + " and " + std::to_string(cap - w) + " over " +
                                 std::to_string(layers.size()) + " (" + llama_turboq_exact_window_margin_key() + ")");
    }
    for (uint32_t l : layers) {
        uint64_t sizes[2];
        io.read(sizes, sizeof(sizes));
        if (sizes[0] != k[l]->nb[1] || sizes[1] != v[l]->nb[1]) {
            throw std::runtime_error(what + "the state's rows have another size");
        }
    }
    uint32_t n;
    io.read(&n, sizeof(n));
    if (n > n_seq*cap) {
        throw std::runtime_error(what + "the state holds more rows than the window can");
    }
    // every entry is checked before any row is taken, so a refused state changes nothing here
    std::vector<llama_pos> next = held;
    if (seq < 0) {
        std::fill(next.begin(), next.end(), -1);
    } else if ((uint32_t) seq < n_seq) {
        std::fill(next.begin() + seq*cap, next.begin() + (seq + 1)*cap, -1);
    }
    for (uint32_t i = 0; i < n; ++i) {
        int32_t entry[2];
        io.read(entry, sizeof(entry));
        const llama_seq_id s = seq < 0 ? entry[0] : seq;
        if (s < 0 || (uint32_t) s >= n_seq || entry[1] < 0) {
            throw std::runtime_error(what + "a row of sequence " + std::to_string(s) + " at position " +
                                     std::to_string(entry[1]) + " is out of range");
        }
        const uint32_t sl = slot(s, entry[1]);
        for (uint32_t l : layers) {
            io.read_tensor(k[l], sl*k[l]->nb[1], k[l]->nb[1]);
            io.read_tensor(v[l], sl*v[l]->nb[1], v[l]->nb[1]);
        }
        next[sl] = entry[1];
    }
    held = std::move(next);
}

static std::string unexpected_window(uint32_t w) {
    return std::string("the state was saved with an exact window of ") + std::to_string(w) + " positions (" +
           llama_turboq_exact_window_key() + "=" + std::to_string(w) +
           "), and this context has none: restore it into a context with the same window";
}

void llama_turboq_window::refuse_rest(llama_memory_i * mem, llama_seq_id seq, const void * rest, size_t n) {
    uint32_t head[2];
    if (n < sizeof(head)) {
        return;
    }
    memcpy(head, rest, sizeof(head));
    if (head[0] != window_mark) {
        return;
    }
    if (mem && seq < 0) {
        mem->clear(true);
    } else if (mem) {
        mem->seq_rm(seq, -1, -1);
    }
    throw std::runtime_error(unexpected_window(head[1]));
}

void llama_turboq_window::refuse_rest(llama_memory_i * mem, llama_seq_id seq, llama_file & file, size_t n) {
    uint32_t head[2];
    if (n < sizeof(head)) {
        return;
    }
    file.read_raw(head, sizeof(head));
    refuse_rest(mem, seq, head, sizeof(head));
}

void llama_turboq_window::refuse_stream_count(llama_io_read_i & io, uint32_t n_stream_read) {
    if (n_stream_read == window_mark) {
        uint32_t w;
        io.read(&w, sizeof(w));
        throw std::runtime_error(unexpected_window(w));
    }
}

bool llama_turboq_window_can_continue(llama_context * ctx, llama_seq_id seq, llama_pos n_past) {
    llama_memory_i * mem = llama_get_memory(ctx);
    std::vector<const llama_kv_cache *> caches;
    if (const auto * kv = dynamic_cast<const llama_kv_cache *>(mem)) {
        caches.push_back(kv);
    } else if (const auto * iswa = dynamic_cast<const llama_kv_cache_iswa *>(mem)) {
        caches.push_back(iswa->get_base());
        caches.push_back(iswa->get_swa());
    }
    for (const auto * kv : caches) {
        if (const auto * win = kv->turboq_window(); win && !win->can_continue(seq, n_past)) {
            return false;
        }
    }
    return true;
}

int32_t llama_turboq_exact_window(const llama_context * ctx) {
    return llama_get_model(ctx)->turboq_exact_window;
}

uint32_t llama_turboq_exact_window_rows(uint32_t w, int32_t m) {
    return w + (m < 0 ? llama_turboq_window::default_margin : (uint32_t) m);
}
