// CUDA kernels for the TurboQuant KV-cache types (pyturbo): turboq2/3/4/8 on 128-value groups
// (turboq2_0..turboq8_0), their twins on 64-, 32- and 16-value groups (_g64, _g32, _g16), and the
// trellis types turboq3t and turboq2t (128-value groups, a 64-state code stream).
// Reference codec: ggml/src/ggml-turboq.c and ggml-turboq-encode.h. One warp handles one group of
// G values: lane l holds values l + 32*k (k < G/32), so the Walsh-Hadamard butterflies h = 1..16
// are warp shuffles and h = 32, 64 are register-local. A 16-value group takes lanes 0..15 (the
// butterflies and sums stop at h = 8); lanes 16..31 hold zeros and write nothing. Every float
// operation of the encoder follows the C reference in the same order with explicitly rounded
// intrinsics (the CUDA build uses -use_fast_math).
//
// This header holds device code only, so that tests/cuda_emulation.cpp can compile it for the
// host with TURBOQ_CUDA_EMULATION (a warp of 32 threads, shuffles through a barrier) and check it
// bit for bit against the C codec where no GPU is at hand.
#pragma once

#ifndef TURBOQ_CUDA_EMULATION
#include "common.cuh"
#include "convert.cuh"
#include "turboq.cuh"
#endif

#ifndef TURBOQ_TABLE
#define TURBOQ_TABLE static __constant__ const
#endif
#include "../ggml-turboq-tables.h"

static_assert(QK_TURBOQ == TURBOQ_GROUP, "turboq block and rotation group must match");

// ---- device helpers ----

// the 128-value types
static constexpr __host__ __device__ bool tq_is_turboq(const ggml_type type) {
    return type == GGML_TYPE_TURBOQ2_0 || type == GGML_TYPE_TURBOQ3_0 || type == GGML_TYPE_TURBOQ4_0 || type == GGML_TYPE_TURBOQ8_0;
}

// the trellis types: a value's codebook entry is its state, the last TURBOQ_TRELLIS_L code-stream bits
static constexpr __host__ __device__ bool tq_is_trellis(const ggml_type type) {
    return type == GGML_TYPE_TURBOQ3_T || type == GGML_TYPE_TURBOQ2_T;
}

// values per rotation group of a turboq type (128, 64, 32 or 16), 0 for any other type
static constexpr __host__ __device__ int tq_group(const ggml_type type) {
    return tq_is_turboq(type) || tq_is_trellis(type) ? 128 :
        type == GGML_TYPE_TURBOQ2_G64 || type == GGML_TYPE_TURBOQ3_G64 || type == GGML_TYPE_TURBOQ4_G64 || type == GGML_TYPE_TURBOQ8_G64 ? 64 :
        type == GGML_TYPE_TURBOQ2_G32 || type == GGML_TYPE_TURBOQ3_G32 || type == GGML_TYPE_TURBOQ4_G32 || type == GGML_TYPE_TURBOQ8_G32 ? 32 :
        type == GGML_TYPE_TURBOQ2_G16 || type == GGML_TYPE_TURBOQ3_G16 || type == GGML_TYPE_TURBOQ4_G16 || type == GGML_TYPE_TURBOQ8_G16 ? 16 : 0;
}

// block: the layout; G: values per group; bits: index width (8: turboq8's grid; a trellis type's
// code bits); n_levels: the level table's size (a trellis type's: one entry per state)
template <ggml_type type> struct tq_traits;
#define TQ_TRAITS(TYPE, BLOCK, G_, BITS)                                                     \
    template <> struct tq_traits<TYPE> {                                                     \
        typedef BLOCK block;                                                                 \
        static constexpr int G        = G_;                                                  \
        static constexpr int bits     = BITS;                                                \
        static constexpr bool trellis = tq_is_trellis(TYPE);                                 \
        static constexpr int n_levels = trellis ? 1 << TURBOQ_TRELLIS_L : 1 << BITS;         \
    };                                                                                       \
    static_assert(sizeof(BLOCK) == 2 + (BITS)*(G_)/8 + ((TYPE) == GGML_TYPE_TURBOQ4_0 ? 2 : 0), "unexpected " #BLOCK " size"); \
    static_assert(tq_group(TYPE) == (G_), "tq_group and tq_traits disagree");
TQ_TRAITS(GGML_TYPE_TURBOQ2_0,   block_turboq2_0,   128, 2)
TQ_TRAITS(GGML_TYPE_TURBOQ3_0,   block_turboq3_0,   128, 3)
TQ_TRAITS(GGML_TYPE_TURBOQ4_0,   block_turboq4_0,   128, 4)
TQ_TRAITS(GGML_TYPE_TURBOQ8_0,   block_turboq8_0,   128, 8)
TQ_TRAITS(GGML_TYPE_TURBOQ2_G64, block_turboq2_g64,  64, 2)
TQ_TRAITS(GGML_TYPE_TURBOQ3_G64, block_turboq3_g64,  64, 3)
TQ_TRAITS(GGML_TYPE_TURBOQ4_G64, block_turboq4_g64,  64, 4)
TQ_TRAITS(GGML_TYPE_TURBOQ8_G64, block_turboq8_g64,  64, 8)
TQ_TRAITS(GGML_TYPE_TURBOQ2_G32, block_turboq2_g32,  32, 2)
TQ_TRAITS(GGML_TYPE_TURBOQ3_G32, block_turboq3_g32,  32, 3)
TQ_TRAITS(GGML_TYPE_TURBOQ4_G32, block_turboq4_g32,  32, 4)
TQ_TRAITS(GGML_TYPE_TURBOQ8_G32, block_turboq8_g32,  32, 8)
TQ_TRAITS(GGML_TYPE_TURBOQ2_G16, block_turboq2_g16,  16, 2)
TQ_TRAITS(GGML_TYPE_TURBOQ3_G16, block_turboq3_g16,  16, 3)
TQ_TRAITS(GGML_TYPE_TURBOQ4_G16, block_turboq4_g16,  16, 4)
TQ_TRAITS(GGML_TYPE_TURBOQ8_G16, block_turboq8_g16,  16, 8)
TQ_TRAITS(GGML_TYPE_TURBOQ3_T,   block_turboq3_t,   128, 3)
TQ_TRAITS(GGML_TYPE_TURBOQ2_T,   block_turboq2_t,   128, 2)
#undef TQ_TRAITS

// values per lane of one group (a 16-value group: one, on half the lanes)
template <ggml_type type>
static constexpr __host__ __device__ int tq_nv() {
    return tq_traits<type>::G >= 32 ? tq_traits<type>::G / 32 : 1;
}

// whether this lane holds values of a G-value group (all lanes but 16..31 of a 16-value group)
template <int G>
static __device__ __forceinline__ bool tq_lane_holds(const int lane) {
    return G >= 32 || lane < G;
}

template <ggml_type type>
static __device__ __forceinline__ const float * tq_centroids() {
    constexpr int G = tq_traits<type>::G;
    if constexpr (tq_traits<type>::trellis) {
        return type == GGML_TYPE_TURBOQ3_T ? turboq3t_codebook : turboq2t_codebook;
    }
    switch (tq_traits<type>::bits) {
        case 2:  return G == 128 ? turboq2_centroids : G == 64 ? turboq2_g64_centroids : G == 32 ? turboq2_g32_centroids : turboq2_g16_centroids;
        case 3:  return G == 128 ? turboq3_centroids : G == 64 ? turboq3_g64_centroids : G == 32 ? turboq3_g32_centroids : turboq3_g16_centroids;
        case 4:  return G == 128 ? turboq4_centroids : G == 64 ? turboq4_g64_centroids : G == 32 ? turboq4_g32_centroids : turboq4_g16_centroids;
        default: return turboq8_centroids; // one grid for every group size
    }
}

template <ggml_type type>
static __device__ __forceinline__ const float * tq_thresholds() {
    constexpr int G = tq_traits<type>::G;
    switch (tq_traits<type>::bits) {
        case 2:  return G == 128 ? turboq2_thresholds : G == 64 ? turboq2_g64_thresholds : G == 32 ? turboq2_g32_thresholds : turboq2_g16_thresholds;
        case 3:  return G == 128 ? turboq3_thresholds : G == 64 ? turboq3_g64_thresholds : G == 32 ? turboq3_g32_thresholds : turboq3_g16_thresholds;
        default: return G == 128 ? turboq4_thresholds : G == 64 ? turboq4_g64_thresholds : G == 32 ? turboq4_g32_thresholds : turboq4_g16_thresholds;
    }
}

static constexpr __host__ __device__ float tq_inv_sqrt_group(const int G) {
    return G == 128 ? TURBOQ_INV_SQRT_GROUP : G == 64 ? TURBOQ_G64_INV_SQRT_GROUP : G == 32 ? TURBOQ_G32_INV_SQRT_GROUP
         : TURBOQ_G16_INV_SQRT_GROUP;
}

// The sign vectors and the level table, staged in shared memory: lanes read different entries,
// which __constant__ memory would serialize. A group of G values uses the first G signs.
template <ggml_type type>
struct tq_smem_tables {
    float sign1[tq_traits<type>::G];
    float sign2[tq_traits<type>::G];
    float lut[tq_traits<type>::n_levels];
};

template <ggml_type type>
static __device__ __forceinline__ void tq_load_tables(tq_smem_tables<type> & t, const int tid, const int nthreads) {
    const float * c = tq_centroids<type>();
    for (int i = tid; i < tq_traits<type>::G; i += nthreads) {
        t.sign1[i] = turboq_sign1[i];
        t.sign2[i] = turboq_sign2[i];
    }
    for (int i = tid; i < tq_traits<type>::n_levels; i += nthreads) {
        t.lut[i] = c[i];
    }
}

// Unnormalised Sylvester Walsh-Hadamard transform of one group of G values (32*NV, or 16 on lanes
// 0..15), butterflies h = 1..G/2 in the order of turboq_generic_fwht_n() in ggml-turboq-encode.h
// (x[j] = a + b, x[j + h] = a - b), bit for bit.
template <int NV, int G = 32*NV>
static __device__ __forceinline__ void tq_fwht(float (&x)[NV], const int lane) {
#pragma unroll
    for (int h = 1; h < (G < 32 ? G : 32); h <<= 1) {
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const float o = __shfl_xor_sync(0xFFFFFFFF, x[k], h, 32);
            x[k] = (lane & h) ? __fsub_rn(o, x[k]) : __fadd_rn(x[k], o);
        }
    }
    // h = 32, 64: (value l + 32k, value l + 32(k + h/32)) within one lane
#pragma unroll
    for (int step = 1; step < NV; step <<= 1) {
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            if (!(k & step)) {
                const float a = x[k];
                const float b = x[k + step];
                x[k]        = __fadd_rn(a, b);
                x[k + step] = __fsub_rn(a, b);
            }
        }
    }
}

// turboq_generic_tree_sum_n() of t: the fixed halving tree h = G/2..1, result broadcast to all lanes.
template <int NV, int G = 32*NV>
static __device__ __forceinline__ float tq_tree_sum(float (&t)[NV]) {
    // h = 64, 32: within one lane
#pragma unroll
    for (int step = NV/2; step > 0; step >>= 1) {
#pragma unroll
        for (int k = 0; k < step; ++k) {
            t[k] = __fadd_rn(t[k], t[k + step]);
        }
    }
    float s = t[0];
#pragma unroll
    for (int h = (G < 32 ? G/2 : 16); h > 0; h >>= 1) {
        s = __fadd_rn(s, __shfl_down_sync(0xFFFFFFFF, s, h, 32));
    }
    return __shfl_sync(0xFFFFFFFF, s, 0, 32);
}

// sign s[v] of value v = lane + 32*k of a G-value group; 0 on a lane that holds none, which keeps
// its values 0 through a rotation
template <int G>
static __device__ __forceinline__ float tq_sign(const float * s, const int lane, const int k) {
    return tq_lane_holds<G>(lane) ? s[32*k + lane] : 0.0f;
}

// y = D2.H.D1.x/sqrt(G) (turboq_rotate_group_with)
template <int NV, int G = 32*NV>
static __device__ __forceinline__ void tq_rotate(float (&x)[NV], const int lane, const float * sign1, const float * sign2) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        x[k] = __fmul_rn(x[k], tq_sign<G>(sign1, lane, k));
    }
    tq_fwht<NV, G>(x, lane);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        x[k] = __fmul_rn(__fmul_rn(x[k], tq_inv_sqrt_group(G)), tq_sign<G>(sign2, lane, k));
    }
}

// x = D1.H.D2.y/sqrt(G) * scale (turboq_unrotate_group_scaled)
template <int NV, int G = 32*NV>
static __device__ __forceinline__ void tq_unrotate_scaled(float (&x)[NV], const float scale, const int lane, const float * sign1, const float * sign2) {
    const float k_s = __fmul_rn(scale, tq_inv_sqrt_group(G));
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        x[k] = __fmul_rn(x[k], tq_sign<G>(sign2, lane, k));
    }
    tq_fwht<NV, G>(x, lane);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        x[k] = __fmul_rn(__fmul_rn(x[k], k_s), tq_sign<G>(sign1, lane, k));
    }
}

// The index layouts of every group size G (ggml-common.h): value v's field sits in byte
// v % S of its array at position v / S, with S = G/4 (2-bit qs), G/8 (turboq3's qh bits),
// G/2 (4-bit qs) or G (turboq8).

// Level indices of values lane + 32*k of one block.
template <ggml_type type>
static __device__ __forceinline__ void tq_unpack(const char * __restrict__ blk, const int lane, int (&idx)[tq_nv<type>()]) {
    typedef typename tq_traits<type>::block block_t;
    constexpr int G  = tq_traits<type>::G;
    constexpr int NV = tq_nv<type>();
    const block_t * b = (const block_t *) blk;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        // unsigned and masked to the warp, so that % and / by the power-of-two strides fold into
        // masks and constant shifts, and the byte that several k share is one load (e.g. turboq3's
        // qh byte lane % 16 at G = 128)
        const unsigned v = ((unsigned) lane & 31u) + 32u*k;
        if (!tq_lane_holds<G>(lane)) {
            idx[k] = 0; // no value here; its fields would lie past the block
            continue;
        }
        if constexpr (tq_traits<type>::trellis) {
            // the state: the TURBOQ_TRELLIS_L stream bits (most significant first, zeros before the
            // stream) that end with value v's code, at bit e, within the two bytes that end there
            const unsigned e = tq_traits<type>::bits*v + tq_traits<type>::bits - 1;
            const unsigned w = (e >= 8 ? (unsigned) b->qs[(e >> 3) - 1] << 8 : 0u) | b->qs[e >> 3];
            idx[k] = (int) ((w >> (7 - (e & 7))) & ((1u << TURBOQ_TRELLIS_L) - 1));
        } else {
            if constexpr (tq_traits<type>::bits == 2 || tq_traits<type>::bits == 3) {
                idx[k] = (b->qs[v % (G/4)] >> (2*(v / (G/4)))) & 3;
            }
            if constexpr (tq_traits<type>::bits == 3) {
                idx[k] |= ((b->qh[v % (G/8)] >> (v / (G/8))) & 1) << 2;
            }
            if constexpr (tq_traits<type>::bits == 4) {
                idx[k] = (b->qs[v % (G/2)] >> (4*(v / (G/2)))) & 15;
            }
            if constexpr (tq_traits<type>::bits == 8) {
                idx[k] = b->qs[v];
            }
        }
    }
}

// Rotated-domain decode of one block: c[k] = level of value lane + 32*k; returns the norm.
template <ggml_type type>
static __device__ __forceinline__ float tq_decode_rotated(const char * __restrict__ blk, const int lane, const float * lut, float (&c)[tq_nv<type>()]) {
    int idx[tq_nv<type>()];
    tq_unpack<type>(blk, lane, idx);
#pragma unroll
    for (int k = 0; k < tq_nv<type>(); ++k) {
        c[k] = lut[idx[k]];
    }
    return __half2float(*(const half *) blk);
}

// Byte b = lane + 32*r (< n_bytes) of an index array whose byte b holds the fields of values
// b + f*S, f = 0..G/S - 1, `width` bits each. The lane that holds value v is v % 32 and its
// register is v / 32, the same for every lane of one (r, f): S either divides 32 (and b < S) or
// is a multiple of 32. Warp-collective.
template <int NV, int S, int width, int G = 32*NV>
static __device__ __forceinline__ void tq_pack_field(uint8_t * __restrict__ dst, const int (&field)[NV], const int lane) {
    constexpr int n_bytes = S;
    constexpr int n_field = G / S;
#pragma unroll
    for (int r = 0; r < (n_bytes + 31)/32; ++r) {
        int byte = 0;
#pragma unroll
        for (int f = 0; f < n_field; ++f) {
            const int reg = (32*r + f*S) / 32;
            const int src = (lane + f*S) % 32;
            // S a multiple of 32: the value is this lane's own (no shuffle)
            const int val = S % 32 == 0 ? field[reg] : __shfl_sync(0xFFFFFFFF, field[reg], src, 32);
            byte |= (val & ((1 << width) - 1)) << (width*f);
        }
        if (lane + 32*r < n_bytes) {
            dst[lane + 32*r] = (uint8_t) byte;
        }
    }
}

// A warp's shared workspace for encoding one group: a trellis type's Viterbi search (costs, the
// cheapest predecessor of each class, its back-pointers and the path); nothing for the others.
template <ggml_type type, bool trellis = tq_traits<type>::trellis>
struct tq_encode_ws {};

template <ggml_type type>
struct tq_encode_ws<type, true> {
    static constexpr int S  = 1 << TURBOQ_TRELLIS_L;
    static constexpr int lo = S >> tq_traits<type>::bits; // predecessor classes p = m >> bits
    float   cost[S];
    float   best[lo];
    uint8_t back[TURBOQ_GROUP][lo];
    uint8_t states[TURBOQ_GROUP];
};

// The trellis types' search (turboq_trellis_viterbi in ggml-turboq-trellis.h), the same float
// operations in the same order and the first minimum on ties: lanes p < lo pick the cheapest
// predecessor h*lo + p of class p, then each lane extends states lane and lane + 32. lane 0 traces
// the path back; idx[k] = the state of value lane + 32*k. Warp-collective.
template <ggml_type type>
static __device__ __forceinline__ void tq_trellis_search(const float (&y)[tq_nv<type>()], const int lane, const float * lut,
                                                         tq_encode_ws<type> & ws, int (&idx)[tq_nv<type>()]) {
    typedef tq_encode_ws<type> ws_t;
    constexpr int kb = tq_traits<type>::bits;
    constexpr int NV = tq_nv<type>();
    static_assert(ws_t::S == 64 && NV*32 == TURBOQ_GROUP, "two states a lane, four values a lane");
    const float cb0 = lut[lane];
    const float cb1 = lut[lane + 32];
    ws.cost[lane]      = lane == 0 ? 0.0f : INFINITY;
    ws.cost[lane + 32] = INFINITY;
    __syncwarp();
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        for (int j = 0; j < 32; ++j) {
            const int   t  = 32*k + j;
            const float yt = __shfl_sync(0xFFFFFFFF, y[k], j, 32);
            if (lane < ws_t::lo) {
                float best = ws.cost[lane];
                int   bt   = 0;
#pragma unroll
                for (int h = 1; h < (1 << kb); ++h) {
                    const float c = ws.cost[h*ws_t::lo + lane];
                    bt   = c < best ? h : bt;
                    best = c < best ? c : best;
                }
                ws.best[lane]    = best;
                ws.back[t][lane] = (uint8_t) bt;
            }
            __syncwarp();
            const float d0 = __fsub_rn(yt, cb0);
            const float d1 = __fsub_rn(yt, cb1);
            ws.cost[lane]      = __fadd_rn(ws.best[lane >> kb], __fmul_rn(d0, d0));
            ws.cost[lane + 32] = __fadd_rn(ws.best[(lane + 32) >> kb], __fmul_rn(d1, d1));
            __syncwarp();
        }
    }
    if (lane == 0) {
        int s = 0;
        for (int m = 1; m < ws_t::S; ++m) {
            s = ws.cost[m] < ws.cost[s] ? m : s;
        }
        for (int t = TURBOQ_GROUP - 1; t >= 0; --t) {
            ws.states[t] = (uint8_t) s;
            const int p = s >> kb;
            s = ws.back[t][p]*ws_t::lo + p;
        }
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        idx[k] = ws.states[32*k + lane];
    }
}

// The code stream of a trellis block from the search's path: each state's low `bits` bits (its
// code), one after another, most significant bit first (turboq_trellis_pack). Warp-collective.
template <ggml_type type>
static __device__ __forceinline__ void tq_trellis_pack(uint8_t * __restrict__ qs, const int lane, const tq_encode_ws<type> & ws) {
    constexpr int kb      = tq_traits<type>::bits;
    constexpr int n_bytes = TURBOQ_GROUP*kb/8;
#pragma unroll
    for (int j = lane; j < n_bytes; j += 32) {
        int byte = 0;
#pragma unroll
        for (int b = 0; b < 8; ++b) {
            const int bit = 8*j + b; // code bit kb - 1 - bit % kb of value bit / kb
            byte |= ((ws.states[bit / kb] >> (kb - 1 - bit % kb)) & 1) << (7 - b);
        }
        qs[j] = (uint8_t) byte;
    }
}

// Encode one group (turboq_encode_group_with + pack). x[k] = value lane + 32*k; ws: this warp's
// workspace. Warp-collective.
template <ggml_type type>
static __device__ __forceinline__ void tq_encode_group(const float (&x)[tq_nv<type>()], char * __restrict__ blk, const int lane, const tq_smem_tables<type> & t,
                                                       tq_encode_ws<type> & ws) {
    typedef typename tq_traits<type>::block block_t;
    constexpr int G  = tq_traits<type>::G;
    constexpr int NV = tq_nv<type>();

    bool finite = true;
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
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

    float v[NV];
    float sq[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        v[k]  = __fdiv_rn(x[k], amax);
        sq[k] = __fmul_rn(v[k], v[k]);
    }
    const float r = __fsqrt_rn(tq_tree_sum<NV, G>(sq));
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        v[k] = __fdiv_rn(v[k], r);
    }

    tq_rotate<NV, G>(v, lane, t.sign1, t.sign2);

    int idx[NV];
    if constexpr (tq_traits<type>::trellis) {
        tq_trellis_search<type>(v, lane, t.lut, ws, idx);
    } else if constexpr (tq_traits<type>::bits == 8) {
        float ya = 0.0f;
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            ya = fmaxf(ya, fabsf(v[k]));
        }
        ya = warp_reduce_max<32>(ya);
        const float s = __fdiv_rn(127.5f, ya);
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const float q = floorf(__fadd_rn(__fmul_rn(v[k], s), 128.0f));
            idx[k] = q < 0.0f ? 0 : q > 255.0f ? 255 : (int) q;
        }
    } else {
        const float * thr = tq_thresholds<type>();
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            int q = 0;
#pragma unroll
            for (int i = 0; i < tq_traits<type>::n_levels - 1; ++i) {
                q += thr[i] < v[k];
            }
            idx[k] = q;
        }
    }

#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const float c = t.lut[idx[k]];
        sq[k] = __fmul_rn(c, c);
    }
    const float cn   = __fsqrt_rn(tq_tree_sum<NV, G>(sq));
    const float norm = fminf(__fdiv_rn(__fmul_rn(amax, r), cn), 65504.0f);

    block_t * b = (block_t *) blk;
    if (lane == 0) {
        b->norm = __float2half_rn(norm);
    }
    if constexpr (type == GGML_TYPE_TURBOQ4_0) {
        if (lane == 0) {
            b->rnorm = __float2half_rn(0.0f); // reserved, always 0
        }
    }
    if constexpr (tq_traits<type>::trellis) {
        tq_trellis_pack<type>(b->qs, lane, ws);
    } else {
        GGML_UNUSED(ws);
        if constexpr (tq_traits<type>::bits == 2 || tq_traits<type>::bits == 3) {
            tq_pack_field<NV, G/4, 2, G>(b->qs, idx, lane);
        }
        if constexpr (tq_traits<type>::bits == 3) {
            int hi[NV];
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                hi[k] = idx[k] >> 2;
            }
            tq_pack_field<NV, G/8, 1, G>(b->qh, hi, lane);
        }
        if constexpr (tq_traits<type>::bits == 4) {
            tq_pack_field<NV, G/2, 4, G>(b->qs, idx, lane);
        }
        if constexpr (tq_traits<type>::bits == 8) {
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                if (tq_lane_holds<G>(lane)) {
                    b->qs[32*k + lane] = (uint8_t) idx[k];
                }
            }
        }
    }
}

// ---- codec kernels (launched from turboq.cu) ----

#define TQ_WARPS_PER_BLOCK 4

// ---- quantization ----

// SET_ROWS: one warp per group of src0 (f32 or f16, rows contiguous).
template <ggml_type type, typename src_t, typename idx_t>
static __global__ void k_tq_set_rows(
        const char * __restrict__ src0, const idx_t * __restrict__ src1, char * __restrict__ dst,
        const int64_t n_groups, const int64_t ng0, const int64_t ne01, const int64_t ne02,
        const int64_t ne11, const int64_t ne12,
        const int64_t nb01, const int64_t nb02, const int64_t nb03,
        const int64_t s10, const int64_t s11, const int64_t s12,
        const int64_t nb1, const int64_t nb2, const int64_t nb3) {
    __shared__ tq_smem_tables<type> tables;
    __shared__ tq_encode_ws<type> ws[TQ_WARPS_PER_BLOCK];
    const int lane = threadIdx.x;
    tq_load_tables<type>(tables, threadIdx.y*WARP_SIZE + lane, TQ_WARPS_PER_BLOCK*WARP_SIZE);
    __syncthreads();

    const int64_t g = (int64_t) blockIdx.x*TQ_WARPS_PER_BLOCK + threadIdx.y;
    if (g >= n_groups) {
        return;
    }
    int64_t r = g / ng0;
    const int64_t ig0 = g - r*ng0;
    const int64_t i01 = r % ne01; r /= ne01;
    const int64_t i02 = r % ne02;
    const int64_t i03 = r / ne02;
    const int64_t i11 = i02 % ne11;
    const int64_t i12 = i03 % ne12;

    const int64_t dst_row = (int64_t) src1[i01*s10 + i11*s11 + i12*s12];

    const src_t * x = (const src_t *) (src0 + i01*nb01 + i02*nb02 + i03*nb03) + ig0*tq_traits<type>::G;
    char * blk = dst + dst_row*nb1 + i02*nb2 + i03*nb3 + ig0*(int64_t) sizeof(typename tq_traits<type>::block);

    float v[tq_nv<type>()];
#pragma unroll
    for (int k = 0; k < tq_nv<type>(); ++k) {
        v[k] = tq_lane_holds<tq_traits<type>::G>(lane) ? ggml_cuda_cast<float>(x[32*k + lane]) : 0.0f;
    }
    tq_encode_group<type>(v, blk, lane, tables, ws[threadIdx.y]);
}

// byte offset of flat element index i in a tensor with the given shape and strides
static __device__ __forceinline__ int64_t tq_offset(int64_t i, const int64_t ne0, const int64_t ne1, const int64_t ne2,
        const int64_t nb0, const int64_t nb1, const int64_t nb2, const int64_t nb3) {
    const int64_t i0 = i % ne0; i /= ne0;
    const int64_t i1 = i % ne1; i /= ne1;
    const int64_t i2 = i % ne2;
    const int64_t i3 = i / ne2;
    return i0*nb0 + i1*nb1 + i2*nb2 + i3*nb3;
}

struct tq_nd {
    int64_t ne0, ne1, ne2;
    int64_t nb0, nb1, nb2, nb3;
};

// byte offset of the block that holds flat value index i of a turboq tensor (its rows hold whole
// groups: nb0 is the block size, ne0 counts values)
template <ggml_type type>
static __device__ __forceinline__ int64_t tq_block_offset(const int64_t i, const tq_nd & t) {
    const int64_t i0 = i % t.ne0;
    return tq_offset(i - i0, t.ne0, t.ne1, t.ne2, 0, t.nb1, t.nb2, t.nb3) + (i0/tq_traits<type>::G)*t.nb0;
}

// CPY f32/f16 -> turboq, any src layout (elements in ggml_nelements order).
template <ggml_type type, typename src_t>
static __global__ void k_tq_quantize_nd(const char * __restrict__ src, char * __restrict__ dst, const int64_t n_groups, const tq_nd s, const tq_nd d) {
    __shared__ tq_smem_tables<type> tables;
    __shared__ tq_encode_ws<type> ws[TQ_WARPS_PER_BLOCK];
    const int lane = threadIdx.x;
    tq_load_tables<type>(tables, threadIdx.y*WARP_SIZE + lane, TQ_WARPS_PER_BLOCK*WARP_SIZE);
    __syncthreads();

    const int64_t g = (int64_t) blockIdx.x*TQ_WARPS_PER_BLOCK + threadIdx.y;
    if (g >= n_groups) {
        return;
    }
    const int64_t i = g*tq_traits<type>::G;
    char * blk = dst + tq_block_offset<type>(i, d);

    float v[tq_nv<type>()];
#pragma unroll
    for (int k = 0; k < tq_nv<type>(); ++k) {
        v[k] = tq_lane_holds<tq_traits<type>::G>(lane) ?
            ggml_cuda_cast<float>(*(const src_t *) (src + tq_offset(i + 32*k + lane, s.ne0, s.ne1, s.ne2, s.nb0, s.nb1, s.nb2, s.nb3))) : 0.0f;
    }
    tq_encode_group<type>(v, blk, lane, tables, ws[threadIdx.y]);
}

// ---- dequantization ----

template <ggml_type type, typename dst_t>
static __device__ __forceinline__ void tq_dequant_group(const char * __restrict__ blk, const int lane, const tq_smem_tables<type> & t, float (&x)[tq_nv<type>()]) {
    const float norm = tq_decode_rotated<type>(blk, lane, t.lut, x);
    tq_unrotate_scaled<tq_nv<type>(), tq_traits<type>::G>(x, norm, lane, t.sign1, t.sign2);
}

// CPY turboq -> f32/f16 (any dst layout) and contiguous conversion.
template <ggml_type type, typename dst_t>
static __global__ void k_tq_dequantize_nd(const char * __restrict__ src, char * __restrict__ dst, const int64_t n_groups, const tq_nd s, const tq_nd d) {
    __shared__ tq_smem_tables<type> tables;
    const int lane = threadIdx.x;
    tq_load_tables<type>(tables, threadIdx.y*WARP_SIZE + lane, TQ_WARPS_PER_BLOCK*WARP_SIZE);
    __syncthreads();

    const int64_t g = (int64_t) blockIdx.x*TQ_WARPS_PER_BLOCK + threadIdx.y;
    if (g >= n_groups) {
        return;
    }
    const int64_t i  = g*tq_traits<type>::G;
    const char * blk = src + tq_block_offset<type>(i, s);

    float x[tq_nv<type>()];
    tq_dequant_group<type, dst_t>(blk, lane, tables, x);
#pragma unroll
    for (int k = 0; k < tq_nv<type>(); ++k) {
        if (tq_lane_holds<tq_traits<type>::G>(lane)) {
            *(dst_t *) (dst + tq_offset(i + 32*k + lane, d.ne0, d.ne1, d.ne2, d.nb0, d.nb1, d.nb2, d.nb3)) = ggml_cuda_cast<dst_t>(x[k]);
        }
    }
}

// GET_ROWS: dst[:, i10, i11, i12] = src0[:, src1[i10, i11, i12], i11, i12]
template <ggml_type type, typename dst_t>
static __global__ void k_tq_get_rows(
        const char * __restrict__ src0, const int32_t * __restrict__ src1, char * __restrict__ dst,
        const int64_t ng0, const int64_t ne10,
        const int64_t nb01, const int64_t nb02, const int64_t nb03,
        const int64_t s10, const int64_t s11, const int64_t s12,
        const int64_t nb1, const int64_t nb2, const int64_t nb3) {
    __shared__ tq_smem_tables<type> tables;
    const int lane = threadIdx.x;
    tq_load_tables<type>(tables, threadIdx.y*WARP_SIZE + lane, TQ_WARPS_PER_BLOCK*WARP_SIZE);
    __syncthreads();

    const int64_t g = (int64_t) blockIdx.x*TQ_WARPS_PER_BLOCK + threadIdx.y;
    if (g >= ng0*ne10) {
        return;
    }
    const int64_t i10 = g / ng0;
    const int64_t ig0 = g - i10*ng0;
    const int64_t i11 = blockIdx.y;
    const int64_t i12 = blockIdx.z;

    const int64_t i01 = src1[i10*s10 + i11*s11 + i12*s12];
    const char * blk = src0 + i01*nb01 + i11*nb02 + i12*nb03 + ig0*(int64_t) sizeof(typename tq_traits<type>::block);
    dst_t * y = (dst_t *) (dst + i10*nb1 + i11*nb2 + i12*nb3) + ig0*tq_traits<type>::G;

    float x[tq_nv<type>()];
    tq_dequant_group<type, dst_t>(blk, lane, tables, x);
#pragma unroll
    for (int k = 0; k < tq_nv<type>(); ++k) {
        if (tq_lane_holds<tq_traits<type>::G>(lane)) {
            y[32*k + lane] = ggml_cuda_cast<dst_t>(x[k]);
        }
    }
}
