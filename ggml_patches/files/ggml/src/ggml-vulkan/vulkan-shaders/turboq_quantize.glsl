// quantize() for copy_to_quant.comp (SET_ROWS and CPY f32 -> turboq): one invocation per block
// (128 values, or 64 for the _g64 twins).
#if defined(DATA_A_TURBOQ)
#include "turboq.glsl"

void quantize(uint dst_idx, uint src_idx) {
    float v[128];
    for (uint j = 0; j < TQ_G; ++j) {
        v[j] = float(data_s[src_idx + j]);
    }
    uint idx[128];
    const float norm = turboq_encode(TQ_TYPE, v, idx);
    data_q[dst_idx].norm = float16_t(norm);

#if defined(DATA_A_TURBOQ2_0) || defined(DATA_A_TURBOQ3_0)
    for (uint w = 0; w < 16; ++w) {
        uint word = 0;
        for (uint b = 0; b < 2; ++b) {
            const uint j = 2 * w + b;
            const uint byte = (idx[j] & 3) | ((idx[j + 32] & 3) << 2) | ((idx[j + 64] & 3) << 4) | ((idx[j + 96] & 3) << 6);
            word |= byte << (8 * b);
        }
        data_q[dst_idx].qs[w] = uint16_t(word);
    }
#endif
#if defined(DATA_A_TURBOQ3_0)
    for (uint w = 0; w < 8; ++w) {
        uint word = 0;
        for (uint b = 0; b < 2; ++b) {
            const uint j = 2 * w + b;
            uint byte = 0;
            for (uint k = 0; k < 8; ++k) {
                byte |= ((idx[j + 16 * k] >> 2) & 1) << k;
            }
            word |= byte << (8 * b);
        }
        data_q[dst_idx].qh[w] = uint16_t(word);
    }
#endif
#if defined(DATA_A_TURBOQ4_0)
    data_q[dst_idx].rnorm = float16_t(0.0);
    for (uint w = 0; w < 32; ++w) {
        uint word = 0;
        for (uint b = 0; b < 2; ++b) {
            const uint j = 2 * w + b;
            word |= ((idx[j] & 15) | ((idx[j + 64] & 15) << 4)) << (8 * b);
        }
        data_q[dst_idx].qs[w] = uint16_t(word);
    }
#endif
#if defined(DATA_A_TURBOQ8_0) || defined(DATA_A_TURBOQ8_G64)
    for (uint w = 0; w < TQ_G / 2; ++w) {
        data_q[dst_idx].qs[w] = uint16_t(idx[2 * w] | (idx[2 * w + 1] << 8));
    }
#endif
#if defined(DATA_A_TURBOQ2_G64) || defined(DATA_A_TURBOQ3_G64)
    for (uint w = 0; w < 8; ++w) {
        uint word = 0;
        for (uint b = 0; b < 2; ++b) {
            const uint j = 2 * w + b;
            const uint byte = (idx[j] & 3) | ((idx[j + 16] & 3) << 2) | ((idx[j + 32] & 3) << 4) | ((idx[j + 48] & 3) << 6);
            word |= byte << (8 * b);
        }
        data_q[dst_idx].qs[w] = uint16_t(word);
    }
#endif
#if defined(DATA_A_TURBOQ3_G64)
    for (uint w = 0; w < 4; ++w) {
        uint word = 0;
        for (uint b = 0; b < 2; ++b) {
            const uint j = 2 * w + b;
            uint byte = 0;
            for (uint k = 0; k < 8; ++k) {
                byte |= ((idx[j + 8 * k] >> 2) & 1) << k;
            }
            word |= byte << (8 * b);
        }
        data_q[dst_idx].qh[w] = uint16_t(word);
    }
#endif
#if defined(DATA_A_TURBOQ4_G64)
    for (uint w = 0; w < 16; ++w) {
        uint word = 0;
        for (uint b = 0; b < 2; ++b) {
            const uint j = 2 * w + b;
            word |= ((idx[j] & 15) | ((idx[j + 32] & 15) << 4)) << (8 * b);
        }
        data_q[dst_idx].qs[w] = uint16_t(word);
    }
#endif
}
#endif
