// TurboQuant KV-cache codec (pyturbo).
//
// Encoding one 128-value group x:
//   1. amax = max|x_i|; a group with a NaN/Inf or all zeros is stored as an all-zero block, so a
//      bad value never reaches (and poisons) the softmax of other tokens.
//   2. u = x/amax, r = ||u|| (dividing first keeps huge and denormal inputs in range), v = u/r.
//   3. y = D2.H.D1.v/sqrt(128): randomized Walsh-Hadamard rotation, signs in ggml-turboq-tables.h.
//   4. idx_i = nearest level: the Lloyd-Max thresholds (turboq2/3/4), or for turboq8 the uniform
//      grid (i - 127.5)/127.5 scaled to the group's absmax of y.
//   5. norm = amax*r / ||c||, with c_i the chosen levels: the "corrected" norm makes the decoded
//      group keep the input's L2 norm. Stored as fp16, saturated at 65504.
// Decoding: x = norm * D1.H.D2.c/sqrt(128), i.e. values come back in the original domain, so
// get_rows, copies and the K-shift (RoPE of cached K) see ordinary numbers.
//
// pyturbo/reference.py mirrors every float operation here in NumPy, bit for bit: sums are a
// fixed halving tree, the butterflies run h = 1..64, and this file is built with
// -ffp-contract=off so that no multiply-add is fused behind our back.

#define GGML_COMMON_DECL_C
#include "ggml-common.h"

#include "ggml-turboq.h"
#include "ggml-turboq-tables.h"
#include "ggml-impl.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static_assert(QK_TURBOQ == TURBOQ_GROUP, "turboq block and rotation group must match");

#define TURBOQ_FP16_MAX 65504.0f

static void turboq_fwht(float * x) {
    for (int h = 1; h < TURBOQ_GROUP; h <<= 1) {
        for (int i = 0; i < TURBOQ_GROUP; i += 2*h) {
            for (int j = i; j < i + h; ++j) {
                const float a = x[j];
                const float b = x[j + h];
                x[j]     = a + b;
                x[j + h] = a - b;
            }
        }
    }
}

// destroys v
static float turboq_tree_sum(float * v) {
    for (int h = TURBOQ_GROUP/2; h > 0; h >>= 1) {
        for (int i = 0; i < h; ++i) {
            v[i] = v[i] + v[i + h];
        }
    }
    return v[0];
}

// The rotation signs. TURBOQ_SIGN_SEED=<n> draws others (splitmix64 from seed n, as
// pyturbo/codebook.py does) on the CPU backend only: an experiment knob for measuring how much
// a result depends on the particular rotation. Caches written under one seed read as noise under
// another, and the GPU backends always use the built-in signs.
static float turboq_sign1_seeded[TURBOQ_GROUP];
static float turboq_sign2_seeded[TURBOQ_GROUP];
static const float * turboq_s1 = turboq_sign1;
static const float * turboq_s2 = turboq_sign2;

#if defined(__GNUC__)
__attribute__((constructor))
#endif
static void turboq_signs_from_env(void) {
    const char * env = getenv("TURBOQ_SIGN_SEED");
    if (env == NULL || *env == '\0') {
        return;
    }
    uint64_t state = strtoull(env, NULL, 0);
    for (int i = 0; i < 2*TURBOQ_GROUP; ++i) {
        state += 0x9E3779B97F4A7C15ull;
        uint64_t z = state;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z = z ^ (z >> 31);
        const float s = (z & 1) ? -1.0f : 1.0f;
        if (i < TURBOQ_GROUP) {
            turboq_sign1_seeded[i] = s;
        } else {
            turboq_sign2_seeded[i - TURBOQ_GROUP] = s;
        }
    }
    turboq_s1 = turboq_sign1_seeded;
    turboq_s2 = turboq_sign2_seeded;
}

static void turboq_rotate_group(float * x) {
    for (int i = 0; i < TURBOQ_GROUP; ++i) x[i] = x[i] * turboq_s1[i];
    turboq_fwht(x);
    for (int i = 0; i < TURBOQ_GROUP; ++i) x[i] = (x[i] * TURBOQ_INV_SQRT_GROUP) * turboq_s2[i];
}

// x = D1.H.D2.y/sqrt(128) * scale
static void turboq_unrotate_group_scaled(float * x, float scale) {
    const float k = scale * TURBOQ_INV_SQRT_GROUP;
    for (int i = 0; i < TURBOQ_GROUP; ++i) x[i] = x[i] * turboq_s2[i];
    turboq_fwht(x);
    for (int i = 0; i < TURBOQ_GROUP; ++i) x[i] = (x[i] * k) * turboq_s1[i];
}

void ggml_turboq_rotate(float * x, int64_t n) {
    for (int64_t i = 0; i + TURBOQ_GROUP <= n; i += TURBOQ_GROUP) {
        turboq_rotate_group(x + i);
    }
}

void ggml_turboq_unrotate(float * x, int64_t n) {
    for (int64_t i = 0; i + TURBOQ_GROUP <= n; i += TURBOQ_GROUP) {
        turboq_unrotate_group_scaled(x + i, 1.0f);
    }
}

// ---- index packing, one pair per layout (see ggml-common.h) ----

static void turboq2_pack(const uint8_t * idx, void * blk) {
    block_turboq2_0 * b = (block_turboq2_0 *) blk;
    for (int i = 0; i < 32; ++i) {
        b->qs[i] = (uint8_t) ((idx[i] & 3) | (idx[i + 32] & 3) << 2 | (idx[i + 64] & 3) << 4 | (idx[i + 96] & 3) << 6);
    }
}

static void turboq2_unpack(const void * blk, uint8_t * idx) {
    const block_turboq2_0 * b = (const block_turboq2_0 *) blk;
    for (int i = 0; i < 32; ++i) {
        for (int k = 0; k < 4; ++k) idx[i + 32*k] = (b->qs[i] >> (2*k)) & 3;
    }
}

static void turboq3_pack(const uint8_t * idx, void * blk) {
    block_turboq3_0 * b = (block_turboq3_0 *) blk;
    for (int i = 0; i < 32; ++i) {
        b->qs[i] = (uint8_t) ((idx[i] & 3) | (idx[i + 32] & 3) << 2 | (idx[i + 64] & 3) << 4 | (idx[i + 96] & 3) << 6);
    }
    for (int i = 0; i < 16; ++i) {
        uint8_t h = 0;
        for (int k = 0; k < 8; ++k) h |= ((idx[i + 16*k] >> 2) & 1) << k;
        b->qh[i] = h;
    }
}

static void turboq3_unpack(const void * blk, uint8_t * idx) {
    const block_turboq3_0 * b = (const block_turboq3_0 *) blk;
    for (int i = 0; i < 32; ++i) {
        for (int k = 0; k < 4; ++k) idx[i + 32*k] = (b->qs[i] >> (2*k)) & 3;
    }
    for (int i = 0; i < 16; ++i) {
        for (int k = 0; k < 8; ++k) idx[i + 16*k] |= ((b->qh[i] >> k) & 1) << 2;
    }
}

static void turboq4_pack(const uint8_t * idx, void * blk) {
    block_turboq4_0 * b = (block_turboq4_0 *) blk;
    b->rnorm = 0; // reserved (the forks keep it for a residual norm); always written as 0
    for (int i = 0; i < 64; ++i) b->qs[i] = (uint8_t) ((idx[i] & 15) | (idx[i + 64] & 15) << 4);
}

static void turboq4_unpack(const void * blk, uint8_t * idx) {
    const block_turboq4_0 * b = (const block_turboq4_0 *) blk;
    for (int i = 0; i < 64; ++i) {
        idx[i]      = b->qs[i] & 15;
        idx[i + 64] = b->qs[i] >> 4;
    }
}

static void turboq8_pack(const uint8_t * idx, void * blk) {
    memcpy(((block_turboq8_0 *) blk)->qs, idx, TURBOQ_GROUP);
}

static void turboq8_unpack(const void * blk, uint8_t * idx) {
    memcpy(idx, ((const block_turboq8_0 *) blk)->qs, TURBOQ_GROUP);
}

// One row per type. thresholds == NULL selects the uniform absmax grid.
struct turboq_codec {
    size_t        block_bytes;
    const float * centroids;
    const float * thresholds;
    int           n_thresholds;
    void (*pack)  (const uint8_t * idx, void * blk);
    void (*unpack)(const void * blk, uint8_t * idx);
};

static const struct turboq_codec turboq_codecs[] = {
    [GGML_TYPE_TURBOQ2_0 - GGML_TYPE_TURBOQ2_0] = { sizeof(block_turboq2_0), turboq2_centroids, turboq2_thresholds, 3,  turboq2_pack, turboq2_unpack },
    [GGML_TYPE_TURBOQ3_0 - GGML_TYPE_TURBOQ2_0] = { sizeof(block_turboq3_0), turboq3_centroids, turboq3_thresholds, 7,  turboq3_pack, turboq3_unpack },
    [GGML_TYPE_TURBOQ4_0 - GGML_TYPE_TURBOQ2_0] = { sizeof(block_turboq4_0), turboq4_centroids, turboq4_thresholds, 15, turboq4_pack, turboq4_unpack },
    [GGML_TYPE_TURBOQ8_0 - GGML_TYPE_TURBOQ2_0] = { sizeof(block_turboq8_0), turboq8_centroids, NULL,               0,  turboq8_pack, turboq8_unpack },
};

static const struct turboq_codec * turboq_codec_of(enum ggml_type type) {
    GGML_ASSERT(ggml_is_turboq(type));
    return &turboq_codecs[type - GGML_TYPE_TURBOQ2_0];
}

// Returns the corrected norm and fills idx; see the header comment for the steps.
static float turboq_encode_group(const struct turboq_codec * codec, const float * x, uint8_t * idx) {
    float amax = 0.0f;
    int finite = 1;
    for (int i = 0; i < TURBOQ_GROUP; ++i) {
        finite &= isfinite(x[i]) ? 1 : 0;
        amax = fmaxf(amax, fabsf(x[i]));
    }
    if (!finite || amax == 0.0f) {
        memset(idx, 0, TURBOQ_GROUP);
        return 0.0f;
    }

    float v[TURBOQ_GROUP];
    float t[TURBOQ_GROUP];
    for (int i = 0; i < TURBOQ_GROUP; ++i) v[i] = x[i] / amax;
    for (int i = 0; i < TURBOQ_GROUP; ++i) t[i] = v[i] * v[i];
    const float r = sqrtf(turboq_tree_sum(t));
    for (int i = 0; i < TURBOQ_GROUP; ++i) v[i] = v[i] / r;

    turboq_rotate_group(v);

    if (codec->thresholds) {
        for (int i = 0; i < TURBOQ_GROUP; ++i) {
            int q = 0;
            for (int k = 0; k < codec->n_thresholds; ++k) q += codec->thresholds[k] < v[i];
            idx[i] = (uint8_t) q;
        }
    } else {
        float ya = 0.0f;
        for (int i = 0; i < TURBOQ_GROUP; ++i) ya = fmaxf(ya, fabsf(v[i]));
        const float s = 127.5f / ya;
        for (int i = 0; i < TURBOQ_GROUP; ++i) {
            const float q = floorf(v[i] * s + 128.0f);
            idx[i] = (uint8_t) (q < 0.0f ? 0 : q > 255.0f ? 255 : (int) q);
        }
    }

    for (int i = 0; i < TURBOQ_GROUP; ++i) {
        const float c = codec->centroids[idx[i]];
        t[i] = c * c;
    }
    const float cn = sqrtf(turboq_tree_sum(t));
    const float norm = (amax * r) / cn;
    return fminf(norm, TURBOQ_FP16_MAX);
}

static void turboq_quantize_row(enum ggml_type type, const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    const struct turboq_codec * codec = turboq_codec_of(type);
    assert(k % TURBOQ_GROUP == 0);
    uint8_t idx[TURBOQ_GROUP];
    for (int64_t ib = 0; ib < k / TURBOQ_GROUP; ++ib) {
        char * blk = (char *) y + ib * codec->block_bytes;
        const float norm = turboq_encode_group(codec, x + ib * TURBOQ_GROUP, idx);
        memset(blk, 0, codec->block_bytes);
        const ggml_half h = GGML_FP32_TO_FP16(norm);
        memcpy(blk, &h, sizeof(h)); // every layout starts with its fp16 norm
        codec->pack(idx, blk);
    }
}

float ggml_turboq_decode_rotated(enum ggml_type type, const void * GGML_RESTRICT block, float * GGML_RESTRICT out) {
    const struct turboq_codec * codec = turboq_codec_of(type);
    uint8_t idx[TURBOQ_GROUP];
    codec->unpack(block, idx);
    for (int i = 0; i < TURBOQ_GROUP; ++i) out[i] = codec->centroids[idx[i]];
    ggml_half h;
    memcpy(&h, block, sizeof(h));
    return GGML_FP16_TO_FP32(h);
}

static void turboq_dequantize_row(enum ggml_type type, const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    const size_t block_bytes = turboq_codec_of(type)->block_bytes;
    assert(k % TURBOQ_GROUP == 0);
    for (int64_t ib = 0; ib < k / TURBOQ_GROUP; ++ib) {
        float * out = y + ib * TURBOQ_GROUP;
        const float norm = ggml_turboq_decode_rotated(type, (const char *) x + ib * block_bytes, out);
        turboq_unrotate_group_scaled(out, norm);
    }
}

static size_t turboq_quantize(enum ggml_type type, const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row) {
    const size_t row_size = ggml_row_size(type, n_per_row);
    for (int64_t r = 0; r < nrows; ++r) {
        turboq_quantize_row(type, src + r * n_per_row, (char *) dst + r * row_size, n_per_row);
    }
    return nrows * row_size;
}

#define TURBOQ_DEFINE_ENTRY_POINTS(N)                                                                          \
    void quantize_row_turboq##N##_0_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {    \
        turboq_quantize_row(GGML_TYPE_TURBOQ##N##_0, x, y, k);                                                 \
    }                                                                                                          \
    void dequantize_row_turboq##N##_0(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {      \
        turboq_dequantize_row(GGML_TYPE_TURBOQ##N##_0, x, y, k);                                               \
    }                                                                                                          \
    size_t quantize_turboq##N##_0(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows,    \
                                  int64_t n_per_row, const float * imatrix) {                                  \
        GGML_UNUSED(imatrix);                                                                                  \
        return turboq_quantize(GGML_TYPE_TURBOQ##N##_0, src, dst, nrows, n_per_row);                           \
    }

TURBOQ_DEFINE_ENTRY_POINTS(2)
TURBOQ_DEFINE_ENTRY_POINTS(3)
TURBOQ_DEFINE_ENTRY_POINTS(4)
TURBOQ_DEFINE_ENTRY_POINTS(8)
