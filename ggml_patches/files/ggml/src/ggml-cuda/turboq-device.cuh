// CUDA kernels for the TurboQuant KV-cache types (pyturbo): turboq2_0/3_0/4_0/8_0.
// Reference codec: ggml/src/ggml-turboq.c and ggml-turboq-encode.h. One warp handles one 128-value group: lane l holds
// values l + 32*k (k = 0..3), so the Walsh-Hadamard butterflies h = 1..16 are warp shuffles and
// h = 32, 64 are register-local. Every float operation of the encoder follows the C reference in
// the same order with explicitly rounded intrinsics (the CUDA build uses -use_fast_math).
#pragma once

#include "common.cuh"
#include "turboq.cuh"

#ifndef TURBOQ_TABLE
#define TURBOQ_TABLE static __constant__ const
#endif
#include "../ggml-turboq-tables.h"

static_assert(QK_TURBOQ == TURBOQ_GROUP, "turboq block and rotation group must match");

// ---- device helpers ----

static constexpr __host__ __device__ bool tq_is_turboq(const ggml_type type) {
    return type == GGML_TYPE_TURBOQ2_0 || type == GGML_TYPE_TURBOQ3_0 || type == GGML_TYPE_TURBOQ4_0 || type == GGML_TYPE_TURBOQ8_0;
}

template <ggml_type type> struct tq_traits;
template <> struct tq_traits<GGML_TYPE_TURBOQ2_0> { typedef block_turboq2_0 block; static constexpr int n_levels =   4; };
template <> struct tq_traits<GGML_TYPE_TURBOQ3_0> { typedef block_turboq3_0 block; static constexpr int n_levels =   8; };
template <> struct tq_traits<GGML_TYPE_TURBOQ4_0> { typedef block_turboq4_0 block; static constexpr int n_levels =  16; };
template <> struct tq_traits<GGML_TYPE_TURBOQ8_0> { typedef block_turboq8_0 block; static constexpr int n_levels = 256; };

template <ggml_type type>
static __device__ __forceinline__ const float * tq_centroids() {
    if constexpr (type == GGML_TYPE_TURBOQ2_0) {
        return turboq2_centroids;
    } else if constexpr (type == GGML_TYPE_TURBOQ3_0) {
        return turboq3_centroids;
    } else if constexpr (type == GGML_TYPE_TURBOQ4_0) {
        return turboq4_centroids;
    } else {
        return turboq8_centroids;
    }
}

// The sign vectors and the level table, staged in shared memory: lanes read different entries,
// which __constant__ memory would serialize.
template <ggml_type type>
struct tq_smem_tables {
    float sign1[TURBOQ_GROUP];
    float sign2[TURBOQ_GROUP];
    float lut[tq_traits<type>::n_levels];
};

template <ggml_type type>
static __device__ __forceinline__ void tq_load_tables(tq_smem_tables<type> & t, const int tid, const int nthreads) {
    const float * c = tq_centroids<type>();
    for (int i = tid; i < TURBOQ_GROUP; i += nthreads) {
        t.sign1[i] = turboq_sign1[i];
        t.sign2[i] = turboq_sign2[i];
    }
    for (int i = tid; i < tq_traits<type>::n_levels; i += nthreads) {
        t.lut[i] = c[i];
    }
}

// Unnormalised Sylvester Walsh-Hadamard transform of one group, butterflies h = 1..64 in the
// order of turboq_generic_fwht() in ggml-turboq-encode.h (x[j] = a + b, x[j + h] = a - b), bit for bit.
static __device__ __forceinline__ void tq_fwht128(float (&x)[4], const int lane) {
#pragma unroll
    for (int h = 1; h < 32; h <<= 1) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float o = __shfl_xor_sync(0xFFFFFFFF, x[k], h, 32);
            x[k] = (lane & h) ? __fsub_rn(o, x[k]) : __fadd_rn(x[k], o);
        }
    }
    float a, b;
    // h = 32: (l, l + 32) and (l + 64, l + 96)
    a = x[0]; b = x[1]; x[0] = __fadd_rn(a, b); x[1] = __fsub_rn(a, b);
    a = x[2]; b = x[3]; x[2] = __fadd_rn(a, b); x[3] = __fsub_rn(a, b);
    // h = 64: (l, l + 64) and (l + 32, l + 96)
    a = x[0]; b = x[2]; x[0] = __fadd_rn(a, b); x[2] = __fsub_rn(a, b);
    a = x[1]; b = x[3]; x[1] = __fadd_rn(a, b); x[3] = __fsub_rn(a, b);
}

// turboq_generic_tree_sum() of t: the fixed halving tree h = 64..1, result broadcast to all lanes.
static __device__ __forceinline__ float tq_tree_sum(const float (&t)[4]) {
    const float s0 = __fadd_rn(t[0], t[2]); // h = 64: value l + value l+64
    const float s1 = __fadd_rn(t[1], t[3]); //         value l+32 + value l+96
    float s = __fadd_rn(s0, s1);            // h = 32
#pragma unroll
    for (int h = 16; h > 0; h >>= 1) {
        s = __fadd_rn(s, __shfl_down_sync(0xFFFFFFFF, s, h, 32));
    }
    return __shfl_sync(0xFFFFFFFF, s, 0, 32);
}

// y = D2.H.D1.x/sqrt(128) (turboq_rotate_group_with)
static __device__ __forceinline__ void tq_rotate(float (&x)[4], const int lane, const float * sign1, const float * sign2) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        x[k] = __fmul_rn(x[k], sign1[32*k + lane]);
    }
    tq_fwht128(x, lane);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        x[k] = __fmul_rn(__fmul_rn(x[k], TURBOQ_INV_SQRT_GROUP), sign2[32*k + lane]);
    }
}

// x = D1.H.D2.y/sqrt(128) * scale (turboq_unrotate_group_scaled)
static __device__ __forceinline__ void tq_unrotate_scaled(float (&x)[4], const float scale, const int lane, const float * sign1, const float * sign2) {
    const float k_s = __fmul_rn(scale, TURBOQ_INV_SQRT_GROUP);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        x[k] = __fmul_rn(x[k], sign2[32*k + lane]);
    }
    tq_fwht128(x, lane);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        x[k] = __fmul_rn(__fmul_rn(x[k], k_s), sign1[32*k + lane]);
    }
}

// Level indices of values lane + 32*k of one block.
template <ggml_type type>
static __device__ __forceinline__ void tq_unpack(const char * __restrict__ blk, const int lane, int (&idx)[4]) {
    if constexpr (type == GGML_TYPE_TURBOQ2_0) {
        const block_turboq2_0 * b = (const block_turboq2_0 *) blk;
        const int q = b->qs[lane];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            idx[k] = (q >> (2*k)) & 3;
        }
    } else if constexpr (type == GGML_TYPE_TURBOQ3_0) {
        const block_turboq3_0 * b = (const block_turboq3_0 *) blk;
        const int q = b->qs[lane];
        // value lane + 32k: high bit in qh[lane % 16], bit 2k + lane/16
        const int h = b->qh[lane & 15] >> (lane >> 4);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            idx[k] = ((q >> (2*k)) & 3) | (((h >> (2*k)) & 1) << 2);
        }
    } else if constexpr (type == GGML_TYPE_TURBOQ4_0) {
        const block_turboq4_0 * b = (const block_turboq4_0 *) blk;
        const int q0 = b->qs[lane];      // values lane (low) and lane + 64 (high)
        const int q1 = b->qs[lane + 32]; // values lane + 32 (low) and lane + 96 (high)
        idx[0] = q0 & 15;
        idx[1] = q1 & 15;
        idx[2] = q0 >> 4;
        idx[3] = q1 >> 4;
    } else {
        static_assert(type == GGML_TYPE_TURBOQ8_0, "not a turboq type");
        const block_turboq8_0 * b = (const block_turboq8_0 *) blk;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            idx[k] = b->qs[32*k + lane];
        }
    }
}

// Rotated-domain decode of one block: c[k] = level of value lane + 32*k; returns the norm.
template <ggml_type type>
static __device__ __forceinline__ float tq_decode_rotated(const char * __restrict__ blk, const int lane, const float * lut, float (&c)[4]) {
    int idx[4];
    tq_unpack<type>(blk, lane, idx);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        c[k] = lut[idx[k]];
    }
    return __half2float(*(const half *) blk);
}

// Encode one group (turboq_encode_group_with + pack). x[k] = value lane + 32*k. Warp-collective.
template <ggml_type type>
static __device__ __forceinline__ void tq_encode_group(const float (&x)[4], char * __restrict__ blk, const int lane, const tq_smem_tables<type> & t) {
    typedef typename tq_traits<type>::block block_t;

    bool finite = true;
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        finite = finite && isfinite(x[k]);
        amax = fmaxf(amax, fabsf(x[k]));
    }
    finite = __all_sync(0xFFFFFFFF, finite);
    amax = warp_reduce_max<32>(amax);

    if (!finite || amax == 0.0f) {
        for (int i = lane; i < (int) sizeof(block_t); i += 32) {
            blk[i] = 0;
        }
        return;
    }

    float v[4];
    float sq[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[k]  = __fdiv_rn(x[k], amax);
        sq[k] = __fmul_rn(v[k], v[k]);
    }
    const float r = __fsqrt_rn(tq_tree_sum(sq));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[k] = __fdiv_rn(v[k], r);
    }

    tq_rotate(v, lane, t.sign1, t.sign2);

    int idx[4];
    if constexpr (type == GGML_TYPE_TURBOQ8_0) {
        float ya = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            ya = fmaxf(ya, fabsf(v[k]));
        }
        ya = warp_reduce_max<32>(ya);
        const float s = __fdiv_rn(127.5f, ya);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float q = floorf(__fadd_rn(__fmul_rn(v[k], s), 128.0f));
            idx[k] = q < 0.0f ? 0 : q > 255.0f ? 255 : (int) q;
        }
    } else {
        const float * thr = type == GGML_TYPE_TURBOQ2_0 ? turboq2_thresholds :
                            type == GGML_TYPE_TURBOQ3_0 ? turboq3_thresholds : turboq4_thresholds;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            int q = 0;
#pragma unroll
            for (int i = 0; i < tq_traits<type>::n_levels - 1; ++i) {
                q += thr[i] < v[k];
            }
            idx[k] = q;
        }
    }

#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float c = t.lut[idx[k]];
        sq[k] = __fmul_rn(c, c);
    }
    const float cn   = __fsqrt_rn(tq_tree_sum(sq));
    const float norm = fminf(__fdiv_rn(__fmul_rn(amax, r), cn), 65504.0f);

    block_t * b = (block_t *) blk;
    if (lane == 0) {
        b->norm = __float2half_rn(norm);
    }
    if constexpr (type == GGML_TYPE_TURBOQ2_0 || type == GGML_TYPE_TURBOQ3_0) {
        b->qs[lane] = (uint8_t) ((idx[0] & 3) | (idx[1] & 3) << 2 | (idx[2] & 3) << 4 | (idx[3] & 3) << 6);
    }
    if constexpr (type == GGML_TYPE_TURBOQ3_0) {
        // qh[i] bit k = bit 2 of value i + 16k; lane l < 16 owns the even bits, lane l + 16 the odd ones
        int h = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            h |= ((idx[k] >> 2) & 1) << (2*k + (lane >> 4));
        }
        h |= __shfl_down_sync(0xFFFFFFFF, h, 16, 32);
        if (lane < 16) {
            b->qh[lane] = (uint8_t) h;
        }
    }
    if constexpr (type == GGML_TYPE_TURBOQ4_0) {
        if (lane == 0) {
            b->rnorm = __float2half_rn(0.0f);
        }
        b->qs[lane]      = (uint8_t) ((idx[0] & 15) | (idx[2] & 15) << 4);
        b->qs[lane + 32] = (uint8_t) ((idx[1] & 15) | (idx[3] & 15) << 4);
    }
    if constexpr (type == GGML_TYPE_TURBOQ8_0) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            b->qs[32*k + lane] = (uint8_t) idx[k];
        }
    }
}
