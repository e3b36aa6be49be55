// What a trellis-coded turboq would cost in C (issue 21's trellis lever; the lab's
// pyturbo/lab/trellis.py). A bit-shift trellis of 256 states (L = 8) or 64
// (L = 6), k = 2 or 3 bits per value, one 128-value group at a time: s_t = ((s_{t-1} << k) | c_t)
// mod 2^L from s_{-1} = 0, value t read back as cb[s_t].
//
// The encoder is Viterbi with back-pointers per step, three ways: plain C, AVX2 and AVX-512 (the
// 256 path costs are 32 or 16 vector registers; AVX-512 for 256 states only). Each keeps the
// lab's float32 operations in the lab's order and its first-minimum ties, so all three return
// pyturbo.format.trellis.viterbi's paths bit for bit (tests/test_kvlab.py runs `check`).
//
// The decoder needs no state carried along a row: s_t is the last L bits of the code stream up
// to c_t, so with the codes packed most significant bit first, value t is cb[the L bits that end
// at bit k(t+1)], one unaligned load, a shift and a table read, at any t. `bench` times it beside
// the shipped turboq3 decoder's shape (3-bit indices through an 8-entry permute) and an F16 row,
// each as a dot product with a query, which is what flash attention does with a K row. Build it
// as ggml builds its CPU backend (-O3 -march=native) for the timings: at -O2 the AVX functions
// are not inlined into their loops.
//
//     gcc -O3 -march=native -ffp-contract=off -o /tmp/trellis_viterbi bench/trellis_viterbi.c -lm
//     /tmp/trellis_viterbi bench                        # the cost table (x86-64)
//     /tmp/trellis_viterbi check K L IMPL < in > out   # in: 2^L codebook floats, then groups of
//                                                   # 128 floats; out: 128 state bytes per group
//
// Results: bench/results/quality-per-bit.md.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define S 256  // states at most (L = 8); `check` and the encoders take L = 6 too
#define N 128

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

// the states of the path from s_{-1} = 0 that ends in `s` at t = N-1, in a trellis of ns states
static void trace_back(uint8_t back[N][64], int k, int ns, int s, uint8_t * states) {
    const int lo = ns >> k;
    for (int t = N - 1; t >= 0; --t) {
        states[t] = (uint8_t) s;
        const int p = s >> k;
        s = back[t][p] * lo + p;
    }
}

static int argmin(const float * cost, int ns) {
    int s = 0;
    for (int m = 1; m < ns; ++m) if (cost[m] < cost[s]) s = m;
    return s;
}

static void encode_c(const float * y, const float * cb, int k, int ns, uint8_t * states) {
    const int lo = ns >> k, nh = 1 << k;
    float cost[S], best[64];
    uint8_t back[N][64];  // per (t, p): the h of state p's cheapest predecessor h*lo + p
    for (int m = 0; m < ns; ++m) cost[m] = m == 0 ? 0.f : INFINITY;
    for (int t = 0; t < N; ++t) {
        uint8_t * bt = back[t];
        for (int p = 0; p < lo; ++p) { best[p] = cost[p]; bt[p] = 0; }
        for (int h = 1; h < nh; ++h) {
            const float * ch = cost + h*lo;
            for (int p = 0; p < lo; ++p) {
                const int lt = ch[p] < best[p];
                best[p] = lt ? ch[p] : best[p];
                bt[p]   = lt ? (uint8_t) h : bt[p];
            }
        }
        for (int m = 0; m < ns; ++m) { const float d = y[t] - cb[m]; cost[m] = best[m >> k] + d*d; }
    }
    trace_back(back, k, ns, argmin(cost, ns), states);
}

#if defined(__x86_64__)
// 8 floats a register: state m = 8i + l, its best predecessor's cost best[m >> k] sits in
// best register (8i >> k) / 8 at lane (8i >> k) % 8 + (l >> k)
__attribute__((target("avx2"))) static inline void encode_avx2_k(const float * y, const float * cb, const int k,
                                                                 const int ns, uint8_t * states) {
    const int lo = ns >> k, nh = 1 << k, nb = lo / 8, nv = ns / 8;
    __m256 cost[32], best[8], cbv[32];
    __m256i lane_of[32];
    uint8_t back[N][64];
    for (int i = 0; i < nv; ++i) {
        cbv[i]  = _mm256_loadu_ps(cb + 8*i);
        cost[i] = _mm256_set1_ps(INFINITY);
        const int p0 = (8*i) >> k;
        lane_of[i] = _mm256_add_epi32(_mm256_set1_epi32(p0 % 8),
                                      _mm256_srlv_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(k)));
    }
    cost[0] = _mm256_setr_ps(0.f, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY);
    for (int t = 0; t < N; ++t) {
        for (int j = 0; j < nb; ++j) {
            __m256 b = cost[j];
            __m256i id = _mm256_setzero_si256();
            for (int h = 1; h < nh; ++h) {
                const __m256 c  = cost[h*nb + j];
                const __m256 lt = _mm256_cmp_ps(c, b, _CMP_LT_OQ);
                b  = _mm256_blendv_ps(b, c, lt);
                id = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(id),
                                                          _mm256_castsi256_ps(_mm256_set1_epi32(h)), lt));
            }
            best[j] = b;
            const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(id), _mm256_extracti128_si256(id, 1));
            _mm_storel_epi64((__m128i *) (back[t] + 8*j), _mm_packus_epi16(w, w));
        }
        const __m256 yt = _mm256_set1_ps(y[t]);
        for (int i = 0; i < nv; ++i) {
            const __m256 e = _mm256_permutevar8x32_ps(best[((8*i) >> k) / 8], lane_of[i]);
            const __m256 d = _mm256_sub_ps(yt, cbv[i]);
            cost[i] = _mm256_add_ps(e, _mm256_mul_ps(d, d));
        }
    }
    float c[S];
    for (int i = 0; i < nv; ++i) _mm256_storeu_ps(c + 8*i, cost[i]);
    trace_back(back, k, ns, argmin(c, ns), states);
}

__attribute__((target("avx2"))) static void encode_avx2(const float * y, const float * cb, int k, int ns,
                                                        uint8_t * states) {
    if (ns == 256) { if (k == 3) encode_avx2_k(y, cb, 3, 256, states); else encode_avx2_k(y, cb, 2, 256, states); }
    else           { if (k == 3) encode_avx2_k(y, cb, 3, 64, states);  else encode_avx2_k(y, cb, 2, 64, states); }
}

// 16 floats a register, as above
__attribute__((target("avx512f,avx512bw"))) static inline void encode_avx512_k(const float * y, const float * cb,
                                                                               const int k, uint8_t * states) {
    const int lo = S >> k, nh = 1 << k, nb = lo / 16;
    __m512 cost[16], best[4], cbv[16];
    __m512i lane_of[16];
    uint8_t back[N][64];
    for (int i = 0; i < 16; ++i) {
        cbv[i]  = _mm512_loadu_ps(cb + 16*i);
        cost[i] = _mm512_set1_ps(INFINITY);
        const int p0 = (16*i) >> k;
        lane_of[i] = _mm512_add_epi32(_mm512_set1_epi32(p0 % 16),
                                      _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), k));
    }
    cost[0] = _mm512_mask_mov_ps(cost[0], 1, _mm512_setzero_ps());
    for (int t = 0; t < N; ++t) {
        for (int j = 0; j < nb; ++j) {
            __m512 b = cost[j];
            __m512i id = _mm512_setzero_si512();
            for (int h = 1; h < nh; ++h) {
                const __m512 c = cost[h*nb + j];
                const __mmask16 lt = _mm512_cmp_ps_mask(c, b, _CMP_LT_OQ);
                b  = _mm512_mask_mov_ps(b, lt, c);
                id = _mm512_mask_mov_epi32(id, lt, _mm512_set1_epi32(h));
            }
            best[j] = b;
            _mm_storeu_si128((__m128i *) (back[t] + 16*j), _mm512_cvtepi32_epi8(id));
        }
        const __m512 yt = _mm512_set1_ps(y[t]);
        for (int i = 0; i < 16; ++i) {
            const __m512 e = _mm512_permutexvar_ps(lane_of[i], best[((16*i) >> k) / 16]);
            const __m512 d = _mm512_sub_ps(yt, cbv[i]);
            cost[i] = _mm512_add_ps(e, _mm512_mul_ps(d, d));
        }
    }
    float c[S];
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(c + 16*i, cost[i]);
    trace_back(back, k, S, argmin(c, S), states);
}

// 256 states only (with 64, the 8 states that share a predecessor set fill half a register)
__attribute__((target("avx512f,avx512bw"))) static void encode_avx512(const float * y, const float * cb, int k, int ns,
                                                                      uint8_t * states) {
    (void) ns;
    if (k == 3) encode_avx512_k(y, cb, 3, states); else encode_avx512_k(y, cb, 2, states);
}
#endif

typedef void (*encoder)(const float *, const float *, int, int, uint8_t *);

static encoder pick(const char * name, int ns) {
    if (!strcmp(name, "c")) return encode_c;
#if defined(__x86_64__)
    if (!strcmp(name, "avx2")   && __builtin_cpu_supports("avx2")) return encode_avx2;
    if (!strcmp(name, "avx512") && ns == 256 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return encode_avx512;
#endif
    return NULL;
}

static int check(int k, int L, const char * impl) {
    if ((k != 2 && k != 3) || (L != 6 && L != 8)) { fprintf(stderr, "k is 2 or 3, L is 6 or 8\n"); return 1; }
    const int ns = 1 << L;
    encoder enc = pick(impl, ns);
    if (!enc) { fprintf(stderr, "encoder %s with %d states: not on this machine\n", impl, ns); return 2; }
    float cb[S], y[N];
    uint8_t st[N];
    if (fread(cb, sizeof(float) * ns, 1, stdin) != 1) { fprintf(stderr, "no codebook\n"); return 1; }
    while (fread(y, sizeof y, 1, stdin) == 1) {
        enc(y, cb, k, ns, st);
        fwrite(st, sizeof st, 1, stdout);
    }
    return 0;
}

// codes c_t = s_t mod 2^k, most significant bit first, after one zero byte (s_{-1} = 0) and
// before three more (so that a 4-byte load at any value stays in the buffer)
static void pack(const uint8_t * states, int k, uint8_t * buf) {
    memset(buf, 0, 1 + N*k/8 + 3);
    for (int t = 0; t < N; ++t) {
        const int c = states[t] & ((1 << k) - 1);
        for (int b = 0; b < k; ++b) {
            const int bit = 8 + k*t + b;  // MSB first: code bit k-1-b
            if ((c >> (k - 1 - b)) & 1) buf[bit / 8] |= (uint8_t) (0x80 >> (bit % 8));
        }
    }
}

static float dot_trellis_c(const uint8_t * buf, int k, int L, const float * cb, const float * q) {
    float acc = 0.f;
    for (int t = 0; t < N; ++t) {
        const int e = 8 + k*(t + 1);  // the state is the 8 bits that end at bit e (exclusive)
        const int b0 = (e - 8) / 8;
        const uint32_t w = ((uint32_t) buf[b0] << 8) | buf[b0 + 1];
        acc += q[t] * cb[(w >> (16 - (e - 8*b0))) & ((1u << L) - 1)];
    }
    return acc;
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) static inline float hsum8(__m256 acc) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

// The states of values t0..t0+7 (t0 a multiple of 8) lie in the 32 bits from bit 8 + k*t0 - 8 of
// the buffer (bit k*t0 of the stream less the 8 before it): lane l's ends 8 + k(l+1) bits in, so
// it is that word shifted right by sh = 24 - k - k*l, masked to L bits.
__attribute__((target("avx2"))) static inline __m256i states8(const uint8_t * buf, int k, int t0, __m256i mask) {
    const __m256i sh = _mm256_sub_epi32(_mm256_set1_epi32(24 - k),
                                        _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(k)));
    uint32_t w;
    memcpy(&w, buf + k*t0/8, 4);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int) __builtin_bswap32(w)), sh), mask);
}

// the same for 16 values, from two such words
__attribute__((target("avx512f"))) static inline __m512i states16(const uint8_t * buf, int k, int t0, __m512i mask) {
    const __m512i l8 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i sh = _mm512_sub_epi32(_mm512_set1_epi32(24 - k), _mm512_mullo_epi32(l8, _mm512_set1_epi32(k)));
    uint32_t w0, w1;
    memcpy(&w0, buf + k*t0/8, 4);
    memcpy(&w1, buf + k*(t0 + 8)/8, 4);
    const __m512i src = _mm512_mask_mov_epi32(_mm512_set1_epi32((int) __builtin_bswap32(w0)), 0xff00,
                                              _mm512_set1_epi32((int) __builtin_bswap32(w1)));
    return _mm512_and_si512(_mm512_srlv_epi32(src, sh), mask);
}

// 256 states, AVX2: a gather from the table
__attribute__((target("avx2,fma"))) static float dot_trellis_avx2(const uint8_t * buf, int k, const float * cb,
                                                                  const float * q) {
    const __m256i ff = _mm256_set1_epi32(255);
    __m256 acc = _mm256_setzero_ps();
    for (int t0 = 0; t0 < N; t0 += 8) {
        const __m256i s = states8(buf, k, t0, ff);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + t0), _mm256_i32gather_ps(cb, s, 4), acc);
    }
    return hsum8(acc);
}

// AVX-512: 16 values a step (two words of 32 bits, as above), and the 256-entry table read
// through eight two-register permutes (entries 0-31, 32-63, ...) and seven blends by the state's
// top three bits, not a gather
__attribute__((target("avx512f,avx512bw"))) static float dot_trellis_avx512(const uint8_t * buf, int k,
                                                                         const __m512 * cbt, const float * q) {
    const __m512i ff = _mm512_set1_epi32(255);
    __m512 acc = _mm512_setzero_ps();
    for (int t0 = 0; t0 < N; t0 += 16) {
        const __m512i s = states16(buf, k, t0, ff);
        __m512 r[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm512_permutex2var_ps(cbt[2*i], s, cbt[2*i + 1]);
        const __mmask16 b5 = _mm512_test_epi32_mask(s, _mm512_set1_epi32(32));
        const __mmask16 b6 = _mm512_test_epi32_mask(s, _mm512_set1_epi32(64));
        const __mmask16 b7 = _mm512_test_epi32_mask(s, _mm512_set1_epi32(128));
        for (int i = 0; i < 4; ++i) r[i] = _mm512_mask_mov_ps(r[2*i], b5, r[2*i + 1]);
        for (int i = 0; i < 2; ++i) r[i] = _mm512_mask_mov_ps(r[2*i], b6, r[2*i + 1]);
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + t0), _mm512_mask_mov_ps(r[0], b7, r[1]), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

// A trellis of 64 states (L = 6; the lab's 0.75x of the scalar codebook's MSE where 256 states
// give 0.68x): the same windows masked to 6 bits, the 64-entry table in eight registers of 8
// (AVX2: eight permutes, seven blends) or four of 16 (AVX-512: two permutes, one blend)
__attribute__((target("avx2,fma"))) static float dot_trellis64_avx2(const uint8_t * buf, int k, const float * cb,
                                                                    const float * q) {
    const __m256i m63 = _mm256_set1_epi32(63);
    __m256 t[8];
    for (int i = 0; i < 8; ++i) t[i] = _mm256_loadu_ps(cb + 8*i);
    __m256 acc = _mm256_setzero_ps();
    for (int t0 = 0; t0 < N; t0 += 8) {
        const __m256i s = states8(buf, k, t0, m63);
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_permutevar8x32_ps(t[i], s);
        // blendv reads the sign bit: move bits 3, 4, 5 of the state there
        const __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(s, 28));
        const __m256 b4 = _mm256_castsi256_ps(_mm256_slli_epi32(s, 27));
        const __m256 b5 = _mm256_castsi256_ps(_mm256_slli_epi32(s, 26));
        for (int i = 0; i < 4; ++i) r[i] = _mm256_blendv_ps(r[2*i], r[2*i + 1], b3);
        for (int i = 0; i < 2; ++i) r[i] = _mm256_blendv_ps(r[2*i], r[2*i + 1], b4);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + t0), _mm256_blendv_ps(r[0], r[1], b5), acc);
    }
    return hsum8(acc);
}

__attribute__((target("avx512f,avx512bw"))) static float dot_trellis64_avx512(const uint8_t * buf, int k,
                                                                           const __m512 * cbt, const float * q) {
    const __m512i m63 = _mm512_set1_epi32(63);
    __m512 acc = _mm512_setzero_ps();
    for (int t0 = 0; t0 < N; t0 += 16) {
        const __m512i s = states16(buf, k, t0, m63);
        const __m512 a = _mm512_permutex2var_ps(cbt[0], s, cbt[1]);
        const __m512 b = _mm512_permutex2var_ps(cbt[2], s, cbt[3]);
        const __mmask16 b5 = _mm512_test_epi32_mask(s, _mm512_set1_epi32(32));
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + t0), _mm512_mask_mov_ps(a, b5, b), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

// the shipped turboq3 layout and decoder shape (ggml-cpu/arch/x86/turboq-kernels.h): low 2 bits
// in qs, high bit in qh, an 8-entry table through one permute per 8 values
__attribute__((target("avx2,fma"))) static float dot_turboq3_avx2(const uint8_t * qs, const uint8_t * qh,
                                                                  const float * cb8, const float * q) {
    const __m256 lut = _mm256_loadu_ps(cb8);
    const __m256i three = _mm256_set1_epi32(3), one = _mm256_set1_epi32(1);
    const __m256i h0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) qh));
    const __m256i h1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (qh + 8)));
    __m256 acc = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
        const __m256i qv = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (qs + 8*j)));
        const __m256i h = (j & 1) ? h1 : h0;
        for (int kk = 0; kk < 4; ++kk) {
            const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(qv, _mm256_set1_epi32(2*kk)), three);
            const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_set1_epi32(2*kk + j/2)), one);
            const __m256 v = _mm256_permutevar8x32_ps(lut, _mm256_or_si256(lo, _mm256_slli_epi32(hi, 2)));
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 32*kk + 8*j), v, acc);
        }
    }
    return hsum8(acc);
}

__attribute__((target("avx2,fma,f16c"))) static float dot_f16_avx2(const uint16_t * k, const float * q) {
    __m256 acc = _mm256_setzero_ps();
    for (int t = 0; t < N; t += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + t), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (k + t))), acc);
    return hsum8(acc);
}

// the groups, as many as a K cache row of this many bytes takes: out of L1 and L2, as in attention
// over a long context
enum { G = 20000, ROWS = 1 << 16 };

static void bench_decode(const float * cb, const uint8_t * states3, const uint8_t * states2) {
    float q[N];
    for (int i = 0; i < N; ++i) q[i] = rand() / (float) RAND_MAX - 0.5f;
    const int bytes[3] = { 1 + 3*N/8 + 3, 1 + 2*N/8 + 3, 2*N };
    uint8_t * tr3 = malloc((size_t) ROWS * bytes[0]), * tr2 = malloc((size_t) ROWS * bytes[1]);
    uint8_t * qs = malloc((size_t) ROWS * 48);
    uint16_t * f16 = malloc((size_t) ROWS * N * 2);
    for (int r = 0; r < ROWS; ++r) {
        pack(states3 + (size_t) (r % G) * N, 3, tr3 + (size_t) r * bytes[0]);
        pack(states2 + (size_t) (r % G) * N, 2, tr2 + (size_t) r * bytes[1]);
        for (int i = 0; i < 48; ++i) qs[(size_t) r*48 + i] = (uint8_t) rand();
        for (int i = 0; i < N; ++i) f16[(size_t) r*N + i] = (uint16_t) (0x3000 + (rand() & 0x0fff));
    }
    const int has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    __m512 cbt[16];
    if (has512) memcpy(cbt, cb, sizeof cbt);
    // the vector decoders read what the plain one does
    for (int r = 0; r < 64; ++r) {
        for (int k = 3; k >= 2; --k) {
            const uint8_t * row = (k == 3 ? tr3 : tr2) + (size_t) r * bytes[3 - k];
            const float a = dot_trellis_c(row, k, 8, cb, q), b = dot_trellis_avx2(row, k, cb, q);
            const float c = has512 ? dot_trellis_avx512(row, k, cbt, q) : a;
            const float a6 = dot_trellis_c(row, k, 6, cb, q), b6 = dot_trellis64_avx2(row, k, cb, q);
            const float c6 = has512 ? dot_trellis64_avx512(row, k, cbt, q) : a6;
            if (fabsf(a - b) > 1e-3f * (1 + fabsf(a)) || fabsf(a - c) > 1e-3f * (1 + fabsf(a)) ||
                fabsf(a6 - b6) > 1e-3f * (1 + fabsf(a6)) || fabsf(a6 - c6) > 1e-3f * (1 + fabsf(a6))) {
                fprintf(stderr, "decoders disagree at row %d, k = %d: %g %g %g, %g %g %g\n", r, k, a, b, c, a6, b6, c6);
                exit(1);
            }
        }
    }
    printf("\n| decode + dot with q, one 128-value group | ns per group | vs F16 |\n|---|---|---|\n");
    double base = 0;
    for (int which = 0; which < 8; ++which) {
        if ((which == 4 || which == 5 || which == 7) && !has512) continue;
        const int reps = 20;
        volatile float sink = 0;
        double t0 = now();
        for (int rep = 0; rep < reps; ++rep) {
            float acc = 0;
            for (int r = 0; r < ROWS; ++r) {
                switch (which) {
                    case 0: acc += dot_f16_avx2(f16 + (size_t) r*N, q); break;
                    case 1: acc += dot_turboq3_avx2(qs + (size_t) r*48, qs + (size_t) r*48 + 32, cb, q); break;
                    case 2: acc += dot_trellis_avx2(tr3 + (size_t) r*bytes[0], 3, cb, q); break;
                    case 3: acc += dot_trellis_avx2(tr2 + (size_t) r*bytes[1], 2, cb, q); break;
                    case 4: acc += dot_trellis_avx512(tr3 + (size_t) r*bytes[0], 3, cbt, q); break;
                    case 5: acc += dot_trellis_avx512(tr2 + (size_t) r*bytes[1], 2, cbt, q); break;
                    case 6: acc += dot_trellis64_avx2(tr3 + (size_t) r*bytes[0], 3, cb, q); break;
                    case 7: acc += dot_trellis64_avx512(tr3 + (size_t) r*bytes[0], 3, cbt, q); break;
                }
            }
            sink += acc;
        }
        const double ns = (now() - t0) / reps / ROWS * 1e9;
        if (which == 0) base = ns;
        static const char * names[8] = { "F16 (256 bytes), AVX2", "turboq3 indices, 8-entry permute (48 bytes), AVX2",
                                         "trellis, 3 bits: 8-bit window, 256-entry gather (48 bytes), AVX2",
                                         "trellis, 2 bits: the same (32 bytes), AVX2",
                                         "trellis, 3 bits: 8-bit window, eight 2-register permutes, AVX-512",
                                         "trellis, 2 bits: the same, AVX-512",
                                         "trellis of 64 states, 3 bits: eight permutes, seven blends, AVX2",
                                         "trellis of 64 states, 3 bits: two 2-register permutes, AVX-512" };
        printf("| %s | %.1f | %.2fx |\n", names[which], ns, ns / base);
        (void) sink;
    }
    free(tr3); free(tr2); free(qs); free(f16);
}
#endif

static int bench(void) {
#if !defined(__x86_64__)
    fprintf(stderr, "bench: x86-64 only\n");
    return 2;
#else
    srand(1);
    float cb[S];
    for (int i = 0; i < S; ++i) cb[i] = (rand() / (float) RAND_MAX - 0.5f) * 4;
    float * y = malloc(sizeof(float) * N * G);
    for (int i = 0; i < N * G; ++i) y[i] = (rand() / (float) RAND_MAX - 0.5f) * 3;
    uint8_t * st[2] = { calloc((size_t) N * G, 1), calloc((size_t) N * G, 1) };
    printf("| encoder | states | k | us per 128-value group |\n|---|---|---|---|\n");
    static const char * impls[3] = { "c", "avx2", "avx512" };
    uint8_t * scratch = malloc((size_t) N * G);
    for (int ns = 256; ns >= 64; ns /= 4) {
        for (int i = 0; i < 3; ++i) {
            encoder enc = pick(impls[i], ns);
            if (!enc) continue;
            for (int k = 3; k >= 2; --k) {
                const int gs = i == 0 ? G / 10 : G;
                uint8_t * out = ns == 256 ? st[3 - k] : scratch;  // the decoders read 256-state paths
                double t0 = now();
                for (int g = 0; g < gs; ++g) enc(y + (size_t) g * N, cb, k, ns, out + (size_t) g * N);
                printf("| %s | %d | %d | %.2f |\n", impls[i], ns, k, (now() - t0) / gs * 1e6);
            }
        }
    }
    free(scratch);
    bench_decode(cb, st[0], st[1]);
    free(y); free(st[0]); free(st[1]);
    return 0;
#endif
}

int main(int argc, char ** argv) {
    if (argc >= 2 && !strcmp(argv[1], "bench")) return bench();
    if (argc == 5 && !strcmp(argv[1], "check")) return check(atoi(argv[2]), atoi(argv[3]), argv[4]);
    fprintf(stderr, "usage: %s bench | check K L c|avx2|avx512 < in > out\n", argv[0]);
    return 2;
}
