// What a Viterbi encoder for a bit-shift trellis costs in C (issue 21's trellis lever; the lab's
// pyturbo/lab/trellis.py, not a shipped type): 256 states (L = 8), k = 2 or 3 bits per value, one
// 128-value group at a time, s_t = ((s_{t-1} << k) | c_t) mod 256 from s_{-1} = 0, back-pointers
// per step. The codebook and the data are random: only the time counts here.
//
//     gcc -O3 -march=native -o /tmp/trellis_viterbi bench/trellis_viterbi.c -lm && /tmp/trellis_viterbi
//
// Results: bench/results/quality-per-bit.md (2026-12-03, third session).
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <time.h>
#define S 256
#define N 128
static float cb[S];
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void encode(const float *y, int k, uint8_t *states_out) {
    const int lo = S >> k, nh = 1 << k;
    float cost[S], best[S];
    uint8_t back[N][S];  // argmin h per (t, p)
    for (int m = 0; m < S; ++m) cost[m] = m == 0 ? 0.f : INFINITY;
    for (int t = 0; t < N; ++t) {
        uint8_t *bt = back[t];
        for (int p = 0; p < lo; ++p) { best[p] = cost[p]; bt[p] = 0; }
        for (int h = 1; h < nh; ++h) {
            const float *ch = cost + h*lo;
            for (int p = 0; p < lo; ++p) {
                const int lt = ch[p] < best[p];
                best[p] = lt ? ch[p] : best[p];
                bt[p] = lt ? (uint8_t) h : bt[p];
            }
        }
        const float yt = y[t];
        for (int m = 0; m < S; ++m) { float d = yt - cb[m]; cost[m] = best[m >> k] + d*d; }
    }
    int s = 0; float b = cost[0];
    for (int m = 1; m < S; ++m) if (cost[m] < b) { b = cost[m]; s = m; }
    for (int t = N - 1; t >= 0; --t) { states_out[t] = (uint8_t) s; int p = s >> k; s = back[t][p] * lo + p; }
}
int main(void) {
    srand(1);
    for (int i = 0; i < S; ++i) cb[i] = (rand() / (float) RAND_MAX - 0.5f) * 4;
    const int G = 20000;
    float *y = malloc(sizeof(float) * N * G);
    for (int i = 0; i < N * G; ++i) y[i] = (rand() / (float) RAND_MAX - 0.5f) * 3;
    uint8_t st[N]; unsigned acc = 0;
    for (int k = 2; k <= 3; ++k) {
        double t0 = now();
        for (int g = 0; g < G; ++g) { encode(y + g * N, k, st); acc += st[5]; }
        double dt = now() - t0;
        printf("k=%d: %.2f us per 128-value group (acc %u)\n", k, dt / G * 1e6, acc);
    }
    return 0;
}
