#pragma once

// The turboq encoder and rotations (pyturbo), one copy for two users: ggml-base's reference codec
// (ggml-turboq.c, the generic steps below) and ggml-cpu's quantizer and flash-attention rotations
// (ggml-cpu/turboq-quants.c), which plug in the architecture's versions of the element-wise steps
// (ggml-cpu/arch/<arch>/turboq-kernels.h).
// A step's SIMD version runs the same IEEE operations on the same values in the same order as its
// generic one, so both quantizers write the same bytes, which pyturbo/format/reference.py reproduces.
// Every file that includes this one is built with -ffp-contract=off: no multiply-add may be fused.
//
// The includer defines GGML_COMMON_DECL_* and includes ggml-common.h first.

// No fused multiply-add, whatever the build flags (GCC takes -ffp-contract=off from CMake and
// ignores this pragma; clang and MSVC honour theirs), from here to the end of the includer: the
// trellis encoder below (ggml-turboq-trellis.h) too
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(_MSC_VER)
#pragma fp_contract(off)
#endif

#include "ggml-turboq.h"
#include "ggml-turboq-tables.h"
#include "ggml-turboq-trellis.h"
#include "ggml-impl.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define TURBOQ_FP16_MAX 65504.0f

// The element-wise steps of encoding one group of `group` values (see ggml-turboq.c for the
// algorithm): 128 for the shipped types, whose steps an architecture may accelerate, 64, 32 and
// 16 for the _G64, _G32 and _G16 types (generic steps only).
struct turboq_encode_steps {
    int   group;
    float (*absmax)(const float * x);                           // max |x_i|, non-finite when some x_i is
    void  (*div_square)(const float * x, float d, float * y, float * t); // y_i = x_i/d, t_i = y_i*y_i
    float (*tree_sum)(float * v);                               // the halving-tree sum; destroys v
    void  (*fwht)(float * x);                                   // Walsh-Hadamard butterflies, h = 1..64
    void  (*scale_signs)(float * x, const float * k, const float * s); // x_i = (x_i*k)*s_i, or x_i*s_i (k NULL)
    void  (*index_thresholds)(const float * thr, int n_thr, const float * y, uint8_t * idx); // thresholds below y_i
    void  (*index_grid)(const float * y, uint8_t * idx);        // turboq8's uniform grid
    void  (*lookup)(const float * tab, int n_tab, const uint8_t * idx, float * out); // out_i = tab[idx_i]
    void  (*pack[4])(const uint8_t * idx, void * blk);          // turboq2, 3, 4, 8: indices into the block
    // the trellis types' Viterbi search (ggml-turboq-trellis.h), the same paths; NULL: the generic one
    void  (*trellis_viterbi)(const float * cb, int k, const float * y, uint8_t * states);
};

// ---- generic steps ----

static inline float turboq_generic_absmax_n(const float * x, int n) {
    float amax = 0.0f;
    int finite = 1;
    for (int i = 0; i < n; ++i) {
        finite &= isfinite(x[i]) ? 1 : 0;
        amax = fmaxf(amax, fabsf(x[i]));
    }
    return finite ? amax : INFINITY;
}

static inline void turboq_generic_div_square_n(const float * x, float d, float * y, float * t, int n) {
    for (int i = 0; i < n; ++i) y[i] = x[i] / d;
    for (int i = 0; i < n; ++i) t[i] = y[i] * y[i];
}

static inline float turboq_generic_tree_sum_n(float * v, int n) {
    for (int h = n/2; h > 0; h >>= 1) {
        for (int i = 0; i < h; ++i) {
            v[i] = v[i] + v[i + h];
        }
    }
    return v[0];
}

static inline void turboq_generic_fwht_n(float * x, int n) {
    for (int h = 1; h < n; h <<= 1) {
        for (int i = 0; i < n; i += 2*h) {
            for (int j = i; j < i + h; ++j) {
                const float a = x[j];
                const float b = x[j + h];
                x[j]     = a + b;
                x[j + h] = a - b;
            }
        }
    }
}

static inline void turboq_generic_scale_signs_n(float * x, const float * k, const float * s, int n) {
    if (k) {
        for (int i = 0; i < n; ++i) x[i] = (x[i] * *k) * s[i];
    } else {
        for (int i = 0; i < n; ++i) x[i] = x[i] * s[i];
    }
}

static inline void turboq_generic_index_thresholds_n(const float * thr, int n_thr, const float * y, uint8_t * idx, int n) {
    for (int i = 0; i < n; ++i) {
        int q = 0;
        for (int k = 0; k < n_thr; ++k) q += thr[k] < y[i];
        idx[i] = (uint8_t) q;
    }
}

// idx_i = floor(y_i * 127.5/max|y| + 128), clamped to 0..255
static inline void turboq_generic_index_grid_n(const float * y, uint8_t * idx, int n) {
    float ya = 0.0f;
    for (int i = 0; i < n; ++i) ya = fmaxf(ya, fabsf(y[i]));
    const float s = 127.5f / ya;
    for (int i = 0; i < n; ++i) {
        const float q = floorf(y[i] * s + 128.0f);
        idx[i] = (uint8_t) (q < 0.0f ? 0 : q > 255.0f ? 255 : (int) q);
    }
}

static inline void turboq_generic_lookup_n(const float * tab, int n_tab, const uint8_t * idx, float * out, int n) {
    (void) n_tab;
    for (int i = 0; i < n; ++i) out[i] = tab[idx[i]];
}

// the steps for one group size G, named turboq_generic<SUFFIX>_<step>
#define TURBOQ_GENERIC_STEPS_OF(SUFFIX, G)                                                                       \
    static inline float turboq_generic##SUFFIX##_absmax(const float * x) { return turboq_generic_absmax_n(x, G); } \
    static inline void turboq_generic##SUFFIX##_div_square(const float * x, float d, float * y, float * t) {     \
        turboq_generic_div_square_n(x, d, y, t, G);                                                              \
    }                                                                                                            \
    static inline float turboq_generic##SUFFIX##_tree_sum(float * v) { return turboq_generic_tree_sum_n(v, G); } \
    static inline void turboq_generic##SUFFIX##_fwht(float * x) { turboq_generic_fwht_n(x, G); }                \
    static inline void turboq_generic##SUFFIX##_scale_signs(float * x, const float * k, const float * s) {       \
        turboq_generic_scale_signs_n(x, k, s, G);                                                                \
    }                                                                                                            \
    static inline void turboq_generic##SUFFIX##_index_thresholds(const float * thr, int n_thr, const float * y, uint8_t * idx) { \
        turboq_generic_index_thresholds_n(thr, n_thr, y, idx, G);                                                \
    }                                                                                                            \
    static inline void turboq_generic##SUFFIX##_index_grid(const float * y, uint8_t * idx) {                     \
        turboq_generic_index_grid_n(y, idx, G);                                                                  \
    }                                                                                                            \
    static inline void turboq_generic##SUFFIX##_lookup(const float * tab, int n_tab, const uint8_t * idx, float * out) { \
        turboq_generic_lookup_n(tab, n_tab, idx, out, G);                                                        \
    }

TURBOQ_GENERIC_STEPS_OF(, TURBOQ_GROUP)
TURBOQ_GENERIC_STEPS_OF(64, QK_TURBOQ_G64)
TURBOQ_GENERIC_STEPS_OF(32, QK_TURBOQ_G32)
TURBOQ_GENERIC_STEPS_OF(16, QK_TURBOQ_G16)

// Every layout (ggml-common.h), for its group G: turboq2 qs[i] = idx[i] | idx[i+G/4] << 2 |
// idx[i+G/2] << 4 | idx[i+3G/4] << 6; turboq3 the same qs first (so that it extends turboq2's layout)
// and qh[i] bit k = bit 2 of idx[i + kG/8]; turboq4 qs[i] = idx[i] | idx[i+G/2] << 4; turboq8 qs = idx.
// NAME: the steps' infix (turboq_genericNAME_packN); SUF: the block's suffix (block_turboqN SUF).
#define TURBOQ_GENERIC_PACK_OF(NAME, SUF, G)                                                                         \
    static_assert(sizeof(((block_turboq2##SUF *) 0)->qs) == (G)/4 && sizeof(((block_turboq3##SUF *) 0)->qh) == (G)/8 &&  \
                  sizeof(((block_turboq4##SUF *) 0)->qs) == (G)/2 && sizeof(((block_turboq8##SUF *) 0)->qs) == (G),     \
                  "the turboq" #SUF " block fields hold their group's indices");                                                     \
    static_assert(offsetof(block_turboq3##SUF, qs) == offsetof(block_turboq2##SUF, qs), "turboq3 extends turboq2's layout"); \
    static inline void turboq_generic##NAME##_pack2(const uint8_t * idx, void * blk) {                                \
        block_turboq2##SUF * b = (block_turboq2##SUF *) blk;                                                           \
        for (int i = 0; i < (G)/4; ++i) {                                                                              \
            b->qs[i] = (uint8_t) ((idx[i] & 3) | (idx[i + (G)/4] & 3) << 2 | (idx[i + (G)/2] & 3) << 4 |              \
                                  (idx[i + 3*(G)/4] & 3) << 6);                                                        \
        }                                                                                                              \
    }                                                                                                                  \
    static inline void turboq_generic##NAME##_pack3(const uint8_t * idx, void * blk) {                                \
        block_turboq3##SUF * b = (block_turboq3##SUF *) blk;                                                           \
        turboq_generic##NAME##_pack2(idx, blk);                                                                        \
        for (int i = 0; i < (G)/8; ++i) {                                                                              \
            uint8_t h = 0;                                                                                             \
            for (int k = 0; k < 8; ++k) h |= ((idx[i + k*((G)/8)] >> 2) & 1) << k;                                    \
            b->qh[i] = h;                                                                                              \
        }                                                                                                              \
    }                                                                                                                  \
    static inline void turboq_generic##NAME##_pack4(const uint8_t * idx, void * blk) {                                \
        block_turboq4##SUF * b = (block_turboq4##SUF *) blk;                                                           \
        for (int i = 0; i < (G)/2; ++i) b->qs[i] = (uint8_t) ((idx[i] & 15) | (idx[i + (G)/2] & 15) << 4);            \
    }                                                                                                                  \
    static inline void turboq_generic##NAME##_pack8(const uint8_t * idx, void * blk) {                                \
        memcpy(((block_turboq8##SUF *) blk)->qs, idx, (G));                                                            \
    }

TURBOQ_GENERIC_PACK_OF(, _0, TURBOQ_GROUP)
TURBOQ_GENERIC_PACK_OF(64, _g64, QK_TURBOQ_G64)
TURBOQ_GENERIC_PACK_OF(32, _g32, QK_TURBOQ_G32)
TURBOQ_GENERIC_PACK_OF(16, _g16, QK_TURBOQ_G16)

static const struct turboq_encode_steps turboq_generic_steps = {
    .group            = TURBOQ_GROUP,
    .absmax           = turboq_generic_absmax,
    .div_square       = turboq_generic_div_square,
    .tree_sum         = turboq_generic_tree_sum,
    .fwht             = turboq_generic_fwht,
    .scale_signs      = turboq_generic_scale_signs,
    .index_thresholds = turboq_generic_index_thresholds,
    .index_grid       = turboq_generic_index_grid,
    .lookup           = turboq_generic_lookup,
    .pack             = { turboq_generic_pack2, turboq_generic_pack3, turboq_generic_pack4, turboq_generic_pack8 },
};

static const struct turboq_encode_steps turboq_generic64_steps = {
    .group            = QK_TURBOQ_G64,
    .absmax           = turboq_generic64_absmax,
    .div_square       = turboq_generic64_div_square,
    .tree_sum         = turboq_generic64_tree_sum,
    .fwht             = turboq_generic64_fwht,
    .scale_signs      = turboq_generic64_scale_signs,
    .index_thresholds = turboq_generic64_index_thresholds,
    .index_grid       = turboq_generic64_index_grid,
    .lookup           = turboq_generic64_lookup,
    .pack             = { turboq_generic64_pack2, turboq_generic64_pack3, turboq_generic64_pack4, turboq_generic64_pack8 },
};
static const struct turboq_encode_steps turboq_generic32_steps = {
    .group            = QK_TURBOQ_G32,
    .absmax           = turboq_generic32_absmax,
    .div_square       = turboq_generic32_div_square,
    .tree_sum         = turboq_generic32_tree_sum,
    .fwht             = turboq_generic32_fwht,
    .scale_signs      = turboq_generic32_scale_signs,
    .index_thresholds = turboq_generic32_index_thresholds,
    .index_grid       = turboq_generic32_index_grid,
    .lookup           = turboq_generic32_lookup,
    .pack             = { turboq_generic32_pack2, turboq_generic32_pack3, turboq_generic32_pack4, turboq_generic32_pack8 },
};
static const struct turboq_encode_steps turboq_generic16_steps = {
    .group            = QK_TURBOQ_G16,
    .absmax           = turboq_generic16_absmax,
    .div_square       = turboq_generic16_div_square,
    .tree_sum         = turboq_generic16_tree_sum,
    .fwht             = turboq_generic16_fwht,
    .scale_signs      = turboq_generic16_scale_signs,
    .index_thresholds = turboq_generic16_index_thresholds,
    .index_grid       = turboq_generic16_index_grid,
    .lookup           = turboq_generic16_lookup,
    .pack             = { turboq_generic16_pack2, turboq_generic16_pack3, turboq_generic16_pack4, turboq_generic16_pack8 },
};

// ---- the codebooks ----

// One row per type. thresholds == NULL selects the uniform absmax grid.
struct turboq_codebook {
    int           group;
    size_t        block_bytes;
    const float * centroids;
    const float * thresholds;
    int           n_thresholds;
    int           trellis_bits;  // > 0: a trellis type, centroids its 2^TURBOQ_TRELLIS_L state values
};

static_assert(GGML_TYPE_TURBOQ2_G64 == GGML_TYPE_TURBOQ8_0 + 1 && GGML_TYPE_TURBOQ8_G64 == GGML_TYPE_TURBOQ2_0 + 7 &&
              GGML_TYPE_TURBOQ2_G32 == GGML_TYPE_TURBOQ8_G64 + 1 && GGML_TYPE_TURBOQ8_G32 == GGML_TYPE_TURBOQ2_0 + 11 &&
              GGML_TYPE_TURBOQ2_G16 == GGML_TYPE_TURBOQ8_G32 + 1 && GGML_TYPE_TURBOQ8_G16 == GGML_TYPE_TURBOQ2_0 + 15,
              "the turboq types are sixteen consecutive ids: turboq2/3/4/8, then their _G64, _G32 and _G16 twins");
static_assert(GGML_TYPE_TURBOQ3_T == GGML_TYPE_TURBOQ8_G16 + 1 && GGML_TYPE_TURBOQ2_T == GGML_TYPE_TURBOQ8_G16 + 2,
              "the trellis types follow the sixteen");

// 0..15 for turboq2/3/4/8 and their _g64, _g32 and _g16 twins, 16 and 17 for turboq3t and turboq2t
static inline int turboq_type_index(enum ggml_type type) {
    GGML_ASSERT(ggml_turboq_group(type) != 0);
    return (int) (type - GGML_TYPE_TURBOQ2_0);
}

static const struct turboq_codebook turboq_codebooks[] = {
    { TURBOQ_GROUP,  sizeof(block_turboq2_0),   turboq2_centroids,     turboq2_thresholds,     3, 0  },
    { TURBOQ_GROUP,  sizeof(block_turboq3_0),   turboq3_centroids,     turboq3_thresholds,     7, 0  },
    { TURBOQ_GROUP,  sizeof(block_turboq4_0),   turboq4_centroids,     turboq4_thresholds,     15, 0 },
    { TURBOQ_GROUP,  sizeof(block_turboq8_0),   turboq8_centroids,     NULL,                   0, 0  },
    { QK_TURBOQ_G64, sizeof(block_turboq2_g64), turboq2_g64_centroids, turboq2_g64_thresholds, 3, 0  },
    { QK_TURBOQ_G64, sizeof(block_turboq3_g64), turboq3_g64_centroids, turboq3_g64_thresholds, 7, 0  },
    { QK_TURBOQ_G64, sizeof(block_turboq4_g64), turboq4_g64_centroids, turboq4_g64_thresholds, 15, 0 },
    { QK_TURBOQ_G64, sizeof(block_turboq8_g64), turboq8_centroids,     NULL,                   0, 0  },
    { QK_TURBOQ_G32, sizeof(block_turboq2_g32), turboq2_g32_centroids, turboq2_g32_thresholds, 3, 0  },
    { QK_TURBOQ_G32, sizeof(block_turboq3_g32), turboq3_g32_centroids, turboq3_g32_thresholds, 7, 0  },
    { QK_TURBOQ_G32, sizeof(block_turboq4_g32), turboq4_g32_centroids, turboq4_g32_thresholds, 15, 0 },
    { QK_TURBOQ_G32, sizeof(block_turboq8_g32), turboq8_centroids,     NULL,                   0, 0  },
    { QK_TURBOQ_G16, sizeof(block_turboq2_g16), turboq2_g16_centroids, turboq2_g16_thresholds, 3, 0  },
    { QK_TURBOQ_G16, sizeof(block_turboq3_g16), turboq3_g16_centroids, turboq3_g16_thresholds, 7, 0  },
    { QK_TURBOQ_G16, sizeof(block_turboq4_g16), turboq4_g16_centroids, turboq4_g16_thresholds, 15, 0 },
    { QK_TURBOQ_G16, sizeof(block_turboq8_g16), turboq8_centroids,     NULL,                   0, 0  },
    { TURBOQ_GROUP,  sizeof(block_turboq3_t),   turboq3t_codebook,     NULL,                   0, 3 },
    { TURBOQ_GROUP,  sizeof(block_turboq2_t),   turboq2t_codebook,     NULL,                   0, 2 },
};

static inline const struct turboq_codebook * turboq_codebook_of(enum ggml_type type) {
    return &turboq_codebooks[turboq_type_index(type)];
}

// 1/sqrt(group)
static inline float turboq_inv_sqrt_group(int group) {
    return group == QK_TURBOQ_G64 ? TURBOQ_G64_INV_SQRT_GROUP : group == QK_TURBOQ_G32 ? TURBOQ_G32_INV_SQRT_GROUP
         : group == QK_TURBOQ_G16 ? TURBOQ_G16_INV_SQRT_GROUP : TURBOQ_INV_SQRT_GROUP;
}

static inline int turboq_codebook_levels(const struct turboq_codebook * cb) {
    return cb->trellis_bits ? 1 << TURBOQ_TRELLIS_L : cb->thresholds ? cb->n_thresholds + 1 : 256;
}

// ---- the algorithm ----

// y = D2.H.D1.x/sqrt(group), on the first `group` signs
static inline void turboq_rotate_group_with(const struct turboq_encode_steps * st, float * x,
                                            const float * s1, const float * s2) {
    const float k = turboq_inv_sqrt_group(st->group);
    st->scale_signs(x, NULL, s1);
    st->fwht(x);
    st->scale_signs(x, &k, s2);
}

// x = D1.H.D2.y/sqrt(group) * scale: the inverse, with a block's norm folded in
static inline void turboq_unrotate_group_with(const struct turboq_encode_steps * st, float * x, float scale,
                                              const float * s1, const float * s2) {
    const float k = scale * turboq_inv_sqrt_group(st->group);
    st->scale_signs(x, NULL, s2);
    st->fwht(x);
    st->scale_signs(x, &k, s1);
}

// Returns the corrected norm and fills idx; see the header comment of ggml-turboq.c for the steps.
static inline float turboq_encode_group_with(const struct turboq_encode_steps * st, const struct turboq_codebook * cb,
                                             const float * x, uint8_t * idx, const float * s1, const float * s2) {
    const int g = st->group;
    const float amax = st->absmax(x);
    if (!isfinite(amax) || amax == 0.0f) {
        memset(idx, 0, g);
        return 0.0f;
    }

    float v[TURBOQ_GROUP];
    float t[TURBOQ_GROUP];
    st->div_square(x, amax, v, t);
    const float r = sqrtf(st->tree_sum(t));
    st->div_square(v, r, v, t); // t is not used

    turboq_rotate_group_with(st, v, s1, s2);

    if (cb->trellis_bits) {
        // idx: the states, which index the trellis codebook as the others' indices do theirs
        (st->trellis_viterbi ? st->trellis_viterbi : turboq_trellis_viterbi)(cb->centroids, cb->trellis_bits, v, idx);
    } else if (cb->thresholds) {
        st->index_thresholds(cb->thresholds, cb->n_thresholds, v, idx);
    } else {
        st->index_grid(v, idx);
    }

    st->lookup(cb->centroids, turboq_codebook_levels(cb), idx, t);
    for (int i = 0; i < g; ++i) t[i] = t[i] * t[i];
    const float cn = sqrtf(st->tree_sum(t));
    const float norm = (amax * r) / cn;
    return fminf(norm, TURBOQ_FP16_MAX);
}

// st: steps of the type's group size (turboq_steps_for)
static inline void turboq_quantize_row_with(const struct turboq_encode_steps * st, enum ggml_type type,
                                            const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    const struct turboq_codebook * cb = turboq_codebook_of(type);
    GGML_ASSERT(st->group == cb->group);
    void (*const pack)(const uint8_t *, void *) = cb->trellis_bits ? NULL : st->pack[turboq_type_index(type) % 4];
    const float * s1;
    const float * s2;
    ggml_turboq_signs(&s1, &s2);
    const int g = cb->group;
    assert(k % g == 0);
    uint8_t idx[TURBOQ_GROUP];
    for (int64_t ib = 0; ib < k / g; ++ib) {
        char * blk = (char *) y + ib * cb->block_bytes;
        const float norm = turboq_encode_group_with(st, cb, x + ib * g, idx, s1, s2);
        memset(blk, 0, cb->block_bytes); // also turboq4's reserved rnorm, always 0
        const ggml_half h = GGML_FP32_TO_FP16(norm);
        memcpy(blk, &h, sizeof(h)); // every layout starts with its fp16 norm
        if (pack) {
            pack(idx, blk);
        } else {
            turboq_trellis_pack(cb->trellis_bits, idx, (uint8_t *) blk + sizeof(ggml_half));
        }
    }
}

// the steps for a type: st128 (an architecture's or the generic ones) for the 128-value types,
// the generic 64-, 32- and 16-value steps for the _G64, _G32 and _G16 types
static inline const struct turboq_encode_steps * turboq_steps_for(enum ggml_type type, const struct turboq_encode_steps * st128) {
    const int g = turboq_codebook_of(type)->group;
    return g == QK_TURBOQ_G64 ? &turboq_generic64_steps : g == QK_TURBOQ_G32 ? &turboq_generic32_steps
         : g == QK_TURBOQ_G16 ? &turboq_generic16_steps : st128;
}
