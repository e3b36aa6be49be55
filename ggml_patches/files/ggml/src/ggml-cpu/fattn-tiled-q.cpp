// Tiled CPU flash attention for quantized and mixed K/V caches (pyturbo); see fattn-tiled-q.h.
//
// A tile is up to GGML_FA_TILE_Q query rows that share one KV head: the rows are (token, head)
// pairs taken token-major over the heads of a GQA group. A K/V tile is therefore decoded once for
// up to 64 query rows, in prefill and in decode (one token, every head of the group). Scores and
// the V sum go through the same simd_gemm micro-kernel as upstream's f16 path, with online softmax
// and fully masked K/V tiles skipped before they are decoded.
//
// turboq K/V stay in the rotated domain: each Q row is rotated once per tile (with the softmax
// scale folded in) and each output row is rotated back once.
//
// When there are fewer tiles than threads (decode), the KV range is split across threads and the
// partial (max, sum, V sum) of every row are merged after a barrier, as upstream does for f16.
//
// Exact rows (ggml-fa-exact.h) are converted and rotated into attention's domain once per node,
// by all threads before the tiles, and each tile reads them after the cache's rows, in the first
// KV chunk only. A node with exact rows always takes this path: no other one reads them.
//
// K/V tiles and chunks start at the first cached row that the tile's queries can see, not at
// row 0: which rows a tile groups (and which SIMD lane a row's softmax term lands in) then
// depends only on the visible rows, not on where a sequence's cells lie in the cache. So a
// sequence whose cells form one run gives bit-identical results wherever that run lies (beside
// other sequences, after other requests), as upstream's one-row f16 path does.

#include "fattn-tiled-q.h"

#include "common.h"
#include "vec.h"
#include "simd-gemm.h"
#include "turboq-cpu.h"
#include "../ggml-turboq.h"
#include "ggml-fa-exact.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int64_t QT = GGML_FA_TILE_Q;   // query rows per tile
constexpr int64_t KT = GGML_FA_TILE_KV;  // cached rows per tile
static_assert(KT % 8 == 0, "row_max reads eight lanes");

bool path_enabled() {
    static const bool on = [] {
        const char * e = getenv("TURBOQ_FA_TILED");
        return !(e && strcmp(e, "0") == 0);
    }();
    return on;
}

bool decodable(ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || ggml_turboq_group(t) || ggml_get_type_traits(t)->to_float != nullptr;
}

// a cached row as f32, in the domain attention runs in (rotated for turboq)
void decode_row(ggml_type t, const void * x, float * y, int64_t n) {
    if (t == GGML_TYPE_F32) {
        memcpy(y, x, n*sizeof(float));
    } else if (t == GGML_TYPE_F16) {
        ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) x, y, n);
    } else if (ggml_turboq_group(t)) {
        ggml_turboq_fa_decode_row(t, x, y, n);
    } else {
        ggml_get_type_traits(t)->to_float(x, y, n);
    }
}

// max of a score row; eight lanes, so that it vectorizes (ggml_vec_max_f32 is a serial chain)
float row_max(const float * x) {
    float m[8];
    for (int l = 0; l < 8; ++l) {
        m[l] = x[l];
    }
    for (int64_t i = 8; i < KT; i += 8) {
        for (int l = 0; l < 8; ++l) {
            m[l] = m[l] < x[i + l] ? x[i + l] : m[l];
        }
    }
    for (int l = 1; l < 8; ++l) {
        m[0] = m[0] < m[l] ? m[l] : m[0];
    }
    return m[0];
}

// floats of scratch per thread, padded to a cache line
int64_t thread_floats(int64_t DK, int64_t DV) {
    const int64_t n = DK*QT      // Qt: scaled (rotated) Q tile, transposed [DK][rows]
                    + KT*DK      // Kd: decoded K tile [kv][DK]
                    + KT*QT      // KQt: scores as the GEMM writes them [kv][rows]
                    + QT*KT      // P: scores, then probabilities [rows][KT]
                    + KT*DV      // Vd: decoded V tile [KT][DV]
                    + QT*DV      // O: V sums [rows][DV]
                    + 2*QT;      // M, S
    return (n + 15) & ~(int64_t) 15;
}

// chunks for a KV span: at most `most`, with at least two K/V tiles each so that the merge stays cheap
int64_t splits(int64_t most, int64_t span) {
    return std::max<int64_t>(1, std::min<int64_t>(most, span/(2*KT)));
}

struct plan {
    int64_t rk2, rk3;      // query heads per K head (dims 2, 3)
    int64_t rows;          // query rows per group: tokens x heads of the group
    int64_t tiles_per_group;
    int64_t n_tiles;
    int64_t nsplit;        // most KV chunks per tile (1 unless tiles < threads): the partials' layout
    int64_t n_rows_total;
};

plan make_plan(const ggml_tensor * dst, int nth) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    plan p;
    p.rk2 = q->ne[2]/k->ne[2];
    p.rk3 = q->ne[3]/k->ne[3];
    p.rows = q->ne[1]*p.rk2;
    p.tiles_per_group = (p.rows + QT - 1)/QT;
    p.n_tiles = p.tiles_per_group*k->ne[2]*q->ne[3];
    p.n_rows_total = q->ne[1]*q->ne[2]*q->ne[3];
    const int64_t nkv = k->ne[1];
    p.nsplit = 1;
    if (p.n_tiles < nth) {
        p.nsplit = splits(nth/p.n_tiles, nkv);
    }
    return p;
}

struct attn {
    const ggml_tensor * q, * k, * v, * mask, * sinks;
    const ggml_tensor * ek, * ev, * emask;  // exact rows (ggml-fa-exact.h), or nullptr
    float * Ek, * Ev;                       // ... as f32 in attention's domain: [ne3][head][row][D]
    ggml_tensor * dst;
    int64_t DK, DV;
    float scale, softcap, max_bias, m0, m1;
    uint32_t n_head_log2;
    bool k_rot, v_rot;
    plan p;

    float slope(int64_t h) const {
        if (max_bias <= 0.0f) {
            return 1.0f;
        }
        return h < n_head_log2 ? powf(m0, h + 1) : powf(m1, 2*(h - n_head_log2) + 1);
    }
};

// the rows [first, last] of the nkv that mask covers (the cache's, or the exact ones) that any
// query row of tile (g, r0..r1) can see; first > last when none
void visible_span(const ggml_tensor * mask, int64_t nkv, const attn & a, int64_t g, int64_t r0, int64_t r1,
                  int64_t & first, int64_t & last) {
    first = 0;
    last  = nkv - 1;
    if (!mask) {
        return;
    }
    const int64_t iq3 = g/a.k->ne[2], ik2 = g%a.k->ne[2];
    first = nkv;
    last  = -1;
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t iq1 = r/a.p.rk2, iq2 = ik2*a.p.rk2 + r%a.p.rk2;
        const ggml_fp16_t * m = (const ggml_fp16_t *) ((const char *) mask->data + iq1*mask->nb[1]
                                + (iq2%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3]);
        // a slope never turns a finite mask value into -inf, so the mask alone says what is visible
        for (int64_t c = 0; c < first; ++c) {
            if (GGML_CPU_FP16_TO_FP32(m[c]) != -INFINITY) {
                first = c;
                break;
            }
        }
        for (int64_t c = nkv - 1; c > last; --c) {
            if (GGML_CPU_FP16_TO_FP32(m[c]) != -INFINITY) {
                last = c;
                break;
            }
        }
    }
}

// one tile (rows r0..r1 of group g) over the cached rows c0..c1; writes dst, or the partials of
// chunk isplit when partials is set
void run_tile(const attn & a, int64_t g, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
              float * scratch, float * partials, int64_t isplit) {
    const int64_t DK = a.DK, DV = a.DV;
    const int64_t n  = r1 - r0;

    float * Qt  = scratch;  // [DK][n], or [n][DK] when by_dot
    float * Kd  = Qt  + DK*QT;
    float * KQt = Kd  + KT*DK;
    float * P   = KQt + KT*QT;
    float * Vd  = P   + QT*KT;
    float * O   = Vd  + KT*DV;
    float * M   = O   + QT*DV;
    float * S   = M   + QT;

    const ggml_tensor * q = a.q, * k = a.k, * v = a.v, * mask = a.mask;

    const int64_t nek2 = k->ne[2];
    const int64_t iq3  = g/nek2;
    const int64_t ik2  = g%nek2;
    const int64_t ik3  = iq3/a.p.rk3;

    // few rows (decode): row-by-row dot products; a GEMM with n < one SIMD width of columns
    // would run mostly masked lanes
    const bool by_dot = n < 16;

    int64_t             iq1[QT], iq2[QT];
    float               slope[QT];
    const ggml_fp16_t * mrow[QT];

    for (int64_t t = 0; t < n; ++t) {
        const int64_t r = r0 + t;
        iq1[t] = r/a.p.rk2;
        iq2[t] = ik2*a.p.rk2 + r%a.p.rk2;
        slope[t] = a.slope(iq2[t]);
        mrow[t] = mask ? (const ggml_fp16_t *) ((const char *) mask->data + iq1[t]*mask->nb[1]
                          + (iq2[t]%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3]) : nullptr;

        // Kd is free until the first K tile: use it for the row before transposing it into Qt
        const float * pq = (const float *) ((const char *) q->data + iq1[t]*q->nb[1] + iq2[t]*q->nb[2] + iq3*q->nb[3]);
        for (int64_t d = 0; d < DK; ++d) {
            Kd[d] = pq[d]*a.scale;
        }
        if (a.k_rot) {
            ggml_turboq_cpu_rotate(a.k->type, Kd, DK);
        }
        if (by_dot) {
            memcpy(Qt + t*DK, Kd, DK*sizeof(float));
        } else {
            for (int64_t d = 0; d < DK; ++d) {
                Qt[d*n + t] = Kd[d];
            }
        }
        M[t] = -INFINITY;
        S[t] = 0.0f;
    }
    memset(O, 0, n*DV*sizeof(float));

    // one K/V tile of kv rows: mr[t] the tile's mask row of query t (nullptr: no mask), load_k and
    // load_v decode its rows into Kd and Vd
    const ggml_fp16_t * mr[QT];
    auto step = [&](int64_t kv, bool masked, auto && load_k, auto && load_v) {
        if (masked) {
            bool all_masked = true;
            for (int64_t t = 0; t < n; ++t) {
                float * pr = P + t*KT;
                const ggml_fp16_t * mp = mr[t];
                for (int64_t j = 0; j < kv; ++j) {
                    pr[j] = slope[t]*GGML_CPU_FP16_TO_FP32(mp[j]);
                    all_masked = all_masked && pr[j] == -INFINITY;
                }
            }
            if (all_masked) {
                return;
            }
        }

        load_k();
        if (by_dot) {
            for (int64_t j = 0; j < kv; ++j) {
                for (int64_t t = 0; t < n; ++t) {
                    ggml_vec_dot_f32((int) DK, KQt + j*n + t, 0, Kd + j*DK, 0, Qt + t*DK, 0, 1);
                }
            }
        } else {
            memset(KQt, 0, kv*n*sizeof(float));
            simd_gemm(KQt, Kd, Qt, (int) kv, (int) DK, (int) n);
        }

        for (int64_t t = 0; t < n; ++t) {
            float * pr = P + t*KT;
            for (int64_t j = 0; j < kv; ++j) {
                float s = KQt[j*n + t];
                if (a.softcap != 0.0f) {
                    s = a.softcap*tanhf(s);
                }
                pr[j] = masked ? pr[j] + s : s;
            }
            for (int64_t j = kv; j < KT; ++j) {
                pr[j] = -INFINITY;
            }

            const float tile_max = row_max(pr);
            if (tile_max == -INFINITY) {
                memset(pr, 0, KT*sizeof(float));
                continue;
            }
            const float Mnew = fmaxf(M[t], tile_max);
            if (Mnew > M[t]) {
                const float ms = expf(M[t] - Mnew);
                ggml_vec_scale_f32((int) DV, O + t*DV, ms);
                S[t] *= ms;
            }
            M[t] = Mnew;
            S[t] += (float) ggml_vec_soft_max_f32((int) KT, pr, pr, Mnew);
        }

        load_v();
        if (kv < KT) {
            memset(Vd + kv*DV, 0, (KT - kv)*DV*sizeof(float));
        }
        simd_gemm(O, P, Vd, (int) n, (int) KT, (int) DV);
    };

    for (int64_t ic = c0; ic < c1; ic += KT) {
        const int64_t kv = std::min(KT, c1 - ic);
        for (int64_t t = 0; t < n; ++t) {
            mr[t] = mask ? mrow[t] + ic : nullptr;
        }
        step(kv, mask != nullptr,
            [&] {
                for (int64_t j = 0; j < kv; ++j) {
                    decode_row(k->type, (const char *) k->data + (ic + j)*k->nb[1] + ik2*k->nb[2] + ik3*k->nb[3], Kd + j*DK, DK);
                }
            },
            [&] {
                for (int64_t j = 0; j < kv; ++j) {
                    decode_row(v->type, (const char *) v->data + (ic + j)*v->nb[1] + ik2*v->nb[2] + ik3*v->nb[3], Vd + j*DV, DV);
                }
            });
    }

    // the exact rows, once per row (in the first KV chunk), already in attention's domain; only
    // those that some query of the tile sees, gathered in index order, so that which rows share a
    // K/V tile (and which lane a row's term lands in) depends on them alone, not on how many
    // others (another sequence's, say) lie between them
    if (a.ek && isplit == 0) {
        const ggml_tensor * em = a.emask;
        const int64_t ne_x = a.ek->ne[1];
        const int64_t ek3  = a.ek->ne[3] == 1 ? 0 : ik3;
        const float * ekb  = a.Ek + (ek3*a.ek->ne[2] + ik2)*ne_x*DK;
        const float * evb  = a.Ev + (ek3*a.ek->ne[2] + ik2)*ne_x*DV;
        const ggml_fp16_t * erow[QT];
        for (int64_t t = 0; t < n; ++t) {
            erow[t] = (const ggml_fp16_t *) ((const char *) em->data + iq1[t]*em->nb[1]
                      + (iq2[t]%em->ne[2])*em->nb[2] + (iq3%em->ne[3])*em->nb[3]);
        }
        ggml_fp16_t gathered[QT][KT];
        int64_t     sel[KT];
        int64_t     m = 0;
        const auto flush = [&] {
            for (int64_t t = 0; t < n; ++t) {
                for (int64_t z = 0; z < m; ++z) {
                    gathered[t][z] = erow[t][sel[z]];
                }
                mr[t] = gathered[t];
            }
            step(m, true,
                [&] {
                    for (int64_t z = 0; z < m; ++z) {
                        memcpy(Kd + z*DK, ekb + sel[z]*DK, DK*sizeof(float));
                    }
                },
                [&] {
                    for (int64_t z = 0; z < m; ++z) {
                        memcpy(Vd + z*DV, evb + sel[z]*DV, DV*sizeof(float));
                    }
                });
            m = 0;
        };
        for (int64_t j = 0; j < ne_x; ++j) {
            bool seen = false;
            for (int64_t t = 0; t < n && !seen; ++t) {
                seen = GGML_CPU_FP16_TO_FP32(erow[t][j]) != -INFINITY;
            }
            if (seen) {
                sel[m++] = j;
                if (m == KT) {
                    flush();
                }
            }
        }
        if (m > 0) {
            flush();
        }
    }

    if (a.sinks && isplit == 0) {
        for (int64_t t = 0; t < n; ++t) {
            const float s = ((const float *) a.sinks->data)[iq2[t]];
            float ms = 1.0f, vs = 1.0f;
            if (s > M[t]) {
                ms = expf(M[t] - s);
                M[t] = s;
                ggml_vec_scale_f32((int) DV, O + t*DV, ms);
            } else {
                vs = expf(s - M[t]);
            }
            S[t] = S[t]*ms + vs;
        }
    }

    const int64_t ne1 = a.dst->ne[1], ne2 = a.dst->ne[2];
    const size_t  nb1 = a.dst->nb[1];
    for (int64_t t = 0; t < n; ++t) {
        float * o = O + t*DV;
        if (a.v_rot) {
            ggml_turboq_cpu_unrotate(a.v->type, o, DV);
        }
        if (partials) {
            float * part = partials + ((g*a.p.rows + r0 + t)*a.p.nsplit + isplit)*(2 + DV);
            part[0] = M[t];
            part[1] = S[t];
            memcpy(part + 2, o, DV*sizeof(float));
        } else {
            ggml_vec_scale_f32((int) DV, o, S[t] == 0.0f ? 0.0f : 1.0f/S[t]);
            memcpy((char *) a.dst->data + (iq3*ne2*ne1 + iq2[t] + iq1[t]*ne1)*nb1, o, nb1);
        }
    }
}

// merges the KV chunks of one row
void merge_row(const attn & a, int64_t R, const float * partials, float * out) {
    const int64_t DV = a.DV;
    float Mf = -INFINITY, Sf = 0.0f;
    memset(out, 0, DV*sizeof(float));
    for (int64_t c = 0; c < a.p.nsplit; ++c) {
        const float * part = partials + (R*a.p.nsplit + c)*(2 + DV);
        if (part[1] == 0.0f) {
            continue;
        }
        const float Mn = fmaxf(Mf, part[0]);
        const float so = expf(Mf - Mn), sn = expf(part[0] - Mn);
        for (int64_t d = 0; d < DV; ++d) {
            out[d] = out[d]*so + part[2 + d]*sn;
        }
        Sf = Sf*so + part[1]*sn;
        Mf = Mn;
    }
    ggml_vec_scale_f32((int) DV, out, Sf == 0.0f ? 0.0f : 1.0f/Sf);

    const int64_t g = R/a.p.rows, r = R%a.p.rows;
    const int64_t nek2 = a.k->ne[2];
    const int64_t iq3 = g/nek2, ik2 = g%nek2;
    const int64_t iq1 = r/a.p.rk2, iq2 = ik2*a.p.rk2 + r%a.p.rk2;
    const int64_t ne1 = a.dst->ne[1], ne2 = a.dst->ne[2];
    memcpy((char *) a.dst->data + (iq3*ne2*ne1 + iq2 + iq1*ne1)*a.dst->nb[1], out, a.dst->nb[1]);
}

// the exact rows' shapes against the node's (ggml-fa-exact.h)
bool exact_rows_fit(const ggml_tensor * dst) {
    const ggml_tensor * k  = dst->src[1];
    const ggml_tensor * v  = dst->src[2];
    const ggml_tensor * ek = ggml_flash_attn_ext_exact_k(dst);
    const ggml_tensor * ev = ggml_flash_attn_ext_exact_v(dst);
    const ggml_tensor * em = ggml_flash_attn_ext_exact_mask(dst);
    const auto row_type = [](const ggml_tensor * t) {
        return (t->type == GGML_TYPE_F16 || t->type == GGML_TYPE_F32) && t->nb[0] == ggml_type_size(t->type);
    };
    return ek && ev && em && row_type(ek) && row_type(ev) && em->type == GGML_TYPE_F16 &&
           ek->ne[0] == k->ne[0] && ev->ne[0] == v->ne[0] &&
           ek->ne[1] == ev->ne[1] && em->ne[0] == ek->ne[1] && em->ne[1] >= dst->src[0]->ne[1] &&
           ek->ne[2] == k->ne[2] && ev->ne[2] == k->ne[2] && ek->ne[3] == ev->ne[3] &&
           (ek->ne[3] == 1 || ek->ne[3] == k->ne[3]) && (em->ne[3] == 1 || em->ne[3] == dst->src[0]->ne[3]);
}

// floats of the exact rows in attention's domain, K then V, padded to a cache line
int64_t exact_floats(const ggml_tensor * dst) {
    const ggml_tensor * ek = ggml_flash_attn_ext_exact_k(dst);
    if (!ek) {
        return 0;
    }
    const int64_t rows = ek->ne[1]*ek->ne[2]*ek->ne[3];
    return (rows*(dst->src[1]->ne[0] + dst->src[2]->ne[0]) + 15) & ~(int64_t) 15;
}

// one exact row as f32 in attention's domain: through f16 (the precision it is kept at, so that a
// row reads the same from the ubatch as later from wherever it is kept), rotated for a turboq cache
void exact_row(const ggml_tensor * t, int64_t r, int64_t h, int64_t i3, ggml_type cache_type, float * y) {
    const char * x = (const char *) t->data + r*t->nb[1] + h*t->nb[2] + i3*t->nb[3];
    const int64_t n = t->ne[0];
    if (t->type == GGML_TYPE_F16) {
        ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) x, y, n);
    } else {
        // the row converters (F16C where the CPU has it): a decode step reads every window row of
        // every layer this way, and the scalar round trip was a few percent of it
        ggml_fp16_t h[256];
        for (int64_t d0 = 0; d0 < n; d0 += 256) {
            const int64_t m = std::min<int64_t>(256, n - d0);
            ggml_cpu_fp32_to_fp16((const float *) x + d0, h, m);
            ggml_cpu_fp16_to_fp32(h, y + d0, m);
        }
    }
    if (ggml_turboq_group(cache_type)) {
        ggml_turboq_cpu_rotate(cache_type, y, n);
    }
}

// the exact rows that some query can see, in attention's domain, into Ek/Ev (the others zeroed:
// a tile may span them, and their weight 0 must not meet a NaN); rows split across the threads
void prepare_exact(const attn & a, int ith, int nth) {
    const ggml_tensor * em = a.emask;
    const int64_t ne_x = a.ek->ne[1], nh = a.ek->ne[2], n3 = a.ek->ne[3];
    const int64_t nq1 = a.q->ne[1];
    for (int64_t i = ith; i < ne_x*nh*n3; i += nth) {
        const int64_t r = i % ne_x, h = (i/ne_x) % nh, i3 = i/(ne_x*nh);
        bool seen = false;
        for (int64_t m3 = 0; m3 < em->ne[3] && !seen; ++m3) {
            for (int64_t m2 = 0; m2 < em->ne[2] && !seen; ++m2) {
                for (int64_t q1 = 0; q1 < nq1 && !seen; ++q1) {
                    const ggml_fp16_t * m = (const ggml_fp16_t *) ((const char *) em->data + q1*em->nb[1] + m2*em->nb[2] + m3*em->nb[3]);
                    seen = GGML_CPU_FP16_TO_FP32(m[r]) != -INFINITY;
                }
            }
        }
        float * yk = a.Ek + i*a.DK;
        float * yv = a.Ev + i*a.DV;
        if (seen) {
            exact_row(a.ek, r, h, i3, a.k->type, yk);
            exact_row(a.ev, r, h, i3, a.v->type, yv);
        } else {
            memset(yk, 0, a.DK*sizeof(float));
            memset(yv, 0, a.DV*sizeof(float));
        }
    }
}

} // namespace

bool ggml_fa_tiled_q_supported(const ggml_tensor * dst) {
    const ggml_tensor * q    = dst->src[0];
    const ggml_tensor * k    = dst->src[1];
    const ggml_tensor * v    = dst->src[2];
    const ggml_tensor * mask = dst->src[3];

    // exact rows: only this path reads them, so it is taken whatever the cache types and TURBOQ_FA_TILED
    const bool exact = ggml_flash_attn_ext_exact_k(dst) != nullptr;
    if (exact && !exact_rows_fit(dst)) {
        return false;
    }
    if ((!exact && !path_enabled()) || q->type != GGML_TYPE_F32) {
        return false;
    }
    // upstream's own tiled path
    if (!exact && k->type == v->type && (k->type == GGML_TYPE_F16 || k->type == GGML_TYPE_F32)) {
        return false;
    }
    if (!decodable(k->type) || !decodable(v->type)) {
        return false;
    }
    if (mask && mask->type != GGML_TYPE_F16) {
        return false;
    }
    // a tile shares one K head and one V head
    return k->ne[2] == v->ne[2] && k->ne[3] == v->ne[3] &&
           q->ne[2] % k->ne[2] == 0 && q->ne[3] % k->ne[3] == 0 &&
           (!ggml_turboq_group(k->type) || k->ne[0] % ggml_turboq_group(k->type) == 0) &&
           (!ggml_turboq_group(v->type) || v->ne[0] % ggml_turboq_group(v->type) == 0);
}

size_t ggml_fa_tiled_q_work_size(const ggml_tensor * dst, int n_threads) {
    if (!ggml_fa_tiled_q_supported(dst)) {
        return 0;
    }
    const int64_t DK = dst->src[1]->ne[0];
    const int64_t DV = dst->src[2]->ne[0];
    const plan p = make_plan(dst, n_threads);
    int64_t floats = n_threads*thread_floats(DK, DV) + exact_floats(dst);
    if (p.nsplit > 1) {
        floats += p.n_rows_total*p.nsplit*(2 + DV);
    }
    return floats*sizeof(float);
}

void ggml_fa_tiled_q_compute(const ggml_compute_params * params, ggml_tensor * dst) {
    const int ith = params->ith;
    const int nth = params->nth;

    attn a;
    a.q     = dst->src[0];
    a.k     = dst->src[1];
    a.v     = dst->src[2];
    a.mask  = dst->src[3];
    a.sinks = dst->src[4];
    a.ek    = ggml_flash_attn_ext_exact_k(dst);
    a.ev    = ggml_flash_attn_ext_exact_v(dst);
    a.emask = ggml_flash_attn_ext_exact_mask(dst);
    a.dst   = dst;
    a.DK    = a.k->ne[0];
    a.DV    = a.v->ne[0];
    a.k_rot = ggml_turboq_group(a.k->type) != 0;
    a.v_rot = ggml_turboq_group(a.v->type) != 0;

    memcpy(&a.scale,    (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&a.max_bias, (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&a.softcap,  (const float *) dst->op_params + 2, sizeof(float));
    if (a.softcap != 0.0f) {
        a.scale /= a.softcap;
    }
    const uint32_t n_head = (uint32_t) a.q->ne[2];
    a.n_head_log2 = 1u << (uint32_t) floor(log2(n_head));
    a.m0 = powf(2.0f, -(a.max_bias       )/a.n_head_log2);
    a.m1 = powf(2.0f, -(a.max_bias/2.0f)/a.n_head_log2);

    GGML_ASSERT(a.q->nb[0] == sizeof(float));
    GGML_ASSERT(a.k->nb[0] == ggml_type_size(a.k->type));
    GGML_ASSERT(a.v->nb[0] == ggml_type_size(a.v->type));
    GGML_ASSERT(dst->nb[0] == sizeof(float));

    a.p = make_plan(dst, nth);

    const int64_t per_thread = thread_floats(a.DK, a.DV);
    GGML_ASSERT(params->wsize >= ggml_fa_tiled_q_work_size(dst, nth));
    float * scratch  = (float *) params->wdata + ith*per_thread;
    float * exact    = (float *) params->wdata + nth*per_thread;
    float * partials = a.p.nsplit > 1 ? exact + exact_floats(dst) : nullptr;
    a.Ek = a.ek ? exact : nullptr;
    a.Ev = a.ek ? exact + a.ek->ne[1]*a.ek->ne[2]*a.ek->ne[3]*a.DK : nullptr;

    const int64_t n_items = a.p.n_tiles*a.p.nsplit;

    if (a.ek) {
        prepare_exact(a, ith, nth);  // the barrier below ends it
    }
    if (ith == 0) {
        ggml_threadpool_chunk_set(params->threadpool, nth);
    }
    ggml_barrier(params->threadpool);

    for (int64_t item = ith; item < n_items; item = ggml_threadpool_chunk_add(params->threadpool, 1)) {
        const int64_t tile   = item/a.p.nsplit;
        const int64_t isplit = item%a.p.nsplit;
        const int64_t g      = tile/a.p.tiles_per_group;
        const int64_t r0     = (tile%a.p.tiles_per_group)*QT;
        const int64_t r1     = std::min(r0 + QT, a.p.rows);
        int64_t first, last;
        visible_span(a.mask, a.k->ne[1], a, g, r0, r1, first, last);
        // the chunks split the visible span, so they too depend on it alone; a chunk past its
        // end runs no K/V tile and leaves an empty partial (sum 0), which the merge skips
        const int64_t span   = std::max<int64_t>(0, last + 1 - first);
        const int64_t nsplit = splits(a.p.nsplit, span);
        const int64_t chunk  = ((span + nsplit - 1)/nsplit + KT - 1)/KT*KT;
        const int64_t c0     = std::min(first + isplit*chunk, last + 1);
        const int64_t c1     = std::min(c0 + chunk, last + 1);
        run_tile(a, g, r0, r1, std::max<int64_t>(c0, 0), std::max<int64_t>(c1, 0), scratch, partials, isplit);
    }

    if (partials) {
        ggml_barrier(params->threadpool);
        for (int64_t R = ith; R < a.p.n_rows_total; R += nth) {
            merge_row(a, R, partials, scratch);
        }
    }
}
