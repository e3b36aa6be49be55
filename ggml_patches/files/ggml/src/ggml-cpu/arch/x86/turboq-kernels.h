#pragma once

// x86 kernels for the turboq CPU paths (AVX2 + FMA; AVX-512F for whole-row decoding), for the
// 128-value types and their _g64, _g32 and _g16 twins, included by
// ggml-cpu/turboq-cpu.c (through turboq-kernels.h), which has the generic versions and the contract
// of each primitive. The quantizer (and the rotations of flash attention: Q, the V sum, the exact
// window's rows) takes the AVX2 encoder steps below for 128-value groups, the generic steps of
// ggml-turboq-encode.h for the rest.

#include <immintrin.h>

#define TURBOQ_ARCH_DECODE     1
#define TURBOQ_ARCH_DECODE_G32 1
#define TURBOQ_ARCH_DOT    1
#define TURBOQ_ARCH_MAD    1

// ---- the encoder's steps (ggml-turboq-encode.h), 128 values ----
// Each output is the generic step's single add, subtract, multiply, divide or max of the same
// operands, so the bytes are the reference's (the tree sum keeps the generic halving order).

static inline void turboq_avx2_fwht(float * x) {
    __m256 r[TURBOQ_GROUP/8];
    for (int i = 0; i < TURBOQ_GROUP/8; ++i) {
        __m256 v = _mm256_loadu_ps(x + 8*i);
        // h = 1, 2, 4 within the register: y holds each value's partner; the lower value of a
        // pair takes a + b (v + y), the upper one a - b (y - v)
        __m256 y = _mm256_permute_ps(v, 0xB1);
        v = _mm256_blend_ps(_mm256_add_ps(v, y), _mm256_sub_ps(y, v), 0xAA);
        y = _mm256_permute_ps(v, 0x4E);
        v = _mm256_blend_ps(_mm256_add_ps(v, y), _mm256_sub_ps(y, v), 0xCC);
        y = _mm256_permute2f128_ps(v, v, 0x01);
        r[i] = _mm256_blend_ps(_mm256_add_ps(v, y), _mm256_sub_ps(y, v), 0xF0);
    }
    for (int h = 1; h < TURBOQ_GROUP/8; h <<= 1) { // h = 8..64 values: whole registers
        for (int i = 0; i < TURBOQ_GROUP/8; i += 2*h) {
            for (int j = i; j < i + h; ++j) {
                const __m256 a = r[j];
                const __m256 b = r[j + h];
                r[j]     = _mm256_add_ps(a, b);
                r[j + h] = _mm256_sub_ps(a, b);
            }
        }
    }
    for (int i = 0; i < TURBOQ_GROUP/8; ++i) {
        _mm256_storeu_ps(x + 8*i, r[i]);
    }
}

// destroys v
static inline float turboq_avx2_tree_sum(float * v) {
    for (int h = TURBOQ_GROUP/2; h >= 8; h >>= 1) {
        for (int i = 0; i < h; i += 8) {
            _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), _mm256_loadu_ps(v + i + h)));
        }
    }
    _mm_storeu_ps(v, _mm_add_ps(_mm_loadu_ps(v), _mm_loadu_ps(v + 4)));
    return (v[0] + v[2]) + (v[1] + v[3]); // the last two halvings
}

// x[i] = (x[i] * k) * s[i], or x[i] * s[i] when k is NULL
static inline void turboq_avx2_scale_signs(float * x, const float * k, const float * s) {
    if (k) {
        const __m256 kk = _mm256_set1_ps(*k);
        for (int i = 0; i < TURBOQ_GROUP; i += 8) {
            _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), kk), _mm256_loadu_ps(s + i)));
        }
    } else {
        for (int i = 0; i < TURBOQ_GROUP; i += 8) {
            _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(s + i)));
        }
    }
}

// max |x_i|, INFINITY when some x_i is not finite
static inline float turboq_avx2_absmax(const float * x) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 inf = _mm256_set1_ps(INFINITY);
    __m256 m = _mm256_setzero_ps();
    __m256 finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int i = 0; i < TURBOQ_GROUP; i += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
        finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, inf, _CMP_LT_OQ)); // false for Inf and NaN
        m = _mm256_max_ps(m, a);
    }
    if (_mm256_movemask_ps(finite) != 0xFF) {
        return INFINITY;
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

// y_i = x_i/d, t_i = y_i*y_i
static inline void turboq_avx2_div_square(const float * x, float d, float * y, float * t) {
    const __m256 dd = _mm256_set1_ps(d);
    for (int i = 0; i < TURBOQ_GROUP; i += 8) {
        const __m256 q = _mm256_div_ps(_mm256_loadu_ps(x + i), dd);
        _mm256_storeu_ps(y + i, q);
        _mm256_storeu_ps(t + i, _mm256_mul_ps(q, q));
    }
}

// The trellis types' Viterbi search (ggml-turboq-trellis.h's, with 8 states a register): state
// m = 8i + l of cost register i takes its best predecessor's cost best[m >> k], which sits in best
// register (8i >> k) / 8 at lane (8i >> k) % 8 + (l >> k). The same compares (first minimum on ties),
// adds and multiplies as the generic search, so the same path (bench/trellis_viterbi.c measured
// 3.2 us a group where the compiler-vectorized generic one took 15).
static inline void turboq_avx2_trellis_viterbi_k(const float * cb, const int k, const float * y, uint8_t * states) {
    enum { S = TURBOQ_TRELLIS_STATES, NV = S/8 };
    const int nb = (S >> k)/8;
    __m256 cost[NV], best[NV], cbv[NV];
    __m256i lane_of[NV];
    uint8_t back[TURBOQ_GROUP][S];
    for (int i = 0; i < NV; ++i) {
        cbv[i]  = _mm256_loadu_ps(cb + 8*i);
        cost[i] = _mm256_set1_ps(INFINITY);
        lane_of[i] = _mm256_add_epi32(_mm256_set1_epi32(((8*i) >> k) % 8),
                                      _mm256_srlv_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(k)));
    }
    cost[0] = _mm256_setr_ps(0.0f, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY);
    for (int t = 0; t < TURBOQ_GROUP; ++t) {
        for (int j = 0; j < nb; ++j) {
            __m256 b = cost[j];
            __m256i id = _mm256_setzero_si256();
            for (int h = 1; h < (1 << k); ++h) {
                const __m256 c  = cost[h*nb + j];
                const __m256 lt = _mm256_cmp_ps(c, b, _CMP_LT_OQ);
                b  = _mm256_blendv_ps(b, c, lt);
                id = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(id), _mm256_castsi256_ps(_mm256_set1_epi32(h)), lt));
            }
            best[j] = b;
            const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(id), _mm256_extracti128_si256(id, 1));
            _mm_storel_epi64((__m128i *) (back[t] + 8*j), _mm_packus_epi16(w, w));
        }
        const __m256 yt = _mm256_set1_ps(y[t]);
        for (int i = 0; i < NV; ++i) {
            const __m256 e = _mm256_permutevar8x32_ps(best[((8*i) >> k) / 8], lane_of[i]);
            const __m256 d = _mm256_sub_ps(yt, cbv[i]);
            cost[i] = _mm256_add_ps(e, _mm256_mul_ps(d, d));
        }
    }
    float c[S];
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(c + 8*i, cost[i]);
    turboq_trellis_trace_back(k, c, back, states);
}

static inline void turboq_avx2_trellis_viterbi(const float * cb, int k, const float * y, uint8_t * states) {
    if (k == 3) {
        turboq_avx2_trellis_viterbi_k(cb, 3, y, states);
    } else {
        turboq_avx2_trellis_viterbi_k(cb, 2, y, states);
    }
}

// a struct turboq_encode_steps initializer (the index and pack steps are the generic ones)
#define TURBOQ_ARCH_ENCODE_STEPS {                                                                    \
    .group            = TURBOQ_GROUP,                                                                 \
    .absmax           = turboq_avx2_absmax,                                                           \
    .div_square       = turboq_avx2_div_square,                                                       \
    .tree_sum         = turboq_avx2_tree_sum,                                                         \
    .fwht             = turboq_avx2_fwht,                                                             \
    .scale_signs      = turboq_avx2_scale_signs,                                                      \
    .index_thresholds = turboq_generic_index_thresholds,                                              \
    .index_grid       = turboq_generic_index_grid,                                                     \
    .lookup           = turboq_generic_lookup,                                                        \
    .pack             = { turboq_generic_pack2, turboq_generic_pack3, turboq_generic_pack4, turboq_generic_pack8 }, \
    .trellis_viterbi  = turboq_avx2_trellis_viterbi,                                                  \
}

static inline __m256i turboq_bytes8(const uint8_t * p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) p));
}

static inline float turboq2_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq2_0 * b = (const block_turboq2_0 *) vb;
    const __m256 lut = _mm256_setr_ps(turboq2_centroids[0], turboq2_centroids[1], turboq2_centroids[2], turboq2_centroids[3],
                                      turboq2_centroids[0], turboq2_centroids[1], turboq2_centroids[2], turboq2_centroids[3]);
    const __m256i three = _mm256_set1_epi32(3);
    for (int j = 0; j < 4; ++j) {
        const __m256i q = turboq_bytes8(b->qs + 8*j);
        for (int k = 0; k < 4; ++k) {
            const __m256i ik = _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_set1_epi32(2*k)), three);
            _mm256_storeu_ps(out + 32*k + 8*j, _mm256_permutevar8x32_ps(lut, ik));
        }
    }
    return GGML_CPU_FP16_TO_FP32(b->norm);
}

static inline float turboq3_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq3_0 * b = (const block_turboq3_0 *) vb;
    const __m256 lut = _mm256_loadu_ps(turboq3_centroids);
    const __m256i three = _mm256_set1_epi32(3);
    const __m256i one   = _mm256_set1_epi32(1);
    const __m256i h0 = turboq_bytes8(b->qh);
    const __m256i h1 = turboq_bytes8(b->qh + 8);
    for (int j = 0; j < 4; ++j) {
        const __m256i q = turboq_bytes8(b->qs + 8*j);
        const __m256i h = (j & 1) ? h1 : h0;
        for (int k = 0; k < 4; ++k) {
            // value 32k + 8j + l: low bits at qs[8j+l] >> 2k, high bit at qh[8(j%2)+l] bit 2k + j/2
            const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_set1_epi32(2*k)), three);
            const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_set1_epi32(2*k + j/2)), one);
            const __m256i idx = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 2));
            _mm256_storeu_ps(out + 32*k + 8*j, _mm256_permutevar8x32_ps(lut, idx));
        }
    }
    return GGML_CPU_FP16_TO_FP32(b->norm);
}

// The _g64 twins: the same layouts with 64 for 128 (ggml-common.h)

static inline float turboq2_g64_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq2_g64 * b = (const block_turboq2_g64 *) vb;
    const __m256 lut = _mm256_setr_ps(turboq2_g64_centroids[0], turboq2_g64_centroids[1], turboq2_g64_centroids[2], turboq2_g64_centroids[3],
                                      turboq2_g64_centroids[0], turboq2_g64_centroids[1], turboq2_g64_centroids[2], turboq2_g64_centroids[3]);
    const __m256i three = _mm256_set1_epi32(3);
    for (int j = 0; j < 2; ++j) {
        const __m256i q = turboq_bytes8(b->qs + 8*j);
        for (int k = 0; k < 4; ++k) {
            // value 16k + 8j + l: qs[8j + l] >> 2k
            const __m256i ik = _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_set1_epi32(2*k)), three);
            _mm256_storeu_ps(out + 16*k + 8*j, _mm256_permutevar8x32_ps(lut, ik));
        }
    }
    return turboq_block_norm(vb);
}

static inline float turboq3_g64_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq3_g64 * b = (const block_turboq3_g64 *) vb;
    const __m256 lut = _mm256_loadu_ps(turboq3_g64_centroids);
    const __m256i three = _mm256_set1_epi32(3);
    const __m256i one   = _mm256_set1_epi32(1);
    const __m256i h = turboq_bytes8(b->qh);
    for (int j = 0; j < 2; ++j) {
        const __m256i q = turboq_bytes8(b->qs + 8*j);
        for (int k = 0; k < 4; ++k) {
            // value 16k + 8j + l: low bits at qs[8j + l] >> 2k, high bit at qh[l] bit 2k + j
            const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_set1_epi32(2*k)), three);
            const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_set1_epi32(2*k + j)), one);
            const __m256i idx = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 2));
            _mm256_storeu_ps(out + 16*k + 8*j, _mm256_permutevar8x32_ps(lut, idx));
        }
    }
    return turboq_block_norm(vb);
}

// The _g32 twins: the same layouts with 32 for 128

static inline float turboq2_g32_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq2_g32 * b = (const block_turboq2_g32 *) vb;
    const __m256 lut = _mm256_setr_ps(turboq2_g32_centroids[0], turboq2_g32_centroids[1], turboq2_g32_centroids[2], turboq2_g32_centroids[3],
                                      turboq2_g32_centroids[0], turboq2_g32_centroids[1], turboq2_g32_centroids[2], turboq2_g32_centroids[3]);
    const __m256i three = _mm256_set1_epi32(3);
    const __m256i q = turboq_bytes8(b->qs);
    for (int k = 0; k < 4; ++k) {
        // value 8k + l: qs[l] >> 2k
        const __m256i ik = _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_set1_epi32(2*k)), three);
        _mm256_storeu_ps(out + 8*k, _mm256_permutevar8x32_ps(lut, ik));
    }
    return turboq_block_norm(vb);
}

static inline float turboq3_g32_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq3_g32 * b = (const block_turboq3_g32 *) vb;
    const __m256 lut = _mm256_loadu_ps(turboq3_g32_centroids);
    const __m256i three = _mm256_set1_epi32(3);
    const __m256i one   = _mm256_set1_epi32(1);
    const __m256i q = turboq_bytes8(b->qs);
    // lane l reads qh[l % 4] shifted right by l / 4, so that value 8k + l's high bit is bit 2k
    uint32_t qh;
    memcpy(&qh, b->qh, sizeof(qh));
    const __m256i h = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_set1_epi32((int) qh)), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    for (int k = 0; k < 4; ++k) {
        const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_set1_epi32(2*k)), three);
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_set1_epi32(2*k)), one);
        const __m256i idx = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 2));
        _mm256_storeu_ps(out + 8*k, _mm256_permutevar8x32_ps(lut, idx));
    }
    return turboq_block_norm(vb);
}

// turboq4 and turboq8 (and twins), for a group of G: turboq4's byte i holds value i (low nibble) and
// i + G/2; turboq8's byte i is value i
#define TURBOQ4_DECODE(NAME, TYPE, G, TABLE)                                                                    \
    static inline float NAME##_decode(const void * vb, float * GGML_RESTRICT out) {                            \
        const block_##TYPE * b = (const block_##TYPE *) vb;                                                     \
        const __m256 lut_lo = _mm256_loadu_ps(TABLE);                                                           \
        const __m256 lut_hi = _mm256_loadu_ps(TABLE + 8);                                                       \
        const __m256i fifteen = _mm256_set1_epi32(15);                                                          \
        for (int j = 0; j < (G)/16; ++j) {                                                                      \
            const __m256i q = turboq_bytes8(b->qs + 8*j);                                                       \
            const __m256i idx[2] = { _mm256_and_si256(q, fifteen), _mm256_srli_epi32(q, 4) };                   \
            for (int k = 0; k < 2; ++k) {                                                                       \
                /* bit 3 of the index picks the upper half of the table; blendv reads the lane's sign bit */    \
                const __m256 sel = _mm256_castsi256_ps(_mm256_slli_epi32(idx[k], 28));                          \
                const __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut_lo, idx[k]),                     \
                                                  _mm256_permutevar8x32_ps(lut_hi, idx[k]), sel);               \
                _mm256_storeu_ps(out + (G)/2*k + 8*j, v);                                                       \
            }                                                                                                   \
        }                                                                                                       \
        return GGML_CPU_FP16_TO_FP32(b->norm);                                                                  \
    }

#define TURBOQ8_DECODE(NAME, TYPE, G)                                                                           \
    static inline float NAME##_decode(const void * vb, float * GGML_RESTRICT out) {                            \
        const block_##TYPE * b = (const block_##TYPE *) vb;                                                     \
        const __m256 step = _mm256_set1_ps(1.0f/127.5f);                                                        \
        const __m256 one  = _mm256_set1_ps(1.0f);                                                               \
        for (int j = 0; j < (G)/8; ++j) {                                                                       \
            const __m256 q = _mm256_cvtepi32_ps(turboq_bytes8(b->qs + 8*j));                                    \
            _mm256_storeu_ps(out + 8*j, _mm256_fmsub_ps(q, step, one));                                         \
        }                                                                                                       \
        return GGML_CPU_FP16_TO_FP32(b->norm);                                                                  \
    }

TURBOQ4_DECODE(turboq4, turboq4_0, TURBOQ_GROUP, turboq4_centroids)
TURBOQ8_DECODE(turboq8, turboq8_0, TURBOQ_GROUP)
TURBOQ4_DECODE(turboq4_g64, turboq4_g64, QK_TURBOQ_G64, turboq4_g64_centroids)
TURBOQ8_DECODE(turboq8_g64, turboq8_g64, QK_TURBOQ_G64)
TURBOQ4_DECODE(turboq4_g32, turboq4_g32, QK_TURBOQ_G32, turboq4_g32_centroids)
TURBOQ8_DECODE(turboq8_g32, turboq8_g32, QK_TURBOQ_G32)

// The _g16 twins (head size 80): two registers a block. turboq2/3's value i + 4k is qs[i] >> 2k,
// so lane l of register r (value 8r + l) reads qs[l % 4] shifted by 4r + 2(l / 4); turboq3's high
// bit of value j is qh[j % 2] bit j / 2, so that lane reads qh[l % 2] shifted by 4r + l / 2.
#define TURBOQ_ARCH_DECODE_G16 1

static inline float turboq2_g16_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq2_g16 * b = (const block_turboq2_g16 *) vb;
    const __m256 lut = _mm256_setr_ps(turboq2_g16_centroids[0], turboq2_g16_centroids[1], turboq2_g16_centroids[2], turboq2_g16_centroids[3],
                                      turboq2_g16_centroids[0], turboq2_g16_centroids[1], turboq2_g16_centroids[2], turboq2_g16_centroids[3]);
    const __m256i three = _mm256_set1_epi32(3);
    uint32_t qs;
    memcpy(&qs, b->qs, sizeof(qs));
    const __m256i q = _mm256_cvtepu8_epi32(_mm_set1_epi32((int) qs));  // qs[l % 4]
    const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    for (int r = 0; r < 2; ++r) {
        const __m256i ir = _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_add_epi32(shift, _mm256_set1_epi32(4*r))), three);
        _mm256_storeu_ps(out + 8*r, _mm256_permutevar8x32_ps(lut, ir));
    }
    return turboq_block_norm(vb);
}

static inline float turboq3_g16_decode(const void * vb, float * GGML_RESTRICT out) {
    const block_turboq3_g16 * b = (const block_turboq3_g16 *) vb;
    const __m256 lut = _mm256_loadu_ps(turboq3_g16_centroids);
    const __m256i three = _mm256_set1_epi32(3);
    const __m256i one   = _mm256_set1_epi32(1);
    uint32_t qs;
    uint16_t qh;
    memcpy(&qs, b->qs, sizeof(qs));
    memcpy(&qh, b->qh, sizeof(qh));
    const __m256i q = _mm256_cvtepu8_epi32(_mm_set1_epi32((int) qs));      // qs[l % 4]
    const __m256i h = _mm256_cvtepu8_epi32(_mm_set1_epi16((short) qh));    // qh[l % 2]
    const __m256i shift_lo = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    const __m256i shift_hi = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    for (int r = 0; r < 2; ++r) {
        const __m256i off = _mm256_set1_epi32(4*r);
        const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_add_epi32(shift_lo, off)), three);
        const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_add_epi32(shift_hi, off)), one);
        _mm256_storeu_ps(out + 8*r, _mm256_permutevar8x32_ps(lut, _mm256_or_si256(lo, _mm256_slli_epi32(hi, 2))));
    }
    return turboq_block_norm(vb);
}

TURBOQ4_DECODE(turboq4_g16, turboq4_g16, QK_TURBOQ_G16, turboq4_g16_centroids)
TURBOQ8_DECODE(turboq8_g16, turboq8_g16, QK_TURBOQ_G16)

static inline float turboq_dot(const float * GGML_RESTRICT a, const float * GGML_RESTRICT b, int n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i +  0), _mm256_loadu_ps(b + i +  0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i +  8), _mm256_loadu_ps(b + i +  8), acc1);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
    }
    if (i < n) { // the 16 values of a _g16 block
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 0), _mm256_loadu_ps(b + i + 0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    const __m256 acc = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline void turboq_mad(float * GGML_RESTRICT acc, const float * GGML_RESTRICT x, float w, int n) {
    const __m256 vw = _mm256_set1_ps(w);
    for (int i = 0; i < n; i += 8) {
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(_mm256_loadu_ps(x + i), vw, _mm256_loadu_ps(acc + i)));
    }
}

// The trellis types (ggml-turboq-trellis.h): value t's state is the 6 code bits that end at bit
// k(t+1) of the stream, so 8 values at t0 (k*t0 a multiple of 8) read one 32-bit window, the stream
// bits [k*t0 - 8, k*t0 + 24), each lane shifting it by its own amount; the 64-entry table is eight
// registers of 8 (AVX2: eight permutes, then blends by state bits 3, 4 and 5) or four of 16
// (AVX-512: two two-register permutes, one blend). bench/trellis_viterbi.c measured these shapes:
// 37 and 16 ns a group with a dot product, against 15 for turboq3's decoder.
#define TURBOQ_ARCH_TRELLIS_DECODE 1

// The window of values t0..t0+7, zero before the stream. Its loads stay within the block: the
// fp16 norm precedes the codes, and turboq2t's window (three bytes) is read from a byte earlier.
static inline uint32_t turboq_trellis_window(const int k, const uint8_t * qs, const int t0) {
    uint32_t w;
    memcpy(&w, qs + k*t0/8 - (k == 3 ? 1 : 2), sizeof(w));
#if defined(_MSC_VER)
    w = _byteswap_ulong(w);
#else
    w = __builtin_bswap32(w);
#endif
    w = k == 3 ? w : w << 8;
    return t0 ? w : w & 0x00FFFFFFu;
}

static inline void turboq_trellis_decode(const int k, const uint8_t * qs, const float * cb, float * GGML_RESTRICT out) {
#if defined(__AVX512F__)
    const __m512i l8 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i sh = _mm512_sub_epi32(_mm512_set1_epi32(24 - k), _mm512_mullo_epi32(l8, _mm512_set1_epi32(k)));
    const __m512i mask = _mm512_set1_epi32(TURBOQ_TRELLIS_STATES - 1);
    __m512 c[4];
    for (int i = 0; i < 4; ++i) c[i] = _mm512_loadu_ps(cb + 16*i);
    for (int t0 = 0; t0 < TURBOQ_GROUP; t0 += 16) {
        const __m512i w = _mm512_mask_mov_epi32(_mm512_set1_epi32((int) turboq_trellis_window(k, qs, t0)), 0xff00,
                                                _mm512_set1_epi32((int) turboq_trellis_window(k, qs, t0 + 8)));
        const __m512i st = _mm512_and_si512(_mm512_srlv_epi32(w, sh), mask);
        const __m512 lo = _mm512_permutex2var_ps(c[0], st, c[1]);
        const __m512 hi = _mm512_permutex2var_ps(c[2], st, c[3]);
        _mm512_storeu_ps(out + t0, _mm512_mask_mov_ps(lo, _mm512_test_epi32_mask(st, _mm512_set1_epi32(32)), hi));
    }
#else
    const __m256i sh = _mm256_sub_epi32(_mm256_set1_epi32(24 - k),
                                        _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(k)));
    const __m256i mask = _mm256_set1_epi32(TURBOQ_TRELLIS_STATES - 1);
    __m256 c[8];
    for (int i = 0; i < 8; ++i) c[i] = _mm256_loadu_ps(cb + 8*i);
    for (int t0 = 0; t0 < TURBOQ_GROUP; t0 += 8) {
        const __m256i st = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int) turboq_trellis_window(k, qs, t0)), sh), mask);
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_permutevar8x32_ps(c[i], st);
        // blendv reads the sign bit: bits 3, 4 and 5 of the state moved there
        const __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(st, 28));
        const __m256 b4 = _mm256_castsi256_ps(_mm256_slli_epi32(st, 27));
        const __m256 b5 = _mm256_castsi256_ps(_mm256_slli_epi32(st, 26));
        for (int i = 0; i < 4; ++i) r[i] = _mm256_blendv_ps(r[2*i], r[2*i + 1], b3);
        for (int i = 0; i < 2; ++i) r[i] = _mm256_blendv_ps(r[2*i], r[2*i + 1], b4);
        _mm256_storeu_ps(out + t0, _mm256_blendv_ps(r[0], r[1], b5));
    }
#endif
}

#if defined(__AVX512F__)
#define TURBOQ_ARCH_DECODE_ROW 1
// 16 lanes, and the block norm folded into the table: one permute per 16 values
static inline __m512i turboq_bytes16(const uint8_t * p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) p));
}

// The tables are repeated to 16 entries, so that permutexvar (which reads the low 4 bits of each
// index) ignores the bits above an index; that saves the masking of the shifted bytes.
static inline void turboq2_decode_row(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t n) {
    const block_turboq2_0 * x = (const block_turboq2_0 *) vx;
    const __m512 lut4 = _mm512_broadcast_f32x4(_mm_loadu_ps(turboq2_centroids));
    for (int64_t ib = 0; ib < n / TURBOQ_GROUP; ++ib, y += TURBOQ_GROUP) {
        const __m512 lut = _mm512_mul_ps(lut4, _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(x[ib].norm)));
        const __m512i q[2] = { turboq_bytes16(x[ib].qs), turboq_bytes16(x[ib].qs + 16) };
        // value 16m + i: qs[16(m%2) + i] >> 2(m/2)
        for (int m = 0; m < 8; ++m) {
            _mm512_storeu_ps(y + 16*m, _mm512_permutexvar_ps(_mm512_srli_epi32(q[m & 1], 2*(m/2)), lut));
        }
    }
}

static inline void turboq3_decode_row(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t n) {
    const block_turboq3_0 * x = (const block_turboq3_0 *) vx;
    const __m512  lut8  = _mm512_zextps256_ps512(_mm256_loadu_ps(turboq3_centroids));
    const __m512  lut16 = _mm512_shuffle_f32x4(lut8, lut8, 0x44);
    const __m512i low2  = _mm512_set1_epi32(3);
    for (int64_t ib = 0; ib < n / TURBOQ_GROUP; ++ib, y += TURBOQ_GROUP) {
        const __m512 lut = _mm512_mul_ps(lut16, _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(x[ib].norm)));
        const __m512i q[2] = { turboq_bytes16(x[ib].qs), turboq_bytes16(x[ib].qs + 16) };
        const __m512i h = turboq_bytes16(x[ib].qh);
        // value 16m + i: low bits at qs[16(m%2) + i] >> 2(m/2), high bit at qh[i] bit m, moved to
        // bit 2; the select (0xCA: low2 ? lo : hi) takes bits 0-1 from lo and the rest from hi
        for (int m = 0; m < 8; ++m) {
            const __m512i lo = _mm512_srli_epi32(q[m & 1], 2*(m/2));
            const __m512i hi = m >= 2 ? _mm512_srli_epi32(h, m - 2) : _mm512_slli_epi32(h, 2 - m);
            const __m512i idx = _mm512_ternarylogic_epi32(low2, lo, hi, 0xCA);
            _mm512_storeu_ps(y + 16*m, _mm512_permutexvar_ps(idx, lut));
        }
    }
}

static inline void turboq2_g64_decode_row(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t n) {
    const block_turboq2_g64 * x = (const block_turboq2_g64 *) vx;
    const __m512 lut4 = _mm512_broadcast_f32x4(_mm_loadu_ps(turboq2_g64_centroids));
    for (int64_t ib = 0; ib < n / QK_TURBOQ_G64; ++ib, y += QK_TURBOQ_G64) {
        const __m512 lut = _mm512_mul_ps(lut4, _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(x[ib].norm)));
        const __m512i q = turboq_bytes16(x[ib].qs);
        // value 16m + i: qs[i] >> 2m
        for (int m = 0; m < 4; ++m) {
            _mm512_storeu_ps(y + 16*m, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 2*m), lut));
        }
    }
}

static inline void turboq3_g64_decode_row(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t n) {
    const block_turboq3_g64 * x = (const block_turboq3_g64 *) vx;
    const __m512  lut8  = _mm512_zextps256_ps512(_mm256_loadu_ps(turboq3_g64_centroids));
    const __m512  lut16 = _mm512_shuffle_f32x4(lut8, lut8, 0x44);
    const __m512i low2  = _mm512_set1_epi32(3);
    // lane i reads qh[i % 8] shifted right by i / 8, so that value 16m + i's high bit is bit 2m
    const __m512i hshift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int64_t ib = 0; ib < n / QK_TURBOQ_G64; ++ib, y += QK_TURBOQ_G64) {
        const __m512 lut = _mm512_mul_ps(lut16, _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(x[ib].norm)));
        const __m512i q = turboq_bytes16(x[ib].qs);
        const __m128i h8 = _mm_loadl_epi64((const __m128i *) x[ib].qh);
        const __m512i h = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(h8, h8)), hshift);
        for (int m = 0; m < 4; ++m) {
            const __m512i lo = _mm512_srli_epi32(q, 2*m);
            const __m512i hi = m >= 1 ? _mm512_srli_epi32(h, 2*m - 2) : _mm512_slli_epi32(h, 2);
            const __m512i idx = _mm512_ternarylogic_epi32(low2, lo, hi, 0xCA);
            _mm512_storeu_ps(y + 16*m, _mm512_permutexvar_ps(idx, lut));
        }
    }
}

// value 16m + i (32 values, two registers): lane i reads byte i % 8 of qs shifted right by
// 2(i / 8) + 4m, so that its low index bits land in bits 0-1 (turboq3: and qh[i % 4] shifted right
// by i / 4, its high bit at bit 4m, moved to bit 2 below)
static inline __m512i turboq_bytes8x2(const uint8_t * p) {
    const __m128i b8 = _mm_loadl_epi64((const __m128i *) p);
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(b8, b8));
}

static inline void turboq2_g32_decode_row(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t n) {
    const block_turboq2_g32 * x = (const block_turboq2_g32 *) vx;
    const __m512 lut4 = _mm512_broadcast_f32x4(_mm_loadu_ps(turboq2_g32_centroids));
    const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    for (int64_t ib = 0; ib < n / QK_TURBOQ_G32; ++ib, y += QK_TURBOQ_G32) {
        const __m512 lut = _mm512_mul_ps(lut4, _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(x[ib].norm)));
        const __m512i q = _mm512_srlv_epi32(turboq_bytes8x2(x[ib].qs), shift);
        _mm512_storeu_ps(y,      _mm512_permutexvar_ps(q, lut));
        _mm512_storeu_ps(y + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut));
    }
}

static inline void turboq3_g32_decode_row(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t n) {
    const block_turboq3_g32 * x = (const block_turboq3_g32 *) vx;
    const __m512  lut8  = _mm512_zextps256_ps512(_mm256_loadu_ps(turboq3_g32_centroids));
    const __m512  lut16 = _mm512_shuffle_f32x4(lut8, lut8, 0x44);
    const __m512i low2  = _mm512_set1_epi32(3);
    const __m512i shift  = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i hshift = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int64_t ib = 0; ib < n / QK_TURBOQ_G32; ++ib, y += QK_TURBOQ_G32) {
        const __m512 lut = _mm512_mul_ps(lut16, _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(x[ib].norm)));
        const __m512i q = _mm512_srlv_epi32(turboq_bytes8x2(x[ib].qs), shift);
        uint32_t qh;
        memcpy(&qh, x[ib].qh, sizeof(qh));
        const __m512i h = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_set1_epi32((int) qh)), hshift);
        // the select (0xCA: low2 ? lo : hi) takes bits 0-1 from lo and the rest from hi, whose bit 2
        // is the high bit (bit 4m of h); permutexvar reads bits 0-3, and bit 3 meets lut16's copy
        _mm512_storeu_ps(y,      _mm512_permutexvar_ps(_mm512_ternarylogic_epi32(low2, q, _mm512_slli_epi32(h, 2), 0xCA), lut));
        _mm512_storeu_ps(y + 16, _mm512_permutexvar_ps(_mm512_ternarylogic_epi32(low2, _mm512_srli_epi32(q, 4), _mm512_srli_epi32(h, 2), 0xCA), lut));
    }
}

#define TURBOQ4_DECODE_ROW(NAME, TYPE, G, TABLE)                                                                \
    static inline void NAME##_decode_row(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t n) {  \
        const block_##TYPE * x = (const block_##TYPE *) vx;                                                     \
        for (int64_t ib = 0; ib < n / (G); ++ib, y += (G)) {                                                    \
            const __m512 lut = _mm512_mul_ps(_mm512_loadu_ps(TABLE), _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(x[ib].norm))); \
            for (int m = 0; m < (G)/32; ++m) {                                                                  \
                const __m512i q = turboq_bytes16(x[ib].qs + 16*m);                                              \
                _mm512_storeu_ps(y + 16*m,         _mm512_permutexvar_ps(q, lut)); /* reads bits 0-3 only */    \
                _mm512_storeu_ps(y + 16*m + (G)/2, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut));       \
            }                                                                                                   \
        }                                                                                                       \
    }

// norm * (q/127.5 - 1)
#define TURBOQ8_DECODE_ROW(NAME, TYPE, G)                                                                       \
    static inline void NAME##_decode_row(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t n) {  \
        const block_##TYPE * x = (const block_##TYPE *) vx;                                                     \
        for (int64_t ib = 0; ib < n / (G); ++ib, y += (G)) {                                                    \
            const float norm = GGML_CPU_FP16_TO_FP32(x[ib].norm);                                              \
            const __m512 step = _mm512_set1_ps(norm/127.5f);                                                    \
            const __m512 off  = _mm512_set1_ps(norm);                                                           \
            for (int m = 0; m < (G)/16; ++m) {                                                                  \
                const __m512 q = _mm512_cvtepi32_ps(turboq_bytes16(x[ib].qs + 16*m));                           \
                _mm512_storeu_ps(y + 16*m, _mm512_fmsub_ps(q, step, off));                                      \
            }                                                                                                   \
        }                                                                                                       \
    }

TURBOQ4_DECODE_ROW(turboq4, turboq4_0, TURBOQ_GROUP, turboq4_centroids)
TURBOQ8_DECODE_ROW(turboq8, turboq8_0, TURBOQ_GROUP)
TURBOQ4_DECODE_ROW(turboq4_g64, turboq4_g64, QK_TURBOQ_G64, turboq4_g64_centroids)
TURBOQ8_DECODE_ROW(turboq8_g64, turboq8_g64, QK_TURBOQ_G64)
TURBOQ4_DECODE_ROW(turboq4_g32, turboq4_g32, QK_TURBOQ_G32, turboq4_g32_centroids)
TURBOQ8_DECODE_ROW(turboq8_g32, turboq8_g32, QK_TURBOQ_G32)
#endif // __AVX512F__
