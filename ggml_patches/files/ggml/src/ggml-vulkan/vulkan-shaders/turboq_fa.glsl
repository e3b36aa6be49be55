// turboq K/V in the scalar flash-attention shaders (included by flash_attn_dequant.glsl).
// Attention runs in the rotated domain: a K or V value is norm * centroid, with no inverse
// rotation per element. Q is rotated once per row before the KV loop and the V sum is rotated
// back once per row after it (turboq_fa_rot.glsl), as the CPU kernel does.
#include "turboq.glsl"

layout (binding = 1) readonly buffer K_PACKED_TURBOQ2_0 { block_turboq2_0 data[]; } k_packed_turboq2_0;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ2_0 { block_turboq2_0 data[]; } v_packed_turboq2_0;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ3_0 { block_turboq3_0 data[]; } k_packed_turboq3_0;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ3_0 { block_turboq3_0 data[]; } v_packed_turboq3_0;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ4_0 { block_turboq4_0 data[]; } k_packed_turboq4_0;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ4_0 { block_turboq4_0 data[]; } v_packed_turboq4_0;
layout (binding = 1) readonly buffer K_PACKED_TURBOQ8_0 { block_turboq8_0 data[]; } k_packed_turboq8_0;
layout (binding = 2) readonly buffer V_PACKED_TURBOQ8_0 { block_turboq8_0 data[]; } v_packed_turboq8_0;

#define FA_DEQUANT4_TURBOQ(BUF, IDX, LEVELS) {                                                    \
    const FLOAT_TYPE n = FLOAT_TYPE(BUF.data[a_offset + ib].norm);                                \
    return n * FLOAT_TYPEV4(LEVELS[IDX(BUF.data[a_offset + ib], iqs     )],                       \
                            LEVELS[IDX(BUF.data[a_offset + ib], iqs + 1u)],                       \
                            LEVELS[IDX(BUF.data[a_offset + ib], iqs + 2u)],                       \
                            LEVELS[IDX(BUF.data[a_offset + ib], iqs + 3u)]);                      \
}
