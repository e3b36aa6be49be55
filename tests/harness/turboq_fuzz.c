// Stand-alone driver for ggml-turboq.c, built with ASan+UBSan by tests/test_fuzz.py.
// stdin: int32 ggml type id (turboq2/3/4/8 or their _g64/_g32/_g16 twins), int32 count, then count*128
// float32 values (count 128-value groups, or 2*count 64-value ones, 4*count 32-value ones, 8*count 16-value ones).
// stdout: the quantized blocks, then the dequantized float32 values.
#include "ggml.h"
#include "ggml-turboq.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

// the ggml-base symbols ggml-turboq.c needs, so the codec links alone
bool ggml_is_turboq(enum ggml_type type) { return type >= GGML_TYPE_TURBOQ2_0 && type <= GGML_TYPE_TURBOQ8_0; }
int ggml_turboq_group(enum ggml_type type) {
    return ggml_is_turboq(type) ? 128 : type >= GGML_TYPE_TURBOQ2_G64 && type <= GGML_TYPE_TURBOQ8_G64 ? 64
         : type >= GGML_TYPE_TURBOQ2_G32 && type <= GGML_TYPE_TURBOQ8_G32 ? 32
         : type >= GGML_TYPE_TURBOQ2_G16 && type <= GGML_TYPE_TURBOQ8_G16 ? 16
         : type == GGML_TYPE_TURBOQ3_T || type == GGML_TYPE_TURBOQ2_T ? 128 : 0;
}

static size_t turboq_block_bytes(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_TURBOQ2_0: return 34;
        case GGML_TYPE_TURBOQ3_0: return 50;
        case GGML_TYPE_TURBOQ4_0: return 68;
        case GGML_TYPE_TURBOQ8_0: return 130;
        case GGML_TYPE_TURBOQ2_G64: return 18;
        case GGML_TYPE_TURBOQ3_G64: return 26;
        case GGML_TYPE_TURBOQ4_G64: return 34;
        case GGML_TYPE_TURBOQ8_G64: return 66;
        case GGML_TYPE_TURBOQ2_G32: return 10;
        case GGML_TYPE_TURBOQ3_G32: return 14;
        case GGML_TYPE_TURBOQ4_G32: return 18;
        case GGML_TYPE_TURBOQ8_G32: return 34;
        case GGML_TYPE_TURBOQ2_G16: return 6;
        case GGML_TYPE_TURBOQ3_G16: return 8;
        case GGML_TYPE_TURBOQ4_G16: return 10;
        case GGML_TYPE_TURBOQ8_G16: return 18;
        case GGML_TYPE_TURBOQ3_T: return 50;
        case GGML_TYPE_TURBOQ2_T: return 34;
        default: abort();
    }
}

size_t ggml_row_size(enum ggml_type type, int64_t ne) {
    return turboq_block_bytes(type) * (size_t) (ne / ggml_turboq_group(type));
}

void ggml_abort(const char * file, int line, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s:%d: ", file, line);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    abort();
}

typedef size_t (*quantize_fn)(const float *, void *, int64_t, int64_t, const float *);
typedef void   (*dequantize_fn)(const void *, float *, int64_t);

static const struct { quantize_fn quantize; dequantize_fn dequantize; } codecs[] = {
    { quantize_turboq2_0, dequantize_row_turboq2_0 },
    { quantize_turboq3_0, dequantize_row_turboq3_0 },
    { quantize_turboq4_0, dequantize_row_turboq4_0 },
    { quantize_turboq8_0, dequantize_row_turboq8_0 },
    { quantize_turboq2_g64, dequantize_row_turboq2_g64 },
    { quantize_turboq3_g64, dequantize_row_turboq3_g64 },
    { quantize_turboq4_g64, dequantize_row_turboq4_g64 },
    { quantize_turboq8_g64, dequantize_row_turboq8_g64 },
    { quantize_turboq2_g32, dequantize_row_turboq2_g32 },
    { quantize_turboq3_g32, dequantize_row_turboq3_g32 },
    { quantize_turboq4_g32, dequantize_row_turboq4_g32 },
    { quantize_turboq8_g32, dequantize_row_turboq8_g32 },
    { quantize_turboq2_g16, dequantize_row_turboq2_g16 },
    { quantize_turboq3_g16, dequantize_row_turboq3_g16 },
    { quantize_turboq4_g16, dequantize_row_turboq4_g16 },
    { quantize_turboq8_g16, dequantize_row_turboq8_g16 },
    { quantize_turboq3_t, dequantize_row_turboq3_t },
    { quantize_turboq2_t, dequantize_row_turboq2_t },
};

int main(void) {
    int32_t hdr[2];
    if (fread(hdr, sizeof(int32_t), 2, stdin) != 2) return 2;
    const enum ggml_type type = (enum ggml_type) hdr[0];
    const int64_t n = (int64_t) hdr[1] * 128;
    if (!ggml_turboq_group(type) || hdr[1] <= 0) return 2;
    float * x = malloc(n * sizeof(float));
    float * y = malloc(n * sizeof(float));
    const size_t nbytes = ggml_row_size(type, n);
    void * q = malloc(nbytes);
    if (fread(x, sizeof(float), n, stdin) != (size_t) n) return 2;
    const size_t written = codecs[type - GGML_TYPE_TURBOQ2_0].quantize(x, q, 1, n, NULL);
    if (written != nbytes) return 3;
    codecs[type - GGML_TYPE_TURBOQ2_0].dequantize(q, y, n);
    fwrite(q, 1, nbytes, stdout);
    fwrite(y, sizeof(float), n, stdout);
    free(x); free(y); free(q);
    return 0;
}
