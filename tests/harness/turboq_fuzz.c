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

// the ggml-base symbols ggml-turboq.c needs, so the codec links alone; the types are
// ggml-turboq-types.h's rows (which ggml.c holds to the enum and the block layouts)
bool ggml_is_turboq(enum ggml_type type) {
    switch (type) {
        GGML_TURBOQ_BASE_TYPES(GGML_TURBOQ_CASE) return true;
        default: return false;
    }
}

int ggml_turboq_group(enum ggml_type type) {
    switch (type) {
#define TQ_ROW(E, name, id, bits, group, bytes) case GGML_TYPE_##E: return (group);
        GGML_TURBOQ_TYPES(TQ_ROW)
#undef TQ_ROW
        default: return 0;
    }
}

static size_t turboq_block_bytes(enum ggml_type type) {
    switch (type) {
#define TQ_ROW(E, name, id, bits, group, bytes) case GGML_TYPE_##E: return (bytes);
        GGML_TURBOQ_TYPES(TQ_ROW)
#undef TQ_ROW
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
#define TQ_ROW(E, name, id, bits, group, bytes) [GGML_TYPE_##E - GGML_TYPE_TURBOQ2] = { quantize_##name, dequantize_row_##name },
    GGML_TURBOQ_TYPES(TQ_ROW)
#undef TQ_ROW
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
    const size_t written = codecs[type - GGML_TYPE_TURBOQ2].quantize(x, q, 1, n, NULL);
    if (written != nbytes) return 3;
    codecs[type - GGML_TYPE_TURBOQ2].dequantize(q, y, n);
    fwrite(q, 1, nbytes, stdout);
    fwrite(y, sizeof(float), n, stdout);
    free(x); free(y); free(q);
    return 0;
}
