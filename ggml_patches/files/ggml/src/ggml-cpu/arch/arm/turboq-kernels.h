#pragma once

// AArch64 NEON kernels for the turboq CPU paths, included through ggml-cpu/turboq-kernels.h by
// turboq-cpu.c (flash attention; the generic versions there state each primitive's contract) and by
// turboq-quants.c (the quantizer: the encoder steps of ggml-turboq-encode.h, whose generic versions
// these must match bit for bit: the same IEEE operations on the same values in the same order,
// lane-wise butterflies, the same halving tree, no fused multiply-add, which turboq-quants.c's
// -ffp-contract=off keeps the compiler from adding).

#include <arm_neon.h>
#include <string.h>

#define TURBOQ_ARCH_DECODE     1
#define TURBOQ_ARCH_DECODE_G32 1
#define TURBOQ_ARCH_DOT    1
#define TURBOQ_ARCH_MAD    1
#define TURBOQ_ARCH_SCALE  1

// ---- the encoder's steps (ggml-turboq-encode.h) ----

static inline void turboq_neon_fwht(float * x) {
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
}

// destroys v
static inline float turboq_neon_tree_sum(float * v) {
    for (int h = TURBOQ_GROUP/2; h >= 4; h >>= 1) {
        for (int i = 0; i < h; i += 4) {
            vst1q_f32(v + i, vaddq_f32(vld1q_f32(v + i), vld1q_f32(v + i + h)));
        }
    }
    return (v[0] + v[2]) + (v[1] + v[3]); // the last two halvings
}

// x[i] = (x[i] * k) * s[i], or x[i] * s[i] when k is NULL
static inline void turboq_neon_scale_signs(float * x, const float * k, const float * s) {
    for (int i = 0; i < TURBOQ_GROUP; i += 4) {
        float32x4_t v = vld1q_f32(x + i);
        if (k) {
            v = vmulq_f32(v, vdupq_n_f32(*k));
        }
        vst1q_f32(x + i, vmulq_f32(v, vld1q_f32(s + i)));
    }
}

// max |x_i|, or a non-finite value when some x_i is not finite: FMAX propagates NaN and keeps Inf,
// so one reduction answers both questions
static inline float turboq_neon_absmax(const float * x) {
    float32x4_t m = vdupq_n_f32(0.0f);
    for (int i = 0; i < TURBOQ_GROUP; i += 4) {
        m = vmaxq_f32(m, vabsq_f32(vld1q_f32(x + i)));
    }
    return vmaxvq_f32(m);
}

// y_i = x_i / d; t_i = y_i * y_i
static inline void turboq_neon_div_square(const float * x, float d, float * y, float * t) {
    const float32x4_t vd = vdupq_n_f32(d);
    for (int i = 0; i < TURBOQ_GROUP; i += 4) {
        const float32x4_t v = vdivq_f32(vld1q_f32(x + i), vd);
        vst1q_f32(y + i, v);
        vst1q_f32(t + i, vmulq_f32(v, v));
    }
}

// out_i = tab[idx_i], i < n (a multiple of 16); n_tab is 4, 8, 16, or 64 (the trellis types) or 256
// (turboq8), which take the generic loop
static inline void turboq_neon_lookup_n(const float * tab, int n_tab, const uint8_t * idx, float * out, int n) {
    if (n_tab > 16) {
        for (int i = 0; i < n; ++i) out[i] = tab[idx[i]];
        return;
    }
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
    for (int i = 0; i < n; i += 16) {
        const uint8x16_t b4 = vshlq_n_u8(vld1q_u8(idx + i), 2);
        for (int k = 0; k < 4; ++k) {
            const uint8x16_t bytes = vaddq_u8(vqtbl1q_u8(b4, vld1q_u8(sel[k])), bo);
            vst1q_f32(out + i + 4*k, vreinterpretq_f32_u8(vqtbl4q_u8(t, bytes)));
        }
    }
}

static inline void turboq_neon_lookup(const float * tab, int n_tab, const uint8_t * idx, float * out) {
    turboq_neon_lookup_n(tab, n_tab, idx, out, TURBOQ_GROUP);
}

// idx_i = the number of thresholds below y_i
static inline void turboq_neon_index_thresholds(const float * thr, int n_thr, const float * y, uint8_t * idx) {
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
}

// turboq8: idx_i = floor(y_i * 127.5/max|y| + 128), clamped to 0..255
static inline void turboq_neon_index_grid(const float * y, uint8_t * idx) {
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
}

// qs[i] = idx[i] | idx[i+32] << 2 | idx[i+64] << 4 | idx[i+96] << 6, low two bits of each
static inline void turboq_neon_pack2_bits(const uint8_t * idx, uint8_t * qs) {
    const uint8x16_t m = vdupq_n_u8(3);
    for (int i = 0; i < 32; i += 16) {
        uint8x16_t q = vandq_u8(vld1q_u8(idx + i), m);
        q = vorrq_u8(q, vshlq_n_u8(vandq_u8(vld1q_u8(idx + i + 32), m), 2));
        q = vorrq_u8(q, vshlq_n_u8(vandq_u8(vld1q_u8(idx + i + 64), m), 4));
        q = vorrq_u8(q, vshlq_n_u8(vld1q_u8(idx + i + 96), 6));
        vst1q_u8(qs + i, q);
    }
}

static inline void turboq_neon_pack2(const uint8_t * idx, void * blk) {
    turboq_neon_pack2_bits(idx, ((block_turboq2_0 *) blk)->qs);
}

// the low two bits as turboq2's, and qh[i] bit k = bit 2 of idx[i + 16k]
static inline void turboq_neon_pack3(const uint8_t * idx, void * blk) {
    block_turboq3_0 * b = (block_turboq3_0 *) blk;
    turboq_neon_pack2_bits(idx, b->qs);
    uint8x16_t hv = vdupq_n_u8(0);
    for (int k = 0; k < 8; ++k) {
        const uint8x16_t bit = vandq_u8(vshrq_n_u8(vld1q_u8(idx + 16*k), 2), vdupq_n_u8(1));
        hv = vorrq_u8(hv, vshlq_u8(bit, vdupq_n_s8((int8_t) k)));
    }
    vst1q_u8(b->qh, hv);
}

static inline void turboq_neon_pack4(const uint8_t * idx, void * blk) {
    block_turboq4_0 * b = (block_turboq4_0 *) blk;
    const uint8x16_t m = vdupq_n_u8(15);
    for (int i = 0; i < 64; i += 16) {
        vst1q_u8(b->qs + i, vorrq_u8(vandq_u8(vld1q_u8(idx + i), m), vshlq_n_u8(vld1q_u8(idx + i + 64), 4)));
    }
}

// a struct turboq_encode_steps initializer: every step (turboq8 packs with the generic memcpy)
#define TURBOQ_ARCH_ENCODE_STEPS {                                                                    \
    .group            = TURBOQ_GROUP,                                                                 \
    .absmax           = turboq_neon_absmax,                                                           \
    .div_square       = turboq_neon_div_square,                                                       \
    .tree_sum         = turboq_neon_tree_sum,                                                         \
    .fwht             = turboq_neon_fwht,                                                             \
    .scale_signs      = turboq_neon_scale_signs,                                                      \
    .index_thresholds = turboq_neon_index_thresholds,                                                 \
    .index_grid       = turboq_neon_index_grid,                                                       \
    .lookup           = turboq_neon_lookup,                                                           \
    .pack             = { turboq_neon_pack2, turboq_neon_pack3, turboq_neon_pack4, turboq_generic_pack8 }, \
}

// ---- flash attention ----

// idx[i + 32k] = (qs[i] >> 2k) & 3
static inline void turboq_neon_unpack2_bits(const uint8_t * qs, uint8_t * idx) {
    const uint8x16_t m = vdupq_n_u8(3);
    for (int i = 0; i < 32; i += 16) {
        const uint8x16_t q = vld1q_u8(qs + i);
        vst1q_u8(idx + i,      vandq_u8(q, m));
        vst1q_u8(idx + i + 32, vandq_u8(vshrq_n_u8(q, 2), m));
        vst1q_u8(idx + i + 64, vandq_u8(vshrq_n_u8(q, 4), m));
        vst1q_u8(idx + i + 96, vshrq_n_u8(q, 6));
    }
}

// turboqN_decode: a block's centroid values in the rotated domain (unscaled); returns its norm
static inline float turboq2_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq2_0 * b = (const block_turboq2_0 *) vb;
    uint8_t idx[TURBOQ_GROUP];
    turboq_neon_unpack2_bits(b->qs, idx);
    turboq_neon_lookup(turboq2_centroids, 4, idx, out);
    return GGML_CPU_FP16_TO_FP32(b->norm);
}

static inline float turboq3_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq3_0 * b = (const block_turboq3_0 *) vb;
    uint8_t idx[TURBOQ_GROUP];
    turboq_neon_unpack2_bits(b->qs, idx);
    const uint8x16_t hv = vld1q_u8(b->qh);
    for (int k = 0; k < 8; ++k) {
        const uint8x16_t hi = vshlq_n_u8(vandq_u8(vshlq_u8(hv, vdupq_n_s8((int8_t) -k)), vdupq_n_u8(1)), 2);
        vst1q_u8(idx + 16*k, vorrq_u8(vld1q_u8(idx + 16*k), hi));
    }
    turboq_neon_lookup(turboq3_centroids, 8, idx, out);
    return GGML_CPU_FP16_TO_FP32(b->norm);
}

static inline float turboq4_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq4_0 * b = (const block_turboq4_0 *) vb;
    uint8_t idx[TURBOQ_GROUP];
    for (int i = 0; i < 64; i += 16) {
        const uint8x16_t q = vld1q_u8(b->qs + i);
        vst1q_u8(idx + i,      vandq_u8(q, vdupq_n_u8(15)));
        vst1q_u8(idx + i + 64, vshrq_n_u8(q, 4));
    }
    turboq_neon_lookup(turboq4_centroids, 16, idx, out);
    return GGML_CPU_FP16_TO_FP32(b->norm);
}

static inline float turboq8_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq8_0 * b = (const block_turboq8_0 *) vb;
    for (int i = 0; i < TURBOQ_GROUP; ++i) out[i] = turboq8_centroids[b->qs[i]];
    return GGML_CPU_FP16_TO_FP32(b->norm);
}

// The _g64 twins: the same layouts with 64 for 128 (ggml-common.h)

static inline float turboq2_g64_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq2_g64 * b = (const block_turboq2_g64 *) vb;
    uint8_t idx[QK_TURBOQ_G64];
    // idx[i + 16k] = (qs[i] >> 2k) & 3
    const uint8x16_t m = vdupq_n_u8(3);
    const uint8x16_t q = vld1q_u8(b->qs);
    vst1q_u8(idx,      vandq_u8(q, m));
    vst1q_u8(idx + 16, vandq_u8(vshrq_n_u8(q, 2), m));
    vst1q_u8(idx + 32, vandq_u8(vshrq_n_u8(q, 4), m));
    vst1q_u8(idx + 48, vshrq_n_u8(q, 6));
    turboq_neon_lookup_n(turboq2_g64_centroids, 4, idx, out, QK_TURBOQ_G64);
    return turboq_block_norm(vb);
}

static inline float turboq3_g64_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq3_g64 * b = (const block_turboq3_g64 *) vb;
    uint8_t idx[QK_TURBOQ_G64];
    const uint8x16_t m = vdupq_n_u8(3);
    const uint8x16_t q = vld1q_u8(b->qs);
    // value 16k + i: high bit at qh[i % 8] bit 2k + i/8; lane i holds qh[i % 8] >> (i / 8)
    static const int8_t half_shift[16] = { 0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1, -1 };
    const uint8x8_t h8 = vld1_u8(b->qh);
    const uint8x16_t hv = vshlq_u8(vcombine_u8(h8, h8), vld1q_s8(half_shift));
    for (int k = 0; k < 4; ++k) {
        const uint8x16_t lo = k == 3 ? vshrq_n_u8(q, 6) : vandq_u8(vshlq_u8(q, vdupq_n_s8((int8_t) (-2*k))), m);
        const uint8x16_t hi = vshlq_n_u8(vandq_u8(vshlq_u8(hv, vdupq_n_s8((int8_t) (-2*k))), vdupq_n_u8(1)), 2);
        vst1q_u8(idx + 16*k, vorrq_u8(lo, hi));
    }
    turboq_neon_lookup_n(turboq3_g64_centroids, 8, idx, out, QK_TURBOQ_G64);
    return turboq_block_norm(vb);
}

static inline float turboq4_g64_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq4_g64 * b = (const block_turboq4_g64 *) vb;
    uint8_t idx[QK_TURBOQ_G64];
    for (int i = 0; i < 32; i += 16) {
        const uint8x16_t q = vld1q_u8(b->qs + i);
        vst1q_u8(idx + i,      vandq_u8(q, vdupq_n_u8(15)));
        vst1q_u8(idx + i + 32, vshrq_n_u8(q, 4));
    }
    turboq_neon_lookup_n(turboq4_g64_centroids, 16, idx, out, QK_TURBOQ_G64);
    return turboq_block_norm(vb);
}

static inline float turboq8_g64_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq8_g64 * b = (const block_turboq8_g64 *) vb;
    for (int i = 0; i < QK_TURBOQ_G64; ++i) out[i] = turboq8_centroids[b->qs[i]];
    return turboq_block_norm(vb);
}

// The _g32 twins: the same layouts with 32 for 128; a block's 8 or 16 bytes are duplicated across
// the two halves of a register, and each lane shifts its copy by its own amount

static inline float turboq2_g32_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq2_g32 * b = (const block_turboq2_g32 *) vb;
    uint8_t idx[QK_TURBOQ_G32];
    // value 8k + i = (qs[i] >> 2k) & 3: lanes 0-7 take k = 0 (2 in the second store), lanes 8-15 k = 1 (3)
    static const int8_t shift[16] = { 0, 0, 0, 0, 0, 0, 0, 0, -2, -2, -2, -2, -2, -2, -2, -2 };
    const uint8x8_t q8 = vld1_u8(b->qs);
    const uint8x16_t q = vcombine_u8(q8, q8);
    const uint8x16_t m = vdupq_n_u8(3);
    const int8x16_t  s = vld1q_s8(shift);
    vst1q_u8(idx,      vandq_u8(vshlq_u8(q, s), m));
    vst1q_u8(idx + 16, vandq_u8(vshlq_u8(vshrq_n_u8(q, 4), s), m));
    turboq_neon_lookup_n(turboq2_g32_centroids, 4, idx, out, QK_TURBOQ_G32);
    return turboq_block_norm(vb);
}

static inline float turboq3_g32_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq3_g32 * b = (const block_turboq3_g32 *) vb;
    uint8_t idx[QK_TURBOQ_G32];
    static const int8_t shift[16] = { 0, 0, 0, 0, 0, 0, 0, 0, -2, -2, -2, -2, -2, -2, -2, -2 };
    // value v's high bit: qh[v % 4] bit v / 4; lane l holds qh[l % 4] >> (l / 4), and >> 4 more for v = 16 + l
    static const int8_t hshift[16] = { 0, 0, 0, 0, -1, -1, -1, -1, -2, -2, -2, -2, -3, -3, -3, -3 };
    const uint8x8_t q8 = vld1_u8(b->qs);
    const uint8x16_t q = vcombine_u8(q8, q8);
    uint32_t qh;
    memcpy(&qh, b->qh, sizeof(qh));
    const uint8x16_t hv = vshlq_u8(vreinterpretq_u8_u32(vdupq_n_u32(qh)), vld1q_s8(hshift));
    const uint8x16_t m = vdupq_n_u8(3);
    const uint8x16_t one = vdupq_n_u8(1);
    const int8x16_t  s = vld1q_s8(shift);
    const uint8x16_t lo0 = vandq_u8(vshlq_u8(q, s), m);
    const uint8x16_t lo1 = vandq_u8(vshlq_u8(vshrq_n_u8(q, 4), s), m);
    vst1q_u8(idx,      vorrq_u8(lo0, vshlq_n_u8(vandq_u8(hv, one), 2)));
    vst1q_u8(idx + 16, vorrq_u8(lo1, vshlq_n_u8(vandq_u8(vshrq_n_u8(hv, 4), one), 2)));
    turboq_neon_lookup_n(turboq3_g32_centroids, 8, idx, out, QK_TURBOQ_G32);
    return turboq_block_norm(vb);
}

static inline float turboq4_g32_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq4_g32 * b = (const block_turboq4_g32 *) vb;
    uint8_t idx[QK_TURBOQ_G32];
    const uint8x16_t q = vld1q_u8(b->qs);
    vst1q_u8(idx,      vandq_u8(q, vdupq_n_u8(15)));
    vst1q_u8(idx + 16, vshrq_n_u8(q, 4));
    turboq_neon_lookup_n(turboq4_g32_centroids, 16, idx, out, QK_TURBOQ_G32);
    return turboq_block_norm(vb);
}

static inline float turboq8_g32_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq8_g32 * b = (const block_turboq8_g32 *) vb;
    for (int i = 0; i < QK_TURBOQ_G32; ++i) out[i] = turboq8_centroids[b->qs[i]];
    return turboq_block_norm(vb);
}

// four independent FMA chains hide the FMLA latency; the lanes are summed at the end
static inline float turboq_dot(const float * GGML_RESTRICT a, const float * GGML_RESTRICT b, int n) {
    float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (int i = 0; i < n; i += 16) {
        acc0 = vfmaq_f32(acc0, vld1q_f32(a + i +  0), vld1q_f32(b + i +  0));
        acc1 = vfmaq_f32(acc1, vld1q_f32(a + i +  4), vld1q_f32(b + i +  4));
        acc2 = vfmaq_f32(acc2, vld1q_f32(a + i +  8), vld1q_f32(b + i +  8));
        acc3 = vfmaq_f32(acc3, vld1q_f32(a + i + 12), vld1q_f32(b + i + 12));
    }
    return vaddvq_f32(vaddq_f32(vaddq_f32(acc0, acc1), vaddq_f32(acc2, acc3)));
}

static inline void turboq_mad(float * GGML_RESTRICT acc, const float * GGML_RESTRICT x, float w, int n) {
    for (int i = 0; i < n; i += 4) {
        vst1q_f32(acc + i, vfmaq_n_f32(vld1q_f32(acc + i), vld1q_f32(x + i), w));
    }
}

static inline void turboq_scale(float * GGML_RESTRICT x, float w, int n) {
    for (int i = 0; i < n; i += 4) {
        vst1q_f32(x + i, vmulq_n_f32(vld1q_f32(x + i), w));
    }
}
