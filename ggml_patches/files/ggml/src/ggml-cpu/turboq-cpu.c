// CPU kernels for the TurboQuant KV-cache types (pyturbo); see turboq-cpu.h.

#define GGML_COMMON_DECL_C
#include "ggml-common.h"

#include "turboq-cpu.h"
#include "ggml-cpu-impl.h"
#include "simd-mappings.h"
#include "../ggml-turboq.h"
#include "../ggml-turboq-tables.h"
#include "../ggml-turboq-trellis.h"
#include "../ggml-impl.h"

#include "turboq-kernels.h"

// ---- generic primitives ----
// Each takes the group size n of its type (128, or 64, 32 and 16 for the _g64, _g32 and _g16
// types), a constant where it is inlined into a kernel.

// turboqN_decode / turboqN_g64_decode / turboqN_g32_decode / turboqN_g16_decode: a block's centroid values in the rotated
// domain (unscaled); returns its norm. The generic ones read the bytes directly, in the layouts of
// ggml-turboq-encode.h's TURBOQ_GENERIC_PACK_OF (ggml_turboq_decode_rotated unpacks to indices
// first: the same values, measured 1.7x slower in decode). NAME: the decoder's infix; SUF: the
// block's suffix; G: the group.
#define TURBOQ_DEFINE_DECODE(NAME, SUF, G)                                                                    \
    static float turboq2##NAME##_decode(const void * vb, float * GGML_RESTRICT out) {                        \
        const block_turboq2##SUF * b = (const block_turboq2##SUF *) vb;                                       \
        for (int k = 0; k < 4; ++k) {                                                                         \
            for (int i = 0; i < (G)/4; ++i) out[i + k*((G)/4)] = turboq2##NAME##_centroids[(b->qs[i] >> (2*k)) & 3]; \
        }                                                                                                     \
        return turboq_block_norm(vb);                                                                         \
    }                                                                                                         \
    static float turboq3##NAME##_decode(const void * vb, float * GGML_RESTRICT out) {                        \
        const block_turboq3##SUF * b = (const block_turboq3##SUF *) vb;                                       \
        for (int k = 0; k < 4; ++k) {                                                                         \
            for (int i = 0; i < (G)/4; ++i) {                                                                 \
                const int j = i + k*((G)/4); /* high bit: qh[j % (G/8)], bit j / (G/8) */                     \
                out[j] = turboq3##NAME##_centroids[((b->qs[i] >> (2*k)) & 3) |                                \
                                                   (((b->qh[j % ((G)/8)] >> (j / ((G)/8))) & 1) << 2)];       \
            }                                                                                                 \
        }                                                                                                     \
        return turboq_block_norm(vb);                                                                         \
    }                                                                                                         \
    static float turboq4##NAME##_decode(const void * vb, float * GGML_RESTRICT out) {                        \
        const block_turboq4##SUF * b = (const block_turboq4##SUF *) vb;                                       \
        for (int i = 0; i < (G)/2; ++i) {                                                                     \
            out[i]         = turboq4##NAME##_centroids[b->qs[i] & 15];                                        \
            out[i + (G)/2] = turboq4##NAME##_centroids[b->qs[i] >> 4];                                        \
        }                                                                                                     \
        return turboq_block_norm(vb);                                                                         \
    }                                                                                                         \
    static float turboq8##NAME##_decode(const void * vb, float * GGML_RESTRICT out) {                        \
        const block_turboq8##SUF * b = (const block_turboq8##SUF *) vb;                                       \
        for (int i = 0; i < (G); ++i) out[i] = turboq8_centroids[b->qs[i]];                                   \
        return turboq_block_norm(vb);                                                                         \
    }

// an arch file may leave the _g32 twins (heads of 96, 160: few models) to these
#ifndef TURBOQ_ARCH_DECODE_G32
TURBOQ_DEFINE_DECODE(_g32, _g32, QK_TURBOQ_G32)
#endif
// and the _g16 twins (head size 80: Phi-2)
#ifndef TURBOQ_ARCH_DECODE_G16
TURBOQ_DEFINE_DECODE(_g16, _g16, QK_TURBOQ_G16)
#endif
#ifndef TURBOQ_ARCH_DECODE
TURBOQ_DEFINE_DECODE(, _0, TURBOQ_GROUP)
TURBOQ_DEFINE_DECODE(_g64, _g64, QK_TURBOQ_G64)
#endif

// the trellis types: a block's values (unscaled) from its k-bit code stream qs and the type's table cb
#ifndef TURBOQ_ARCH_TRELLIS_DECODE
static inline void turboq_trellis_decode(const int k, const uint8_t * qs, const float * cb, float * GGML_RESTRICT out) {
    uint8_t st[TURBOQ_GROUP];
    turboq_trellis_states(k, qs, st);
    for (int i = 0; i < TURBOQ_GROUP; ++i) out[i] = cb[st[i]];
}
#endif
static float turboq3t_decode(const void * vb, float * GGML_RESTRICT out) {
    turboq_trellis_decode(3, ((const block_turboq3_t *) vb)->qs, turboq3t_codebook, out);
    return turboq_block_norm(vb);
}
static float turboq2t_decode(const void * vb, float * GGML_RESTRICT out) {
    turboq_trellis_decode(2, ((const block_turboq2_t *) vb)->qs, turboq2t_codebook, out);
    return turboq_block_norm(vb);
}

// a[0..n) . b[0..n), eight partial sums
#ifndef TURBOQ_ARCH_DOT
static inline float turboq_dot(const float * GGML_RESTRICT a, const float * GGML_RESTRICT b, int n) {
    float s[8] = {0};
    for (int i = 0; i < n; i += 8) {
        for (int l = 0; l < 8; ++l) s[l] += a[i + l]*b[i + l];
    }
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}
#endif

// acc[0..n) += w * x[0..n)
#ifndef TURBOQ_ARCH_MAD
static inline void turboq_mad(float * GGML_RESTRICT acc, const float * GGML_RESTRICT x, float w, int n) {
    for (int i = 0; i < n; ++i) acc[i] += x[i]*w;
}
#endif

// x[0..n) *= w
#ifndef TURBOQ_ARCH_SCALE
static inline void turboq_scale(float * GGML_RESTRICT x, float w, int n) {
    for (int i = 0; i < n; ++i) x[i] *= w;
}
#endif

// ---- flash attention (rotated domain; Q is rotated by turboq-quants.c) ----
// NAME: the decoder's prefix (NAME_decode); TYPE: the type's name (block_TYPE, ggml_vec_dot_TYPE_f32);
// G: its group

#define TURBOQ_DEFINE_FA_KERNELS(NAME, TYPE, G)                                                                 \
    static void NAME##_fa_kq_dot(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,      \
                                 size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) {                \
        GGML_UNUSED(bs); GGML_UNUSED(bx); GGML_UNUSED(by); GGML_UNUSED(nrc);                                    \
        const block_##TYPE * x = (const block_##TYPE *) vx;                                                     \
        const float * q = (const float *) vy;                                                                   \
        float c[G];                                                                                             \
        float sum = 0.0f;                                                                                       \
        for (int ib = 0; ib < n / (G); ++ib) {                                                                  \
            const float norm = NAME##_decode(x + ib, c);                                                        \
            sum += norm * turboq_dot(c, q + ib*(G), G);                                                         \
        }                                                                                                       \
        *s = sum;                                                                                               \
    }                                                                                                           \
    static void NAME##_fa_v_mad(int64_t n, float * GGML_RESTRICT acc, const void * GGML_RESTRICT vv, float w) { \
        const block_##TYPE * v = (const block_##TYPE *) vv;                                                     \
        float c[G];                                                                                             \
        for (int64_t ib = 0; ib < n / (G); ++ib) {                                                              \
            const float norm = NAME##_decode(v + ib, c);                                                        \
            turboq_mad(acc + ib*(G), c, w*norm, G);                                                             \
        }                                                                                                       \
    }                                                                                                           \
    void ggml_vec_dot_##TYPE##_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,    \
                                   size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) {              \
        GGML_UNUSED(bs); GGML_UNUSED(bx); GGML_UNUSED(by); GGML_UNUSED(nrc);                                    \
        const block_##TYPE * x = (const block_##TYPE *) vx;                                                     \
        const float * y = (const float *) vy;                                                                   \
        float tmp[G];                                                                                           \
        float sum = 0.0f;                                                                                       \
        for (int ib = 0; ib < n / (G); ++ib) {                                                                  \
            dequantize_row_##TYPE(x + ib, tmp, G);                                                              \
            sum += turboq_dot(tmp, y + ib*(G), G);                                                              \
        }                                                                                                       \
        *s = sum;                                                                                               \
    }

TURBOQ_DEFINE_FA_KERNELS(turboq2, turboq2_0, TURBOQ_GROUP)
TURBOQ_DEFINE_FA_KERNELS(turboq3, turboq3_0, TURBOQ_GROUP)
TURBOQ_DEFINE_FA_KERNELS(turboq4, turboq4_0, TURBOQ_GROUP)
TURBOQ_DEFINE_FA_KERNELS(turboq8, turboq8_0, TURBOQ_GROUP)
TURBOQ_DEFINE_FA_KERNELS(turboq2_g64, turboq2_g64, QK_TURBOQ_G64)
TURBOQ_DEFINE_FA_KERNELS(turboq3_g64, turboq3_g64, QK_TURBOQ_G64)
TURBOQ_DEFINE_FA_KERNELS(turboq4_g64, turboq4_g64, QK_TURBOQ_G64)
TURBOQ_DEFINE_FA_KERNELS(turboq8_g64, turboq8_g64, QK_TURBOQ_G64)

TURBOQ_DEFINE_FA_KERNELS(turboq2_g32, turboq2_g32, QK_TURBOQ_G32)
TURBOQ_DEFINE_FA_KERNELS(turboq3_g32, turboq3_g32, QK_TURBOQ_G32)
TURBOQ_DEFINE_FA_KERNELS(turboq4_g32, turboq4_g32, QK_TURBOQ_G32)
TURBOQ_DEFINE_FA_KERNELS(turboq8_g32, turboq8_g32, QK_TURBOQ_G32)
TURBOQ_DEFINE_FA_KERNELS(turboq2_g16, turboq2_g16, QK_TURBOQ_G16)
TURBOQ_DEFINE_FA_KERNELS(turboq3_g16, turboq3_g16, QK_TURBOQ_G16)
TURBOQ_DEFINE_FA_KERNELS(turboq4_g16, turboq4_g16, QK_TURBOQ_G16)
TURBOQ_DEFINE_FA_KERNELS(turboq8_g16, turboq8_g16, QK_TURBOQ_G16)
TURBOQ_DEFINE_FA_KERNELS(turboq3t, turboq3_t, TURBOQ_GROUP)
TURBOQ_DEFINE_FA_KERNELS(turboq2t, turboq2_t, TURBOQ_GROUP)

// a whole row, block norms applied
#define TURBOQ_DEFINE_DECODE_ROW(NAME, TYPE, G)                                                                 \
    static void NAME##_decode_row(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t n) {         \
        const block_##TYPE * x = (const block_##TYPE *) vx;                                                     \
        for (int64_t ib = 0; ib < n / (G); ++ib) {                                                              \
            float * GGML_RESTRICT out = y + ib*(G);                                                             \
            turboq_scale(out, NAME##_decode(x + ib, out), G);                                                   \
        }                                                                                                       \
    }

TURBOQ_DEFINE_DECODE_ROW(turboq2_g16, turboq2_g16, QK_TURBOQ_G16)
TURBOQ_DEFINE_DECODE_ROW(turboq3_g16, turboq3_g16, QK_TURBOQ_G16)
TURBOQ_DEFINE_DECODE_ROW(turboq4_g16, turboq4_g16, QK_TURBOQ_G16)
TURBOQ_DEFINE_DECODE_ROW(turboq8_g16, turboq8_g16, QK_TURBOQ_G16)
TURBOQ_DEFINE_DECODE_ROW(turboq3t, turboq3_t, TURBOQ_GROUP)
TURBOQ_DEFINE_DECODE_ROW(turboq2t, turboq2_t, TURBOQ_GROUP)

// an arch file that defines TURBOQ_ARCH_DECODE_ROW decodes the rows of the other twelve types
#ifndef TURBOQ_ARCH_DECODE_ROW

TURBOQ_DEFINE_DECODE_ROW(turboq2, turboq2_0, TURBOQ_GROUP)
TURBOQ_DEFINE_DECODE_ROW(turboq3, turboq3_0, TURBOQ_GROUP)
TURBOQ_DEFINE_DECODE_ROW(turboq4, turboq4_0, TURBOQ_GROUP)
TURBOQ_DEFINE_DECODE_ROW(turboq8, turboq8_0, TURBOQ_GROUP)
TURBOQ_DEFINE_DECODE_ROW(turboq2_g64, turboq2_g64, QK_TURBOQ_G64)
TURBOQ_DEFINE_DECODE_ROW(turboq3_g64, turboq3_g64, QK_TURBOQ_G64)
TURBOQ_DEFINE_DECODE_ROW(turboq4_g64, turboq4_g64, QK_TURBOQ_G64)
TURBOQ_DEFINE_DECODE_ROW(turboq8_g64, turboq8_g64, QK_TURBOQ_G64)
TURBOQ_DEFINE_DECODE_ROW(turboq2_g32, turboq2_g32, QK_TURBOQ_G32)
TURBOQ_DEFINE_DECODE_ROW(turboq3_g32, turboq3_g32, QK_TURBOQ_G32)
TURBOQ_DEFINE_DECODE_ROW(turboq4_g32, turboq4_g32, QK_TURBOQ_G32)
TURBOQ_DEFINE_DECODE_ROW(turboq8_g32, turboq8_g32, QK_TURBOQ_G32)
#endif

static const struct {
    ggml_vec_dot_t         kq_dot;
    ggml_turboq_fa_v_mad_t v_mad;
    void (*decode_row)(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n);
} turboq_fa_kernels[] = {
    [GGML_TYPE_TURBOQ2_0 - GGML_TYPE_TURBOQ2_0] = { turboq2_fa_kq_dot, turboq2_fa_v_mad, turboq2_decode_row },
    [GGML_TYPE_TURBOQ3_0 - GGML_TYPE_TURBOQ2_0] = { turboq3_fa_kq_dot, turboq3_fa_v_mad, turboq3_decode_row },
    [GGML_TYPE_TURBOQ4_0 - GGML_TYPE_TURBOQ2_0] = { turboq4_fa_kq_dot, turboq4_fa_v_mad, turboq4_decode_row },
    [GGML_TYPE_TURBOQ8_0 - GGML_TYPE_TURBOQ2_0] = { turboq8_fa_kq_dot, turboq8_fa_v_mad, turboq8_decode_row },
    [GGML_TYPE_TURBOQ2_G64 - GGML_TYPE_TURBOQ2_0] = { turboq2_g64_fa_kq_dot, turboq2_g64_fa_v_mad, turboq2_g64_decode_row },
    [GGML_TYPE_TURBOQ3_G64 - GGML_TYPE_TURBOQ2_0] = { turboq3_g64_fa_kq_dot, turboq3_g64_fa_v_mad, turboq3_g64_decode_row },
    [GGML_TYPE_TURBOQ4_G64 - GGML_TYPE_TURBOQ2_0] = { turboq4_g64_fa_kq_dot, turboq4_g64_fa_v_mad, turboq4_g64_decode_row },
    [GGML_TYPE_TURBOQ8_G64 - GGML_TYPE_TURBOQ2_0] = { turboq8_g64_fa_kq_dot, turboq8_g64_fa_v_mad, turboq8_g64_decode_row },
    [GGML_TYPE_TURBOQ2_G32 - GGML_TYPE_TURBOQ2_0] = { turboq2_g32_fa_kq_dot, turboq2_g32_fa_v_mad, turboq2_g32_decode_row },
    [GGML_TYPE_TURBOQ3_G32 - GGML_TYPE_TURBOQ2_0] = { turboq3_g32_fa_kq_dot, turboq3_g32_fa_v_mad, turboq3_g32_decode_row },
    [GGML_TYPE_TURBOQ4_G32 - GGML_TYPE_TURBOQ2_0] = { turboq4_g32_fa_kq_dot, turboq4_g32_fa_v_mad, turboq4_g32_decode_row },
    [GGML_TYPE_TURBOQ8_G32 - GGML_TYPE_TURBOQ2_0] = { turboq8_g32_fa_kq_dot, turboq8_g32_fa_v_mad, turboq8_g32_decode_row },
    [GGML_TYPE_TURBOQ2_G16 - GGML_TYPE_TURBOQ2_0] = { turboq2_g16_fa_kq_dot, turboq2_g16_fa_v_mad, turboq2_g16_decode_row },
    [GGML_TYPE_TURBOQ3_G16 - GGML_TYPE_TURBOQ2_0] = { turboq3_g16_fa_kq_dot, turboq3_g16_fa_v_mad, turboq3_g16_decode_row },
    [GGML_TYPE_TURBOQ4_G16 - GGML_TYPE_TURBOQ2_0] = { turboq4_g16_fa_kq_dot, turboq4_g16_fa_v_mad, turboq4_g16_decode_row },
    [GGML_TYPE_TURBOQ8_G16 - GGML_TYPE_TURBOQ2_0] = { turboq8_g16_fa_kq_dot, turboq8_g16_fa_v_mad, turboq8_g16_decode_row },
    [GGML_TYPE_TURBOQ3_T   - GGML_TYPE_TURBOQ2_0] = { turboq3t_fa_kq_dot,    turboq3t_fa_v_mad,    turboq3t_decode_row },
    [GGML_TYPE_TURBOQ2_T   - GGML_TYPE_TURBOQ2_0] = { turboq2t_fa_kq_dot,    turboq2t_fa_v_mad,    turboq2t_decode_row },
};

ggml_vec_dot_t ggml_turboq_fa_kq_dot(enum ggml_type k_type) {
    return ggml_turboq_group(k_type) ? turboq_fa_kernels[k_type - GGML_TYPE_TURBOQ2_0].kq_dot : NULL;
}

ggml_turboq_fa_v_mad_t ggml_turboq_fa_v_mad(enum ggml_type v_type) {
    return ggml_turboq_group(v_type) ? turboq_fa_kernels[v_type - GGML_TYPE_TURBOQ2_0].v_mad : NULL;
}

void ggml_turboq_fa_decode_row(enum ggml_type type, const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    GGML_ASSERT(ggml_turboq_group(type));
    turboq_fa_kernels[type - GGML_TYPE_TURBOQ2_0].decode_row(x, y, n);
}
