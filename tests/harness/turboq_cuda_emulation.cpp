// The CUDA backend's turboq codec kernels (ggml-cuda/turboq-device.cuh), compiled for the host and
// run under a small emulation of CUDA's execution model, so that they can be checked against the
// NumPy reference where no GPU is at hand (tests/test_cuda_emulation.py).
//
// What is emulated: a block is blockDim.x*blockDim.y threads; __syncthreads is a barrier of
// the block; each warp of 32 threads exchanges values through a barrier (__shfl_*_sync,
// __all_sync); __shared__ variables are statics, which the threads of the one block that runs at
// a time share. The threads are fibers (ucontext) on one OS thread, switched at the barriers:
// OS threads meeting at a barrier after every shuffle spent most of the test's time in the
// scheduler on a 2-core machine. The float intrinsics (__fadd_rn, ...) are IEEE single operations, compiled with
// -ffp-contract=off as nvcc keeps them. What is not: the GPU's flush-to-zero of subnormals
// (-use_fast_math), timing, memory coherence beyond the barriers, and the host launches (the
// harness plans and launches the kernels as turboq.cu and fattn-turboq*.cu do).
//
//   turboq-cuda-emulation codec TYPE_ID NE0 NROWS in.f32 out.bin
// reads NROWS rows of NE0 floats and writes, concatenated:
//   1. the blocks SET_ROWS stores (rows scattered through a permutation, written back in input order);
//   2. GET_ROWS to f32 of those blocks (gathered in reverse order, written back in input order);
//   3. GET_ROWS to f16;
//   4. the blocks of a CPY f32 -> turboq from a source with padded rows (quantize_nd);
//   5. CPY turboq -> f16 into a destination with padded rows (dequantize_nd), padding dropped.
//
//   turboq-cuda-emulation fa ...        (fa_main below)
//   turboq-cuda-emulation fa-f16 ...    (fa_f16_main below)
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <ucontext.h>
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
#define __launch_bounds__(...)
#define TURBOQ_TABLE static const
#define WARP_SIZE 32

struct half {
    uint16_t bits;
    operator uint16_t() const { return bits; }
};
static inline float __half2float(half h) { return ggml_fp16_to_fp32(h.bits); }
static inline float __half2float(uint16_t h) { return ggml_fp16_to_fp32(h); } // ggml_half is uint16_t here
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
using std::max;
using std::min;

struct float2 {
    float x, y;
};
static inline float2 make_float2(float x, float y) { return { x, y }; }

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// A barrier of fibers: the last to arrive goes on; the others return to the scheduler, which
// resumes them once the barrier's generation has moved on.
struct emu_barrier {
    explicit emu_barrier(int n) : expected(n) {}
    int      expected;
    int      count = 0;
    uint64_t gen   = 0;
    void arrive_and_wait();
};

struct emu_warp {
    emu_barrier bar{32};
    uint32_t slot[32];
};

struct emu_block {
    explicit emu_block(int n) : bar(n), warps(n/32) {}
    emu_barrier bar;
    std::vector<emu_warp> warps;
};

struct emu_fiber {
    ucontext_t          ctx;
    bool                done    = false;
    const emu_barrier * waiting = nullptr;  // blocked until waiting->gen != wait_gen
    uint64_t            wait_gen = 0;
};

// the running fiber's CUDA coordinates, set by the scheduler at every switch
static dim3        threadIdx;
static dim3        blockIdx;
static emu_block * emu_cur_block;
static emu_warp  * emu_cur_warp;
static int         emu_lane;
static emu_fiber * emu_cur_fiber;
static ucontext_t  emu_scheduler;

void emu_barrier::arrive_and_wait() {
    if (++count == expected) {
        count = 0;
        ++gen;
        return;
    }
    emu_cur_fiber->waiting  = this;
    emu_cur_fiber->wait_gen = gen;
    swapcontext(&emu_cur_fiber->ctx, &emu_scheduler);
}

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

static inline void __syncwarp() { emu_cur_warp->bar.arrive_and_wait(); }

template <int width = WARP_SIZE>
static float warp_reduce_sum(float x) {
    for (int offset = width/2; offset > 0; offset >>= 1) {
        x += __shfl_xor_sync(0xffffffff, x, offset, width);
    }
    return x;
}

static float get_alibi_slope(const float max_bias, const uint32_t h, const uint32_t n_head_log2, const float m0, const float m1) {
    if (max_bias <= 0.0f) {
        return 1.0f;
    }
    const float base = h < n_head_log2 ? m0 : m1;
    const int   exph = h < n_head_log2 ? h + 1 : 2*(h - n_head_log2) + 1;
    return powf(base, exph);
}

#define TURBOQ_CUDA_EMULATION 1
#include "ggml-cuda/turboq-device.cuh"
#include "ggml-cuda/fattn-turboq.cuh"
#include "ggml-cuda/fattn-turboq-f16.cuh"

static const std::function<void()> * emu_kernel;

static void emu_fiber_main() {
    (*emu_kernel)();
    emu_cur_fiber->done = true;  // then uc_link: back to the scheduler
}

// runs kernel() as grid x block threads, one block at a time, each thread a fiber; the stacks
// are kept for the next block (untouched pages cost nothing)
static void emu_launch(dim3 grid, dim3 block, const std::function<void()> & kernel) {
    constexpr size_t STACK = 512*1024;
    static std::vector<std::unique_ptr<char[]>> stacks;
    const int n = (int) (block.x*block.y*block.z);
    if (n % 32 != 0) {
        fprintf(stderr, "emulation: a block must be whole warps\n");
        exit(2);
    }
    while ((int) stacks.size() < n) {
        stacks.emplace_back(new char[STACK]);
    }
    emu_kernel = &kernel;
    for (unsigned bz = 0; bz < grid.z; ++bz) {
        for (unsigned by = 0; by < grid.y; ++by) {
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                emu_block blk(n);
                std::vector<emu_fiber> fibers(n);
                for (int t = 0; t < n; ++t) {
                    getcontext(&fibers[t].ctx);
                    fibers[t].ctx.uc_stack.ss_sp   = stacks[t].get();
                    fibers[t].ctx.uc_stack.ss_size = STACK;
                    fibers[t].ctx.uc_link          = &emu_scheduler;
                    makecontext(&fibers[t].ctx, emu_fiber_main, 0);
                }
                blockIdx = dim3(bx, by, bz);
                emu_cur_block = &blk;
                for (int left = n; left > 0;) {
                    bool ran = false;
                    for (int t = 0; t < n; ++t) {
                        emu_fiber & f = fibers[t];
                        if (f.done || (f.waiting && f.waiting->gen == f.wait_gen)) {
                            continue;
                        }
                        f.waiting     = nullptr;
                        threadIdx     = dim3(t % block.x, (t / block.x) % block.y, t / (block.x*block.y));
                        emu_cur_warp  = &blk.warps[t / 32];
                        emu_lane      = t % 32;
                        emu_cur_fiber = &f;
                        swapcontext(&emu_scheduler, &f.ctx);
                        ran = true;
                        left -= f.done;
                    }
                    if (!ran) {
                        fprintf(stderr, "emulation: every thread of the block waits at a barrier that not all reach\n");
                        exit(3);
                    }
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

// ---- flash attention, as ggml_cuda_turboq_fa_case plans and launches it ----

struct fa_args {
    int d, n_head, n_head_kv, n_q, n_kv;
    float softcap, max_bias;
    int64_t resident;                          // blocks the "GPU" holds at once: sets the KV split
    std::vector<float> q, k, v, sinks;         // q [n_head][n_q][d], k/v [n_head_kv][n_kv][d], sinks [n_head] or empty
    std::vector<uint16_t> mask;                // [n_q][n_kv] f16, or empty
    // exact rows (ggml-fa-exact.h), held as llama.cpp holds them: [n_exact][n_head_kv][d] (a
    // permuted view, so a head's rows are strided), of exact_type; their mask [n_q][n_exact] f16
    int n_exact = 0;
    ggml_type exact_type = GGML_TYPE_F32;
    std::vector<float> ek, ev;
    std::vector<uint16_t> emask;
};

static std::vector<char> fa_cache(ggml_type type, const std::vector<float> & x, int d) {
    std::vector<char> out(ggml_row_size(type, d) * (x.size() / d));
    if (type == GGML_TYPE_F16) {
        ggml_fp32_to_fp16_row(x.data(), (ggml_fp16_t *) out.data(), (int64_t) x.size());
    } else if (type == GGML_TYPE_F32) {
        memcpy(out.data(), x.data(), x.size()*sizeof(float));
    } else {
        ggml_get_type_traits(type)->from_float_ref(x.data(), out.data(), (int64_t) x.size());
    }
    return out;
}

template <int D, int ncols, ggml_type TK, ggml_type TV>
static void fa_run(const fa_args & a, tq_fa_params p, std::vector<float> & dst) {
    const tq_fa_grid g = tq_fa_plan(p, ncols, a.n_kv, a.resident);
    p.nsplit       = g.nsplit;
    p.kv_per_split = g.kv_per_split;
    const int     n_slices = g.nsplit + (a.n_exact ? 1 : 0);
    const int64_t n_rows   = (int64_t) p.ne01*p.ne02*p.ne03;
    std::vector<float>  vkq(n_slices*n_rows*D, NAN);
    std::vector<float2> meta(n_slices*n_rows, float2{ NAN, NAN });
    p.VKQ  = vkq.data();
    p.meta = meta.data();
    emu_launch(dim3(g.gx, g.gy, g.gz), dim3(WARP_SIZE, TQ_FA_NWARPS, 1), [&] { tq_flash_attn_ext<D, ncols, TK, TV>(p); });
    if (a.n_exact) {
        // as ggml_cuda_turboq_fa_exact launches it (fattn-turboq-exact.cu, tq_fa_set_exact)
        const std::vector<char> ek = fa_cache(a.exact_type, a.ek, D);
        const std::vector<char> ev = fa_cache(a.exact_type, a.ev, D);
        const int64_t row = ggml_row_size(a.exact_type, D);
        tq_fa_params e = p;
        e.K = ek.data(); e.V = ev.data(); e.mask = (const char *) a.emask.data();
        e.ne11 = a.n_exact; e.ne12 = a.n_head_kv; e.ne13 = 1;
        e.nb11 = row*a.n_head_kv; e.nb12 = row; e.nb13 = e.nb11*a.n_exact;
        e.ne22 = a.n_head_kv; e.ne23 = 1;
        e.nb21 = e.nb11; e.nb22 = e.nb12; e.nb23 = e.nb13;
        e.ne32 = 1; e.ne33 = 1;
        e.nb31 = (int64_t) a.n_exact*2; e.nb32 = e.nb31*a.n_q; e.nb33 = e.nb32;
        const tq_fa_grid ge = tq_fa_exact_plan(e, ncols, a.n_exact, g.nsplit);
        if (a.exact_type == GGML_TYPE_F16) {
            emu_launch(dim3(ge.gx, ge.gy, ge.gz), dim3(WARP_SIZE, TQ_FA_NWARPS, 1),
                       [&] { tq_flash_attn_ext<D, ncols, GGML_TYPE_F16, GGML_TYPE_F16>(e); });
        } else {
            emu_launch(dim3(ge.gx, ge.gy, ge.gz), dim3(WARP_SIZE, TQ_FA_NWARPS, 1),
                       [&] { tq_flash_attn_ext<D, ncols, GGML_TYPE_F32, GGML_TYPE_F32>(e); });
        }
    }
    emu_launch(dim3((unsigned) n_rows), dim3(D), [&] {
        tq_flash_attn_ext_combine<D, tq_group(TV)>(vkq.data(), meta.data(), a.sinks.empty() ? nullptr : a.sinks.data(),
                                                       dst.data(), n_rows, n_slices, a.n_head, g.nsplit);
    });
    fprintf(stderr, "fa: ncols %d (%d heads), grid %d x %d x %d, %d KV slices of %d\n", ncols, p.ncols2, g.gx, g.gy, g.gz,
            g.nsplit, g.kv_per_split);
}

template <int D, ggml_type TK, ggml_type TV>
static std::vector<float> fa(const fa_args & a) {
    const std::vector<char> k = fa_cache(TK, a.k, D);
    const std::vector<char> v = fa_cache(TV, a.v, D);
    const int64_t rk = ggml_row_size(TK, D);
    const int64_t rv = ggml_row_size(TV, D);

    tq_fa_params p = {};
    p.Q    = (const char *) a.q.data();
    p.K    = k.data();
    p.V    = v.data();
    p.mask = a.mask.empty() ? nullptr : (const char *) a.mask.data();
    tq_fa_set_scales(p, 1.0f/sqrtf((float) D), a.max_bias, a.softcap, (uint32_t) a.n_head);
    p.ne01 = a.n_q; p.ne02 = a.n_head; p.ne03 = 1;
    p.nb01 = D*4; p.nb02 = p.nb01*a.n_q; p.nb03 = p.nb02*a.n_head;
    p.ne11 = a.n_kv; p.ne12 = a.n_head_kv; p.ne13 = 1;
    p.nb11 = rk; p.nb12 = rk*a.n_kv; p.nb13 = p.nb12*a.n_head_kv;
    p.ne22 = a.n_head_kv; p.ne23 = 1;
    p.nb21 = rv; p.nb22 = rv*a.n_kv; p.nb23 = p.nb22*a.n_head_kv;
    p.ne32 = 1; p.ne33 = 1;
    p.nb31 = (int64_t) a.n_kv*2; p.nb32 = p.nb31*a.n_q; p.nb33 = p.nb32;

    std::vector<float> dst((size_t) a.n_q*a.n_head*D, NAN);
    switch (tq_fa_ncols(a.n_q, a.n_head / a.n_head_kv, &p.ncols2)) {
        case 2:  fa_run<D, 2, TK, TV>(a, p, dst); break;
        case 4:  fa_run<D, 4, TK, TV>(a, p, dst); break;
        default: fa_run<D, 8, TK, TV>(a, p, dst); break;
    }
    return dst;
}

// the K/V pairs and head sizes that tests/test_cuda_emulation.py runs (each is three kernel instances)
#define TQ_EMU_FA_CASES(X)                                      \
    X(128, GGML_TYPE_TURBOQ3, GGML_TYPE_TURBOQ3)            \
    X(256, GGML_TYPE_TURBOQ4, GGML_TYPE_TURBOQ2)            \
    X(128, GGML_TYPE_Q8_0,      GGML_TYPE_TURBOQ4)            \
    X(256, GGML_TYPE_F16,       GGML_TYPE_TURBOQ3)            \
    X(128, GGML_TYPE_TURBOQ8, GGML_TYPE_TURBOQ8)            \
    X(128, GGML_TYPE_TURBOQ2, GGML_TYPE_F16)                  \
    X(128, GGML_TYPE_TURBOQ3, GGML_TYPE_Q8_0)                 \
    X( 64, GGML_TYPE_TURBOQ3_G64, GGML_TYPE_TURBOQ3_G64)        \
    X( 64, GGML_TYPE_TURBOQ4_G64, GGML_TYPE_F16)                \
    X( 64, GGML_TYPE_Q8_0,        GGML_TYPE_TURBOQ2_G64)        \
    X( 96, GGML_TYPE_TURBOQ3_G32, GGML_TYPE_TURBOQ3_G32)        \
    X( 96, GGML_TYPE_F16,         GGML_TYPE_TURBOQ8_G32)        \
    X( 96, GGML_TYPE_TURBOQ4_G32, GGML_TYPE_Q8_0)                 \
    X(128, GGML_TYPE_TURBOQ3T,   GGML_TYPE_TURBOQ3T)          \
    X(256, GGML_TYPE_TURBOQ2T,   GGML_TYPE_TURBOQ4)          \
    X(128, GGML_TYPE_F16,         GGML_TYPE_TURBOQ2T)

static bool read_file(const char * path, void * dst, size_t n) {
    FILE * f = fopen(path, "rb");
    const bool ok = f && fread(dst, 1, n, f) == n;
    if (f) {
        fclose(f);
    }
    if (!ok) {
        fprintf(stderr, "cannot read %zu bytes from %s\n", n, path);
    }
    return ok;
}

// fa TYPE_K TYPE_V D N_HEAD N_HEAD_KV N_Q N_KV SOFTCAP MAX_BIAS RESIDENT q.f32 k.f32 v.f32 mask.f16|- sinks.f32|- out.f32
//    [N_EXACT EXACT_TYPE ek.f32 ev.f32 emask.f16]   (exact rows: EXACT_TYPE 0 = f32, 1 = f16, as ggml's ids)
static int fa_main(int argc, char ** argv) {
    if (argc != 18 && argc != 23) {
        fprintf(stderr, "usage: %s fa TYPE_K TYPE_V D N_HEAD N_HEAD_KV N_Q N_KV SOFTCAP MAX_BIAS RESIDENT "
                        "q.f32 k.f32 v.f32 mask.f16|- sinks.f32|- out.f32 [N_EXACT EXACT_TYPE ek.f32 ev.f32 emask.f16]\n", argv[0]);
        return 2;
    }
    const ggml_type tk = (ggml_type) atoi(argv[2]);
    const ggml_type tv = (ggml_type) atoi(argv[3]);
    fa_args a;
    a.d = atoi(argv[4]); a.n_head = atoi(argv[5]); a.n_head_kv = atoi(argv[6]); a.n_q = atoi(argv[7]); a.n_kv = atoi(argv[8]);
    a.softcap = (float) atof(argv[9]); a.max_bias = (float) atof(argv[10]); a.resident = atoll(argv[11]);
    if (a.n_head <= 0 || a.n_head_kv <= 0 || a.n_head % a.n_head_kv != 0 || a.n_q <= 0 || a.n_kv <= 0 || a.resident <= 0) {
        fprintf(stderr, "bad shapes\n");
        return 2;
    }
    a.q.resize((size_t) a.n_head*a.n_q*a.d);
    a.k.resize((size_t) a.n_head_kv*a.n_kv*a.d);
    a.v.resize(a.k.size());
    bool ok = read_file(argv[12], a.q.data(), a.q.size()*4) && read_file(argv[13], a.k.data(), a.k.size()*4) &&
              read_file(argv[14], a.v.data(), a.v.size()*4);
    if (ok && strcmp(argv[15], "-") != 0) {
        a.mask.resize((size_t) a.n_q*a.n_kv);
        ok = read_file(argv[15], a.mask.data(), a.mask.size()*2);
    }
    if (ok && strcmp(argv[16], "-") != 0) {
        a.sinks.resize(a.n_head);
        ok = read_file(argv[16], a.sinks.data(), a.sinks.size()*4);
    }
    if (ok && argc == 23) {
        a.n_exact    = atoi(argv[18]);
        a.exact_type = (ggml_type) atoi(argv[19]);
        if (a.n_exact <= 0 || (a.exact_type != GGML_TYPE_F32 && a.exact_type != GGML_TYPE_F16)) {
            fprintf(stderr, "bad exact rows: %d of type %d\n", a.n_exact, (int) a.exact_type);
            return 2;
        }
        a.ek.resize((size_t) a.n_exact*a.n_head_kv*a.d);
        a.ev.resize(a.ek.size());
        a.emask.resize((size_t) a.n_q*a.n_exact);
        ok = read_file(argv[20], a.ek.data(), a.ek.size()*4) && read_file(argv[21], a.ev.data(), a.ev.size()*4) &&
             read_file(argv[22], a.emask.data(), a.emask.size()*2);
    }
    if (!ok) {
        return 2;
    }
    std::vector<float> out;
#define TQ_EMU_FA_DISPATCH(D_, TK_, TV_) \
    if (out.empty() && a.d == (D_) && tk == (TK_) && tv == (TV_)) { out = fa<D_, TK_, TV_>(a); }
    TQ_EMU_FA_CASES(TQ_EMU_FA_DISPATCH)
#undef TQ_EMU_FA_DISPATCH
    if (out.empty()) {
        fprintf(stderr, "no emulated instance for D=%d K=%s V=%s (TQ_EMU_FA_CASES)\n", a.d, ggml_type_name(tk), ggml_type_name(tv));
        return 2;
    }
    FILE * f = fopen(argv[17], "wb");
    if (!f || fwrite(out.data(), 4, out.size(), f) != out.size()) {
        fprintf(stderr, "cannot write %s\n", argv[17]);
        return 1;
    }
    return fclose(f) == 0 ? 0 : 1;
}


// ---- a larger batch's F16 K, V and mask with the exact rows appended (fattn-turboq-f16.cuh) ----

// fa-f16 TYPE_K TYPE_V D N_HEAD_KV N_STREAM N_Q N_KV N_EXACT EXACT_TYPE EXACT_STREAMS
//        k.f32 v.f32 mask.f16 ek.f32 ev.f32 emask.f16 out.bin
// k, v: [N_STREAM][N_KV][N_HEAD_KV][D] (a cache's view: the KV heads of a row together, each
// stream its own rows), turboq or f16; mask [N_STREAM][N_Q][N_KV] f16; ek, ev
// [EXACT_STREAMS][N_EXACT][N_HEAD_KV][D] and emask [EXACT_STREAMS][N_Q][N_EXACT], EXACT_STREAMS 1
// (every stream reads the same set) or N_STREAM. tq_fa_f16_node_init and tq_fa_f16_fill run as
// CUDA runs them, with launches emulated; writes the buffers, concatenated: K, V
// [N_STREAM][N_HEAD_KV][n_tot][D] f16, the mask [N_STREAM][rows][n_tot] f16 (n_tot, rows on stderr).
template <ggml_type type>
static void fa_f16_convert(const char * x, half * y, int64_t ne00, int64_t ne01, int64_t s01, int64_t s02, int64_t s03) {
    // as tq_to_fp16_nc (turboq.cu) converts with ne02 = ne03 = 1
    const int64_t bs = (int64_t) sizeof(typename tq_traits<type>::block);
    const tq_nd s = { ne00, ne01, 1, bs, s01*bs, s02*bs, s03*bs };
    const tq_nd d = { ne00, ne01, 1, 2, 2*ne00, 2*ne00*ne01, 2*ne00*ne01 };
    const int64_t n_groups = ne00*ne01 / tq_traits<type>::G;
    emu_launch(emu_grid(n_groups), dim3(WARP_SIZE, TQ_WARPS_PER_BLOCK, 1),
               [&] { k_tq_dequantize_nd<type, half>(x, (char *) y, n_groups, s, d); });
}

// a tensor struct over host data: ne0 x ne1 x ne2 x ne3 at byte strides nb1..nb3
static ggml_tensor fa_f16_view(ggml_type type, void * data, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3,
                               size_t nb1, size_t nb2, size_t nb3) {
    ggml_tensor t = {};
    t.type = type;
    t.data = data;
    t.ne[0] = ne0; t.ne[1] = ne1; t.ne[2] = ne2; t.ne[3] = ne3;
    t.nb[0] = ggml_type_size(type); t.nb[1] = nb1; t.nb[2] = nb2; t.nb[3] = nb3;
    return t;
}

static int fa_f16_main(int argc, char ** argv) {
    if (argc != 19) {
        fprintf(stderr, "usage: %s fa-f16 TYPE_K TYPE_V D N_HEAD_KV N_STREAM N_Q N_KV N_EXACT EXACT_TYPE EXACT_STREAMS "
                        "k.f32 v.f32 mask.f16 ek.f32 ev.f32 emask.f16 out.bin\n", argv[0]);
        return 2;
    }
    const ggml_type types[2] = { (ggml_type) atoi(argv[2]), (ggml_type) atoi(argv[3]) };
    const int64_t d = atoi(argv[4]), n_head_kv = atoi(argv[5]), n_stream = atoi(argv[6]), n_q = atoi(argv[7]),
                  n_kv = atoi(argv[8]), n_exact = atoi(argv[9]), n_es = atoi(argv[11]);
    const ggml_type te = (ggml_type) atoi(argv[10]);
    for (ggml_type t : types) {
        if (t != GGML_TYPE_F16 && (ggml_turboq_group(t) == 0 || d % ggml_turboq_group(t) != 0)) {
            fprintf(stderr, "the cache must be f16 or a turboq type whose group divides D\n");
            return 2;
        }
    }
    if (d <= 0 || n_head_kv <= 0 || n_stream <= 0 || n_q <= 0 || n_kv <= 0 || n_exact <= 0 ||
        (te != GGML_TYPE_F32 && te != GGML_TYPE_F16) || (n_es != 1 && n_es != n_stream)) {
        fprintf(stderr, "bad shapes\n");
        return 2;
    }
    std::vector<float> kv[2], ex[2];
    std::vector<uint16_t> mask((size_t) n_stream*n_q*n_kv), emask((size_t) n_es*n_q*n_exact);
    bool ok = true;
    for (int i = 0; i < 2; ++i) {
        kv[i].resize((size_t) n_stream*n_kv*n_head_kv*d);
        ex[i].resize((size_t) n_es*n_exact*n_head_kv*d);
        ok = ok && read_file(argv[12 + i], kv[i].data(), kv[i].size()*4) && read_file(argv[15 + i], ex[i].data(), ex[i].size()*4);
    }
    ok = ok && read_file(argv[14], mask.data(), mask.size()*2) && read_file(argv[17], emask.data(), emask.size()*2);
    if (!ok) {
        return 2;
    }
    std::vector<char> cache[2], exact[2];
    ggml_tensor c[2], e[2];
    for (int i = 0; i < 2; ++i) {
        cache[i] = fa_cache(types[i], kv[i], (int) d);
        exact[i] = fa_cache(te, ex[i], (int) d);
        const size_t row = ggml_row_size(types[i], d), erow = ggml_row_size(te, d);
        c[i] = fa_f16_view(types[i], cache[i].data(), d, n_kv, n_head_kv, n_stream, row*n_head_kv, row, row*n_head_kv*n_kv);
        e[i] = fa_f16_view(te, exact[i].data(), d, n_exact, n_head_kv, n_es, erow*n_head_kv, erow, erow*n_head_kv*n_exact);
    }
    ggml_tensor q  = fa_f16_view(GGML_TYPE_F32, nullptr, d, n_q, 4*n_head_kv, n_stream, 4*d, 4*d*n_q, 16*d*n_q*n_head_kv);
    ggml_tensor m  = fa_f16_view(GGML_TYPE_F16, mask.data(), n_kv, n_q, 1, n_stream, 2*n_kv, 2*n_kv*n_q, 2*n_kv*n_q);
    ggml_tensor em = fa_f16_view(GGML_TYPE_F16, emask.data(), n_exact, n_q, 1, n_es, 2*n_exact, 2*n_exact*n_q, 2*n_exact*n_q);
    ggml_tensor fa = fa_f16_view(GGML_TYPE_F32, nullptr, d, 4*n_head_kv, n_q, n_stream, 4*d, 16*d*n_head_kv, 16*d*n_head_kv*n_q);
    fa.op = GGML_OP_FLASH_ATTN_EXT;
    fa.src[0] = &q; fa.src[1] = &c[0]; fa.src[2] = &c[1]; fa.src[3] = &m;
    ggml_flash_attn_ext_set_exact(&fa, &e[0], &e[1], &em);

    tq_fa_f16_node n;
    const auto converts = [](const ggml_tensor * t) { return t->type == GGML_TYPE_F16 || ggml_turboq_group(t->type) != 0; };
    if (!tq_fa_f16_node_init(n, &fa, converts)) {
        fprintf(stderr, "tq_fa_f16_node_init declined the node\n");
        return 1;
    }
    const tq_fa_f16_layout & l = n.layout;
    std::vector<char> buf(l.size + 128);
    char * base = (char *) tq_fa_f16_align((uintptr_t) buf.data());
    for (size_t i = 0; i + 1 < l.size; i += 2) {
        memcpy(base + i, "\x00\x7e", 2);  // NaN: every value must be written
    }
    const auto convert = [](const ggml_tensor * cache, const char * x, half * y, int64_t ne00, int64_t ne01, int64_t s01,
                            int64_t s02, int64_t s03) {
        switch (cache->type) {
            case GGML_TYPE_TURBOQ2:     fa_f16_convert<GGML_TYPE_TURBOQ2>(x, y, ne00, ne01, s01, s02, s03); break;
            case GGML_TYPE_TURBOQ3:     fa_f16_convert<GGML_TYPE_TURBOQ3>(x, y, ne00, ne01, s01, s02, s03); break;
            case GGML_TYPE_TURBOQ4:     fa_f16_convert<GGML_TYPE_TURBOQ4>(x, y, ne00, ne01, s01, s02, s03); break;
            case GGML_TYPE_TURBOQ3_G64: fa_f16_convert<GGML_TYPE_TURBOQ3_G64>(x, y, ne00, ne01, s01, s02, s03); break;
            case GGML_TYPE_TURBOQ3T:    fa_f16_convert<GGML_TYPE_TURBOQ3T>(x, y, ne00, ne01, s01, s02, s03); break;
            default: fprintf(stderr, "no emulated conversion for %s\n", ggml_type_name(cache->type)); exit(2);
        }
    };
    const auto rows = [](const tq_fa_f16_rows_args & a) {
        emu_launch(a.grid, dim3(TQ_FA_F16_THREADS), [&] {
            if (a.type == GGML_TYPE_F32) {
                k_tq_fa_f16_rows<float>(a);
            } else {
                k_tq_fa_f16_rows<half>(a);
            }
        });
    };
    const auto masks = [](const tq_fa_f16_mask_args & a) {
        emu_launch(a.grid, dim3(TQ_FA_F16_THREADS), [&] { k_tq_fa_f16_mask(a); });
    };
    tq_fa_f16_fill(n, &fa, base, convert, rows, masks);
    if (n.k.data != base + l.k_offs || n.mask.data != base + l.mask_offs || n.fa.src[1] != &n.k || n.fa.src[5] != nullptr) {
        fprintf(stderr, "the node does not point at its buffers\n");
        return 1;
    }
    fprintf(stderr, "n_tot %lld, mask rows %lld\n", (long long) l.n_tot, (long long) l.mask_ne1);
    FILE * f = fopen(argv[18], "wb");
    const size_t nk = ggml_nbytes(&n.k), nv = ggml_nbytes(&n.v), nm = ggml_nbytes(&n.mask);
    ok = f && fwrite(n.k.data, 1, nk, f) == nk && fwrite(n.v.data, 1, nv, f) == nv && fwrite(n.mask.data, 1, nm, f) == nm;
    if (!ok) {
        fprintf(stderr, "cannot write %s\n", argv[18]);
    }
    return f && fclose(f) == 0 && ok ? 0 : 1;
}

#define TQ_EMU_CASE(T) case T: codec<T>(ne0, nrows, x, out); break;

int main(int argc, char ** argv) {
    if (argc >= 2 && strcmp(argv[1], "fa") == 0) {
        return fa_main(argc, argv);
    }
    if (argc >= 2 && strcmp(argv[1], "fa-f16") == 0) {
        return fa_f16_main(argc, argv);
    }
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
        TQ_EMU_CASE(GGML_TYPE_TURBOQ2)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ3)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ4)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ8)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ2_G64)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ3_G64)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ4_G64)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ8_G64)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ2_G32)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ3_G32)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ4_G32)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ8_G32)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ2_G16)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ3_G16)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ4_G16)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ8_G16)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ3T)
        TQ_EMU_CASE(GGML_TYPE_TURBOQ2T)
        default: fprintf(stderr, "type %d is not a turboq type\n", (int) type); return 2;
    }
    return fclose(out) == 0 ? 0 : 1;
}
