// One decode step's flash-attention node on the CPU backend, alone (issue 62): Q [D, nq, H],
// K and V [D, N, HKV] of the given types filled with quantized random rows, a zero mask, timed
// over many graph computes, and the node's read-bandwidth bound beside it: the K/V bytes over
// the measured read bandwidth of this machine with the same thread count (a read of a buffer
// larger than the caches, in 4 KiB pages as ggml's CPU buffers are). A layer of SmolLM2-135M at depth 8192 is `64 9 3 8192`; Gemma 3's
// global layers `256 4 1 N`.
//
//     g++ -O2 -march=native -std=c++17 -I build/upstream/llama.cpp/ggml/include bench/fa_decode_node.cpp \
//         -L build/bin -lggml-base -lggml-cpu -lggml -Wl,-rpath,$PWD/build/bin -pthread -o /tmp/fa_decode_node
//     /tmp/fa_decode_node TYPE_K TYPE_V D H HKV N THREADS [ITERS [NQ [OUT|- [LAYERS [LAYOUT]]]]]
//
// LAYERS (default 1) puts that many such nodes, each with its own K/V, in one graph, as a decode
// step's layers: once they outgrow the caches, K/V come from memory, as in a real decode (the
// figures are per node). LAYOUT `llama` (the default) holds K/V as llama.cpp's cache does, a
// position's KV heads side by side; `head-major` holds each KV head's rows contiguously (until
// 2026-12-07 this bench's only layout, which made a node look faster than in a model).
//
// Two libggml-cpu builds compare by LD_LIBRARY_PATH (the rpath is a RUNPATH). It prints a checksum
// of the output and writes the output's floats to OUT when given, so that two builds' results
// can be diffed.
// Results: bench/results/cpu-decode.md.
#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

static ggml_type type_of(const char * name) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * s = ggml_type_name((ggml_type) t);
        if (s && strcmp(s, name) == 0) {
            return (ggml_type) t;
        }
    }
    fprintf(stderr, "unknown type %s\n", name);
    exit(2);
}

// GB/s of a read of 512 MiB by nth threads, the best of three. The loop ORs 32-byte vectors into
// four accumulators, and needs -march=native to load them whole: on one thread of the 2-core
// AVX-512 machine, a scalar loop of 64-bit adds read 10.1 GB/s and this loop with SSE2 10.5, where
// it reads 13.2 GB/s with AVX2, and NumPy's reduction over 4 KiB pages (bench speed's probe,
// pyturbo/bench/bandwidth.py) 14.2; the slower loops measured themselves, not the memory.
typedef uint64_t probe_vec __attribute__((vector_size(32)));
static double read_bandwidth(int nth) {
    const size_t n = (size_t) 512 << 20 >> 5;
    std::vector<probe_vec> buf(n, probe_vec{1, 1, 1, 1});
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) {
        std::vector<uint64_t> part(nth * 8);
        const auto t0 = std::chrono::steady_clock::now();
        std::vector<std::thread> th;
        for (int i = 0; i < nth; ++i) {
            th.emplace_back([&, i] {
                probe_vec s0 = {}, s1 = {}, s2 = {}, s3 = {};
                for (size_t j = n*i/nth; j + 4 <= n*(i + 1)/nth; j += 4) {
                    s0 |= buf[j]; s1 |= buf[j + 1]; s2 |= buf[j + 2]; s3 |= buf[j + 3];
                }
                const probe_vec s = s0 | s1 | s2 | s3;
                part[i*8] = s[0] | s[1] | s[2] | s[3];
            });
        }
        for (auto & t : th) {
            t.join();
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        uint64_t sum = 0;
        for (int i = 0; i < nth; ++i) {
            sum += part[i*8];
        }
        if (sum == 0) {
            fprintf(stderr, "unexpected sum\n");
        }
        best = std::max(best, n*32/s/1e9);
    }
    return best;
}

int main(int argc, char ** argv) {
    if (argc < 8) {
        fprintf(stderr, "usage: %s TYPE_K TYPE_V D H HKV N THREADS [ITERS [NQ [OUT|- [LAYERS [llama|head-major]]]]]\n", argv[0]);
        return 2;
    }
    const ggml_type tk = type_of(argv[1]), tv = type_of(argv[2]);
    const int D = atoi(argv[3]), H = atoi(argv[4]), HKV = atoi(argv[5]), N = atoi(argv[6]), nth = atoi(argv[7]);
    const int iters = argc > 8 ? atoi(argv[8]) : 50;
    const int nq = argc > 9 ? atoi(argv[9]) : 1;

    const int  layers     = argc > 11 ? std::max(1, atoi(argv[11])) : 1;
    const bool head_major = argc > 12 && strcmp(argv[12], "head-major") == 0;
    if (argc > 12 && !head_major && strcmp(argv[12], "llama") != 0) {
        fprintf(stderr, "LAYOUT is llama or head-major, not %s\n", argv[12]);
        return 2;
    }
    const size_t mem = (ggml_row_size(tk, (int64_t) D*N*HKV) + ggml_row_size(tv, (int64_t) D*N*HKV) + (size_t) D*H*nq*8 + 4096)*layers +
                       (size_t) N*nq*2 + ((size_t) 64 << 20);
    ggml_context * ctx = ggml_init({ mem, nullptr, false });
    ggml_tensor * m = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, N, nq, 1, 1);
    for (int64_t i = 0; i < ggml_nelements(m); ++i) ((ggml_fp16_t *) m->data)[i] = ggml_fp32_to_fp16(0.0f);
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0, 1);
    std::vector<float> buf((size_t) D*N*HKV);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_tensor * out = nullptr, * k = nullptr, * v = nullptr;
    for (int l = 0; l < layers; ++l) {
        ggml_tensor * q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, nq, H, 1);
        // as llama.cpp's cache holds them: a position's KV heads side by side, a head's rows strided
        ggml_tensor * kc = ggml_new_tensor_2d(ctx, tk, (int64_t) D*HKV, N);
        ggml_tensor * vc = ggml_new_tensor_2d(ctx, tv, (int64_t) D*HKV, N);
        for (auto & x : buf) x = nd(rng);
        ggml_quantize_chunk(tk, buf.data(), kc->data, 0, (int64_t) N*HKV, D, nullptr);
        for (auto & x : buf) x = nd(rng);
        ggml_quantize_chunk(tv, buf.data(), vc->data, 0, (int64_t) N*HKV, D, nullptr);
        for (int64_t i = 0; i < ggml_nelements(q); ++i) ((float *) q->data)[i] = nd(rng);
        if (head_major) {
            k = ggml_view_3d(ctx, kc, D, N, HKV, ggml_row_size(tk, D), ggml_row_size(tk, D)*N, 0);
            v = ggml_view_3d(ctx, vc, D, N, HKV, ggml_row_size(tv, D), ggml_row_size(tv, D)*N, 0);
        } else {
            k = ggml_view_3d(ctx, kc, D, N, HKV, kc->nb[1], ggml_row_size(tk, D), 0);
            v = ggml_view_3d(ctx, vc, D, N, HKV, vc->nb[1], ggml_row_size(tv, D), 0);
        }
        out = ggml_flash_attn_ext(ctx, q, k, v, m, 1.0f/sqrtf((float) D), 0.0f, 0.0f);
        ggml_build_forward_expand(gf, out);
    }
    ggml_backend_t be = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(be, nth);
    ggml_backend_graph_compute(be, gf);

    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) {
        ggml_backend_graph_compute(be, gf);
    }
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count()/iters/layers;

    const float * o = (const float *) out->data;
    double cs = 0;
    for (int64_t i = 0; i < ggml_nelements(out); ++i) cs += o[i];
    if (argc > 10 && strcmp(argv[10], "-") != 0) {
        FILE * f = fopen(argv[10], "wb");
        if (!f) {
            fprintf(stderr, "cannot write %s\n", argv[10]);
            return 1;
        }
        fwrite(o, sizeof(float), ggml_nelements(out), f);
        fclose(f);
    }
    const double bytes = (double) (ggml_nbytes(k) + ggml_nbytes(v));
    const double bw = read_bandwidth(nth);
    const double bound_us = bytes/(bw*1e3);
    printf("%s/%s D=%d H=%d HKV=%d N=%d nq=%d layers=%d -t %d: %.1f us a node; K+V %.2f MB, read bandwidth %.1f GB/s, "
           "bound %.1f us (%.0f%% of it); checksum %.6f\n", argv[1], argv[2], D, H, HKV, N, nq, layers, nth, us, bytes/1e6, bw,
           bound_us, 100*bound_us/us, cs);
    ggml_backend_free(be);
    ggml_free(ctx);
    return 0;
}
