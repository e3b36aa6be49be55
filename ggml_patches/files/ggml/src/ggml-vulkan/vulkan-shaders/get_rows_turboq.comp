#version 450

// GET_ROWS from a turboq tensor: one invocation decodes one block, 128, 64, 32 or 16 values (the inverse
// rotation needs the whole group), into f32 or f16.

#include "types.glsl"
#include "generic_binary_head.glsl"
#include "turboq.glsl"

layout(local_size_x = 32, local_size_y = 1, local_size_z = 1) in;

void main() {
    const uint i00 = gl_GlobalInvocationID.x * QUANT_K;

    if (i00 >= p.ne00) {
        return;
    }

    uint gid_z = gl_GlobalInvocationID.z;
    while (gid_z < p.ne11 * p.ne12) {
        uint gid_y = gl_GlobalInvocationID.y;
        while (gid_y < p.ne10) {
            const uint i10 = gid_y;
            const uint i11 = gid_z / p.ne12;
            const uint i12 = gid_z % p.ne12;

            const uint i01 = data_b[get_boffset() + i10*p.nb10 + i11*p.nb11 + i12*p.nb12];

            const uint a_offset = get_aoffset() + i01*p.nb01 + i11*p.nb02 + i12*p.nb03;
            const uint d_offset = get_doffset() + i10*p.nb21 + i11*p.nb22 + i12*p.nb23;

            float x[128];
            turboq_decode_a(a_offset + i00/QUANT_K, x);
            for (uint j = 0; j < TQ_G; ++j) {
                data_d[d_offset + i00 + j] = D_TYPE(x[j]);
            }

            gid_y += gl_WorkGroupSize.y * gl_NumWorkGroups.y;
        }
        gid_z += gl_WorkGroupSize.z * gl_NumWorkGroups.z;
    }
}
