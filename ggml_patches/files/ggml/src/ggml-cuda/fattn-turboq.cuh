// Flash attention with TurboQuant K and/or V caches (pyturbo), in the rotated domain like the
// CPU backend (ggml-cpu/ops.cpp + turboq-cpu.c):
//   - turboq K: Q is rotated once per block (q' = D2.H.D1.q/sqrt(G) per group of G = 128 values,
//     64 or 32 for the _g64 and _g32 twins), then q.k = norm_k * (q'.c_k) against the raw levels c_k;
//   - turboq V: sum_t p_t * norm_t * c_t is accumulated in the rotated domain and rotated back
//     once per output row, in the combine kernel.
// K and V are each one of f16, q8_0 or a turboq type (at least one of them turboq), at one head
// size D for both: 128 or 256 with turboq2/3/4/8, 64 with the _g64 twins, 96 with the _g32 twins
// (pyturbo/format/cuda_instances.py lists the instances).
//
// This kernel serves decode and batches of up to TQ_FA_PACKED_MAX_BATCH queries (larger ones
// convert K/V to f16 for the mainline tensor-core kernels, see turboq.cuh). A block of 4 warps
// handles `ncols` (query, head) columns (ncols2 heads of one GQA group x ncols/ncols2 queries)
// over a slice of the KV sequence, TQ_FA_CHUNK tokens at a time (one warp per token: lane l
// holds head dims 32*k + l). The KV sequence is split over blocks until the grid fills the GPU's
// resident-block slots; the combine kernel merges the slices (online softmax), adds the sinks,
// divides by the sum, rotates V back and writes dst. Temporary memory: nsplit * n_rows * (D + 2)
// floats, n_rows = the number of output rows (n_q * n_head * n_seq).
//
// The kernels and the launch plan (tq_fa_ncols, tq_fa_plan) are device code and plain C++, which
// tests/harness/turboq_cuda_emulation.cpp also compiles for the host (TURBOQ_CUDA_EMULATION); the
// launches themselves are not.
#pragma once

#ifndef TURBOQ_CUDA_EMULATION
#include "common.cuh"
#endif
#include "turboq-device.cuh"

#define TQ_FA_NWARPS 4
// 32 tokens per chunk (8 per warp): a short context still splits into enough blocks to fill
// the GPU (at n_kv = 256, 8 slices per KV head).
#define TQ_FA_CHUNK  32

struct tq_fa_params {
    const char  * Q;
    const char  * K;
    const char  * V;
    const char  * mask;
    float       * VKQ;  // [nsplit][n_rows][D]
    float2      * meta; // [nsplit][n_rows]: running max, sum

    float    scale;
    float    max_bias;
    float    m0;
    float    m1;
    uint32_t n_head_log2;
    float    logit_softcap;

    int     ne01, ne02, ne03;
    int64_t nb01, nb02, nb03;
    int     ne11, ne12, ne13;
    int64_t nb11, nb12, nb13;
    int     ne22, ne23;
    int64_t nb21, nb22, nb23;
    int     ne32, ne33;
    int64_t nb31, nb32, nb33;

    int ncols2;      // heads per block (divides the GQA ratio)
    int nsplit;      // KV slices
    int kv_per_split;
};

// Row values at dims 32*k + lane, k = 0..D/32-1 (turboq: rotated domain, scaled by the norm).
template <ggml_type type, int D>
static __device__ __forceinline__ void tq_fa_load_row(const char * __restrict__ row, const int lane, const float * lut, float (&v)[D/32]) {
    if constexpr (type == GGML_TYPE_F16) {
        const half * r = (const half *) row;
#pragma unroll
        for (int k = 0; k < D/32; ++k) {
            v[k] = __half2float(r[32*k + lane]);
        }
    } else if constexpr (type == GGML_TYPE_Q8_0) {
        const block_q8_0 * b = (const block_q8_0 *) row;
#pragma unroll
        for (int k = 0; k < D/32; ++k) {
            v[k] = __half2float(b[k].d) * (float) b[k].qs[lane];
        }
    } else {
        static_assert(tq_group(type) != 0, "unsupported K/V type");
        typedef typename tq_traits<type>::block block_t;
        constexpr int NV = tq_nv<type>();
#pragma unroll
        for (int g = 0; g < D/tq_traits<type>::G; ++g) {
            float c[NV];
            const float norm = tq_decode_rotated<type>(row + g*sizeof(block_t), lane, lut, c);
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                v[NV*g + k] = norm * c[k];
            }
        }
    }
}

template <ggml_type type>
static constexpr __host__ __device__ int tq_fa_lut_size() {
    if constexpr (tq_group(type) != 0) {
        return tq_traits<type>::n_levels;
    } else {
        return 1;
    }
}

template <ggml_type type>
static __device__ __forceinline__ void tq_fa_fill_lut(float * lut, const int tid) {
    if constexpr (tq_group(type) != 0) {
        for (int i = tid; i < tq_traits<type>::n_levels; i += TQ_FA_NWARPS*WARP_SIZE) {
            lut[i] = tq_centroids<type>()[i];
        }
    } else {
        GGML_UNUSED(lut);
        GGML_UNUSED(tid);
    }
}

template <int D, int ncols, ggml_type type_K, ggml_type type_V>
__launch_bounds__(TQ_FA_NWARPS*WARP_SIZE, 1)
static __global__ void tq_flash_attn_ext(const tq_fa_params p) {
    constexpr int nw = TQ_FA_NWARPS;
    constexpr int C  = TQ_FA_CHUNK;
    constexpr int nk = D/32;
    constexpr int GK = tq_group(type_K);
    constexpr int GV = tq_group(type_V);
    static_assert(D % 32 == 0 && D % (GK ? GK : 32) == 0 && D % (GV ? GV : 32) == 0,
                  "D must be a multiple of 32 and of the K and V groups");

    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const int tid  = warp*WARP_SIZE + lane;

    __shared__ float lutK[tq_fa_lut_size<type_K>()];
    __shared__ float lutV[tq_fa_lut_size<type_V>()];
    __shared__ float sQ[ncols][D]; // Q staging, then the cross-warp VKQ sum
    __shared__ float sKQ[ncols][C];
    __shared__ float sM[ncols];
    __shared__ float sS[ncols];
    __shared__ float sScale[ncols];

    const int ncols2 = p.ncols2;
    const int ncols1 = ncols / ncols2;
    const int iq3    = blockIdx.z / p.nsplit;
    const int split  = blockIdx.z - iq3*p.nsplit;
    const int head0  = blockIdx.y * ncols2;
    const int iq0    = blockIdx.x * ncols1;

    const char * K = p.K + (int64_t) (iq3 / (p.ne03/p.ne13))*p.nb13 + (int64_t) (head0 / (p.ne02/p.ne12))*p.nb12;
    const char * V = p.V + (int64_t) (iq3 / (p.ne03/p.ne23))*p.nb23 + (int64_t) (head0 / (p.ne02/p.ne22))*p.nb22;

    tq_fa_fill_lut<type_K>(lutK, tid);
    tq_fa_fill_lut<type_V>(lutV, tid);

    // Q, pre-scaled; rotated per 128-group when K is turboq
    for (int i = tid; i < ncols*D; i += nw*WARP_SIZE) {
        const int j  = i / D;
        const int e  = i - j*D;
        const int iq = iq0 + j / ncols2;
        const int h  = head0 + j % ncols2;
        float q = 0.0f;
        if (iq < p.ne01) {
            q = ((const float *) (p.Q + iq3*p.nb03 + h*p.nb02 + iq*p.nb01))[e] * p.scale;
        }
        sQ[j][e] = q;
    }
    if (tid < ncols) {
        sM[tid] = -FLT_MAX/2.0f;
        sS[tid] = 0.0f;
    }
    __syncthreads();

    float q[ncols][nk];
    if constexpr (GK != 0) {
        // one warp per (column, group)
        constexpr int NV = GK/32;
        for (int jg = warp; jg < ncols*(D/GK); jg += nw) {
            const int j = jg / (D/GK);
            const int g = jg - j*(D/GK);
            float x[NV];
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                x[k] = sQ[j][g*GK + 32*k + lane];
            }
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                x[k] *= turboq_sign1[32*k + lane];
            }
            tq_fwht<NV>(x, lane);
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                sQ[j][g*GK + 32*k + lane] = x[k] * tq_inv_sqrt_group(GK) * turboq_sign2[32*k + lane];
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < ncols; ++j) {
#pragma unroll
        for (int k = 0; k < nk; ++k) {
            q[j][k] = sQ[j][32*k + lane];
        }
    }

    // the column this lane scores (lanes < ncols): mask row and ALiBi slope
    const int  jl       = lane < ncols ? lane : 0;
    const int  iq_l     = iq0 + jl / ncols2;
    const int  h_l      = head0 + jl % ncols2;
    const bool valid_l  = lane < ncols && iq_l < p.ne01;
    const half * mask_l = p.mask && valid_l ?
        (const half *) (p.mask + (int64_t) (iq3 % p.ne33)*p.nb33 + (int64_t) (h_l % p.ne32)*p.nb32 + (int64_t) iq_l*p.nb31) : nullptr;
    const float slope_l = get_alibi_slope(p.max_bias, h_l, p.n_head_log2, p.m0, p.m1);

    float acc[ncols][nk];
#pragma unroll
    for (int j = 0; j < ncols; ++j) {
#pragma unroll
        for (int k = 0; k < nk; ++k) {
            acc[j][k] = 0.0f;
        }
    }

    const int kv_start = split*p.kv_per_split;
    const int kv_end   = min(p.ne11, kv_start + p.kv_per_split);

    for (int kv0 = kv_start; kv0 < kv_end; kv0 += C) {
        // KQ: one warp per token
        for (int t = warp; t < C; t += nw) {
            const int kv = kv0 + t;
            float s_l = -INFINITY;
            if (kv < kv_end) {
                float kr[nk];
                tq_fa_load_row<type_K, D>(K + (int64_t) kv*p.nb11, lane, lutK, kr);
#pragma unroll
                for (int j = 0; j < ncols; ++j) {
                    float s = 0.0f;
#pragma unroll
                    for (int k = 0; k < nk; ++k) {
                        s += q[j][k]*kr[k];
                    }
                    s = warp_reduce_sum<32>(s);
                    if (lane == j) {
                        s_l = s;
                    }
                }
                if (valid_l) {
                    if (p.logit_softcap != 0.0f) {
                        s_l = p.logit_softcap*tanhf(s_l);
                    }
                    if (mask_l) {
                        s_l += slope_l*__half2float(mask_l[kv]);
                    }
                } else {
                    s_l = -INFINITY;
                }
            }
            if (lane < ncols) {
                sKQ[lane][t] = s_l;
            }
        }
        __syncthreads();

        // online softmax, one warp per column
        for (int j = warp; j < ncols; j += nw) {
            float mx = -FLT_MAX/2.0f;
            for (int t = lane; t < C; t += WARP_SIZE) {
                mx = fmaxf(mx, sKQ[j][t]);
            }
            mx = warp_reduce_max<32>(mx);
            const float M_old = sM[j];
            const float M_new = fmaxf(M_old, mx);
            float sum = 0.0f;
            for (int t = lane; t < C; t += WARP_SIZE) {
                const float e = expf(sKQ[j][t] - M_new);
                sKQ[j][t] = e;
                sum += e;
            }
            sum = warp_reduce_sum<32>(sum);
            __syncwarp();
            if (lane == 0) {
                const float ms = expf(M_old - M_new);
                sScale[j] = ms;
                sS[j]     = sS[j]*ms + sum;
                sM[j]     = M_new;
            }
        }
        __syncthreads();

        // VKQ: one warp per token
#pragma unroll
        for (int j = 0; j < ncols; ++j) {
            const float ms = sScale[j];
#pragma unroll
            for (int k = 0; k < nk; ++k) {
                acc[j][k] *= ms;
            }
        }
        for (int t = warp; t < C; t += nw) {
            const int kv = kv0 + t;
            if (kv >= kv_end) {
                break;
            }
            float pr[ncols];
            bool any = false;
#pragma unroll
            for (int j = 0; j < ncols; ++j) {
                pr[j] = sKQ[j][t];
                any = any || pr[j] != 0.0f;
            }
            if (!any) {
                continue; // e.g. causally masked for every column of this block
            }
            float vr[nk];
            tq_fa_load_row<type_V, D>(V + (int64_t) kv*p.nb21, lane, lutV, vr);
#pragma unroll
            for (int j = 0; j < ncols; ++j) {
#pragma unroll
                for (int k = 0; k < nk; ++k) {
                    acc[j][k] += pr[j]*vr[k];
                }
            }
        }
        __syncthreads();
    }

    // sum the warps' accumulators in a fixed order
    for (int i = tid; i < ncols*D; i += nw*WARP_SIZE) {
        sQ[i / D][i % D] = 0.0f;
    }
    __syncthreads();
    for (int w = 0; w < nw; ++w) {
        if (warp == w) {
#pragma unroll
            for (int j = 0; j < ncols; ++j) {
#pragma unroll
                for (int k = 0; k < nk; ++k) {
                    sQ[j][32*k + lane] += acc[j][k];
                }
            }
        }
        __syncthreads();
    }

    const int64_t n_rows = (int64_t) p.ne03*p.ne01*p.ne02;
    for (int i = tid; i < ncols*D; i += nw*WARP_SIZE) {
        const int j  = i / D;
        const int e  = i - j*D;
        const int iq = iq0 + j / ncols2;
        if (iq < p.ne01) {
            const int64_t row = ((int64_t) iq3*p.ne01 + iq)*p.ne02 + head0 + j % ncols2;
            p.VKQ[(split*n_rows + row)*D + e] = sQ[j][e];
        }
    }
    if (tid < ncols) {
        const int iq = iq0 + tid / ncols2;
        if (iq < p.ne01) {
            const int64_t row = ((int64_t) iq3*p.ne01 + iq)*p.ne02 + head0 + tid % ncols2;
            p.meta[split*n_rows + row] = make_float2(sM[tid], sS[tid]);
        }
    }
}

// Merge the KV slices, add the sinks, normalize, rotate turboq V back (groups of GV values; 0:
// V is not turboq), write dst. One block of D threads per output row.
template <int D, int GV>
__launch_bounds__(D, 1)
static __global__ void tq_flash_attn_ext_combine(const float * __restrict__ VKQ, const float2 * __restrict__ meta,
        const float * __restrict__ sinks, float * __restrict__ dst, const int64_t n_rows, const int nsplit, const int n_head) {
    const int64_t row = blockIdx.x;
    const int     e   = threadIdx.x;

    float M = -FLT_MAX/2.0f;
    for (int s = 0; s < nsplit; ++s) {
        M = fmaxf(M, meta[s*n_rows + row].x);
    }
    float S   = 0.0f;
    float acc = 0.0f;
    for (int s = 0; s < nsplit; ++s) {
        const float2 ms = meta[s*n_rows + row];
        const float  w  = expf(ms.x - M);
        S   += w*ms.y;
        acc += w*VKQ[(s*n_rows + row)*D + e];
    }
    if (sinks) {
        const float sk = sinks[row % n_head];
        const float Mn = fmaxf(M, sk);
        const float f  = expf(M - Mn);
        S   = S*f + expf(sk - Mn);
        acc = acc*f;
    }
    float out = S == 0.0f ? 0.0f : acc/S;

    if constexpr (GV != 0) {
        __shared__ float buf[D];
        const int i = e % GV;
        buf[e] = out * turboq_sign2[i];
        __syncthreads();
#pragma unroll
        for (int h = 1; h < GV; h <<= 1) {
            float a = 0.0f;
            float b = 0.0f;
            const bool lo = (i & h) == 0;
            if (lo) {
                a = buf[e];
                b = buf[e + h];
            }
            __syncthreads();
            if (lo) {
                buf[e]     = a + b;
                buf[e + h] = a - b;
            }
            __syncthreads();
        }
        out = buf[e] * tq_inv_sqrt_group(GV) * turboq_sign1[i];
    }

    dst[row*D + e] = out;
}

// the node's scale, ALiBi bias and soft cap, as the kernel reads them
static void tq_fa_set_scales(tq_fa_params & p, float scale, const float max_bias, const float logit_softcap, const uint32_t n_head) {
    if (logit_softcap != 0.0f) {
        scale /= logit_softcap;
    }
    const uint32_t n_head_log2 = 1u << (uint32_t) floorf(log2f((float) n_head));
    p.scale         = scale;
    p.max_bias      = max_bias;
    p.m0            = powf(2.0f, -(max_bias       ) / n_head_log2);
    p.m1            = powf(2.0f, -(max_bias / 2.0f) / n_head_log2);
    p.n_head_log2   = n_head_log2;
    p.logit_softcap = logit_softcap;
}

// heads of one GQA group share a block (K/V read once for all of them): the block's columns
// (2, 4 or 8: the kernel's instances) and, in *ncols2, how many of them are heads
static int tq_fa_ncols(const int64_t n_q, const int gqa, int * ncols2) {
    int n2 = 1;
    while (n2 < 8 && gqa % (2*n2) == 0) {
        n2 *= 2;
    }
    const int64_t needed = n_q*n2;
    const int ncols = needed <= 2 ? 2 : needed <= 4 ? 4 : 8;
    *ncols2 = std::min(n2, ncols);
    return ncols;
}

struct tq_fa_grid {
    int gx, gy, gz;   // blocks: query tiles, head groups, sequences x KV slices
    int nsplit;       // KV slices
    int kv_per_split; // tokens per slice, a multiple of TQ_FA_CHUNK
};

// Split the KV sequence until the grid fills every SM with as many resident blocks as fit
// (`resident` blocks in all): a warp walks its tokens one dependent load after another, so at
// depth the kernel is bound by memory latency, and only more warps in flight hide it.
static tq_fa_grid tq_fa_plan(const tq_fa_params & p, const int ncols, const int n_kv, const int64_t resident) {
    const int ncols1 = ncols / p.ncols2;
    const int gx = (p.ne01 + ncols1 - 1) / ncols1;
    const int gy = p.ne02 / p.ncols2;
    const int64_t blocks = (int64_t) gx*gy*p.ne03;

    const int max_split = std::max(1, n_kv / TQ_FA_CHUNK);
    int nsplit = 1;
    if (blocks < resident) {
        nsplit = (int) std::min<int64_t>(max_split, (resident + blocks - 1) / blocks);
    }
    nsplit = std::min(nsplit, 65535 / std::max(1, p.ne03));
    int kv_per_split = (n_kv + nsplit - 1) / nsplit;
    // at least one chunk: n_kv == 0 would otherwise divide by zero below (the output is then 0, as on the CPU)
    kv_per_split = std::max(TQ_FA_CHUNK, (kv_per_split + TQ_FA_CHUNK - 1) / TQ_FA_CHUNK * TQ_FA_CHUNK);
    nsplit = (n_kv + kv_per_split - 1) / kv_per_split;
    nsplit = std::max(nsplit, 1);
    return { gx, gy, p.ne03*nsplit, nsplit, kv_per_split };
}

#ifndef TURBOQ_CUDA_EMULATION

template <int D, int ncols, ggml_type type_K, ggml_type type_V>
static void tq_fa_launch(ggml_backend_cuda_context & ctx, ggml_tensor * dst, tq_fa_params & p) {
    const ggml_tensor * Q     = dst->src[0];
    const ggml_tensor * K     = dst->src[1];
    const ggml_tensor * sinks = dst->src[4];

    const int device = ggml_cuda_get_device();
    const int nsm    = ggml_cuda_info().devices[device].nsm;
    static int blocks_per_sm[GGML_CUDA_MAX_DEVICES] = {0}; // per instance and device, asked once
    if (blocks_per_sm[device] == 0) {
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm[device],
            tq_flash_attn_ext<D, ncols, type_K, type_V>, TQ_FA_NWARPS*WARP_SIZE, 0));
        blocks_per_sm[device] = std::max(2, blocks_per_sm[device]);
    }
    const tq_fa_grid g = tq_fa_plan(p, ncols, (int) K->ne[1], (int64_t) blocks_per_sm[device]*nsm);
    p.nsplit       = g.nsplit;
    p.kv_per_split = g.kv_per_split;

    const int64_t n_rows = (int64_t) p.ne01*p.ne02*p.ne03;
    ggml_cuda_pool_alloc<float>  VKQ (ctx.pool(), g.nsplit*n_rows*D);
    ggml_cuda_pool_alloc<float2> meta(ctx.pool(), g.nsplit*n_rows);
    p.VKQ  = VKQ.ptr;
    p.meta = meta.ptr;

    GGML_ASSERT(g.gy <= 65535 && g.gz <= 65535);
    GGML_ASSERT(n_rows <= INT_MAX);

    cudaStream_t stream = ctx.stream();
    const dim3 block_dims(WARP_SIZE, TQ_FA_NWARPS, 1);
    const dim3 block_nums(g.gx, g.gy, g.gz);
    tq_flash_attn_ext<D, ncols, type_K, type_V><<<block_nums, block_dims, 0, stream>>>(p);
    CUDA_CHECK(cudaGetLastError());

    tq_flash_attn_ext_combine<D, tq_group(type_V)><<<(unsigned int) n_rows, D, 0, stream>>>(
        p.VKQ, p.meta, sinks ? (const float *) sinks->data : nullptr, (float *) dst->data, n_rows, g.nsplit, (int) Q->ne[2]);
    CUDA_CHECK(cudaGetLastError());
}

template <int D, ggml_type type_K, ggml_type type_V>
void ggml_cuda_turboq_fa_case(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * Q    = dst->src[0];
    const ggml_tensor * K    = dst->src[1];
    const ggml_tensor * V    = dst->src[2];
    const ggml_tensor * mask = dst->src[3];

    GGML_ASSERT(Q->ne[0] == D && K->ne[0] == D && V->ne[0] == D);
    GGML_ASSERT(K->type == type_K && V->type == type_V);

    tq_fa_params p = {};
    p.Q    = (const char *) Q->data;
    p.K    = (const char *) K->data;
    p.V    = (const char *) V->data;
    p.mask = mask ? (const char *) mask->data : nullptr;

    float scale         = 1.0f;
    float max_bias      = 0.0f;
    float logit_softcap = 0.0f;
    memcpy(&scale,         (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias,      (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&logit_softcap, (const float *) dst->op_params + 2, sizeof(float));
    tq_fa_set_scales(p, scale, max_bias, logit_softcap, (uint32_t) Q->ne[2]);

    p.ne01 = Q->ne[1]; p.ne02 = Q->ne[2]; p.ne03 = Q->ne[3];
    p.nb01 = Q->nb[1]; p.nb02 = Q->nb[2]; p.nb03 = Q->nb[3];
    p.ne11 = K->ne[1]; p.ne12 = K->ne[2]; p.ne13 = K->ne[3];
    p.nb11 = K->nb[1]; p.nb12 = K->nb[2]; p.nb13 = K->nb[3];
    p.ne22 = V->ne[2]; p.ne23 = V->ne[3];
    p.nb21 = V->nb[1]; p.nb22 = V->nb[2]; p.nb23 = V->nb[3];
    p.ne32 = mask ? mask->ne[2] : 1; p.ne33 = mask ? mask->ne[3] : 1;
    p.nb31 = mask ? mask->nb[1] : 0; p.nb32 = mask ? mask->nb[2] : 0; p.nb33 = mask ? mask->nb[3] : 0;

    switch (tq_fa_ncols(Q->ne[1], (int) (Q->ne[2] / K->ne[2]), &p.ncols2)) {
        case 2:  tq_fa_launch<D, 2, type_K, type_V>(ctx, dst, p); break;
        case 4:  tq_fa_launch<D, 4, type_K, type_V>(ctx, dst, p); break;
        default: tq_fa_launch<D, 8, type_K, type_V>(ctx, dst, p); break;
    }
}

#define DECL_TQ_FA_CASE(D, type_K, type_V) \
    template void ggml_cuda_turboq_fa_case<D, type_K, type_V>(ggml_backend_cuda_context & ctx, ggml_tensor * dst)

#define EXTERN_DECL_TQ_FA_CASE(D, type_K, type_V) \
    extern DECL_TQ_FA_CASE(D, type_K, type_V)

#endif // TURBOQ_CUDA_EMULATION
