#pragma once

#include "ggml-turboq-tables.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

// The trellis types' code stream (pyturbo): turboq3t and turboq2t, for ggml-base's codec
// (ggml-turboq-encode.h) and ggml-cpu's flash-attention decoders (ggml-cpu/turboq-cpu.c).
//
// A group's value t is cb[s_t], s_t = ((s_(t-1) << k) | c_t) mod 2^L from s_(-1) = 0, with c_t the
// k-bit code of value t (k = 3 or 2, L = TURBOQ_TRELLIS_L); the block stores the codes one after
// another, most significant bit first, so s_t is also the L stream bits that end with c_t. The
// encoder takes the path of least squared error over the whole group (Viterbi), keeping the first
// minimum on ties; pyturbo/format/trellis.py's viterbi is the same float32 operations in the same order,
// provided no multiply-add is fused: the encoder's users include it through ggml-turboq-encode.h,
// which turns contraction off, and are built with -ffp-contract=off.

#define TURBOQ_TRELLIS_STATES (1 << TURBOQ_TRELLIS_L)

// the best path's states from the final costs (the first minimum) and the back-pointers: back[t][p]
// is the h of the cheapest predecessor h*lo + p of the states m with m >> k == p at step t
static inline void turboq_trellis_trace_back(const int k, const float * cost, uint8_t back[][TURBOQ_TRELLIS_STATES],
                                             uint8_t * states) {
    const int lo = TURBOQ_TRELLIS_STATES >> k;
    int s = 0;
    for (int m = 1; m < TURBOQ_TRELLIS_STATES; ++m) s = cost[m] < cost[s] ? m : s;
    for (int t = TURBOQ_GROUP - 1; t >= 0; --t) {
        states[t] = (uint8_t) s;
        const int p = s >> k;
        s = back[t][p]*lo + p;
    }
}

// y: a rotated unit group; states[t] = s_t of the best path
static inline void turboq_trellis_viterbi(const float * cb, int k, const float * y, uint8_t * states) {
    enum { S = TURBOQ_TRELLIS_STATES };
    const int lo = S >> k;  // state m's predecessors are h*lo + (m >> k), h < 2^k
    float cost[S];
    float best[S];
    uint8_t back[TURBOQ_GROUP][S];  // turboq_trellis_trace_back's
    for (int m = 0; m < S; ++m) cost[m] = m == 0 ? 0.0f : INFINITY;
    for (int t = 0; t < TURBOQ_GROUP; ++t) {
        uint8_t * bt = back[t];
        for (int p = 0; p < lo; ++p) { best[p] = cost[p]; bt[p] = 0; }
        for (int h = 1; h < (1 << k); ++h) {
            const float * ch = cost + h*lo;
            for (int p = 0; p < lo; ++p) {
                const int lt = ch[p] < best[p];
                best[p] = lt ? ch[p] : best[p];
                bt[p]   = lt ? (uint8_t) h : bt[p];
            }
        }
        for (int m = 0; m < S; ++m) {
            const float d = y[t] - cb[m];
            cost[m] = best[m >> k] + d*d;
        }
    }
    turboq_trellis_trace_back(k, cost, back, states);
}

static inline void turboq_trellis_pack(int k, const uint8_t * states, uint8_t * qs) {
    memset(qs, 0, TURBOQ_GROUP*k/8);
    for (int t = 0; t < TURBOQ_GROUP; ++t) {
        const int c = states[t] & ((1 << k) - 1);
        for (int b = 0; b < k; ++b) {
            const int bit = k*t + b;  // code bit k-1-b
            qs[bit/8] |= (uint8_t) (((c >> (k - 1 - b)) & 1) << (7 - bit % 8));
        }
    }
}

// the states s_0..s_127 of a block's code stream
static inline void turboq_trellis_states(int k, const uint8_t * qs, uint8_t * states) {
    uint32_t buf = 0;
    int nbits = 0, s = 0;
    for (int t = 0; t < TURBOQ_GROUP; ++t) {
        if (nbits < k) { buf = (buf << 8) | *qs++; nbits += 8; }
        nbits -= k;
        s = ((s << k) | (int) ((buf >> nbits) & ((1u << k) - 1))) & (TURBOQ_TRELLIS_STATES - 1);
        states[t] = (uint8_t) s;
    }
}
