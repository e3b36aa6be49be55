#include "llama-turboq.h"

#include "llama-impl.h"
#include "llama-io.h"
#include "llama-model.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <stdexcept>
#include <string>

namespace {

constexpr ggml_type KEEP = GGML_TYPE_COUNT; // the layer keeps the requested type

// which layers are "boundary" layers, and what K and V get there and elsewhere
struct layer_policy {
    int       mode;
    uint32_t  n_first;     // boundary layers at the start
    uint32_t  n_last;      // boundary layers at the end
    uint32_t  k_gain_div;  // > 0: the n_layer/k_gain_div (at least 1) layers of largest K gain are boundary layers
    ggml_type k_boundary;
    ggml_type v_boundary;
    ggml_type v_other;
};

constexpr layer_policy policies[] = {
    { 1, 4, 4, 0, GGML_TYPE_Q8_0, GGML_TYPE_Q8_0,      KEEP                },
    { 2, 0, 8, 0, GGML_TYPE_Q8_0, GGML_TYPE_Q8_0,      KEEP                },
    { 3, 0, 0, 9, GGML_TYPE_Q8_0, KEEP,                KEEP                },
    { 5, 2, 2, 0, KEEP,           GGML_TYPE_TURBOQ4_0, GGML_TYPE_TURBOQ2_0 },
    { 6, 0, 8, 0, KEEP,           GGML_TYPE_TURBOQ4_0, GGML_TYPE_TURBOQ2_0 },
    { 7, 2, 2, 0, KEEP,           GGML_TYPE_Q8_0,      GGML_TYPE_TURBOQ2_0 },
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
    std::string s = "0";
    for (const auto & p : policies) {
        s += ", " + std::to_string(p.mode);
    }
    return s;
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
    const int32_t row[7] = { p.mode, (int32_t) p.n_first, (int32_t) p.n_last, (int32_t) p.k_gain_div,
                             id(p.k_boundary), id(p.v_boundary), id(p.v_other) };
    std::memcpy(out, row, sizeof(row));
    return true;
}

int llama_turboq_layer_adaptive_mode() {
    const char * env = std::getenv("TURBO_LAYER_ADAPTIVE");
    if (env == nullptr || *env == '\0') {
        return 0;
    }
    char * end = nullptr;
    const long mode = std::strtol(env, &end, 10);
    if (*end != '\0' || (mode != 0 && policy_of((int) mode) == nullptr)) {
        throw std::runtime_error(std::string("invalid TURBO_LAYER_ADAPTIVE='") + env + "': valid modes are " + valid_modes());
    }
    return (int) mode;
}

std::vector<bool> llama_turboq_boundary_layers(int mode, const llama_model & model) {
    const uint32_t n_layer = model.hparams.n_layer();
    std::vector<bool> boundary(n_layer, false);
    const layer_policy * p = policy_of(mode);
    if (p == nullptr) {
        return boundary;
    }
    for (uint32_t il = 0; il < n_layer; ++il) {
        boundary[il] = il < p->n_first || il + p->n_last >= n_layer;
    }
    if (p->k_gain_div == 0) {
        return boundary;
    }
    // The K gain of a layer, from its weights: the RMS of the K norm's scale on models with a
    // K norm (Gemma, Qwen3, ...), else the RMS of the K projection. The K quantization error of
    // a layer grows with it; on Gemma 3 270M the top two (layers 11 and 5) carry half of the
    // attention-output error of turboq3 K (pyturbo kvlab).
    std::vector<std::pair<double, uint32_t>> gain;
    for (uint32_t il = 0; il < n_layer; ++il) {
        const auto & layer = model.layers[il];
        const ggml_tensor * w = layer.attn_k_norm ? layer.attn_k_norm : layer.wk;
        if (w == nullptr || !model.hparams.has_kv(il)) {
            continue;
        }
        if (w->data == nullptr) {
            // a sizing pass without weights (llama_params_fit): any n_pick layers cost the same memory
            gain.push_back({ (double) il, il });
            continue;
        }
        const double g = weight_rms(w);
        if (g < 0.0) {
            throw std::runtime_error("TURBO_LAYER_ADAPTIVE=" + std::to_string(mode) + ": cannot read the K weights of layer " +
                                     std::to_string(il) + " (type " + ggml_type_name(w->type) + ")");
        }
        gain.push_back({ g, il });
    }
    if (gain.empty()) {
        throw std::runtime_error("TURBO_LAYER_ADAPTIVE=" + std::to_string(mode) + ": this model has no K weights to rank its layers by");
    }
    std::sort(gain.begin(), gain.end(), [](const auto & a, const auto & b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
    const size_t n_pick = std::max<size_t>(1, n_layer/p->k_gain_div);
    for (size_t i = 0; i < std::min(n_pick, gain.size()); ++i) {
        boundary[gain[i].second] = true;
    }
    return boundary;
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

void llama_turboq_check_layer_types(const llama_turboq_layer_types & lt, uint32_t il, uint32_t n_embd_head_k, uint32_t n_embd_head_v, bool v_trans) {
    const auto fail = [&](const std::string & why) {
        throw std::runtime_error("TURBO_LAYER_ADAPTIVE: layer " + std::to_string(il) + ": " + why);
    };
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
    if (v_trans && ggml_is_turboq(lt.type_k)) {
        fail(std::string("K type ") + ggml_type_name(lt.type_k) + " requires flash_attn to be enabled");
    }
}

// ---- K centering (see llama-turboq.h) ----

namespace {

constexpr uint32_t K_MEAN_MAGIC = 0x4d4b5154; // "TQKM"

} // namespace

bool llama_turboq_k_centering(ggml_type type_k) {
    if (!ggml_is_turboq(type_k)) {
        return false;
    }
    const char * env = std::getenv("TURBOQ_K_CENTER");
    return env == nullptr || std::strcmp(env, "0") != 0;
}

ggml_tensor * llama_turboq_new_k_mean(ggml_context * ctx, int64_t n_embd_k_gqa, const char * tag, uint32_t il) {
    ggml_tensor * t = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n_embd_k_gqa + 1);
    ggml_format_name(t, "cache_%sk_mean_l%d", tag, il);
    return t;
}

ggml_tensor * llama_turboq_center_k(ggml_context * ctx, ggml_tensor * k_cur, ggml_tensor * k_mean) {
    const int64_t n        = k_cur->ne[0];
    const int64_t n_tokens = k_cur->ne[1];
    GGML_ASSERT(k_mean->ne[0] == n + 1);

    ggml_tensor * mu_old = ggml_view_1d(ctx, k_mean, n, 0);
    ggml_tensor * ready  = ggml_view_1d(ctx, k_mean, 1, n*ggml_element_size(k_mean));

    ggml_tensor * mean = ggml_sum_rows(ctx, ggml_cont(ctx, ggml_transpose(ctx, k_cur)));
    mean = ggml_scale(ctx, ggml_reshape_1d(ctx, mean, n), 1.0f/(float) n_tokens);

    // mu = ready ? mu_old : mean, as arithmetic so that the graph is the same for every ubatch
    ggml_tensor * mu  = ggml_add(ctx, mean, ggml_mul(ctx, ggml_sub(ctx, mu_old, mean), ready));
    ggml_tensor * one = ggml_scale_bias(ctx, ready, 0.0f, 1.0f);

    // the write-back is an ancestor of the result, so it runs in every graph that stores K
    ggml_tensor * stored = ggml_cpy(ctx, ggml_concat(ctx, mu, one, 0), k_mean);
    return ggml_sub(ctx, k_cur, ggml_view_1d(ctx, stored, n, 0));
}

ggml_tensor * llama_turboq_k_mean_heads(ggml_context * ctx, ggml_tensor * k_mean, int64_t n_cols, int64_t n_head_kv,
                                        int64_t n_embd_head, int64_t offset) {
    const size_t es = ggml_element_size(k_mean);
    return ggml_view_3d(ctx, k_mean, n_cols, n_head_kv, 1, n_embd_head*es, n_embd_head*n_head_kv*es, offset*es);
}

void llama_turboq_write_k_mean(llama_io_write_i & io, ggml_tensor * k_mean) {
    const uint32_t magic = K_MEAN_MAGIC;
    const uint32_t n = (uint32_t) ggml_nelements(k_mean);
    io.write(&magic, sizeof(magic));
    io.write(&n, sizeof(n));
    io.write_tensor(k_mean, 0, ggml_nbytes(k_mean));
}

bool llama_turboq_read_k_rows(llama_io_read_i & io, ggml_tensor * k_mean, ggml_tensor * k, size_t k_size_row,
                              const uint32_t * run_from, const uint32_t * run_to, size_t n_runs, uint32_t il) {
    uint32_t magic = 0;
    uint32_t n = 0;
    io.read(&magic, sizeof(magic));
    if (magic != K_MEAN_MAGIC) {
        LLAMA_LOG_ERROR("%s: layer %u: the state has no K-centering mean for this %s K cache "
                        "(saved without K centering, e.g. with TURBOQ_K_CENTER=0, or corrupt)\n", __func__, il, ggml_type_name(k->type));
        return false;
    }
    io.read(&n, sizeof(n));
    if (n != (uint32_t) ggml_nelements(k_mean)) {
        LLAMA_LOG_ERROR("%s: layer %u: K-centering mean has %u values, the cache needs %lld\n", __func__, il, n, (long long) ggml_nelements(k_mean));
        return false;
    }
    std::vector<float> saved(n);
    std::vector<float> cur(n);
    io.read(saved.data(), n*sizeof(float));
    for (float x : saved) {
        if (!std::isfinite(x)) {
            LLAMA_LOG_ERROR("%s: layer %u: the saved K-centering mean is not finite (corrupt state)\n", __func__, il);
            return false;
        }
    }
    if (saved[n - 1] != 1.0f) {
        LLAMA_LOG_ERROR("%s: layer %u: the saved K-centering mean was never set (corrupt state)\n", __func__, il);
        return false;
    }
    ggml_backend_tensor_get(k_mean, cur.data(), 0, n*sizeof(float));

    const bool adopt = cur[n - 1] != 1.0f; // nothing written since the last clear: take the saved mean
    if (adopt) {
        ggml_backend_tensor_set(k_mean, saved.data(), 0, n*sizeof(float));
    }
    if (adopt || std::memcmp(saved.data(), cur.data(), n*sizeof(float)) == 0) {
        for (size_t r = 0; r < n_runs; ++r) {
            io.read_tensor(k, (size_t) run_from[r]*k_size_row, (size_t) (run_to[r] - run_from[r])*k_size_row);
        }
        return true;
    }

    // other sequences already use another mean: re-center these rows onto it
    const auto * traits = ggml_get_type_traits(k->type);
    const int64_t n_embd = n - 1;
    std::vector<uint8_t> rows;
    std::vector<float> x(n_embd);
    for (size_t r = 0; r < n_runs; ++r) {
        const size_t n_rows = run_to[r] - run_from[r];
        rows.resize(n_rows*k_size_row);
        io.read(rows.data(), rows.size());
        for (size_t i = 0; i < n_rows; ++i) {
            uint8_t * row = rows.data() + i*k_size_row;
            traits->to_float(row, x.data(), n_embd);
            for (int64_t j = 0; j < n_embd; ++j) {
                x[j] += saved[j] - cur[j];
            }
            traits->from_float_ref(x.data(), row, n_embd);
        }
        ggml_backend_tensor_set(k, rows.data(), (size_t) run_from[r]*k_size_row, rows.size());
    }
    LLAMA_LOG_INFO("%s: layer %u: re-centered %s K rows onto the cache's mean\n", __func__, il, ggml_type_name(k->type));
    return true;
}

// ---- sequence state files ----

namespace {

constexpr char SEAL_MAGIC[4] = {'T', 'Q', 'C', 'K'};

uint32_t crc32_update(uint32_t crc, const uint8_t * p, size_t n) {
    static uint32_t table[256];
    static const bool init = [] {
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) {
                c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            }
            table[i] = c;
        }
        return true;
    }();
    (void) init;
    crc = ~crc;
    for (size_t i = 0; i < n; ++i) {
        crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
    }
    return ~crc;
}

// CRC-32 of the first n bytes of f (from its start); false on a short read
bool crc32_of_prefix(FILE * f, long n, uint32_t & crc) {
    std::vector<uint8_t> buf(1 << 20);
    crc = 0;
    if (std::fseek(f, 0, SEEK_SET) != 0) {
        return false;
    }
    long left = n;
    while (left > 0) {
        const size_t want = (size_t) std::min<long>(left, (long) buf.size());
        if (std::fread(buf.data(), 1, want, f) != want) {
            return false;
        }
        crc = crc32_update(crc, buf.data(), want);
        left -= (long) want;
    }
    return true;
}

} // namespace

bool llama_turboq_seq_file_seal(const char * path) {
    FILE * f = std::fopen(path, "r+b");
    if (!f) {
        LLAMA_LOG_ERROR("%s: cannot reopen %s to seal it\n", __func__, path);
        return false;
    }
    bool ok = std::fseek(f, 0, SEEK_END) == 0;
    const long size = ok ? std::ftell(f) : -1;
    uint32_t crc = 0;
    ok = ok && size >= 0 && crc32_of_prefix(f, size, crc) && std::fseek(f, 0, SEEK_END) == 0 &&
         std::fwrite(SEAL_MAGIC, 1, 4, f) == 4 && std::fwrite(&crc, 1, 4, f) == 4;
    ok = (std::fclose(f) == 0) && ok;
    if (!ok) {
        LLAMA_LOG_ERROR("%s: failed to seal %s\n", __func__, path);
    }
    return ok;
}

int llama_turboq_seq_file_check(const char * path) {
    FILE * f = std::fopen(path, "rb");
    if (!f) {
        return 0; // the reader reports a missing file
    }
    int res = 0;
    char magic[4];
    uint32_t stored = 0;
    long size = -1;
    if (std::fseek(f, 0, SEEK_END) == 0 && (size = std::ftell(f)) >= 8 && std::fseek(f, size - 8, SEEK_SET) == 0 &&
        std::fread(magic, 1, 4, f) == 4 && std::fread(&stored, 1, 4, f) == 4 && std::memcmp(magic, SEAL_MAGIC, 4) == 0) {
        uint32_t crc = 0;
        if (crc32_of_prefix(f, size - 8, crc) && crc == stored) {
            res = 1;
        } else {
            LLAMA_LOG_ERROR("%s: %s is corrupt: its CRC-32 is %08x, the file says %08x\n", __func__, path, crc, stored);
            res = -1;
        }
    }
    std::fclose(f);
    return res;
}

