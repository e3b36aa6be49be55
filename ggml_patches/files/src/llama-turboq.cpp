#include "llama-turboq.h"
#include "llama-turboq-center.h"

#include "llama-impl.h"
#include "llama-io.h"
#include "llama-model.h"
#include "llama-model-loader.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <cstring>
#include <vector>
#include <stdexcept>
#include <string>

namespace {

constexpr ggml_type KEEP = GGML_TYPE_COUNT; // the layer keeps the requested type
constexpr int QK_G128 = 128; // values per rotation group (ggml_turboq_group)
constexpr int QK_G64  = 64;
constexpr int QK_G32  = 32;
constexpr int QK_G16  = 16;

// set while the K-centering calibration context is built and run (llama-turboq-center.cpp): it is
// a plain f16 context, whatever the layer-adaptive mode says
thread_local bool t_calibrating = false;

// which layers are "boundary" layers, and what K and V get there and elsewhere
struct layer_policy {
    int       mode;
    uint32_t  n_first;     // boundary layers at the start
    uint32_t  n_last;      // boundary layers at the end
    uint32_t  k_gain_div;  // > 0: the n_layer/k_gain_div (at least 1) layers of largest K gain are boundary layers
    ggml_type k_boundary;
    ggml_type v_boundary;
    ggml_type v_other;
    // the ranking's candidates are only the layers that attend over the whole context: a needle
    // thousands of positions back is read there, and there a turboq3 K loses it (pyturbo bench
    // needle: on Gemma 3 270M, whose 3 such layers of 18 hold most of a long context's cache, a
    // turboq4 K on them alone keeps what f16 finds)
    bool      full_context;
    // what the mode does, for users: the flag takes it beside the number (which keeps working)
    const char * name;
};

constexpr const char * MODE_0_NAME = "off";  // mode 0: every layer as -ctk/-ctv ask

constexpr layer_policy policies[] = {
    { 1, 4, 4, 0, GGML_TYPE_Q8_0,      GGML_TYPE_Q8_0,      KEEP,                false, "q8-edges"    },
    { 2, 0, 8, 0, GGML_TYPE_Q8_0,      GGML_TYPE_Q8_0,      KEEP,                false, "q8-last8"    },
    { 3, 0, 0, 9, GGML_TYPE_Q8_0,      KEEP,                KEEP,                false, "k8-gain"     },
    { 4, 0, 0, 1, GGML_TYPE_TURBOQ4_0, KEEP,                KEEP,                true,  "k4-global"   },
    { 5, 2, 2, 0, KEEP,                GGML_TYPE_TURBOQ4_0, GGML_TYPE_TURBOQ2_0, false, "v2-edges-v4" },
    { 6, 0, 8, 0, KEEP,                GGML_TYPE_TURBOQ4_0, GGML_TYPE_TURBOQ2_0, false, "v2-last8-v4" },
    { 7, 2, 2, 0, KEEP,                GGML_TYPE_Q8_0,      GGML_TYPE_TURBOQ2_0, false, "v2-edges-q8" },
};

const layer_policy * policy_of(int mode) {
    for (const auto & p : policies) {
        if (p.mode == mode) {
            return &p;
        }
    }
    return nullptr;
}

std::string valid_modes() {
    std::string s = "0", names = std::string(" (or their names: ") + MODE_0_NAME;
    for (const auto & p : policies) {
        s += ", " + std::to_string(p.mode);
        names += std::string(", ") + p.name;
    }
    return s + names + ")";
}

// RMS of a weight tensor's values, read from whichever backend holds it
double weight_rms(const ggml_tensor * t) {
    std::vector<uint8_t> raw(ggml_nbytes(t));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    const int64_t n = ggml_nelements(t);
    std::vector<float> x(n);
    if (t->type == GGML_TYPE_F32) {
        std::memcpy(x.data(), raw.data(), n*sizeof(float));
    } else {
        const auto * traits = ggml_get_type_traits(t->type);
        if (!traits->to_float || !ggml_is_contiguous(t)) {
            return -1.0;
        }
        traits->to_float(raw.data(), x.data(), n);
    }
    double ss = 0.0;
    for (float v : x) {
        ss += (double) v*v;
    }
    return std::sqrt(ss/(double) n);
}

} // namespace

bool llama_turboq_layer_policy(int32_t i, int32_t * out) {
    if (i < 0 || (size_t) i >= sizeof(policies)/sizeof(policies[0])) {
        return false;
    }
    const layer_policy & p = policies[i];
    auto id = [](ggml_type t) { return t == KEEP ? -1 : (int32_t) t; };
    const int32_t row[8] = { p.mode, (int32_t) p.n_first, (int32_t) p.n_last, (int32_t) p.k_gain_div,
                             id(p.k_boundary), id(p.v_boundary), id(p.v_other), p.full_context ? 1 : 0 };
    std::memcpy(out, row, sizeof(row));
    return true;
}

const char * llama_turboq_layer_adaptive_name(int32_t mode) {
    if (mode == 0) {
        return MODE_0_NAME;
    }
    const layer_policy * p = policy_of(mode);
    return p ? p->name : nullptr;
}

const char * llama_turboq_layer_adaptive_key(void) {
    return "turboq.layer_adaptive";
}

void llama_turboq_load_model_settings(const llama_model_loader & ml, llama_model & model) {
    const char * key = llama_turboq_layer_adaptive_key();
    int64_t mode = 0;
    std::string from;
    const auto it = ml.kv_overrides.find(key);
    if (it != ml.kv_overrides.end()) {
        if (it->second.tag != LLAMA_KV_OVERRIDE_TYPE_INT) {
            throw std::runtime_error(std::string(key) + ": the override must be an int (a layer-adaptive mode)");
        }
        mode = it->second.val_i64;
        from = "set by --layer-adaptive, LLAMA_ARG_LAYER_ADAPTIVE or kv_overrides";
    } else if (const int64_t id = gguf_find_key(ml.metadata, key); id >= 0) {
        switch (gguf_get_kv_type(ml.metadata, id)) {
            case GGUF_TYPE_INT8:   mode = gguf_get_val_i8 (ml.metadata, id); break;
            case GGUF_TYPE_UINT8:  mode = gguf_get_val_u8 (ml.metadata, id); break;
            case GGUF_TYPE_INT16:  mode = gguf_get_val_i16(ml.metadata, id); break;
            case GGUF_TYPE_UINT16: mode = gguf_get_val_u16(ml.metadata, id); break;
            case GGUF_TYPE_INT32:  mode = gguf_get_val_i32(ml.metadata, id); break;
            case GGUF_TYPE_UINT32: mode = gguf_get_val_u32(ml.metadata, id); break;
            case GGUF_TYPE_INT64:  mode = gguf_get_val_i64(ml.metadata, id); break;
            case GGUF_TYPE_UINT64: mode = (int64_t) std::min<uint64_t>(gguf_get_val_u64(ml.metadata, id), INT64_MAX); break;
            default: throw std::runtime_error(std::string(key) + " in the GGUF must be an integer (a layer-adaptive mode)");
        }
        from = "from the GGUF";
    }
    // range first: a 64-bit value must not wrap onto a valid mode
    if (mode != 0 && (mode < 0 || mode > 255 || policy_of((int) mode) == nullptr)) {
        throw std::runtime_error(std::string(key) + "=" + std::to_string(mode) + " (" + from +
                                 ") is not a layer-adaptive mode: valid modes are " + valid_modes());
    }
    model.turboq_layer_adaptive = (int) mode;
    llama_turboq_load_k_center(ml, model);  // the model's other turboq setting read here (llama-turboq-center.h)
}

int llama_turboq_layer_adaptive_mode(const llama_model & model) {
    return t_calibrating ? 0 : model.turboq_layer_adaptive;
}

namespace {

// The selection rule, the one copy (bindings reach it through llama_turboq_boundary_from_gains):
// the mode's layers at the ends, plus for a ranking mode the n_layer/k_gain_div (at least 1)
// candidates of largest gain, ties to the lower layer; gains[il] < 0: layer il is no candidate.
void boundary_from_gains(const layer_policy & p, uint32_t n_layer, const double * gains, bool * out) {
    for (uint32_t il = 0; il < n_layer; ++il) {
        out[il] = il < p.n_first || il + p.n_last >= n_layer;
    }
    if (p.k_gain_div == 0) {
        return;
    }
    std::vector<std::pair<double, uint32_t>> gain;
    for (uint32_t il = 0; il < n_layer; ++il) {
        if (gains[il] >= 0.0) {
            gain.push_back({ gains[il], il });
        }
    }
    std::sort(gain.begin(), gain.end(), [](const auto & a, const auto & b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
    const size_t n_pick = std::max<size_t>(1, n_layer/p.k_gain_div);
    for (size_t i = 0; i < std::min(n_pick, gain.size()); ++i) {
        out[gain[i].second] = true;
    }
}

} // namespace

bool llama_turboq_boundary_from_gains(int32_t mode, int32_t n_layer, const double * gains, bool * out) {
    if (n_layer < 0 || (n_layer > 0 && out == nullptr)) {
        return false;
    }
    const layer_policy * p = policy_of(mode);
    if (p == nullptr) {
        std::fill(out, out + n_layer, false);
        return mode == 0;
    }
    if (p->k_gain_div != 0 && gains == nullptr) {
        return false;
    }
    boundary_from_gains(*p, (uint32_t) n_layer, gains, out);
    return true;
}

std::vector<bool> llama_turboq_boundary_layers(int mode, const llama_model & model) {
    const uint32_t n_layer = model.hparams.n_layer();
    const layer_policy * p = policy_of(mode);
    if (p == nullptr) {
        return std::vector<bool>(n_layer, false);
    }
    // The K gain of a layer, from its weights: the RMS of the K norm's scale on models with a
    // K norm (Gemma, Qwen3, ...), else the RMS of the K projection. The K quantization error of
    // a layer grows with it; on Gemma 3 270M the top two (layers 11 and 5) carry half of the
    // attention-output error of turboq3 K (pyturbo kvlab). An MLA layer caches the normed latent
    // (and its rotary part) as K, so its K norm is the latent's.
    const bool is_mla = model.hparams.is_mla();
    if (is_mla && p->k_boundary == KEEP) {
        LLAMA_LOG_WARN("%s: layer-adaptive mode %d sets only V types, and this model (MLA) caches no V: attention "
                       "reads V out of K, so every layer keeps the requested K type\n", __func__, mode);
    }
    std::vector<double> gains(n_layer, -1.0);
    bool any = false;
    for (uint32_t il = 0; il < n_layer && p->k_gain_div != 0; ++il) {
        const auto & layer = model.layers[il];
        const ggml_tensor * w = is_mla ? (layer.attn_kv_a_norm ? layer.attn_kv_a_norm : layer.wkv_a_mqa)
                                       : (layer.attn_k_norm ? layer.attn_k_norm : layer.wk);
        if (w == nullptr || !model.hparams.has_kv(il) || (p->full_context && model.hparams.is_swa(il))) {
            continue;
        }
        any = true;
        if (w->data == nullptr) {
            // a sizing pass without weights (llama_params_fit): any n_pick layers cost the same memory
            gains[il] = (double) il;
            continue;
        }
        gains[il] = weight_rms(w);
        if (gains[il] < 0.0) {
            throw std::runtime_error("layer-adaptive mode " + std::to_string(mode) + ": cannot read the K weights of layer " +
                                     std::to_string(il) + " (type " + ggml_type_name(w->type) + ")");
        }
    }
    if (p->k_gain_div != 0 && !any) {
        throw std::runtime_error("layer-adaptive mode " + std::to_string(mode) + ": this model has no K weights to rank its layers by");
    }
    if (p->full_context && !model.hparams.is_swa_any()) {
        LLAMA_LOG_INFO("%s: layer-adaptive mode %d: this model has no sliding-window layers, so every layer attends over "
                       "the whole context and takes the mode's K type\n", __func__, mode);
    }
    std::unique_ptr<bool[]> out(new bool[n_layer]);
    boundary_from_gains(*p, n_layer, gains.data(), out.get());
    return std::vector<bool>(out.get(), out.get() + n_layer);
}

llama_turboq_layer_types llama_turboq_layer_types_for(int mode, bool boundary, ggml_type type_k, ggml_type type_v) {
    const layer_policy * p = policy_of(mode);
    if (p == nullptr) {
        return { type_k, type_v };
    }
    const auto pick = [](ggml_type t, ggml_type requested) { return t == KEEP ? requested : t; };
    if (boundary) {
        return { pick(p->k_boundary, type_k), pick(p->v_boundary, type_v) };
    }
    return { type_k, pick(p->v_other, type_v) };
}

ggml_type llama_turboq_type_for_head(ggml_type type, uint32_t n_embd_head) {
    if (!ggml_is_turboq(type) || n_embd_head % QK_G16 != 0) {
        return type;
    }
    // debug: a smaller group than the head size needs (64, 32 or 16), to measure a twin's quality on
    // a model whose heads do not call for it
    const char * env   = std::getenv("TURBOQ_GROUP");
    const int    force = env ? std::atoi(env) : 0;
    int group = n_embd_head % QK_G128 == 0 ? QK_G128 : n_embd_head % QK_G64 == 0 ? QK_G64
              : n_embd_head % QK_G32 == 0 ? QK_G32 : QK_G16;
    if ((force == QK_G64 || force == QK_G32 || force == QK_G16) && force < group) {
        group = force;
    }
    if (group == QK_G128) {
        return type;
    }
    const ggml_type twin0 = group == QK_G64 ? GGML_TYPE_TURBOQ2_G64 : group == QK_G32 ? GGML_TYPE_TURBOQ2_G32 : GGML_TYPE_TURBOQ2_G16;
    return (ggml_type) (twin0 + (type - GGML_TYPE_TURBOQ2_0));
}

uint32_t llama_turboq_head_block(ggml_type type, uint32_t n_embd_head) {
    return (uint32_t) ggml_blck_size(llama_turboq_type_for_head(type, n_embd_head));
}

int32_t llama_turboq_stored_type(int32_t type, uint32_t n_embd_head) {
    if (type < 0 || type >= GGML_TYPE_COUNT) {
        return type;
    }
    return llama_turboq_type_for_head((ggml_type) type, n_embd_head);
}

int32_t llama_turboq_mode_type_for_head(int32_t type, uint32_t n_embd_head) {
    if (type < 0 || type >= GGML_TYPE_COUNT) {
        return type;
    }
    ggml_type t = (ggml_type) type;
    // q8_0 at head size 80: the mode asks for 8 bits there, and turboq8 in 16-value groups gives q8_0's
    // error (SmolLM2 with 16-value groups forced: mean KLD 0.00354 against q8_0's 0.00364) at 9 bits
    if (t == GGML_TYPE_Q8_0 && n_embd_head % ggml_blck_size(t) != 0) {
        t = GGML_TYPE_TURBOQ8_0;
    }
    return llama_turboq_type_for_head(t, n_embd_head);
}

llama_turboq_layer_types llama_turboq_fit_heads(const llama_turboq_layer_types & lt, const llama_turboq_layer_types & requested,
                                                uint32_t il, uint32_t n_embd_head_k, uint32_t n_embd_head_v, bool is_mla) {
    const auto fit = [](ggml_type t, ggml_type req, uint32_t n_embd_head) {
        return t == req ? llama_turboq_type_for_head(t, n_embd_head) : (ggml_type) llama_turboq_mode_type_for_head(t, n_embd_head);
    };
    const ggml_type type_k = fit(lt.type_k, requested.type_k, n_embd_head_k);
    if (is_mla) {
        if (type_k != lt.type_k) {
            LLAMA_LOG_INFO("%s: layer %3u: head size %u: K %s (turboq in %d-value groups), read as V through its first %u "
                           "values (MLA)\n", __func__, il, n_embd_head_k, ggml_type_name(type_k), ggml_turboq_group(type_k), n_embd_head_v);
        }
        return { type_k, type_k };
    }
    const llama_turboq_layer_types out = { type_k, fit(lt.type_v, requested.type_v, n_embd_head_v) };
    for (const auto & [side, from, to, n_embd_head] : { std::make_tuple("K", lt.type_k, out.type_k, n_embd_head_k),
                                                         std::make_tuple("V", lt.type_v, out.type_v, n_embd_head_v) }) {
        if (to != from && !ggml_is_turboq(from)) {
            LLAMA_LOG_INFO("%s: layer %3u: head size %u: the mode's %s %s does not divide it; %s %s (turboq in %d-value groups)\n",
                           __func__, il, n_embd_head, side, ggml_type_name(from), side, ggml_type_name(to), ggml_turboq_group(to));
        }
    }
    if (out.type_k != lt.type_k || out.type_v != lt.type_v) {
        const ggml_type twin = out.type_k != lt.type_k ? out.type_k : out.type_v;
        LLAMA_LOG_INFO("%s: layer %3u: head size %u: K %s, V %s (turboq in %d-value groups)\n", __func__, il,
                       out.type_k != lt.type_k ? n_embd_head_k : n_embd_head_v, ggml_type_name(out.type_k), ggml_type_name(out.type_v),
                       ggml_turboq_group(twin));
    }
    return out;
}

namespace {

bool is_rpc(ggml_backend_dev_t dev);

// what dev computes of what a layer with these K/V types needs from it, asked with
// ggml_backend_dev_supports_op on shapes like the layer's
struct kv_ops_on_device {
    bool set_rows;   // SET_ROWS into each cache
    bool attention;  // flash attention over them
};

kv_ops_on_device device_takes_kv_types(ggml_backend_dev_t dev, const llama_turboq_layer_types & lt, uint32_t n_embd_head_k,
                                       uint32_t n_embd_head_v, uint32_t n_gqa) {
    const ggml_init_params params = { 16 * ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(params);
    if (ctx == nullptr) {
        throw std::runtime_error("out of memory for a probe of the KV cache's device");
    }
    const int64_t n_kv = 256;
    ggml_tensor * k    = ggml_new_tensor_3d(ctx, lt.type_k, n_embd_head_k, n_kv, 1);
    ggml_tensor * v    = ggml_new_tensor_3d(ctx, lt.type_v, n_embd_head_v, n_kv, 1);
    // one decoded token of the layer's query heads per KV head: backends pick kernels by that ratio
    ggml_tensor * q    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_embd_head_k, 1, std::max(1u, n_gqa));
    ggml_tensor * mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, 1);
    ggml_tensor * rows = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd_head_k, 1);
    ggml_tensor * idx  = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, 1);
    ggml_tensor * fa   = ggml_flash_attn_ext(ctx, q, k, v, mask, 1.0f, 0.0f, 0.0f);
    ggml_prec_set_acc(fa, GGML_PREC_F32); // as llama-graph sets it
    ggml_tensor * set_k = ggml_set_rows(ctx, ggml_view_2d(ctx, k, n_embd_head_k, n_kv, k->nb[1], 0), rows, idx);
    ggml_tensor * rows_v = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd_head_v, 1);
    ggml_tensor * set_v = ggml_set_rows(ctx, ggml_view_2d(ctx, v, n_embd_head_v, n_kv, v->nb[1], 0), rows_v, idx);
    const kv_ops_on_device ops = {
        ggml_backend_dev_supports_op(dev, set_k) && ggml_backend_dev_supports_op(dev, set_v),
        ggml_backend_dev_supports_op(dev, fa),
    };
    ggml_free(ctx);
    return ops;
}

} // namespace

void llama_turboq_check_layer_device(const llama_turboq_layer_types & lt, ggml_backend_dev_t dev, uint32_t il,
                                     uint32_t n_embd_head_k, uint32_t n_embd_head_v, uint32_t n_gqa) {
    // a twin: 64-, 32- or 16-value groups
    const bool k64 = ggml_turboq_group(lt.type_k) != 0 && ggml_turboq_group(lt.type_k) < QK_G128;
    const bool v64 = ggml_turboq_group(lt.type_v) != 0 && ggml_turboq_group(lt.type_v) < QK_G128;
    const bool any = ggml_turboq_group(lt.type_k) || ggml_turboq_group(lt.type_v);
    if (!any || dev == nullptr || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
        return;
    }
    if (ggml_is_turboq_trellis(lt.type_k) || ggml_is_turboq_trellis(lt.type_v)) {
        const char * released = llama_turboq_trellis_released(ggml_is_turboq_trellis(lt.type_k) ? lt.type_k : lt.type_v);
        // experimental types: an RPC server's build may lack them whatever its device claims here
        if (is_rpc(dev)) {
            throw std::runtime_error(format("layer %u: its KV cache is K %s, V %s, and this layer runs on %s, an RPC "
                "server, whose build may lack the experimental trellis types (its attention would run there even with "
                "the cache kept here); run the layer on this machine or use %s", il, ggml_type_name(lt.type_k),
                ggml_type_name(lt.type_v), ggml_backend_dev_name(dev), released));
        }
        const kv_ops_on_device ops = device_takes_kv_types(dev, lt, n_embd_head_k, n_embd_head_v, n_gqa);
        if (!ops.set_rows || !ops.attention) {
            throw std::runtime_error(format("layer %u: head size %u: its KV cache (K %s, V %s) is on %s, which declines "
                "the trellis types' SET_ROWS or flash attention (the CPU backend and Vulkan compute them, CUDA built with "
                "-DGGML_CUDA_TURBOQ_TWINS=ON); keep the KV cache on the CPU (--no-kv-offload, offload_kqv=False) or use %s",
                il, n_embd_head_k,
                ggml_type_name(lt.type_k), ggml_type_name(lt.type_v), ggml_backend_dev_name(dev), released));
        }
        return;
    }
    if (!k64 && !v64) {
        if (is_rpc(dev)) {
            return;
        }
        const kv_ops_on_device ops = device_takes_kv_types(dev, lt, n_embd_head_k, n_embd_head_v, n_gqa);
        // a cache write that its device declines has nowhere else to run: the scheduler aborts on
        // an op into a device buffer whose backend cannot compute it
        if (!ops.set_rows) {
            throw std::runtime_error(format("layer %u: head size %u: this layer's KV cache is on %s, which declines "
                "SET_ROWS into its turboq cache (K %s, V %s); keep the KV cache on the CPU (--no-kv-offload, "
                "offload_kqv=False) or use q8_0 or q4_0", il, n_embd_head_k, ggml_backend_dev_name(dev),
                ggml_type_name(lt.type_k), ggml_type_name(lt.type_v)));
        }
        // every backend takes some head sizes of the 128-value groups, and a probe is not the graph
        // (its batch, its views), so a device that declines this layer's attention is said, not refused
        if (!ops.attention) {
            LLAMA_LOG_WARN("%s: layer %u: head size %u: %s declines flash attention over its turboq cache (K %s, V %s) "
                "at this head size, so this layer's attention runs on the CPU, reading the cache across from the "
                "device at every step; --no-kv-offload keeps the cache on the CPU\n", __func__, il,
                n_embd_head_k, ggml_backend_dev_name(dev), ggml_type_name(lt.type_k), ggml_type_name(lt.type_v));
        }
        return;
    }
    const uint32_t n_embd_head = k64 ? n_embd_head_k : n_embd_head_v;
    const ggml_type twin        = k64 ? lt.type_k : lt.type_v;
    const char *    type_name   = ggml_type_name(twin);
    const int       group       = ggml_turboq_group(twin);
    // an RPC server's build may lack the twins whatever its device claims here
    if (is_rpc(dev)) {
        throw std::runtime_error(format("layer %u: head size %u: its turboq cache stores %d-value groups (%s), and this "
            "layer runs on %s, an RPC server, whose build may lack them (its attention would run there even with the "
            "cache kept here); run the layer on this machine or use q8_0 or q4_0, whose 32-value blocks every backend "
            "takes", il, n_embd_head, group, type_name, ggml_backend_dev_name(dev)));
    }
    // other devices answer for themselves
    const kv_ops_on_device ops = device_takes_kv_types(dev, lt, n_embd_head_k, n_embd_head_v, n_gqa);
    if (!ops.set_rows || !ops.attention) {
        throw std::runtime_error(format("layer %u: head size %u: its turboq cache stores %d-value groups (%s), and this "
            "layer's KV cache is on %s, which declines their SET_ROWS or flash attention (the CPU backend computes "
            "them, Vulkan at head sizes 64, 80, 96 and 192 and MLA's 576, CUDA built with -DGGML_CUDA_TURBOQ_TWINS=ON); keep the KV cache "
            "on the CPU (--no-kv-offload, offload_kqv=False) or use %s",
            il, n_embd_head, group, type_name, ggml_backend_dev_name(dev),
            n_embd_head % 32 == 0 ? "q8_0 or q4_0, whose 32-value blocks every backend takes" : "f16 (q8_0's and q4_0's 32-value blocks do not divide this head size)"));
    }
}

bool llama_turboq_trellis_built(void) {
#ifdef PYTURBO_TRELLIS
    return true;
#else
    return false;
#endif
}

int32_t llama_turboq_trellis_released_type(int32_t type) {
    if (type < 0 || type >= GGML_TYPE_COUNT || !ggml_is_turboq_trellis((ggml_type) type)) {
        return -1;
    }
    return type == GGML_TYPE_TURBOQ3_T ? GGML_TYPE_TURBOQ3_0 : GGML_TYPE_TURBOQ2_0;
}

const char * llama_turboq_trellis_released(ggml_type type) {
    GGML_ASSERT(ggml_is_turboq_trellis(type));
    return ggml_type_name((ggml_type) llama_turboq_trellis_released_type(type));
}

void llama_turboq_explain_head_size(const char * side, ggml_type type, uint32_t il, uint32_t n_embd_head) {
    if (ggml_is_turboq_trellis(type)) {
        // no 64-, 32- or 16-value trellis twins (yet): the experimental types take heads of 128 and 256
        LLAMA_LOG_ERROR("%s: layer %u: %s cache %s: the trellis types store 128-value groups only, and this model's "
            "head size is %u; the released %s takes it\n", __func__, il, side, ggml_type_name(type), n_embd_head,
            llama_turboq_trellis_released(type));
        return;
    }
    if (!ggml_is_turboq(type)) {
        return;
    }
    // not a multiple of 16: q8_0's and q4_0's 32-value blocks do not fit such a head either
    LLAMA_LOG_ERROR("%s: layer %u: %s cache %s: turboq types rotate and store groups of 128 values, or of 64, 32 or 16 "
        "(CPU and Vulkan) for head sizes that are a multiple of 64, 32 or 16, and this model's is %u; caches that work "
        "with it: f16 (q8_0 and q4_0 need a multiple of 32 as well)\n", __func__, il, side, ggml_type_name(type), n_embd_head);
}

void llama_turboq_check_layer_types(const llama_turboq_layer_types & lt, uint32_t il, uint32_t n_embd_head_k, uint32_t n_embd_head_v, bool v_trans) {
    const auto fail = [&](const std::string & why) {
        throw std::runtime_error("layer-adaptive: layer " + std::to_string(il) + ": " + why);
    };
    // the requested types fit (upstream checked them) and a mode's fit through llama_turboq_mode_type_for_head,
    // so this guards against a policy row that neither rule covers
    if (n_embd_head_k % ggml_blck_size(lt.type_k) != 0) {
        fail(std::string("K type ") + ggml_type_name(lt.type_k) + " needs head_dim % " + std::to_string(ggml_blck_size(lt.type_k)) +
             " == 0, the model has n_embd_head_k=" + std::to_string(n_embd_head_k));
    }
    if (n_embd_head_v % ggml_blck_size(lt.type_v) != 0) {
        fail(std::string("V type ") + ggml_type_name(lt.type_v) + " needs head_dim % " + std::to_string(ggml_blck_size(lt.type_v)) +
             " == 0, the model has n_embd_head_v=" + std::to_string(n_embd_head_v));
    }
    if (v_trans && ggml_is_quantized(lt.type_v)) {
        fail(std::string("V type ") + ggml_type_name(lt.type_v) + " requires flash_attn to be enabled");
    }
    if (v_trans && ggml_turboq_group(lt.type_k)) {
        fail(std::string("K type ") + ggml_type_name(lt.type_k) + " requires flash_attn to be enabled");
    }
}


// ---- a seeded build ----

namespace {

constexpr int32_t SIGN_MARK = 0x53515454; // "TTQS", then the seed (u64); no ggml type has this id

bool is_rpc(ggml_backend_dev_t dev) {
    const char * name = ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev));
    return name != nullptr && std::strncmp(name, "RPC", 3) == 0;
}

// this build's seed (0 and false for the shipped signs)
bool build_seed(uint64_t & seed) {
    const char * text = ggml_turboq_sign_seed();
    seed = text ? std::strtoull(text, nullptr, 10) : 0;
    return text != nullptr;
}

std::string signs_text(bool marked, uint64_t seed) {
    return marked ? "rotation signs from PYTURBO_SIGN_SEED=" + std::to_string(seed) : "the shipped rotation signs";
}

} // namespace

bool llama_turboq_is_rpc(ggml_backend_dev_t dev) {
    return dev != nullptr && is_rpc(dev);
}

void llama_turboq_check_sign_seed(const llama_turboq_layer_types & lt, ggml_backend_dev_t layer_dev, uint32_t il) {
    const char * seed = ggml_turboq_sign_seed();
    if (seed == nullptr || (!ggml_turboq_group(lt.type_k) && !ggml_turboq_group(lt.type_v))) {
        return;
    }
    if (layer_dev == nullptr || !is_rpc(layer_dev)) {
        return; // the backends of this build share its generated tables
    }
    // measured with the former runtime switch: with the cache kept on the CPU (--no-kv-offload)
    // and the layer on RPC, PPL moved from the CPU-only run's 261 to 345 on a tiny model
    throw std::runtime_error(format("layer %u: this build draws its turboq rotation signs from PYTURBO_SIGN_SEED=%s "
        "(a debug build option), and this layer runs on %s, a server whose build may use other signs, which would "
        "read the cache as noise; run the model on this machine's devices, or use a build without the option",
        il, seed, ggml_backend_dev_name(layer_dev)));
}

void llama_turboq_write_sign_mark(llama_io_write_i & io, ggml_type type) {
    uint64_t value = 0;
    if (!build_seed(value) || !ggml_turboq_group(type)) {
        return;
    }
    io.write(&SIGN_MARK, sizeof(SIGN_MARK));
    io.write(&value, sizeof(value));
}

bool llama_turboq_read_type(llama_io_read_i & io, ggml_type type, uint32_t il, int32_t & type_ref) {
    io.read(&type_ref, sizeof(type_ref));
    const bool marked = type_ref == SIGN_MARK;
    uint64_t saved = 0;
    if (marked) {
        io.read(&saved, sizeof(saved));
        io.read(&type_ref, sizeof(type_ref));
    }
    if (!ggml_turboq_group(type) || type_ref != (int32_t) type) {
        return true; // not turboq here, or another type, which the caller reports
    }
    uint64_t value = 0;
    const bool seeded = build_seed(value);
    if (marked != seeded || saved != value) {
        LLAMA_LOG_ERROR("%s: layer %u: the state's %s rows were written with %s, and this build has %s (a debug build "
                        "option): they would read as noise\n", __func__, il, ggml_type_name(type),
                        signs_text(marked, saved).c_str(), signs_text(seeded, value).c_str());
        return false;
    }
    return true;
}

void llama_turboq_set_calibrating(bool on) {
    t_calibrating = on;
}

bool llama_turboq_calibrating(void) {
    return t_calibrating;
}
