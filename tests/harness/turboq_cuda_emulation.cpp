// The CUDA backend's turboq codec kernels (ggml-cuda/turboq-device.cuh), compiled for the host and
// run under a small emulation of CUDA's execution model, so that they can be checked against the
// NumPy reference where no GPU is at hand (tests/test_cuda_emulation.py).
//
// What is emulated: a block is blockDim.x*blockDim.y host threads; __syncthreads is a barrier of
// the block; each warp of 32 threads exchanges values through a barrier (__shfl_*_sync,
// __all_sync); __shared__ variables are statics, which the threads of the one block that runs at
// a time share. The float intrinsics (__fadd_rn, ...) are IEEE single operations, compiled with
// -ffp-contract=off as nvcc keeps them. What is not: the GPU's flush-to-zero of subnormals
// (-use_fast_math), timing, memory coherence beyond the barriers, and everything outside the
// codec kernels (flash attention, the host launches).
//
//   turboq-cuda-emulation codec TYPE_ID NE0 NROWS in.f32 out.bin
// reads NROWS rows of NE0 floats and writes, concatenated:
//   1. the blocks SET_ROWS stores (rows scattered through a permutation, written back in input order);
//   2. GET_ROWS to f32 of those blocks (gathered in reverse order, written back in input order);
//   3. GET_ROWS to f16;
//   4. the blocks of a CPY f32 -> turboq from a source with padded rows (quantize_nd);
//   5. CPY turboq -> f16 into a destination with padded rows (dequantize_nd), padding dropped.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "ggml.h"
#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"

// ---- the CUDA surface that turboq-device.cuh uses ----

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define TURBOQ_TABLE static const
#define WARP_SIZE 32

struct half {
    uint16_t bits;
    operator uint16_t() const { return bits; }
};
static inline float __half2float(half h) { return ggml_fp16_to_fp32(h.bits); }
static inline half __float2half_rn(float f) { return half{ ggml_fp32_to_fp16(f) }; }

template <typename dst_t, typename src_t> inline dst_t ggml_cuda_cast(src_t x);
template <> inline float ggml_cuda_cast<float, float>(float x) { return x; }
template <> inline float ggml_cuda_cast<float, half>(half x) { return __half2float(x); }
template <> inline half ggml_cuda_cast<half, float>(float x) { return __float2half_rn(x); }

static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return std::sqrt(a); }
using std::isfinite;

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct emu_warp {
    std::barrier<> bar{32};
    uint32_t slot[32];
};

struct emu_block {
    explicit emu_block(int n) : bar(n), warps(n/32) {}
    std::barrier<> bar;
    std::vector<emu_warp> warps;
};

static thread_local dim3        threadIdx;
static thread_local dim3        blockIdx;
static thread_local emu_block * emu_cur_block;
static thread_local emu_warp  * emu_cur_warp;
static thread_local int         emu_lane;

static inline void __syncthreads() { emu_cur_block->bar.arrive_and_wait(); }

template <typename T>
static T emu_read_lane(T v, int src) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    uint32_t u;
    memcpy(&u, &v, 4);
    emu_cur_warp->slot[emu_lane] = u;
    emu_cur_warp->bar.arrive_and_wait();
    const uint32_t r = emu_cur_warp->slot[src];
    emu_cur_warp->bar.arrive_and_wait();
    T out;
    memcpy(&out, &r, 4);
    return out;
}

template <typename T> static T __shfl_xor_sync(unsigned, T v, int m, int = 32) { return emu_read_lane(v, emu_lane ^ m); }
template <typename T> static T __shfl_down_sync(unsigned, T v, int d, int = 32) {
    return emu_read_lane(v, emu_lane + d < 32 ? emu_lane + d : emu_lane);
}
template <typename T> static T __shfl_sync(unsigned, T v, int src, int = 32) { return emu_read_lane(v, src); }

static int __all_sync(unsigned, int pred) {
    emu_cur_warp->slot[emu_lane] = pred ? 1 : 0;
    emu_cur_warp->bar.arrive_and_wait();
    int all = 1;
    for (int l = 0; l < 32; ++l) {
        all &= (int) emu_cur_warp->slot[l];
    }
    emu_cur_warp->bar.arrive_and_wait();
    return all;
}

template <int width = WARP_SIZE>
static float warp_reduce_max(float x) {
    for (int offset = width/2; offset > 0; offset >>= 1) {
        x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset, width));
    }
    return x;
}

#define TURBOQ_CUDA_EMULATION 1
#include "ggml-cuda/turboq-device.cuh"

// runs kernel() as grid x block threads, one block at a time
static void emu_launch(dim3 grid, dim3 block, const std::function<void()> & kernel) {
    const int n = (int) (block.x*block.y*block.z);
    if (block.x != 32 || n % 32 != 0) {
        fprintf(stderr, "emulation: blockDim.x must be 32\n");
        exit(2);
    }
    for (unsigned bz = 0; bz < grid.z; ++bz) {
        for (unsigned by = 0; by < grid.y; ++by) {
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                emu_block blk(n);
                std::vector<std::thread> threads;
                threads.reserve(n);
                for (int t = 0; t < n; ++t) {
                    threads.emplace_back([&, t] {
                        threadIdx     = dim3(t % block.x, (t / block.x) % block.y, t / (block.x*block.y));
                        blockIdx      = dim3(bx, by, bz);
                        emu_cur_block = &blk;
                        emu_cur_warp  = &blk.warps[t / 32];
                        emu_lane      = t % 32;
                        kernel();
                    });
                }
                for (auto & th : threads) {
                    th.join();
                }
            }
        }
    }
}

static dim3 emu_grid(int64_t n_groups) {
    return dim3((unsigned) ((n_groups + TQ_WARPS_PER_BLOCK - 1) / TQ_WARPS_PER_BLOCK));
}

// ---- the codec of one type, as the launches in turboq.cu run it ----

template <ggml_type type>
static void codec(const int64_t ne0, const int64_t nrows, const std::vector<float> & x, FILE * out) {
    constexpr int G  = tq_traits<type>::G;
    const size_t  bs = sizeof(typename tq_traits<type>::block);
    const int64_t ng0 = ne0 / G;
    const int64_t n_groups = ng0*nrows;
    const size_t  row_bytes = ng0*bs;
    const dim3    block(WARP_SIZE, TQ_WARPS_PER_BLOCK, 1);

    std::vector<int64_t> perm(nrows);
    for (int64_t i = 0; i < nrows; ++i) {
        perm[i] = (i*7 + 3) % nrows; // a permutation when gcd(7, nrows) = 1
    }

    // 1. SET_ROWS f32 -> rows perm[i]
    std::vector<char> cache(nrows*row_bytes, 0x55);
    emu_launch(emu_grid(n_groups), block, [&] {
        k_tq_set_rows<type, float, int64_t>((const char *) x.data(), perm.data(), cache.data(),
            n_groups, ng0, nrows, 1, 1, 1,
            ne0*4, ne0*4*nrows, ne0*4*nrows,
            1, nrows, nrows,
            row_bytes, row_bytes*nrows, row_bytes*nrows);
    });
    for (int64_t i = 0; i < nrows; ++i) {
        fwrite(cache.data() + perm[i]*row_bytes, 1, row_bytes, out);
    }

    // 2./3. GET_ROWS: output row i = cache row idx[i], idx = reverse order
    std::vector<int32_t> idx(nrows);
    for (int64_t i = 0; i < nrows; ++i) {
        idx[i] = (int32_t) (nrows - 1 - i);
    }
    std::vector<float> back(ne0*nrows);
    std::vector<half>  back16(ne0*nrows);
    const int64_t nb = (ng0*nrows + TQ_WARPS_PER_BLOCK - 1) / TQ_WARPS_PER_BLOCK;
    emu_launch(dim3((unsigned) nb, 1, 1), block, [&] {
        k_tq_get_rows<type, float>(cache.data(), idx.data(), (char *) back.data(), ng0, nrows,
            row_bytes, row_bytes*nrows, row_bytes*nrows, 1, nrows, nrows,
            ne0*4, ne0*4*nrows, ne0*4*nrows);
    });
    emu_launch(dim3((unsigned) nb, 1, 1), block, [&] {
        k_tq_get_rows<type, half>(cache.data(), idx.data(), (char *) back16.data(), ng0, nrows,
            row_bytes, row_bytes*nrows, row_bytes*nrows, 1, nrows, nrows,
            ne0*2, ne0*2*nrows, ne0*2*nrows);
    });
    for (int64_t i = 0; i < nrows; ++i) {
        fwrite(back.data() + (nrows - 1 - perm[i])*ne0, 4, ne0, out);
    }
    for (int64_t i = 0; i < nrows; ++i) {
        fwrite(back16.data() + (nrows - 1 - perm[i])*ne0, 2, ne0, out);
    }

    // 4. CPY f32 (rows padded by 40 floats) -> contiguous turboq
    const int64_t pad = 40;
    std::vector<float> xp((ne0 + pad)*nrows, NAN);
    for (int64_t i = 0; i < nrows; ++i) {
        memcpy(xp.data() + i*(ne0 + pad), x.data() + i*ne0, ne0*4);
    }
    const int64_t sp = (ne0 + pad)*4;
    const tq_nd s_pad = { ne0, nrows, 1, 4, sp, sp*nrows, sp*nrows };
    const tq_nd d_blk = { ne0, nrows, 1, (int64_t) bs, (int64_t) row_bytes, (int64_t) row_bytes*nrows, (int64_t) row_bytes*nrows };
    std::vector<char> cpy(nrows*row_bytes, 0x55);
    emu_launch(emu_grid(n_groups), block, [&] {
        k_tq_quantize_nd<type, float>((const char *) xp.data(), cpy.data(), n_groups, s_pad, d_blk);
    });
    fwrite(cpy.data(), 1, cpy.size(), out);

    // 5. CPY turboq -> f16 (rows padded by 40 values)
    const int64_t dp = (ne0 + pad)*2;
    const tq_nd d_pad = { ne0, nrows, 1, 2, dp, dp*nrows, dp*nrows };
    std::vector<half> yp((ne0 + pad)*nrows, half{ 0x7e00 });
    emu_launch(emu_grid(n_groups), block, [&] {
        k_tq_dequantize_nd<type, half>(cpy.data(), (char *) yp.data(), n_groups, d_blk, d_pad);
    });
    for (int64_t i = 0; i < nrows; ++i) {
        fwrite(yp.data() + i*(ne0 + pad), 2, ne0, out);
    }
    for (int64_t i = 0; i < nrows; ++i) {
        for (int64_t j = ne0; j < ne0 + pad; ++j) {
            if (yp[i*(ne0 + pad) + j].bits != 0x7e00) {
                fprintf(stderr, "CPY wrote past row %lld's %lld values\n", (long long) i, (long long) ne0);
                exit(3);
            }
        }
    }
}

#define TQ_EMU_CASE(T) case T: codec<T>(ne0, nrows, x, out); break;

int main(int argc, char ** argv) {
    if (argc != 7 || strcmp(argv[1], "codec") != 0) {
        fprintf(stderr, "usage: %s codec TYPE_ID NE0 NROWS in.f32 out.bin\n", argv[0]);
        return 2;
    }
    const ggml_type type  = (ggml_type) atoi(argv[2]);
    const int64_t   ne0   = atoll(argv[3]);
    const int64_t   nrows = atoll(argv[4]);
    const int       group = ggml_turboq_group(type);
    if (group == 0 || ne0 <= 0 || ne0 % group != 0 || nrows <= 0 || nrows % 7 == 0) {
        fprintf(stderr, "bad arguments: type %d, ne0 %lld (a multiple of the group), nrows %lld (not a multiple of 7)\n",
                (int) type, (long long) ne0, (long long) nrows);
        return 2;
    }
    std::vector<float> x(ne0*nrows);
    FILE * in = fopen(argv[5], "rb");
    if (!in || fread(x.data(), 4, x.size(), in) != x.size()) {
        fprintf(stderr, "cannot read %lld floats from %s\n", (long long) x.size(), argv[5]);
        return 2;
    }
    fclose(in);
    FILE * out = fopen(argv[6], "wb");
    if (!out) {
        fprintf(stderr, "cannot write %s\n", argv[6]);
        return 2;
    }
    switch (type) {
        TQ_EMU_CASE(GGML_TYPE_TURBOQ2_0)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ3_0)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ4_0)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ8_0)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ2_G64)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ3_G64)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ4_G64)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ8_G64)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ2_G32)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ3_G32)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ4_G32)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ8_G32)
        default: fprintf(stderr, "type %d is not a turboq type\n", (int) type); return 2;
    }
    return fclose(out) == 0 ? 0 : 1;
}
