#include "llama-turboq-tail.h"

#include "llama-batch.h"

#include "ggml-backend.h"
#include "ggml-fa-exact.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <vector>

static int32_t env_positions(const char * name, const char * what) {
    const char * s = getenv(name);
    const int32_t n = s ? atoi(s) : 0;
    if (n > 0) {
        // stderr, not the log: the first read may come while llama.cpp's memory fit has the log muted
        fprintf(stderr, "%s=%d: %s %d positions of each sequence are read exact within a ubatch "
                        "(a debug measurement; slow)\n", name, n, what, n);
    }
    return n > 0 ? n : 0;
}

int32_t llama_turboq_exact_tail() {
    static const int32_t w = env_positions("TURBOQ_EXACT_TAIL", "the last");
    return w;
}

int32_t llama_turboq_exact_sink() {
    static const int32_t n = env_positions("TURBOQ_EXACT_SINK", "the first");
    return n;
}

static bool exact_rows_on() {
    return llama_turboq_exact_tail() > 0 || llama_turboq_exact_sink() > 0;
}

ggml_tensor * llama_turboq_tail_new_mask(ggml_context * ctx, const ggml_tensor * kq_mask) {
    if (!exact_rows_on() || kq_mask == nullptr) {
        return nullptr;
    }
    // flash attention only (its mask is F16; without it V is stored transposed), one stream only
    if (kq_mask->type != GGML_TYPE_F16 || kq_mask->ne[3] != 1) {
        static bool warned = false;
        if (!warned) {
            warned = true;
            fprintf(stderr, "%s: exact rows need flash attention and a cache with one stream; "
                            "every row is read as stored\n", __func__);
        }
        return nullptr;
    }
    const int64_t n_kv     = kq_mask->ne[0];
    const int64_t n_tokens = kq_mask->ne[1];
    ggml_tensor * res = ggml_new_tensor_4d(ctx, kq_mask->type, n_kv + n_tokens, n_tokens, 1, 1);
    ggml_set_input(res);
    ggml_set_name(res, "attn_inp_kq_mask_turboq_tail");
    return res;
}

// the masks are F16: llama_turboq_tail_new_mask makes one only for flash attention's
static float mask_get(const ggml_tensor * t, int64_t i0, int64_t i1) {
    return ggml_fp16_to_fp32(*(const ggml_fp16_t *) ((const char *) t->data + i1*t->nb[1] + i0*t->nb[0]));
}

std::vector<uint8_t> llama_turboq_mask_copy(const ggml_tensor * kq_mask_desc, ggml_backend_buffer_t host_buffer,
                                            const std::function<void(ggml_tensor *)> & fill_mask) {
    std::vector<uint8_t> scratch(ggml_nbytes(kq_mask_desc));
    ggml_tensor base = *kq_mask_desc;
    base.data     = scratch.data();
    base.buffer   = host_buffer;  // fill_mask checks that it writes host memory
    base.view_src = nullptr;
    fill_mask(&base);
    return scratch;
}

void llama_turboq_tail_set_mask(ggml_tensor * dst, const ggml_tensor * kq_mask_desc, const ggml_tensor * k_idxs,
                                const llama_ubatch * ubatch, const std::function<void(ggml_tensor *)> & fill_mask) {
    GGML_ASSERT(ggml_backend_buffer_is_host(dst->buffer));
    GGML_ASSERT(dst->type == GGML_TYPE_F16 && kq_mask_desc->type == GGML_TYPE_F16);
    GGML_ASSERT(ggml_is_contiguous(kq_mask_desc));

    std::vector<uint8_t> scratch = llama_turboq_mask_copy(kq_mask_desc, dst->buffer, fill_mask);
    ggml_tensor base = *kq_mask_desc;
    base.data = scratch.data();
    const ggml_tensor * kq_mask = &base;

    const int64_t n_kv     = kq_mask->ne[0];
    const int64_t n_tokens = kq_mask->ne[1];
    GGML_ASSERT(dst->ne[0] == n_kv + n_tokens && dst->ne[1] == n_tokens && (int64_t) ubatch->n_tokens == n_tokens);

    // the cell each ubatch row went to; a row stored outside the view (another stream's offset) or
    // without idxs keeps only its stored copy
    std::vector<int64_t> cell(n_tokens, -1);
    if (k_idxs && k_idxs->buffer && ggml_backend_buffer_is_host(k_idxs->buffer) && k_idxs->ne[0] == n_tokens) {
        const int64_t * idx = (const int64_t *) k_idxs->data;
        for (int64_t j = 0; j < n_tokens; ++j) {
            cell[j] = idx[j] < n_kv ? idx[j] : -1;
        }
    }

    if (n_tokens > 0 && std::count(cell.begin(), cell.end(), -1) == n_tokens) {
        static bool warned = false;
        if (!warned) {
            warned = true;
            fprintf(stderr, "%s: the ubatch's rows are outside the cache's view (a stream other than the "
                            "first); they are read as stored\n", __func__);
        }
    }

    // dst holds two contiguous masks (flash attention takes no other): the cache's [n_kv, n_tokens],
    // then the exact rows' [n_tokens, n_tokens]
    ggml_fp16_t * cache_mask = (ggml_fp16_t *) dst->data;
    ggml_fp16_t * exact_mask = cache_mask + n_kv*n_tokens;
    const int64_t w    = llama_turboq_exact_tail();
    const int64_t sink = llama_turboq_exact_sink();
    for (int64_t i = 0; i < n_tokens; ++i) {
        for (int64_t c = 0; c < n_kv; ++c) {
            cache_mask[i*n_kv + c] = ggml_fp32_to_fp16(mask_get(kq_mask, c, i));
        }
        for (int64_t j = 0; j < n_tokens; ++j) {
            const int64_t d = (int64_t) ubatch->pos[i] - ubatch->pos[j];
            float m = -INFINITY;
            if (cell[j] >= 0 && ((d >= 0 && d < w) || ubatch->pos[j] < sink)) {
                m = mask_get(kq_mask, cell[j], i);  // visible to this query (sequence, causality, SWA)?
                if (m != -INFINITY) {
                    cache_mask[i*n_kv + cell[j]] = ggml_fp32_to_fp16(-INFINITY);
                }
            }
            exact_mask[i*n_tokens + j] = ggml_fp32_to_fp16(m);
        }
    }
}

bool llama_turboq_tail_layer(const ggml_tensor * k, const ggml_tensor * v) {
    return exact_rows_on() && k && v && k->ne[3] == 1 && v->ne[3] == 1 &&
           (ggml_is_quantized(k->type) || ggml_is_quantized(v->type));
}

llama_turboq_exact_rows llama_turboq_tail_rows_new(ggml_context * ctx, ggml_tensor * tail_mask,
                                                  ggml_tensor * k_stored, ggml_tensor * v_cur) {
    const int64_t n_tokens = tail_mask->ne[1];
    const int64_t n_kv     = tail_mask->ne[0] - n_tokens;
    const int64_t n_head   = v_cur->ne[1];
    llama_turboq_exact_rows r;
    // [n_embd_head, n_tokens, n_head_kv, 1], as flash attention takes K and V
    if (!ggml_is_contiguous(k_stored)) {
        k_stored = ggml_cont(ctx, k_stored);
    }
    r.k = ggml_permute(ctx, ggml_reshape_3d(ctx, k_stored, k_stored->ne[0]/n_head, n_head, n_tokens), 0, 2, 1, 3);
    r.v = ggml_permute(ctx, v_cur, 0, 2, 1, 3);
    const size_t  es       = ggml_element_size(tail_mask);
    r.cache_mask = ggml_view_2d(ctx, tail_mask, n_kv, n_tokens, n_kv*es, 0);  // see llama_turboq_tail_set_mask
    r.mask       = ggml_view_2d(ctx, tail_mask, n_tokens, n_tokens, n_tokens*es, n_kv*n_tokens*es);
    return r;
}

static ggml_tensor * append_rows(ggml_context * ctx, ggml_tensor * cache, ggml_tensor * exact) {
    GGML_ASSERT(exact->type == GGML_TYPE_F16 && exact->ne[0] == cache->ne[0] && exact->ne[1] == cache->ne[1]);
    ggml_tensor * res = nullptr;
    for (int64_t s = 0; s < cache->ne[3]; ++s) {
        ggml_tensor * one = ggml_view_3d(ctx, cache, cache->ne[0], cache->ne[1], cache->ne[2], cache->nb[1], cache->nb[2],
                                         s*cache->nb[3]);
        one = ggml_concat(ctx, ggml_cast(ctx, one, GGML_TYPE_F16), exact, 2);
        res = res ? ggml_concat(ctx, res, one, 3) : one;
    }
    return res;
}

void llama_turboq_exact_append(ggml_context * ctx, llama_turboq_exact_rows & rows, ggml_tensor *& k, ggml_tensor *& v) {
    if (!rows.append) {
        return;
    }
    GGML_ASSERT(rows.k && rows.v && rows.cache_mask && k && v);
    k = append_rows(ctx, k, rows.k);
    v = append_rows(ctx, v, rows.v);
    GGML_ASSERT(rows.cache_mask->ne[0] == k->ne[2] && k->ne[2] == v->ne[2]);
    rows.k = rows.v = nullptr;
    rows.append = false;
}

void llama_turboq_tail_attach(ggml_tensor * fa, const llama_turboq_exact_rows * rows) {
    if (rows && rows->k) {
        ggml_flash_attn_ext_set_exact(fa, rows->k, rows->v, rows->mask);
    }
}
