#version 450

// CPY turboq -> f32/f16: one workgroup of one invocation per block, as copy_from_quant.comp.

#include "types.glsl"
#include "generic_unary_head.glsl"
#include "turboq.glsl"

layout(local_size_x = 1, local_size_y = 1, local_size_z = 1) in;

void main() {
    const uint idx = gl_WorkGroupID.z * 262144 + gl_WorkGroupID.y * 512 + gl_WorkGroupID.x * QUANT_K;

    if (idx >= p.ne) {
        return;
    }

    const uint dst_idx = get_doffset() + dst_idx(idx);
    const uint src_idx = get_aoffset() + src0_idx_quant(idx, QUANT_K);

    float x[128];
    turboq_decode_a(src_idx, x);
    for (uint j = 0; j < TQ_G; ++j) {
        data_d[dst_idx + j] = D_TYPE(x[j]);
    }
}
