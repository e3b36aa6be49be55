// TurboQuant codec for the Vulkan shaders: the steps and the float order of ggml-turboq-encode.h.
// `precise` keeps the compiler from fusing a multiply into an add where the C code rounds between
// them, so a CPU Vulkan driver reproduces the CPU blocks.
#if !defined(GGML_TURBOQ_GLSL)
#define GGML_TURBOQ_GLSL

#include "turboq_tables.glsl"

#define TQ_SIGN1(i) ((((turboq_sign1_bits[(i) >> 5u] >> ((i) & 31u)) & 1u) != 0u) ? -1.0 : 1.0)
#define TQ_SIGN2(i) ((((turboq_sign2_bits[(i) >> 5u] >> ((i) & 31u)) & 1u) != 0u) ? -1.0 : 1.0)

float turboq_centroid(const uint type, const uint q) {
    switch (type) {
        case GGML_TYPE_TURBOQ2_0:   return turboq2_centroids[q];
        case GGML_TYPE_TURBOQ3_0:   return turboq3_centroids[q];
        case GGML_TYPE_TURBOQ4_0:   return turboq4_centroids[q];
        case GGML_TYPE_TURBOQ2_G64: return turboq2_g64_centroids[q];
        case GGML_TYPE_TURBOQ3_G64: return turboq3_g64_centroids[q];
        case GGML_TYPE_TURBOQ4_G64: return turboq4_g64_centroids[q];
        case GGML_TYPE_TURBOQ2_G32: return turboq2_g32_centroids[q];
        case GGML_TYPE_TURBOQ3_G32: return turboq3_g32_centroids[q];
        case GGML_TYPE_TURBOQ4_G32: return turboq4_g32_centroids[q];
        case GGML_TYPE_TURBOQ2_G16: return turboq2_g16_centroids[q];
        case GGML_TYPE_TURBOQ3_G16: return turboq3_g16_centroids[q];
        case GGML_TYPE_TURBOQ4_G16: return turboq4_g16_centroids[q];
        case GGML_TYPE_TURBOQ3_T:   return turboq3t_codebook[q];
        case GGML_TYPE_TURBOQ2_T:   return turboq2t_codebook[q];
        default:                    return turboq8_centroids[q];
    }
}

// the number of thresholds below v of the type's codebook (not turboq8's grid)
uint turboq_threshold_index(const uint type, const float v) {
    uint q = 0;
    switch (type) {
        case GGML_TYPE_TURBOQ2_0:   for (uint k = 0; k < 3;  ++k) q += turboq2_thresholds[k] < v ? 1 : 0; break;
        case GGML_TYPE_TURBOQ3_0:   for (uint k = 0; k < 7;  ++k) q += turboq3_thresholds[k] < v ? 1 : 0; break;
        case GGML_TYPE_TURBOQ4_0:   for (uint k = 0; k < 15; ++k) q += turboq4_thresholds[k] < v ? 1 : 0; break;
        case GGML_TYPE_TURBOQ2_G64: for (uint k = 0; k < 3;  ++k) q += turboq2_g64_thresholds[k] < v ? 1 : 0; break;
        case GGML_TYPE_TURBOQ3_G64: for (uint k = 0; k < 7;  ++k) q += turboq3_g64_thresholds[k] < v ? 1 : 0; break;
        case GGML_TYPE_TURBOQ4_G64: for (uint k = 0; k < 15; ++k) q += turboq4_g64_thresholds[k] < v ? 1 : 0; break;
        case GGML_TYPE_TURBOQ2_G32: for (uint k = 0; k < 3;  ++k) q += turboq2_g32_thresholds[k] < v ? 1 : 0; break;
        case GGML_TYPE_TURBOQ3_G32: for (uint k = 0; k < 7;  ++k) q += turboq3_g32_thresholds[k] < v ? 1 : 0; break;
        case GGML_TYPE_TURBOQ4_G32: for (uint k = 0; k < 15; ++k) q += turboq4_g32_thresholds[k] < v ? 1 : 0; break;
        case GGML_TYPE_TURBOQ2_G16: for (uint k = 0; k < 3;  ++k) q += turboq2_g16_thresholds[k] < v ? 1 : 0; break;
        case GGML_TYPE_TURBOQ3_G16: for (uint k = 0; k < 7;  ++k) q += turboq3_g16_thresholds[k] < v ? 1 : 0; break;
        default:                    for (uint k = 0; k < 15; ++k) q += turboq4_g16_thresholds[k] < v ? 1 : 0; break;
    }
    return q;
}

// 1/sqrt(g) for a group of g values
float turboq_inv_sqrt_group(const uint g) {
    return g == TURBOQ_G64_GROUP ? TURBOQ_G64_INV_SQRT_GROUP : g == TURBOQ_G32_GROUP ? TURBOQ_G32_INV_SQRT_GROUP
         : g == TURBOQ_G16_GROUP ? TURBOQ_G16_INV_SQRT_GROUP : TURBOQ_INV_SQRT_GROUP;
}

// unnormalised Walsh-Hadamard butterflies on the first g values, h = 1..g/2 as in the C code
void turboq_fwht(inout float x[128], const uint g) {
    for (uint h = 1; h < g; h <<= 1) {
        for (uint i = 0; i < g; i += 2 * h) {
            for (uint j = i; j < i + h; ++j) {
                const float a = x[j];
                const float b = x[j + h];
                x[j]     = a + b;
                x[j + h] = a - b;
            }
        }
    }
}

// x = D1.H.D2.x/sqrt(g) * scale, on the first g values and signs
void turboq_unrotate_scaled(inout float x[128], const uint g, const float scale) {
    precise const float k = scale * turboq_inv_sqrt_group(g);
    for (uint i = 0; i < g; ++i) x[i] = x[i] * TQ_SIGN2(i);
    turboq_fwht(x, g);
    for (uint i = 0; i < g; ++i) {
        precise const float t = x[i] * k;
        x[i] = t * TQ_SIGN1(i);
    }
}

// the halving-tree sum of the first g values; destroys t
float turboq_tree_sum(inout float t[128], const uint g) {
    for (uint h = g / 2; h > 0; h >>= 1) {
        for (uint i = 0; i < h; ++i) {
            t[i] = t[i] + t[i + h];
        }
    }
    return t[0];
}

// The trellis types' search (ggml-turboq-trellis.h): the path of least squared error through the
// 64 states, the same float operations in the same order, the first minimum on ties. back[t] holds
// the K-bit h of each predecessor class p < 64 >> K at bits K*p (24 or 32 bits).
void turboq_trellis_viterbi(const uint type, const float y[128], out uint states[128]) {
    const uint k = type == GGML_TYPE_TURBOQ3_T ? 3u : 2u;
    const uint lo = 64u >> k;
    const uint hmask = (1u << k) - 1u;
    float cost[64];
    float best[16];
    uint back[128];
    for (uint m = 0; m < 64; ++m) cost[m] = m == 0 ? 0.0 : uintBitsToFloat(0x7f800000u);
    for (uint t = 0; t < 128; ++t) {
        uint bt = 0;
        for (uint p = 0; p < lo; ++p) best[p] = cost[p];
        for (uint h = 1; h <= hmask; ++h) {
            for (uint p = 0; p < lo; ++p) {
                const float c = cost[h * lo + p];
                if (c < best[p]) {
                    best[p] = c;
                    bt = (bt & ~(hmask << (k * p))) | (h << (k * p));
                }
            }
        }
        for (uint m = 0; m < 64; ++m) {
            precise const float d = y[t] - turboq_centroid(type, m);
            precise const float dd = d * d;
            precise const float c = best[m >> k] + dd;
            cost[m] = c;
        }
        back[t] = bt;
    }
    uint s = 0;
    for (uint m = 1; m < 64; ++m) s = cost[m] < cost[s] ? m : s;
    for (int t = 127; t >= 0; --t) {
        states[t] = s;
        const uint p = s >> k;
        s = ((back[t] >> (k * p)) & hmask) * lo + p;
    }
}

// Encodes the group v (its first TURBOQ_GROUP_OF(type) values; destroyed): fills idx, returns the
// corrected norm (see ggml-turboq-encode.h).
float turboq_encode(const uint type, inout float v[128], out uint idx[128]) {
    const uint g = TURBOQ_GROUP_OF(type);
    float amax = 0.0;
    bool finite = true;
    for (uint i = 0; i < g; ++i) {
        finite = finite && !isnan(v[i]) && !isinf(v[i]);
        amax = max(amax, abs(v[i]));
    }
    if (!finite || amax == 0.0) {
        for (uint i = 0; i < 128; ++i) idx[i] = 0;
        return 0.0;
    }

    float t[128];
    for (uint i = 0; i < g; ++i) v[i] = v[i] / amax;
    for (uint i = 0; i < g; ++i) {
        precise const float sq = v[i] * v[i];
        t[i] = sq;
    }
    const float r = sqrt(turboq_tree_sum(t, g));
    for (uint i = 0; i < g; ++i) v[i] = v[i] / r;

    const float k = turboq_inv_sqrt_group(g);
    for (uint i = 0; i < g; ++i) v[i] = v[i] * TQ_SIGN1(i);
    turboq_fwht(v, g);
    for (uint i = 0; i < g; ++i) {
        precise const float y = v[i] * k;
        v[i] = y * TQ_SIGN2(i);
    }

    if (TURBOQ_IS_TRELLIS(type)) {
        // idx: the states, which index the trellis codebook as the others' indices do theirs
        turboq_trellis_viterbi(type, v, idx);
    } else if (type == GGML_TYPE_TURBOQ8_0 || type == GGML_TYPE_TURBOQ8_G64 || type == GGML_TYPE_TURBOQ8_G32 || type == GGML_TYPE_TURBOQ8_G16) {
        float ya = 0.0;
        for (uint i = 0; i < g; ++i) ya = max(ya, abs(v[i]));
        const float s = 127.5 / ya;
        for (uint i = 0; i < g; ++i) {
            precise const float p = v[i] * s;
            precise const float q = floor(p + 128.0);
            idx[i] = uint(clamp(q, 0.0, 255.0));
        }
    } else {
        for (uint i = 0; i < g; ++i) {
            idx[i] = turboq_threshold_index(type, v[i]);
        }
    }

    for (uint i = 0; i < g; ++i) {
        const float c = turboq_centroid(type, idx[i]);
        precise const float c2 = c * c;
        t[i] = c2;
    }
    const float cn = sqrt(turboq_tree_sum(t, g));
    precise const float an = amax * r;
    return min(an / cn, 65504.0);
}

#if defined(DATA_A_TURBOQ)
// Decodes block ib of data_a into the original domain (its first TQ_G values of x).
void turboq_decode_a(const uint ib, out float x[128]) {
    for (uint i = 0; i < TQ_G; ++i) {
        x[i] = turboq_centroid(TQ_TYPE, TQ_IDX(data_a[ib], i));
    }
    turboq_unrotate_scaled(x, TQ_G, float(data_a[ib].norm));
}
#endif

#endif
