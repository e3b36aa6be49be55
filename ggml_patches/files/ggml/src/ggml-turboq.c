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
// pyturbo/lab/reference.py mirrors every float operation here in NumPy, bit for bit: sums are a
// fixed halving tree, the butterflies run h = 1..64, and this file is built with
// -ffp-contract=off so that no multiply-add is fused behind our back.
//
// Architecture code: on AArch64 the hot loops below have NEON versions (#if TURBOQ_NEON blocks
// next to the generic C). NEON is part of the AArch64 base ISA, so ggml-base may use it as
// ggml-impl.h does for fp16; x86 SIMD would need flags that ggml-base is not built with. The
// NEON versions run the same IEEE operations on the same values in the same order (lane-wise
// butterflies, the same halving tree, no fused multiply-add), so they are bit-exact with the
// generic code and with pyturbo/lab/reference.py; tests/test_portable_kernels.py checks it under qemu.

#define GGML_COMMON_DECL_C
#include "ggml-common.h"

#include "ggml-turboq.h"
#include "ggml-turboq-tables.h"
#include "ggml-impl.h"

#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__ARM_NEON) && defined(__aarch64__) && !defined(GGML_TURBOQ_GENERIC)
#include <arm_neon.h>
#define TURBOQ_NEON 1
#endif

static_assert(QK_TURBOQ == TURBOQ_GROUP, "turboq block and rotation group must match");

#define TURBOQ_FP16_MAX 65504.0f

static void turboq_fwht(float * x) {
#ifdef TURBOQ_NEON
    // h = 1 and 2 inside each group of 4: vld4q de-interleaves 16 values, lane l of val[k] being
    // value 4l + k, so that both stages become lane-wise butterflies
    for (int i = 0; i < TURBOQ_GROUP; i += 16) {
        float32x4x4_t q = vld4q_f32(x + i);
        const float32x4_t a0 = vaddq_f32(q.val[0], q.val[1]);
        const float32x4_t a1 = vsubq_f32(q.val[0], q.val[1]);
        const float32x4_t a2 = vaddq_f32(q.val[2], q.val[3]);
        const float32x4_t a3 = vsubq_f32(q.val[2], q.val[3]);
        q.val[0] = vaddq_f32(a0, a2);
        q.val[2] = vsubq_f32(a0, a2);
        q.val[1] = vaddq_f32(a1, a3);
        q.val[3] = vsubq_f32(a1, a3);
        vst4q_f32(x + i, q);
    }
    for (int h = 4; h < TURBOQ_GROUP; h <<= 1) {
        for (int i = 0; i < TURBOQ_GROUP; i += 2*h) {
            for (int j = i; j < i + h; j += 4) {
                const float32x4_t a = vld1q_f32(x + j);
                const float32x4_t b = vld1q_f32(x + j + h);
                vst1q_f32(x + j,     vaddq_f32(a, b));
                vst1q_f32(x + j + h, vsubq_f32(a, b));
            }
        }
    }
    return;
#endif
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
#ifdef TURBOQ_NEON
    for (int h = TURBOQ_GROUP/2; h >= 4; h >>= 1) {
        for (int i = 0; i < h; i += 4) {
            vst1q_f32(v + i, vaddq_f32(vld1q_f32(v + i), vld1q_f32(v + i + h)));
        }
    }
    return (v[0] + v[2]) + (v[1] + v[3]); // the last two halvings
#endif
    for (int h = TURBOQ_GROUP/2; h > 0; h >>= 1) {
        for (int i = 0; i < h; ++i) {
            v[i] = v[i] + v[i + h];
        }
    }
    return v[0];
}

// The rotation signs. TURBOQ_SIGN_SEED=<n> draws others (splitmix64 from seed n, as
// pyturbo/lab/codebook.py does) on the CPU backend only: an experiment knob for measuring how much
// a result depends on the particular rotation. Caches written under one seed read as noise under
// another, and the GPU backends always use the built-in signs, so llama refuses a turboq cache on
// another backend and state I/O while it is on (ggml_turboq_sign_seed tells it).
static float turboq_sign1_seeded[TURBOQ_GROUP];
static float turboq_sign2_seeded[TURBOQ_GROUP];
static const float * turboq_s1 = turboq_sign1;
static const float * turboq_s2 = turboq_sign2;
static char turboq_seed_text[32];

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
    snprintf(turboq_seed_text, sizeof(turboq_seed_text), "%s", env);
}

const char * ggml_turboq_sign_seed(void) {
    return turboq_s1 == turboq_sign1 ? NULL : turboq_seed_text;
}

#ifdef TURBOQ_NEON
// x[i] = (x[i] * k) * s[i], or x[i] * s[i] when k is NULL
static void turboq_neon_scale_signs(float * x, const float * k, const float * s) {
    for (int i = 0; i < TURBOQ_GROUP; i += 4) {
        float32x4_t v = vld1q_f32(x + i);
        if (k) {
            v = vmulq_f32(v, vdupq_n_f32(*k));
        }
        vst1q_f32(x + i, vmulq_f32(v, vld1q_f32(s + i)));
    }
}
#endif

static void turboq_rotate_group(float * x) {
#ifdef TURBOQ_NEON
    const float k = TURBOQ_INV_SQRT_GROUP;
    turboq_neon_scale_signs(x, NULL, turboq_s1);
    turboq_fwht(x);
    turboq_neon_scale_signs(x, &k, turboq_s2);
    return;
#endif
    for (int i = 0; i < TURBOQ_GROUP; ++i) x[i] = x[i] * turboq_s1[i];
    turboq_fwht(x);
    for (int i = 0; i < TURBOQ_GROUP; ++i) x[i] = (x[i] * TURBOQ_INV_SQRT_GROUP) * turboq_s2[i];
}

// x = D1.H.D2.y/sqrt(128) * scale
static void turboq_unrotate_group_scaled(float * x, float scale) {
    const float k = scale * TURBOQ_INV_SQRT_GROUP;
#ifdef TURBOQ_NEON
    turboq_neon_scale_signs(x, NULL, turboq_s2);
    turboq_fwht(x);
    turboq_neon_scale_signs(x, &k, turboq_s1);
    return;
#endif
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

#ifdef TURBOQ_NEON
// qs[i] = idx[i] | idx[i+32] << 2 | idx[i+64] << 4 | idx[i+96] << 6, low two bits of each
static void turboq_neon_pack2(const uint8_t * idx, uint8_t * qs) {
    const uint8x16_t m = vdupq_n_u8(3);
    for (int i = 0; i < 32; i += 16) {
        uint8x16_t q = vandq_u8(vld1q_u8(idx + i), m);
        q = vorrq_u8(q, vshlq_n_u8(vandq_u8(vld1q_u8(idx + i + 32), m), 2));
        q = vorrq_u8(q, vshlq_n_u8(vandq_u8(vld1q_u8(idx + i + 64), m), 4));
        q = vorrq_u8(q, vshlq_n_u8(vld1q_u8(idx + i + 96), 6));
        vst1q_u8(qs + i, q);
    }
}

// idx[i + 32k] = (qs[i] >> 2k) & 3
static void turboq_neon_unpack2(const uint8_t * qs, uint8_t * idx) {
    const uint8x16_t m = vdupq_n_u8(3);
    for (int i = 0; i < 32; i += 16) {
        const uint8x16_t q = vld1q_u8(qs + i);
        vst1q_u8(idx + i,      vandq_u8(q, m));
        vst1q_u8(idx + i + 32, vandq_u8(vshrq_n_u8(q, 2), m));
        vst1q_u8(idx + i + 64, vandq_u8(vshrq_n_u8(q, 4), m));
        vst1q_u8(idx + i + 96, vshrq_n_u8(q, 6));
    }
}
#endif

static void turboq2_pack(const uint8_t * idx, void * blk) {
    block_turboq2_0 * b = (block_turboq2_0 *) blk;
#ifdef TURBOQ_NEON
    turboq_neon_pack2(idx, b->qs);
    return;
#endif
    for (int i = 0; i < 32; ++i) {
        b->qs[i] = (uint8_t) ((idx[i] & 3) | (idx[i + 32] & 3) << 2 | (idx[i + 64] & 3) << 4 | (idx[i + 96] & 3) << 6);
    }
}

static void turboq2_unpack(const void * blk, uint8_t * idx) {
    const block_turboq2_0 * b = (const block_turboq2_0 *) blk;
#ifdef TURBOQ_NEON
    turboq_neon_unpack2(b->qs, idx);
    return;
#endif
    for (int i = 0; i < 32; ++i) {
        for (int k = 0; k < 4; ++k) idx[i + 32*k] = (b->qs[i] >> (2*k)) & 3;
    }
}

static void turboq3_pack(const uint8_t * idx, void * blk) {
    block_turboq3_0 * b = (block_turboq3_0 *) blk;
#ifdef TURBOQ_NEON
    // qh[i] bit k = bit 2 of idx[i + 16k]
    turboq_neon_pack2(idx, b->qs);
    uint8x16_t hv = vdupq_n_u8(0);
    for (int k = 0; k < 8; ++k) {
        const uint8x16_t bit = vandq_u8(vshrq_n_u8(vld1q_u8(idx + 16*k), 2), vdupq_n_u8(1));
        hv = vorrq_u8(hv, vshlq_u8(bit, vdupq_n_s8((int8_t) k)));
    }
    vst1q_u8(b->qh, hv);
    return;
#endif
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
#ifdef TURBOQ_NEON
    turboq_neon_unpack2(b->qs, idx);
    const uint8x16_t hv = vld1q_u8(b->qh);
    for (int k = 0; k < 8; ++k) {
        const uint8x16_t hi = vshlq_n_u8(vandq_u8(vshlq_u8(hv, vdupq_n_s8((int8_t) -k)), vdupq_n_u8(1)), 2);
        vst1q_u8(idx + 16*k, vorrq_u8(vld1q_u8(idx + 16*k), hi));
    }
    return;
#endif
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
#ifdef TURBOQ_NEON
    const uint8x16_t m = vdupq_n_u8(15);
    for (int i = 0; i < 64; i += 16) {
        vst1q_u8(b->qs + i, vorrq_u8(vandq_u8(vld1q_u8(idx + i), m), vshlq_n_u8(vld1q_u8(idx + i + 64), 4)));
    }
    return;
#endif
    for (int i = 0; i < 64; ++i) b->qs[i] = (uint8_t) ((idx[i] & 15) | (idx[i + 64] & 15) << 4);
}

static void turboq4_unpack(const void * blk, uint8_t * idx) {
    const block_turboq4_0 * b = (const block_turboq4_0 *) blk;
#ifdef TURBOQ_NEON
    for (int i = 0; i < 64; i += 16) {
        const uint8x16_t q = vld1q_u8(b->qs + i);
        vst1q_u8(idx + i,      vandq_u8(q, vdupq_n_u8(15)));
        vst1q_u8(idx + i + 64, vshrq_n_u8(q, 4));
    }
    return;
#endif
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

// ---- the element-wise steps of encoding and decoding ----

// max |x_i|, or a non-finite value when some x_i is not finite
static float turboq_absmax(const float * x) {
#ifdef TURBOQ_NEON
    // FMAX propagates NaN and keeps Inf, so one reduction answers both questions
    float32x4_t m = vdupq_n_f32(0.0f);
    for (int i = 0; i < TURBOQ_GROUP; i += 4) {
        m = vmaxq_f32(m, vabsq_f32(vld1q_f32(x + i)));
    }
    return vmaxvq_f32(m);
#else
    float amax = 0.0f;
    int finite = 1;
    for (int i = 0; i < TURBOQ_GROUP; ++i) {
        finite &= isfinite(x[i]) ? 1 : 0;
        amax = fmaxf(amax, fabsf(x[i]));
    }
    return finite ? amax : INFINITY;
#endif
}

// y_i = x_i / d; t_i = y_i * y_i
static void turboq_div_square(const float * x, float d, float * y, float * t) {
#ifdef TURBOQ_NEON
    const float32x4_t vd = vdupq_n_f32(d);
    for (int i = 0; i < TURBOQ_GROUP; i += 4) {
        const float32x4_t v = vdivq_f32(vld1q_f32(x + i), vd);
        vst1q_f32(y + i, v);
        vst1q_f32(t + i, vmulq_f32(v, v));
    }
#else
    for (int i = 0; i < TURBOQ_GROUP; ++i) y[i] = x[i] / d;
    for (int i = 0; i < TURBOQ_GROUP; ++i) t[i] = y[i] * y[i];
#endif
}

// out_i = tab[idx_i]; n_tab is 4, 8, 16 or 256
static void turboq_lookup(const float * tab, int n_tab, const uint8_t * idx, float * out) {
#ifdef TURBOQ_NEON
    if (n_tab <= 16) {
        // a byte table lookup: float k of a 16-value group takes bytes 4*idx + 0..3 of the table
        static const uint8_t sel[4][16] = {
            {  0,  0,  0,  0,  1,  1,  1,  1,  2,  2,  2,  2,  3,  3,  3,  3 },
            {  4,  4,  4,  4,  5,  5,  5,  5,  6,  6,  6,  6,  7,  7,  7,  7 },
            {  8,  8,  8,  8,  9,  9,  9,  9, 10, 10, 10, 10, 11, 11, 11, 11 },
            { 12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15 },
        };
        static const uint8_t byte_of_float[16] = { 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3 };
        const uint8x16_t zero = vdupq_n_u8(0);
        uint8x16x4_t t;
        t.val[0] = vld1q_u8((const uint8_t *) tab);
        t.val[1] = n_tab > 4 ? vld1q_u8((const uint8_t *) (tab + 4))  : zero;
        t.val[2] = n_tab > 8 ? vld1q_u8((const uint8_t *) (tab + 8))  : zero;
        t.val[3] = n_tab > 8 ? vld1q_u8((const uint8_t *) (tab + 12)) : zero;
        const uint8x16_t bo = vld1q_u8(byte_of_float);
        for (int i = 0; i < TURBOQ_GROUP; i += 16) {
            const uint8x16_t b4 = vshlq_n_u8(vld1q_u8(idx + i), 2);
            for (int k = 0; k < 4; ++k) {
                const uint8x16_t bytes = vaddq_u8(vqtbl1q_u8(b4, vld1q_u8(sel[k])), bo);
                vst1q_f32(out + i + 4*k, vreinterpretq_f32_u8(vqtbl4q_u8(t, bytes)));
            }
        }
        return;
    }
#endif
    GGML_UNUSED(n_tab);
    for (int i = 0; i < TURBOQ_GROUP; ++i) out[i] = tab[idx[i]];
}

// idx_i = the number of thresholds below y_i
static void turboq_index_thresholds(const float * thr, int n_thr, const float * y, uint8_t * idx) {
#ifdef TURBOQ_NEON
    for (int i = 0; i < TURBOQ_GROUP; i += 16) {
        float32x4_t v[4];
        uint32x4_t  c[4];
        for (int m = 0; m < 4; ++m) {
            v[m] = vld1q_f32(y + i + 4*m);
            c[m] = vdupq_n_u32(0);
        }
        for (int k = 0; k < n_thr; ++k) {
            const float32x4_t t = vdupq_n_f32(thr[k]);
            for (int m = 0; m < 4; ++m) {
                c[m] = vsubq_u32(c[m], vcltq_f32(t, v[m])); // a true lane is all ones, i.e. -1
            }
        }
        const uint16x8_t lo = vcombine_u16(vmovn_u32(c[0]), vmovn_u32(c[1]));
        const uint16x8_t hi = vcombine_u16(vmovn_u32(c[2]), vmovn_u32(c[3]));
        vst1q_u8(idx + i, vcombine_u8(vmovn_u16(lo), vmovn_u16(hi)));
    }
#else
    for (int i = 0; i < TURBOQ_GROUP; ++i) {
        int q = 0;
        for (int k = 0; k < n_thr; ++k) q += thr[k] < y[i];
        idx[i] = (uint8_t) q;
    }
#endif
}

// turboq8: idx_i = floor(y_i * 127.5/max|y| + 128), clamped to 0..255
static void turboq_index_grid(const float * y, uint8_t * idx) {
#ifdef TURBOQ_NEON
    float32x4_t m = vdupq_n_f32(0.0f);
    for (int i = 0; i < TURBOQ_GROUP; i += 4) {
        m = vmaxq_f32(m, vabsq_f32(vld1q_f32(y + i)));
    }
    const float32x4_t s = vdupq_n_f32(127.5f / vmaxvq_f32(m));
    const float32x4_t off = vdupq_n_f32(128.0f);
    const uint32x4_t top = vdupq_n_u32(255);
    for (int i = 0; i < TURBOQ_GROUP; i += 16) {
        uint32x4_t q[4];
        for (int k = 0; k < 4; ++k) {
            // vcvtq_u32 turns the negative values into 0; the values are whole numbers already
            const float32x4_t f = vrndmq_f32(vaddq_f32(vmulq_f32(vld1q_f32(y + i + 4*k), s), off));
            q[k] = vminq_u32(vcvtq_u32_f32(f), top);
        }
        const uint16x8_t lo = vcombine_u16(vmovn_u32(q[0]), vmovn_u32(q[1]));
        const uint16x8_t hi = vcombine_u16(vmovn_u32(q[2]), vmovn_u32(q[3]));
        vst1q_u8(idx + i, vcombine_u8(vmovn_u16(lo), vmovn_u16(hi)));
    }
#else
    float ya = 0.0f;
    for (int i = 0; i < TURBOQ_GROUP; ++i) ya = fmaxf(ya, fabsf(y[i]));
    const float s = 127.5f / ya;
    for (int i = 0; i < TURBOQ_GROUP; ++i) {
        const float q = floorf(y[i] * s + 128.0f);
        idx[i] = (uint8_t) (q < 0.0f ? 0 : q > 255.0f ? 255 : (int) q);
    }
#endif
}

// Returns the corrected norm and fills idx; see the header comment for the steps.
static float turboq_encode_group(const struct turboq_codec * codec, const float * x, uint8_t * idx) {
    const float amax = turboq_absmax(x);
    if (!isfinite(amax) || amax == 0.0f) {
        memset(idx, 0, TURBOQ_GROUP);
        return 0.0f;
    }

    float v[TURBOQ_GROUP];
    float t[TURBOQ_GROUP];
    turboq_div_square(x, amax, v, t);
    const float r = sqrtf(turboq_tree_sum(t));
    turboq_div_square(v, r, v, t); // t is not used

    turboq_rotate_group(v);

    if (codec->thresholds) {
        turboq_index_thresholds(codec->thresholds, codec->n_thresholds, v, idx);
    } else {
        turboq_index_grid(v, idx);
    }

    turboq_lookup(codec->centroids, codec->thresholds ? codec->n_thresholds + 1 : 256, idx, t);
    for (int i = 0; i < TURBOQ_GROUP; ++i) t[i] = t[i] * t[i];
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
    turboq_lookup(codec->centroids, codec->thresholds ? codec->n_thresholds + 1 : 256, idx, out);
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
