// TurboQuant (pyturbo) block layouts for the Vulkan shaders; included by types.glsl.
// The blocks are 34/50/68/130 bytes (18/26/34/66 for the _g64 twins, 10/14/18/34 for the _g32 ones, 6/8/10/18 for the _g16 ones,
// 50/34 for the trellis types), so they are declared as
// 16-bit words: every field stays addressable with 16-bit storage alone. The layouts and the codec are those of
// ggml-common.h and ggml-turboq.c.
#if !defined(GGML_TURBOQ_TYPES_GLSL)
#define GGML_TURBOQ_TYPES_GLSL

// must match ggml.h
#define GGML_TYPE_TURBOQ2_0 60u
#define GGML_TYPE_TURBOQ3_0 61u
#define GGML_TYPE_TURBOQ4_0 62u
#define GGML_TYPE_TURBOQ8_0 63u
#define GGML_TYPE_TURBOQ2_G64 64u
#define GGML_TYPE_TURBOQ3_G64 65u
#define GGML_TYPE_TURBOQ4_G64 66u
#define GGML_TYPE_TURBOQ8_G64 67u
#define GGML_TYPE_TURBOQ2_G32 68u
#define GGML_TYPE_TURBOQ3_G32 69u
#define GGML_TYPE_TURBOQ4_G32 70u
#define GGML_TYPE_TURBOQ8_G32 71u
#define GGML_TYPE_TURBOQ2_G16 72u
#define GGML_TYPE_TURBOQ3_G16 73u
#define GGML_TYPE_TURBOQ4_G16 74u
#define GGML_TYPE_TURBOQ8_G16 75u
#define GGML_TYPE_TURBOQ3_T 76u
#define GGML_TYPE_TURBOQ2_T 77u
// the trellis types count as turboq types here (ggml_turboq_group() != 0), unlike ggml_is_turboq()
#define TURBOQ_IS(t) ((t) >= GGML_TYPE_TURBOQ2_0 && (t) <= GGML_TYPE_TURBOQ2_T)
#define TURBOQ_IS_TRELLIS(t) ((t) >= GGML_TYPE_TURBOQ3_T && (t) <= GGML_TYPE_TURBOQ2_T)
// the group (rotation and block) size of a turboq type
#define TURBOQ_GROUP_OF(t) ((t) >= GGML_TYPE_TURBOQ3_T ? 128u : (t) >= GGML_TYPE_TURBOQ2_G16 ? 16u : (t) >= GGML_TYPE_TURBOQ2_G32 ? 32u : (t) >= GGML_TYPE_TURBOQ2_G64 ? 64u : 128u)

#define QUANT_K_TURBOQ 128
#define QUANT_K_TURBOQ_G64 64
#define QUANT_K_TURBOQ_G32 32
#define QUANT_K_TURBOQ_G16 16

// qs byte i: 2-bit indices of values i, i+32, i+64, i+96
struct block_turboq2_0 { float16_t norm; uint16_t qs[16]; };
// qs as turboq2 (low 2 bits); qh byte i, bit k: bit 2 of value i+16k
struct block_turboq3_0 { float16_t norm; uint16_t qs[16]; uint16_t qh[8]; };
// qs byte i: value i in the low nibble, value i+64 in the high nibble; rnorm is reserved (0)
struct block_turboq4_0 { float16_t norm; float16_t rnorm; uint16_t qs[32]; };
// qs byte i: value i
struct block_turboq8_0 { float16_t norm; uint16_t qs[64]; };

// byte j of a 16-bit word array
#define TQ_BYTE(W, j) ((uint(W[(j) >> 1u]) >> (((j) & 1u) * 8u)) & 0xFFu)

// the codebook index of value i of block B of a group of G values (128, or 64, 32 and 16 for the twins):
// 2-bit fields qs byte i = values i, i+G/4, i+G/2, i+3G/4; turboq3's qh byte i, bit k = bit 2 of
// value i + k*G/8; turboq4's qs byte i = value i (low nibble) and i+G/2
#define TQ_IDX2_G(B, i, G) ((TQ_BYTE(B.qs, (i) % ((G) / 4u)) >> (((i) / ((G) / 4u)) * 2u)) & 3u)
#define TQ_IDX3_G(B, i, G) (TQ_IDX2_G(B, i, G) | (((TQ_BYTE(B.qh, (i) % ((G) / 8u)) >> ((i) / ((G) / 8u))) & 1u) << 2u))
#define TQ_IDX4_G(B, i, G) ((TQ_BYTE(B.qs, (i) % ((G) / 2u)) >> (((i) / ((G) / 2u)) * 4u)) & 15u)

#define TQ_IDX_TURBOQ2_0(B, i) TQ_IDX2_G(B, i, 128u)
#define TQ_IDX_TURBOQ3_0(B, i) TQ_IDX3_G(B, i, 128u)
#define TQ_IDX_TURBOQ4_0(B, i) TQ_IDX4_G(B, i, 128u)
#define TQ_IDX_TURBOQ8_0(B, i) TQ_BYTE(B.qs, (i))

// the _g64 twins: the layouts above with 64 for 128 (no reserved field in turboq4_g64)
struct block_turboq2_g64 { float16_t norm; uint16_t qs[8]; };
struct block_turboq3_g64 { float16_t norm; uint16_t qs[8]; uint16_t qh[4]; };
struct block_turboq4_g64 { float16_t norm; uint16_t qs[16]; };
struct block_turboq8_g64 { float16_t norm; uint16_t qs[32]; };

#define TQ_IDX_TURBOQ2_G64(B, i) TQ_IDX2_G(B, i, 64u)
#define TQ_IDX_TURBOQ3_G64(B, i) TQ_IDX3_G(B, i, 64u)
#define TQ_IDX_TURBOQ4_G64(B, i) TQ_IDX4_G(B, i, 64u)
#define TQ_IDX_TURBOQ8_G64(B, i) TQ_BYTE(B.qs, (i))

// the _g32 twins: the same with 32 for 128
struct block_turboq2_g32 { float16_t norm; uint16_t qs[4]; };
struct block_turboq3_g32 { float16_t norm; uint16_t qs[4]; uint16_t qh[2]; };
struct block_turboq4_g32 { float16_t norm; uint16_t qs[8]; };
struct block_turboq8_g32 { float16_t norm; uint16_t qs[16]; };

#define TQ_IDX_TURBOQ2_G32(B, i) TQ_IDX2_G(B, i, 32u)
#define TQ_IDX_TURBOQ3_G32(B, i) TQ_IDX3_G(B, i, 32u)
#define TQ_IDX_TURBOQ4_G32(B, i) TQ_IDX4_G(B, i, 32u)
#define TQ_IDX_TURBOQ8_G32(B, i) TQ_BYTE(B.qs, (i))

// the _g16 twins: the same with 16 for 128
struct block_turboq2_g16 { float16_t norm; uint16_t qs[2]; };
struct block_turboq3_g16 { float16_t norm; uint16_t qs[2]; uint16_t qh[1]; };
struct block_turboq4_g16 { float16_t norm; uint16_t qs[4]; };
struct block_turboq8_g16 { float16_t norm; uint16_t qs[8]; };

#define TQ_IDX_TURBOQ2_G16(B, i) TQ_IDX2_G(B, i, 16u)
#define TQ_IDX_TURBOQ3_G16(B, i) TQ_IDX3_G(B, i, 16u)
#define TQ_IDX_TURBOQ4_G16(B, i) TQ_IDX4_G(B, i, 16u)
#define TQ_IDX_TURBOQ8_G16(B, i) TQ_BYTE(B.qs, (i))

// the trellis types: the fp16 norm, then the K-bit codes of the 128 values one after another, most
// significant bit first (bytes in order, so byte j is the low byte of word j/2 when j is even)
struct block_turboq3_t { float16_t norm; uint16_t qs[24]; };
struct block_turboq2_t { float16_t norm; uint16_t qs[16]; };

// The state of value i, which indexes the codebook: the 6 (TURBOQ_TRELLIS_L) stream bits that end
// with value i's code, zeros before the stream. They lie in the two bytes that end at bit e = K*i + K - 1.
#define TQ_TSTATE(B, i, K) ((((TQ_BYTE(B.qs, max(((K) * (i) + (K) - 1u) >> 3u, 1u) - 1u) * uint(((K) * (i) + (K) - 1u) >= 8u)) << 8u | \
                              TQ_BYTE(B.qs, ((K) * (i) + (K) - 1u) >> 3u)) >> (7u - (((K) * (i) + (K) - 1u) & 7u))) & 63u)
#define TQ_IDX_TURBOQ3_T(B, i) TQ_TSTATE(B, i, 3u)
#define TQ_IDX_TURBOQ2_T(B, i) TQ_TSTATE(B, i, 2u)

#if defined(DATA_A_TURBOQ2_0)
#define TQ_TYPE GGML_TYPE_TURBOQ2_0
#define A_TYPE block_turboq2_0
#define TQ_IDX TQ_IDX_TURBOQ2_0
#define QUANT_K QUANT_K_TURBOQ
#elif defined(DATA_A_TURBOQ3_0)
#define TQ_TYPE GGML_TYPE_TURBOQ3_0
#define A_TYPE block_turboq3_0
#define TQ_IDX TQ_IDX_TURBOQ3_0
#define QUANT_K QUANT_K_TURBOQ
#elif defined(DATA_A_TURBOQ4_0)
#define TQ_TYPE GGML_TYPE_TURBOQ4_0
#define A_TYPE block_turboq4_0
#define TQ_IDX TQ_IDX_TURBOQ4_0
#define QUANT_K QUANT_K_TURBOQ
#elif defined(DATA_A_TURBOQ8_0)
#define TQ_TYPE GGML_TYPE_TURBOQ8_0
#define A_TYPE block_turboq8_0
#define TQ_IDX TQ_IDX_TURBOQ8_0
#define QUANT_K QUANT_K_TURBOQ
#elif defined(DATA_A_TURBOQ2_G64)
#define TQ_TYPE GGML_TYPE_TURBOQ2_G64
#define A_TYPE block_turboq2_g64
#define TQ_IDX TQ_IDX_TURBOQ2_G64
#define QUANT_K QUANT_K_TURBOQ_G64
#elif defined(DATA_A_TURBOQ3_G64)
#define TQ_TYPE GGML_TYPE_TURBOQ3_G64
#define A_TYPE block_turboq3_g64
#define TQ_IDX TQ_IDX_TURBOQ3_G64
#define QUANT_K QUANT_K_TURBOQ_G64
#elif defined(DATA_A_TURBOQ4_G64)
#define TQ_TYPE GGML_TYPE_TURBOQ4_G64
#define A_TYPE block_turboq4_g64
#define TQ_IDX TQ_IDX_TURBOQ4_G64
#define QUANT_K QUANT_K_TURBOQ_G64
#elif defined(DATA_A_TURBOQ8_G64)
#define TQ_TYPE GGML_TYPE_TURBOQ8_G64
#define A_TYPE block_turboq8_g64
#define TQ_IDX TQ_IDX_TURBOQ8_G64
#define QUANT_K QUANT_K_TURBOQ_G64
#elif defined(DATA_A_TURBOQ2_G32)
#define TQ_TYPE GGML_TYPE_TURBOQ2_G32
#define A_TYPE block_turboq2_g32
#define TQ_IDX TQ_IDX_TURBOQ2_G32
#define QUANT_K QUANT_K_TURBOQ_G32
#elif defined(DATA_A_TURBOQ3_G32)
#define TQ_TYPE GGML_TYPE_TURBOQ3_G32
#define A_TYPE block_turboq3_g32
#define TQ_IDX TQ_IDX_TURBOQ3_G32
#define QUANT_K QUANT_K_TURBOQ_G32
#elif defined(DATA_A_TURBOQ4_G32)
#define TQ_TYPE GGML_TYPE_TURBOQ4_G32
#define A_TYPE block_turboq4_g32
#define TQ_IDX TQ_IDX_TURBOQ4_G32
#define QUANT_K QUANT_K_TURBOQ_G32
#elif defined(DATA_A_TURBOQ8_G32)
#define TQ_TYPE GGML_TYPE_TURBOQ8_G32
#define A_TYPE block_turboq8_g32
#define TQ_IDX TQ_IDX_TURBOQ8_G32
#define QUANT_K QUANT_K_TURBOQ_G32
#elif defined(DATA_A_TURBOQ2_G16)
#define TQ_TYPE GGML_TYPE_TURBOQ2_G16
#define A_TYPE block_turboq2_g16
#define TQ_IDX TQ_IDX_TURBOQ2_G16
#define QUANT_K QUANT_K_TURBOQ_G16
#elif defined(DATA_A_TURBOQ3_G16)
#define TQ_TYPE GGML_TYPE_TURBOQ3_G16
#define A_TYPE block_turboq3_g16
#define TQ_IDX TQ_IDX_TURBOQ3_G16
#define QUANT_K QUANT_K_TURBOQ_G16
#elif defined(DATA_A_TURBOQ4_G16)
#define TQ_TYPE GGML_TYPE_TURBOQ4_G16
#define A_TYPE block_turboq4_g16
#define TQ_IDX TQ_IDX_TURBOQ4_G16
#define QUANT_K QUANT_K_TURBOQ_G16
#elif defined(DATA_A_TURBOQ8_G16)
#define TQ_TYPE GGML_TYPE_TURBOQ8_G16
#define A_TYPE block_turboq8_g16
#define TQ_IDX TQ_IDX_TURBOQ8_G16
#define QUANT_K QUANT_K_TURBOQ_G16
#elif defined(DATA_A_TURBOQ3_T)
#define TQ_TYPE GGML_TYPE_TURBOQ3_T
#define A_TYPE block_turboq3_t
#define TQ_IDX TQ_IDX_TURBOQ3_T
#define QUANT_K QUANT_K_TURBOQ
#elif defined(DATA_A_TURBOQ2_T)
#define TQ_TYPE GGML_TYPE_TURBOQ2_T
#define A_TYPE block_turboq2_t
#define TQ_IDX TQ_IDX_TURBOQ2_T
#define QUANT_K QUANT_K_TURBOQ
#endif
#if defined(TQ_TYPE)
#define DATA_A_TURBOQ
#define TQ_G uint(QUANT_K)
#define QUANT_R 1
#endif

#endif
