// The rotations around the scalar flash-attention loop for turboq K/V (included by flash_attn.comp
// before main). q.k = norm_k * (R q).c_k with R q = D2.H.D1.q/sqrt(g), and
// sum_j p_j v_j = R^-1 (sum_j p_j norm_j c_j), both per group of a row (128 values, 64, 32 or 16 for
// the twins: K's group for Q, V's for the sum).
// The staging buffer is f32: the unnormalised V sum would overflow f16 inside the butterflies.

// single comparisons: the spec-constant folding of older glslc optimizers chokes on && / ||
// (the turboq ids are the last ones in ggml.h)
const bool TQ_K = FaTypeK >= GGML_TYPE_TURBOQ2_0;
const bool TQ_V = FaTypeV >= GGML_TYPE_TURBOQ2_0;
const uint32_t tq_row_len = HSK > HSV ? HSK : HSV;
shared float tq_sh[FaTypeK >= GGML_TYPE_TURBOQ2_0 ? Br * tq_row_len : (FaTypeV >= GGML_TYPE_TURBOQ2_0 ? Br * tq_row_len : 1)];

// Rotates (forward) or rotates back every g-group (128, 64, 32 or 16) of the first n floats of tq_sh.
void tq_sh_rotate(const uint n, const uint g, const bool forward) {
    const uint tid = gl_LocalInvocationIndex;
    const uint half_g = g / 2u;
    for (uint e = tid; e < n; e += gl_WorkGroupSize.x) {
        const uint k = e % g;
        tq_sh[e] = tq_sh[e] * (forward ? TQ_SIGN1(k) : TQ_SIGN2(k));
    }
    barrier();
    for (uint h = 1; h < g; h <<= 1) {
        for (uint pr = tid; pr < n / 2; pr += gl_WorkGroupSize.x) {
            const uint k = pr % half_g;
            const uint j = (pr / half_g) * g + (k / h) * 2u * h + (k % h);
            const float a = tq_sh[j];
            const float b = tq_sh[j + h];
            tq_sh[j]     = a + b;
            tq_sh[j + h] = a - b;
        }
        barrier();
    }
    const float inv_sqrt_g = turboq_inv_sqrt_group(g);
    for (uint e = tid; e < n; e += gl_WorkGroupSize.x) {
        const uint k = e % g;
        precise const float t = tq_sh[e] * inv_sqrt_g;
        tq_sh[e] = t * (forward ? TQ_SIGN2(k) : TQ_SIGN1(k));
    }
    barrier();
}

#ifndef MMQ
// Replaces the rows of Qf by R q, taken from the f32 Q (times the softmax scale).
void tq_rotate_q(const uint q_offset, const uint i, const uint q_stride) {
    const uint tid = gl_LocalInvocationIndex;
    for (uint e = tid; e < Br * HSK / 4; e += gl_WorkGroupSize.x) {
        const uint r = e / (HSK / 4);
        const uint d = e % (HSK / 4);
        vec4 q = vec4(0.0);
        if (i * Br + r < p.N) {
            q = data_qv4[q_offset / 4 + (i * Br + r) * q_stride / 4 + d] * p.scale;
        }
        tq_sh[r * HSK + 4 * d + 0] = q.x;
        tq_sh[r * HSK + 4 * d + 1] = q.y;
        tq_sh[r * HSK + 4 * d + 2] = q.z;
        tq_sh[r * HSK + 4 * d + 3] = q.w;
    }
    barrier();
    tq_sh_rotate(Br * HSK, TURBOQ_GROUP_OF(FaTypeK), true);
    for (uint e = tid; e < Br * HSK / 4; e += gl_WorkGroupSize.x) {
        const uint r = e / (HSK / 4);
        const uint d = e % (HSK / 4);
        Qf[r * qf_stride + d] = FLOAT_TYPEV4(tq_sh[r * HSK + 4 * d + 0], tq_sh[r * HSK + 4 * d + 1],
                                             tq_sh[r * HSK + 4 * d + 2], tq_sh[r * HSK + 4 * d + 3]);
    }
    barrier();
}
#endif

// Rotates the finished V sums of every row back, in place in Of (after the cross-thread reduction,
// when each thread with col_tid == 0 holds its columns of its rows). A macro because Of is local
// to main.
#define TQ_UNROTATE_O()                                                                            \
    barrier();                                                                                    \
    if (col_tid == 0) {                                                                           \
        [[unroll]] for (uint32_t r = 0; r < rows_per_thread; ++r) {                               \
            [[unroll]] for (uint32_t d = 0; d < HSV_per_thread / 4; ++d) {                        \
                const uint e = tile_row(r) * HSV + 4 * (d * D_split + d_tid);                     \
                const vec4 o = vec4(Of[r][d]);                                                    \
                tq_sh[e + 0] = o.x; tq_sh[e + 1] = o.y; tq_sh[e + 2] = o.z; tq_sh[e + 3] = o.w;   \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    barrier();                                                                                    \
    tq_sh_rotate(Br * HSV, TURBOQ_GROUP_OF(FaTypeV), false);                                                                \
    [[unroll]] for (uint32_t r = 0; r < rows_per_thread; ++r) {                                   \
        [[unroll]] for (uint32_t d = 0; d < HSV_per_thread / 4; ++d) {                            \
            const uint e = tile_row(r) * HSV + 4 * (d * D_split + d_tid);                         \
            Of[r][d] = FLOAT_TYPEV4(tq_sh[e + 0], tq_sh[e + 1], tq_sh[e + 2], tq_sh[e + 3]);      \
        }                                                                                         \
    }                                                                                             \
    barrier();
