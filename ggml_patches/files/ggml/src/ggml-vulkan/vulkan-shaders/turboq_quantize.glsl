// quantize() for copy_to_quant.comp (SET_ROWS and CPY f32 -> turboq): one invocation per block
// (128 values, or 64, 32 and 16 for the _g64, _g32 and _g16 twins; the trellis types' whole search too).
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

    // The layouts of ggml-common.h, the same in terms of the group G (128, or 64, 32 and 16 for the twins):
    // 2-bit fields qs byte i = values i, i+G/4, i+G/2, i+3G/4; turboq3's qh byte i, bit k = bit 2
    // of value i + k*G/8; turboq4's qs byte i = value i (low nibble) and i+G/2; turboq8 a byte each.
#if defined(DATA_A_TURBOQ2_0) || defined(DATA_A_TURBOQ3_0) || defined(DATA_A_TURBOQ2_G64) || defined(DATA_A_TURBOQ3_G64) || \
    defined(DATA_A_TURBOQ2_G32) || defined(DATA_A_TURBOQ3_G32) || defined(DATA_A_TURBOQ2_G16) || defined(DATA_A_TURBOQ3_G16)
    const uint q4 = TQ_G / 4;
    for (uint w = 0; w < TQ_G / 8; ++w) {
        uint word = 0;
        for (uint b = 0; b < 2; ++b) {
            const uint j = 2 * w + b;
            const uint byte = (idx[j] & 3) | ((idx[j + q4] & 3) << 2) | ((idx[j + 2 * q4] & 3) << 4) | ((idx[j + 3 * q4] & 3) << 6);
            word |= byte << (8 * b);
        }
        data_q[dst_idx].qs[w] = uint16_t(word);
    }
#endif
#if defined(DATA_A_TURBOQ3_0) || defined(DATA_A_TURBOQ3_G64) || defined(DATA_A_TURBOQ3_G32) || defined(DATA_A_TURBOQ3_G16)
    const uint q8 = TQ_G / 8;
    for (uint w = 0; w < TQ_G / 16; ++w) {
        uint word = 0;
        for (uint b = 0; b < 2; ++b) {
            const uint j = 2 * w + b;
            uint byte = 0;
            for (uint k = 0; k < 8; ++k) {
                byte |= ((idx[j + q8 * k] >> 2) & 1) << k;
            }
            word |= byte << (8 * b);
        }
        data_q[dst_idx].qh[w] = uint16_t(word);
    }
#endif
#if defined(DATA_A_TURBOQ4_0)
    data_q[dst_idx].rnorm = float16_t(0.0);
#endif
#if defined(DATA_A_TURBOQ4_0) || defined(DATA_A_TURBOQ4_G64) || defined(DATA_A_TURBOQ4_G32) || defined(DATA_A_TURBOQ4_G16)
    for (uint w = 0; w < TQ_G / 4; ++w) {
        uint word = 0;
        for (uint b = 0; b < 2; ++b) {
            const uint j = 2 * w + b;
            word |= ((idx[j] & 15) | ((idx[j + TQ_G / 2] & 15) << 4)) << (8 * b);
        }
        data_q[dst_idx].qs[w] = uint16_t(word);
    }
#endif
#if defined(DATA_A_TURBOQ3_T) || defined(DATA_A_TURBOQ2_T)
    // the trellis types: each state's low K bits (its code), one after another, most significant first
    const uint k = TQ_TYPE == GGML_TYPE_TURBOQ3_T ? 3u : 2u;
    for (uint w = 0; w < k * 8u; ++w) {
        uint word = 0;
        for (uint b = 0; b < 16u; ++b) {
            const uint bit = 16u * w + (b < 8u ? 7u - b : 23u - b);  // the stream bit at word bit b
            const uint t = bit / k;
            word |= ((idx[t] >> (k - 1u - bit % k)) & 1u) << b;
        }
        data_q[dst_idx].qs[w] = uint16_t(word);
    }
#endif
#if defined(DATA_A_TURBOQ8_0) || defined(DATA_A_TURBOQ8_G64) || defined(DATA_A_TURBOQ8_G32) || defined(DATA_A_TURBOQ8_G16)
    for (uint w = 0; w < TQ_G / 2; ++w) {
        data_q[dst_idx].qs[w] = uint16_t(idx[2 * w] | (idx[2 * w + 1] << 8));
    }
#endif
}
#endif
