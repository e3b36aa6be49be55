// TurboQuant KV-cache codec (pyturbo).
//
// Encoding one 128-value group x (the _g64/_g32/_g16 types: 64/32/16 values, the first 64/32/16
// signs and their own codebooks; read 64, 32 or 16 for 128 below):
//   1. amax = max|x_i|; a group with a NaN/Inf or all zeros is stored as an all-zero block, so a
//      bad value never reaches (and poisons) the softmax of other tokens.
//   2. u = x/amax, r = ||u|| (dividing first keeps huge and denormal inputs in range), v = u/r.
//   3. y = D2.H.D1.v/sqrt(128): randomized Walsh-Hadamard rotation, signs in ggml-turboq-tables.h.
//   4. idx_i = nearest level: the Lloyd-Max thresholds (turboq2/3/4), or for turboq8 the uniform
//      grid (i - 127.5)/127.5 scaled to the group's absmax of y; for the trellis types (turboq3t,
//      turboq2t) the states of the Viterbi path through a 64-state trellis (ggml-turboq-encode.h).
//   5. norm = amax*r / ||c||, with c_i the chosen levels: the "corrected" norm makes the decoded
//      group keep the input's L2 norm. Stored as fp16, saturated at 65504.
// Decoding: x = norm * D1.H.D2.c/sqrt(128), i.e. values come back in the original domain, so
// get_rows, copies and the K-shift (RoPE of cached K) see ordinary numbers.
//
// pyturbo/format/reference.py mirrors every float operation here in NumPy, bit for bit: sums are a
// fixed halving tree, the butterflies run h = 1..64, and this file is built with
// -ffp-contract=off so that no multiply-add is fused behind our back.
//
// This file is generic C: ggml-base is built without SIMD flags. The encoder's algorithm lives in
// ggml-turboq-encode.h, which ggml-cpu's quantizer (ggml-cpu/turboq-quants.c) shares with the
// reference here, plugging in the SIMD steps of ggml-cpu/arch/<arch>/turboq-kernels.h; the CPU
// backend's SET_ROWS goes through that one (its type traits' from_float), its flash attention
// through ggml-cpu/turboq-cpu.c. tests/test_portable_kernels.py checks the AArch64 steps under qemu.

#define GGML_COMMON_DECL_C
#include "ggml-common.h"

#include "ggml-turboq.h"
#include "ggml-turboq-encode.h"
#include "ggml-turboq-tables.h"
#include "ggml-impl.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

static_assert(QK_TURBOQ == TURBOQ_GROUP, "turboq block and rotation group must match");

// The rotation signs are the generated tables'. A build configured with PYTURBO_SIGN_SEED (a debug
// option, for measuring how much a result depends on the rotation draw) compiles other signs into
// those tables, for every backend alike, and names its seed there; llama records it in saved state.
const char * ggml_turboq_sign_seed(void) {
#ifdef TURBOQ_SIGN_SEED_BUILD
    return TURBOQ_SIGN_SEED_BUILD;
#else
    return NULL;
#endif
}

void ggml_turboq_signs(const float ** s1, const float ** s2) {
    *s1 = turboq_sign1;
    *s2 = turboq_sign2;
}

// ---- decoding: the index unpacking of each layout (packing: ggml-turboq-encode.h) ----

// the inverse of ggml-turboq-encode.h's TURBOQ_GENERIC_PACK_OF, for a group G
#define TURBOQ_DEFINE_UNPACK(NAME, SUF, G)                                                              \
    static void turboq2##NAME##_unpack(const void * blk, uint8_t * idx) {                              \
        const block_turboq2##SUF * b = (const block_turboq2##SUF *) blk;                                \
        for (int i = 0; i < (G)/4; ++i) {                                                               \
            for (int k = 0; k < 4; ++k) idx[i + k*((G)/4)] = (b->qs[i] >> (2*k)) & 3;                   \
        }                                                                                               \
    }                                                                                                   \
    static void turboq3##NAME##_unpack(const void * blk, uint8_t * idx) {                              \
        const block_turboq3##SUF * b = (const block_turboq3##SUF *) blk;                                \
        turboq2##NAME##_unpack(blk, idx);                                                               \
        for (int i = 0; i < (G)/8; ++i) {                                                               \
            for (int k = 0; k < 8; ++k) idx[i + k*((G)/8)] |= ((b->qh[i] >> k) & 1) << 2;               \
        }                                                                                               \
    }                                                                                                   \
    static void turboq4##NAME##_unpack(const void * blk, uint8_t * idx) {                              \
        const block_turboq4##SUF * b = (const block_turboq4##SUF *) blk;                                \
        for (int i = 0; i < (G)/2; ++i) {                                                               \
            idx[i]         = b->qs[i] & 15;                                                             \
            idx[i + (G)/2]   = b->qs[i] >> 4;                                                           \
        }                                                                                               \
    }                                                                                                   \
    static void turboq8##NAME##_unpack(const void * blk, uint8_t * idx) {                              \
        memcpy(idx, ((const block_turboq8##SUF *) blk)->qs, (G));                                       \
    }

TURBOQ_DEFINE_UNPACK(, _0, TURBOQ_GROUP)
TURBOQ_DEFINE_UNPACK(_g64, _g64, QK_TURBOQ_G64)
TURBOQ_DEFINE_UNPACK(_g32, _g32, QK_TURBOQ_G32)
TURBOQ_DEFINE_UNPACK(_g16, _g16, QK_TURBOQ_G16)

// the trellis types: their states, which index the codebook as the others' indices do
static void turboq3t_unpack(const void * blk, uint8_t * idx) {
    turboq_trellis_states(3, ((const block_turboq3_t *) blk)->qs, idx);
}
static void turboq2t_unpack(const void * blk, uint8_t * idx) {
    turboq_trellis_states(2, ((const block_turboq2_t *) blk)->qs, idx);
}

static void (*const turboq_unpack[])(const void * blk, uint8_t * idx) = {
    turboq2_unpack,     turboq3_unpack,     turboq4_unpack,     turboq8_unpack,
    turboq2_g64_unpack, turboq3_g64_unpack, turboq4_g64_unpack, turboq8_g64_unpack,
    turboq2_g32_unpack, turboq3_g32_unpack, turboq4_g32_unpack, turboq8_g32_unpack,
    turboq2_g16_unpack, turboq3_g16_unpack, turboq4_g16_unpack, turboq8_g16_unpack,
    turboq3t_unpack,    turboq2t_unpack,
};

float ggml_turboq_decode_rotated(enum ggml_type type, const void * GGML_RESTRICT block, float * GGML_RESTRICT out) {
    const struct turboq_codebook * cb = turboq_codebook_of(type);
    uint8_t idx[TURBOQ_GROUP];
    turboq_unpack[turboq_type_index(type)](block, idx);
    turboq_generic_lookup_n(cb->centroids, turboq_codebook_levels(cb), idx, out, cb->group);
    ggml_half h;
    memcpy(&h, block, sizeof(h));
    return GGML_FP16_TO_FP32(h);
}

static void turboq_dequantize_row(enum ggml_type type, const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
    const struct turboq_codebook * cb = turboq_codebook_of(type);
    const struct turboq_encode_steps * st = turboq_steps_for(type, &turboq_generic_steps);
    const int g = cb->group;
    assert(k % g == 0);
    for (int64_t ib = 0; ib < k / g; ++ib) {
        float * out = y + ib * g;
        const float norm = ggml_turboq_decode_rotated(type, (const char *) x + ib * cb->block_bytes, out);
        turboq_unrotate_group_with(st, out, norm, turboq_sign1, turboq_sign2);
    }
}

static size_t turboq_quantize(enum ggml_type type, const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row) {
    const size_t row_size = ggml_row_size(type, n_per_row);
    for (int64_t r = 0; r < nrows; ++r) {
        turboq_quantize_row_with(turboq_steps_for(type, &turboq_generic_steps), type, src + r * n_per_row, (char *) dst + r * row_size, n_per_row);
    }
    return nrows * row_size;
}

#define TURBOQ_DEFINE_ENTRY_POINTS(N, SUF, TYPE)                                                               \
    void quantize_row_turboq##N##SUF##_ref(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) { \
        turboq_quantize_row_with(turboq_steps_for(TYPE, &turboq_generic_steps), TYPE, x, y, k);                \
    }                                                                                                          \
    void dequantize_row_turboq##N##SUF(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {     \
        turboq_dequantize_row(TYPE, x, y, k);                                                                  \
    }                                                                                                          \
    size_t quantize_turboq##N##SUF(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows,   \
                                  int64_t n_per_row, const float * imatrix) {                                  \
        GGML_UNUSED(imatrix);                                                                                  \
        return turboq_quantize(TYPE, src, dst, nrows, n_per_row);                                              \
    }

TURBOQ_DEFINE_ENTRY_POINTS(2, _0, GGML_TYPE_TURBOQ2_0)
TURBOQ_DEFINE_ENTRY_POINTS(3, _0, GGML_TYPE_TURBOQ3_0)
TURBOQ_DEFINE_ENTRY_POINTS(4, _0, GGML_TYPE_TURBOQ4_0)
TURBOQ_DEFINE_ENTRY_POINTS(8, _0, GGML_TYPE_TURBOQ8_0)
TURBOQ_DEFINE_ENTRY_POINTS(2, _g64, GGML_TYPE_TURBOQ2_G64)
TURBOQ_DEFINE_ENTRY_POINTS(3, _g64, GGML_TYPE_TURBOQ3_G64)
TURBOQ_DEFINE_ENTRY_POINTS(4, _g64, GGML_TYPE_TURBOQ4_G64)
TURBOQ_DEFINE_ENTRY_POINTS(8, _g64, GGML_TYPE_TURBOQ8_G64)
TURBOQ_DEFINE_ENTRY_POINTS(2, _g32, GGML_TYPE_TURBOQ2_G32)
TURBOQ_DEFINE_ENTRY_POINTS(3, _g32, GGML_TYPE_TURBOQ3_G32)
TURBOQ_DEFINE_ENTRY_POINTS(4, _g32, GGML_TYPE_TURBOQ4_G32)
TURBOQ_DEFINE_ENTRY_POINTS(8, _g32, GGML_TYPE_TURBOQ8_G32)
TURBOQ_DEFINE_ENTRY_POINTS(2, _g16, GGML_TYPE_TURBOQ2_G16)
TURBOQ_DEFINE_ENTRY_POINTS(3, _g16, GGML_TYPE_TURBOQ3_G16)
TURBOQ_DEFINE_ENTRY_POINTS(4, _g16, GGML_TYPE_TURBOQ4_G16)
TURBOQ_DEFINE_ENTRY_POINTS(8, _g16, GGML_TYPE_TURBOQ8_G16)
TURBOQ_DEFINE_ENTRY_POINTS(3, _t, GGML_TYPE_TURBOQ3_T)
TURBOQ_DEFINE_ENTRY_POINTS(2, _t, GGML_TYPE_TURBOQ2_T)
