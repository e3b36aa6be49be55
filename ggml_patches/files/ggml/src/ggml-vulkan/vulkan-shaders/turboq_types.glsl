// TurboQuant (pyturbo) block layouts for the Vulkan shaders; included by types.glsl.
// The blocks are 34/50/68/130 bytes, so they are declared as 16-bit words: every field stays
// addressable with 16-bit storage alone. The layouts and the codec are those of
// ggml-common.h and ggml-turboq.c.
#if !defined(GGML_TURBOQ_TYPES_GLSL)
#define GGML_TURBOQ_TYPES_GLSL

// must match ggml.h
#define GGML_TYPE_TURBOQ2_0 60u
#define GGML_TYPE_TURBOQ3_0 61u
#define GGML_TYPE_TURBOQ4_0 62u
#define GGML_TYPE_TURBOQ8_0 63u
#define TURBOQ_IS(t) ((t) >= GGML_TYPE_TURBOQ2_0 && (t) <= GGML_TYPE_TURBOQ8_0)

#define QUANT_K_TURBOQ 128

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

// the codebook index of value i (0..127) of block B
#define TQ_IDX_TURBOQ2_0(B, i) ((TQ_BYTE(B.qs, (i) & 31u) >> (((i) >> 5u) * 2u)) & 3u)
#define TQ_IDX_TURBOQ3_0(B, i) (TQ_IDX_TURBOQ2_0(B, i) | (((TQ_BYTE(B.qh, (i) & 15u) >> ((i) >> 4u)) & 1u) << 2u))
#define TQ_IDX_TURBOQ4_0(B, i) ((TQ_BYTE(B.qs, (i) & 63u) >> (((i) >> 6u) * 4u)) & 15u)
#define TQ_IDX_TURBOQ8_0(B, i) TQ_BYTE(B.qs, (i))

#if defined(DATA_A_TURBOQ2_0)
#define TQ_TYPE GGML_TYPE_TURBOQ2_0
#define A_TYPE block_turboq2_0
#define TQ_IDX TQ_IDX_TURBOQ2_0
#elif defined(DATA_A_TURBOQ3_0)
#define TQ_TYPE GGML_TYPE_TURBOQ3_0
#define A_TYPE block_turboq3_0
#define TQ_IDX TQ_IDX_TURBOQ3_0
#elif defined(DATA_A_TURBOQ4_0)
#define TQ_TYPE GGML_TYPE_TURBOQ4_0
#define A_TYPE block_turboq4_0
#define TQ_IDX TQ_IDX_TURBOQ4_0
#elif defined(DATA_A_TURBOQ8_0)
#define TQ_TYPE GGML_TYPE_TURBOQ8_0
#define A_TYPE block_turboq8_0
#define TQ_IDX TQ_IDX_TURBOQ8_0
#endif
#if defined(TQ_TYPE)
#define DATA_A_TURBOQ
#define QUANT_K QUANT_K_TURBOQ
#define QUANT_R 1
#endif

#endif
