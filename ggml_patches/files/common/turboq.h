#pragma once

// pyturbo: the layer-adaptive mode of the turboq KV caches is a model setting, the key that
// llama_turboq_layer_adaptive_key() names, read when the model loads. Tools set it through the
// model's kv_overrides: common's --layer-adaptive N, whose environment alias is
// TURBO_LAYER_ADAPTIVE, and llama-bench, which has no such parser, from the alias alone.

#include "llama.h"

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#define COMMON_TURBOQ_LAYER_ADAPTIVE_ENV "TURBO_LAYER_ADAPTIVE"
#define COMMON_TURBOQ_EXACT_WINDOW_ENV   "LLAMA_ARG_KV_EXACT_WINDOW"
#define COMMON_TURBOQ_WINDOW_MARGIN_ENV  "LLAMA_ARG_KV_EXACT_WINDOW_MARGIN"

// libllama's (src/llama-turboq.h, src/llama-turboq-window.h): the keys, and the rows of the mode table
extern "C" const char * llama_turboq_layer_adaptive_key(void);
extern "C" const char * llama_turboq_exact_window_key(void);
extern "C" const char * llama_turboq_exact_window_margin_key(void);
extern "C" bool llama_turboq_layer_policy(int32_t i, int32_t * out);

// libllama's (src/llama-turboq-window.h): whether ctx's caches hold exact rows for the window's
// positions before n_past of seq (true without a window), and the window's positions (0: none)
extern "C" bool    llama_turboq_window_can_continue(struct llama_context * ctx, llama_seq_id seq, llama_pos n_past);
extern "C" int32_t llama_turboq_exact_window(const struct llama_context * ctx);

// adds an int setting to an override list that is not terminated yet
inline void common_turboq_set_int(std::vector<llama_model_kv_override> & overrides, const char * key, int64_t value) {
    llama_model_kv_override kvo = {};
    std::strncpy(kvo.key, key, sizeof(kvo.key) - 1);
    kvo.tag     = LLAMA_KV_OVERRIDE_TYPE_INT;
    kvo.val_i64 = value;
    overrides.push_back(kvo);
}

// the exact window's positions (llama-turboq-window.h: --kv-exact-window) or its margin
// (--kv-exact-window-margin) from text; throws std::invalid_argument when it is not 0..4096
inline int64_t common_turboq_parse_positions(const std::string & text, const char * what) {
    char * end = nullptr;
    errno = 0;
    const long long n = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || errno != 0 || n < 0 || n > 4096) {
        throw std::invalid_argument("'" + text + "' is not " + what + ": a number of positions, 0 to 4096");
    }
    return n;
}

inline int64_t common_turboq_parse_exact_window(const std::string & text) {
    return common_turboq_parse_positions(text, "an exact window (0: off)");
}

inline int64_t common_turboq_parse_window_margin(const std::string & text) {
    return common_turboq_parse_positions(text, "an exact window's margin");
}

// the window (LLAMA_ARG_KV_EXACT_WINDOW) or its margin (LLAMA_ARG_KV_EXACT_WINDOW_MARGIN) from the
// environment; false when it is unset; throws as above
inline bool common_turboq_exact_window_from_env(int64_t & w) {
    const char * env = std::getenv(COMMON_TURBOQ_EXACT_WINDOW_ENV);
    if (env != nullptr) {
        w = common_turboq_parse_exact_window(env);
    }
    return env != nullptr;
}

inline bool common_turboq_window_margin_from_env(int64_t & m) {
    const char * env = std::getenv(COMMON_TURBOQ_WINDOW_MARGIN_ENV);
    if (env != nullptr) {
        m = common_turboq_parse_window_margin(env);
    }
    return env != nullptr;
}

// adds the mode to an override list that is not terminated yet (common_turboq_keep_last_layer_adaptive
// then drops the earlier settings)
inline void common_turboq_set_layer_adaptive(std::vector<llama_model_kv_override> & overrides, int64_t mode) {
    llama_model_kv_override kvo = {};
    std::strncpy(kvo.key, llama_turboq_layer_adaptive_key(), sizeof(kvo.key) - 1);
    kvo.tag     = LLAMA_KV_OVERRIDE_TYPE_INT;
    kvo.val_i64 = mode;
    overrides.push_back(kvo);
}

// keeps only the last setting of a key (the mode, the exact window) in an override list that is
// not terminated yet: the environment alias is parsed before the arguments, and the model loader
// keeps the first of two equal keys, so a later --override-kv of the key would otherwise lose to
// the environment
inline void common_turboq_keep_last(std::vector<llama_model_kv_override> & overrides, const char * key) {
    for (size_t i = overrides.size(); i-- > 0;) {
        if (std::strcmp(overrides[i].key, key) == 0) {
            for (size_t j = i; j-- > 0;) {
                if (std::strcmp(overrides[j].key, key) == 0) {
                    overrides.erase(overrides.begin() + j);
                }
            }
            return;
        }
    }
}

inline void common_turboq_keep_last_layer_adaptive(std::vector<llama_model_kv_override> & overrides) {
    common_turboq_keep_last(overrides, llama_turboq_layer_adaptive_key());
}

// a layer-adaptive mode from text (an argument, the environment); throws std::invalid_argument,
// naming the valid modes, when it is not one
inline int64_t common_turboq_parse_layer_adaptive(const std::string & text) {
    std::string valid = "0";
    bool known = false;
    char * end = nullptr;
    errno = 0;
    const long long mode = std::strtoll(text.c_str(), &end, 10);
    const bool number = !text.empty() && *end == '\0' && errno == 0;
    int32_t row[7];
    for (int32_t i = 0; llama_turboq_layer_policy(i, row); ++i) {
        valid += ", " + std::to_string(row[0]);
        known = known || (number && row[0] == mode);
    }
    if (!number || (mode != 0 && !known)) {
        throw std::invalid_argument("'" + text + "' is not a layer-adaptive mode: valid modes are " + valid);
    }
    return mode;
}

// TURBO_LAYER_ADAPTIVE's mode; false when it is unset; throws as above (also when it is empty,
// as common's parser does)
inline bool common_turboq_layer_adaptive_from_env(int64_t & mode) {
    const char * env = std::getenv(COMMON_TURBOQ_LAYER_ADAPTIVE_ENV);
    if (env == nullptr) {
        return false;
    }
    mode = common_turboq_parse_layer_adaptive(env);
    return true;
}
