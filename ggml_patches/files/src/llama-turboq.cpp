#include "llama-turboq.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace {

// which layers are "boundary" layers, what they get, and what the others get
struct layer_policy {
    int       mode;
    uint32_t  n_first;    // boundary layers at the start
    uint32_t  n_last;     // boundary layers at the end
    bool      set_k;      // K follows the policy too (else K keeps the requested type)
    ggml_type boundary;   // type of K/V in boundary layers
    ggml_type other_v;    // V elsewhere; GGML_TYPE_COUNT keeps the requested type
};

constexpr layer_policy policies[] = {
    { 1, 4, 4, true,  GGML_TYPE_Q8_0,      GGML_TYPE_COUNT     },
    { 2, 0, 8, true,  GGML_TYPE_Q8_0,      GGML_TYPE_COUNT     },
    { 5, 2, 2, false, GGML_TYPE_TURBOQ4_0, GGML_TYPE_TURBOQ2_0 },
    { 6, 0, 8, false, GGML_TYPE_TURBOQ4_0, GGML_TYPE_TURBOQ2_0 },
    { 7, 2, 2, false, GGML_TYPE_Q8_0,      GGML_TYPE_TURBOQ2_0 },
};

} // namespace

int llama_turboq_layer_adaptive_mode() {
    const char * env = std::getenv("TURBO_LAYER_ADAPTIVE");
    if (env == nullptr || *env == '\0') {
        return 0;
    }
    char * end = nullptr;
    const long mode = std::strtol(env, &end, 10);
    bool valid = *end == '\0' && mode == 0;
    for (const auto & p : policies) {
        valid |= *end == '\0' && mode == p.mode;
    }
    if (!valid) {
        throw std::runtime_error(std::string("invalid TURBO_LAYER_ADAPTIVE='") + env + "': valid modes are 0, 1, 2, 5, 6, 7");
    }
    return (int) mode;
}

llama_turboq_layer_types llama_turboq_layer_types_for(int mode, uint32_t il, uint32_t n_layer, ggml_type type_k, ggml_type type_v) {
    for (const auto & p : policies) {
        if (p.mode != mode) {
            continue;
        }
        const bool boundary = il < p.n_first || il + p.n_last >= n_layer;
        if (boundary) {
            return { p.set_k ? p.boundary : type_k, p.boundary };
        }
        return { type_k, p.other_v == GGML_TYPE_COUNT ? type_v : p.other_v };
    }
    return { type_k, type_v };
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
