#pragma once

// pyturbo: the layer-adaptive mode of the turboq KV caches is a model setting, the key that
// llama_turboq_layer_adaptive_key() names, read when the model loads. Tools set it through the
// model's kv_overrides: common's --layer-adaptive N, whose environment alias is
// LLAMA_ARG_LAYER_ADAPTIVE, and llama-bench, which has no such parser, from the alias alone.

#include "llama.h"

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#define COMMON_TURBOQ_LAYER_ADAPTIVE_ENV "LLAMA_ARG_LAYER_ADAPTIVE"
#define COMMON_TURBOQ_EXACT_WINDOW_ENV   "LLAMA_ARG_KV_EXACT_WINDOW"
#define COMMON_TURBOQ_WINDOW_MARGIN_ENV  "LLAMA_ARG_KV_EXACT_WINDOW_MARGIN"
#define COMMON_TURBOQ_K_CENTER_ENV       "LLAMA_ARG_KV_K_CENTER"
// the mode's alias before it followed llama.cpp's LLAMA_ARG_* naming: still read, for one release
#define COMMON_TURBOQ_LAYER_ADAPTIVE_DEPRECATED_ENV "TURBO_LAYER_ADAPTIVE"

// libllama's (src/llama-turboq.h, src/llama-turboq-window.h): the keys, and the rows of the mode table
extern "C" const char * llama_turboq_layer_adaptive_key(void);
extern "C" const char * llama_turboq_exact_window_key(void);
extern "C" const char * llama_turboq_exact_window_margin_key(void);
extern "C" const char * llama_turboq_k_center_key(void);
extern "C" int32_t llama_turboq_exact_window_max(void);
extern "C" bool llama_turboq_layer_policy(int32_t i, int32_t * out);
extern "C" const char * llama_turboq_layer_adaptive_name(int32_t mode);

// libllama's (src/llama-turboq-window.h): whether ctx's caches hold exact rows for the window's
// positions before n_past of seq (true without a window), and the window's positions (0: none)
extern "C" bool    llama_turboq_window_can_continue(struct llama_context * ctx, llama_seq_id seq, llama_pos n_past);
extern "C" int32_t llama_turboq_exact_window(const struct llama_context * ctx);

// the deprecated alias of the mode: where it is set and LLAMA_ARG_LAYER_ADAPTIVE is not, its value
// becomes LLAMA_ARG_LAYER_ADAPTIVE's, so that common's parser (which reads one name per option) and
// llama-bench read one name; a line on stderr says so, once per process, and says when it is ignored
inline void common_turboq_adopt_deprecated_env() {
    static bool done = false;
    if (done) {
        return;
    }
    done = true;
    const char * old = std::getenv(COMMON_TURBOQ_LAYER_ADAPTIVE_DEPRECATED_ENV);
    if (old == nullptr) {
        return;
    }
    if (std::getenv(COMMON_TURBOQ_LAYER_ADAPTIVE_ENV) != nullptr) {
        std::fprintf(stderr, "warning: " COMMON_TURBOQ_LAYER_ADAPTIVE_DEPRECATED_ENV " is deprecated and ignored: "
                             COMMON_TURBOQ_LAYER_ADAPTIVE_ENV " is set\n");
        return;
    }
    std::fprintf(stderr, "warning: " COMMON_TURBOQ_LAYER_ADAPTIVE_DEPRECATED_ENV " is deprecated: set "
                         COMMON_TURBOQ_LAYER_ADAPTIVE_ENV " instead (read as it for now)\n");
#ifdef _WIN32
    _putenv_s(COMMON_TURBOQ_LAYER_ADAPTIVE_ENV, old);
#else
    setenv(COMMON_TURBOQ_LAYER_ADAPTIVE_ENV, old, 0);
#endif
}

// adds an int setting to an override list that is not terminated yet
inline void common_turboq_set_int(std::vector<llama_model_kv_override> & overrides, const char * key, int64_t value) {
    llama_model_kv_override kvo = {};
    std::strncpy(kvo.key, key, sizeof(kvo.key) - 1);
    kvo.tag     = LLAMA_KV_OVERRIDE_TYPE_INT;
    kvo.val_i64 = value;
    overrides.push_back(kvo);
}

// adds a bool setting to an override list that is not terminated yet
inline void common_turboq_set_bool(std::vector<llama_model_kv_override> & overrides, const char * key, bool value) {
    llama_model_kv_override kvo = {};
    std::strncpy(kvo.key, key, sizeof(kvo.key) - 1);
    kvo.tag      = LLAMA_KV_OVERRIDE_TYPE_BOOL;
    kvo.val_bool = value;
    overrides.push_back(kvo);
}

// K centering (llama-turboq-center.h: --kv-k-center) from text: on/off (also 1/0, true/false, as
// common's other switches take them); throws std::invalid_argument otherwise
inline bool common_turboq_parse_k_center(const std::string & text) {
    if (text == "on" || text == "1" || text == "true") {
        return true;
    }
    if (text == "off" || text == "0" || text == "false") {
        return false;
    }
    throw std::invalid_argument("'" + text + "' is not on or off (K centering)");
}

// LLAMA_ARG_KV_K_CENTER from the environment; false when it is unset; throws as above
inline bool common_turboq_k_center_from_env(bool & on) {
    const char * env = std::getenv(COMMON_TURBOQ_K_CENTER_ENV);
    if (env != nullptr) {
        on = common_turboq_parse_k_center(env);
    }
    return env != nullptr;
}

// the exact window's positions (llama-turboq-window.h: --kv-exact-window) or its margin
// (--kv-exact-window-margin) from text; throws std::invalid_argument when it is not 0 to libllama's
// largest window (llama_turboq_exact_window_max)
inline int64_t common_turboq_parse_positions(const std::string & text, const char * what) {
    char * end = nullptr;
    errno = 0;
    const long long n = std::strtoll(text.c_str(), &end, 10);
    const int32_t max = llama_turboq_exact_window_max();
    if (text.empty() || *end != '\0' || errno != 0 || n < 0 || n > max) {
        throw std::invalid_argument("'" + text + "' is not " + what + ": a number of positions, 0 to " + std::to_string(max));
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

// a layer-adaptive mode from text (an argument, the environment): its number or its name
// (llama_turboq_layer_adaptive_name); throws std::invalid_argument, naming the valid modes, when it
// is not one
inline int64_t common_turboq_parse_layer_adaptive(const std::string & text) {
    std::string valid = "0", names = std::string(" (or their names: ") + llama_turboq_layer_adaptive_name(0);
    bool known = text == llama_turboq_layer_adaptive_name(0);
    int64_t mode = 0;
    char * end = nullptr;
    errno = 0;
    const long long number = std::strtoll(text.c_str(), &end, 10);
    const bool is_number = !text.empty() && *end == '\0' && errno == 0;
    known = known || (is_number && number == 0);
    int32_t row[8];
    for (int32_t i = 0; llama_turboq_layer_policy(i, row); ++i) {
        const char * name = llama_turboq_layer_adaptive_name(row[0]);
        valid += ", " + std::to_string(row[0]);
        names += std::string(", ") + name;
        if ((is_number && row[0] == number) || text == name) {
            known = true;
            mode  = row[0];
        }
    }
    if (!known) {
        throw std::invalid_argument("'" + text + "' is not a layer-adaptive mode: valid modes are " + valid + names + ")");
    }
    return mode;
}

// LLAMA_ARG_LAYER_ADAPTIVE's mode (or the deprecated alias's); false when it is unset; throws as
// above (also when it is empty, as common's parser does)
inline bool common_turboq_layer_adaptive_from_env(int64_t & mode) {
    common_turboq_adopt_deprecated_env();
    const char * env = std::getenv(COMMON_TURBOQ_LAYER_ADAPTIVE_ENV);
    if (env == nullptr) {
        return false;
    }
    mode = common_turboq_parse_layer_adaptive(env);
    return true;
}
