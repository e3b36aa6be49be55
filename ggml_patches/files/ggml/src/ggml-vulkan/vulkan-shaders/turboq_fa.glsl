// turboq K/V in the scalar flash-attention shaders (included by flash_attn_dequant.glsl).
// Attention runs in the rotated domain: a K or V value is norm * centroid, with no inverse
// rotation per element (a trellis type's centroid is the codebook entry of the value's state). Q is
// rotated once per row before the KV loop and the V sum is rotated back once per row after it
// (turboq_fa_rot.glsl), as the CPU kernel does.
#include "turboq.glsl"

layout (binding = 1) readonly buffer K_PACKED_TURBOQ2_0 { block_turboq2_0 data[]; } k_packed_turboq2_0;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ2_0 { block_turboq2_0 data[]; } v_packed_turboq2_0;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ3_0 { block_turboq3_0 data[]; } k_packed_turboq3_0;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ3_0 { block_turboq3_0 data[]; } v_packed_turboq3_0;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ4_0 { block_turboq4_0 data[]; } k_packed_turboq4_0;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ4_0 { block_turboq4_0 data[]; } v_packed_turboq4_0;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ8_0 { block_turboq8_0 data[]; } k_packed_turboq8_0;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ8_0 { block_turboq8_0 data[]; } v_packed_turboq8_0;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ2_G64 { block_turboq2_g64 data[]; } k_packed_turboq2_g64;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ2_G64 { block_turboq2_g64 data[]; } v_packed_turboq2_g64;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ3_G64 { block_turboq3_g64 data[]; } k_packed_turboq3_g64;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ3_G64 { block_turboq3_g64 data[]; } v_packed_turboq3_g64;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ4_G64 { block_turboq4_g64 data[]; } k_packed_turboq4_g64;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ4_G64 { block_turboq4_g64 data[]; } v_packed_turboq4_g64;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ8_G64 { block_turboq8_g64 data[]; } k_packed_turboq8_g64;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ8_G64 { block_turboq8_g64 data[]; } v_packed_turboq8_g64;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ2_G32 { block_turboq2_g32 data[]; } k_packed_turboq2_g32;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ2_G32 { block_turboq2_g32 data[]; } v_packed_turboq2_g32;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ3_G32 { block_turboq3_g32 data[]; } k_packed_turboq3_g32;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ3_G32 { block_turboq3_g32 data[]; } v_packed_turboq3_g32;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ4_G32 { block_turboq4_g32 data[]; } k_packed_turboq4_g32;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ4_G32 { block_turboq4_g32 data[]; } v_packed_turboq4_g32;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ8_G32 { block_turboq8_g32 data[]; } k_packed_turboq8_g32;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ8_G32 { block_turboq8_g32 data[]; } v_packed_turboq8_g32;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ2_G16 { block_turboq2_g16 data[]; } k_packed_turboq2_g16;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ2_G16 { block_turboq2_g16 data[]; } v_packed_turboq2_g16;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ3_G16 { block_turboq3_g16 data[]; } k_packed_turboq3_g16;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ3_G16 { block_turboq3_g16 data[]; } v_packed_turboq3_g16;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ4_G16 { block_turboq4_g16 data[]; } k_packed_turboq4_g16;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ4_G16 { block_turboq4_g16 data[]; } v_packed_turboq4_g16;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ8_G16 { block_turboq8_g16 data[]; } k_packed_turboq8_g16;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ8_G16 { block_turboq8_g16 data[]; } v_packed_turboq8_g16;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ3_T { block_turboq3_t data[]; } k_packed_turboq3_t;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ3_T { block_turboq3_t data[]; } v_packed_turboq3_t;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ2_T { block_turboq2_t data[]; } k_packed_turboq2_t;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ2_T { block_turboq2_t data[]; } v_packed_turboq2_t;

#define FA_DEQUANT4_TURBOQ(BUF, IDX, LEVELS) {                                                    \
    const FLOAT_TYPE n = FLOAT_TYPE(BUF.data[a_offset + ib].norm);                                \
    return n * FLOAT_TYPEV4(LEVELS[IDX(BUF.data[a_offset + ib], iqs     )],                       \
                            LEVELS[IDX(BUF.data[a_offset + ib], iqs + 1u)],                       \
                            LEVELS[IDX(BUF.data[a_offset + ib], iqs + 2u)],                       \
                            LEVELS[IDX(BUF.data[a_offset + ib], iqs + 3u)]);                      \
}

// the case labels of dequantize4's switch for K (kv = k) or V (kv = v)
#define FA_DEQUANT4_TURBOQ_CASES(kv)                                                                                     \
    case GGML_TYPE_TURBOQ2_0:   FA_DEQUANT4_TURBOQ(kv##_packed_turboq2_0,   TQ_IDX_TURBOQ2_0,   turboq2_centroids)     \
    case GGML_TYPE_TURBOQ3_0:   FA_DEQUANT4_TURBOQ(kv##_packed_turboq3_0,   TQ_IDX_TURBOQ3_0,   turboq3_centroids)     \
    case GGML_TYPE_TURBOQ4_0:   FA_DEQUANT4_TURBOQ(kv##_packed_turboq4_0,   TQ_IDX_TURBOQ4_0,   turboq4_centroids)     \
    case GGML_TYPE_TURBOQ8_0:   FA_DEQUANT4_TURBOQ(kv##_packed_turboq8_0,   TQ_IDX_TURBOQ8_0,   turboq8_centroids)     \
    case GGML_TYPE_TURBOQ2_G64: FA_DEQUANT4_TURBOQ(kv##_packed_turboq2_g64, TQ_IDX_TURBOQ2_G64, turboq2_g64_centroids) \
    case GGML_TYPE_TURBOQ3_G64: FA_DEQUANT4_TURBOQ(kv##_packed_turboq3_g64, TQ_IDX_TURBOQ3_G64, turboq3_g64_centroids) \
    case GGML_TYPE_TURBOQ4_G64: FA_DEQUANT4_TURBOQ(kv##_packed_turboq4_g64, TQ_IDX_TURBOQ4_G64, turboq4_g64_centroids) \
    case GGML_TYPE_TURBOQ8_G64: FA_DEQUANT4_TURBOQ(kv##_packed_turboq8_g64, TQ_IDX_TURBOQ8_G64, turboq8_centroids)     \
    case GGML_TYPE_TURBOQ2_G32: FA_DEQUANT4_TURBOQ(kv##_packed_turboq2_g32, TQ_IDX_TURBOQ2_G32, turboq2_g32_centroids) \
    case GGML_TYPE_TURBOQ3_G32: FA_DEQUANT4_TURBOQ(kv##_packed_turboq3_g32, TQ_IDX_TURBOQ3_G32, turboq3_g32_centroids) \
    case GGML_TYPE_TURBOQ4_G32: FA_DEQUANT4_TURBOQ(kv##_packed_turboq4_g32, TQ_IDX_TURBOQ4_G32, turboq4_g32_centroids) \
    case GGML_TYPE_TURBOQ8_G32: FA_DEQUANT4_TURBOQ(kv##_packed_turboq8_g32, TQ_IDX_TURBOQ8_G32, turboq8_centroids)     \
    case GGML_TYPE_TURBOQ2_G16: FA_DEQUANT4_TURBOQ(kv##_packed_turboq2_g16, TQ_IDX_TURBOQ2_G16, turboq2_g16_centroids) \
    case GGML_TYPE_TURBOQ3_G16: FA_DEQUANT4_TURBOQ(kv##_packed_turboq3_g16, TQ_IDX_TURBOQ3_G16, turboq3_g16_centroids) \
    case GGML_TYPE_TURBOQ4_G16: FA_DEQUANT4_TURBOQ(kv##_packed_turboq4_g16, TQ_IDX_TURBOQ4_G16, turboq4_g16_centroids) \
    case GGML_TYPE_TURBOQ8_G16: FA_DEQUANT4_TURBOQ(kv##_packed_turboq8_g16, TQ_IDX_TURBOQ8_G16, turboq8_centroids)     \
    case GGML_TYPE_TURBOQ3_T:   FA_DEQUANT4_TURBOQ(kv##_packed_turboq3_t,   TQ_IDX_TURBOQ3_T,   turboq3t_codebook)     \
    case GGML_TYPE_TURBOQ2_T:   FA_DEQUANT4_TURBOQ(kv##_packed_turboq2_t,   TQ_IDX_TURBOQ2_T,   turboq2t_codebook)
