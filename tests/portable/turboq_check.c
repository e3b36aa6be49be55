// turboq-check: runs the turboq CPU paths of a ggml build on inputs from files and writes what they
// produce, for tests/test_portable_kernels.py to compare with pyturbo.format.reference. It exists for
// builds that Python cannot load: an AArch64 build run under qemu-user, and the x86 builds with
// AVX2/FMA off, with AVX2 but not AVX-512, and with AVX-512 BW and VNNI but not VBMI. Everything but `packed` goes through ggml graphs on
// the CPU, as in llama.cpp.
//
//   turboq-check codec TYPE N_PER_ROW N_ROWS in.f32 out.bin
//       out: the cache after SET_ROWS of the rows (N_ROWS x row size bytes), then GET_ROWS of
//       that cache back to f32 (N_ROWS x N_PER_ROW floats)
//   turboq-check fa TYPE_K TYPE_V DK DV N_HEAD N_HEAD_KV N_Q N_KV N_THREADS USE_REF SOFTCAP
//                   q.f32 k.f32 v.f32 mask.f16|- out.bin
//       q [N_HEAD][N_Q][DK], k [N_HEAD_KV][N_KV][DK], v [N_HEAD_KV][N_KV][DV], mask [N_Q][N_KV];
//       K and V are written into caches of TYPE_K/TYPE_V with SET_ROWS, then flash attention;
//       out: the K cache bytes, the V cache bytes, the result [N_Q][N_HEAD][DV] as f32
//   turboq-check packed TYPE N NQ NK q.f32 cache.bin p.f32 out.bin
//       a decode step's packed kernels alone (ggml-cpu/turboq-cpu.h): Q [NQ][N] rounded once, the
//       scores of NK <= 64 rows of N values held as TYPE's blocks (cache.bin), and the V sums of the
//       same rows with the weights p [NQ][64]; out: the scores [NQ][NK], then the V sums [NQ][N]
//       (from zeros); exit status 3 where the build has no packed kernels for TYPE
//   turboq-check is-packed TYPE
//       prints 1 where a decode step reads TYPE through the packed kernels in this build, else 0
//   turboq-check speed TYPE N_ROWS REPS [FA_REPS]
//       prints the seconds for REPS rounds of SET_ROWS + GET_ROWS over N_ROWS rows of 128 values,
//       then for FA_REPS (default REPS) one-row flash attentions over that cache (K = V, 4 query
//       heads); bench/portable_insns.sh counts the attention alone from two FA_REPS
// TYPE is a ggml type id. Errors go to stderr with exit status 1.

#include "ggml.h"
#include "ggml-cpu.h"
#include "ggml-cpu/turboq-cpu.h"  // the packed kernels, which libggml-cpu exports outside ggml-cpu.h

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void die(const char * msg, const char * arg) {
    fprintf(stderr, "turboq-check: %s%s%s\n", msg, arg ? ": " : "", arg ? arg : "");
    exit(1);
}

static long parse_int(const char * s) {
    char * end = NULL;
    const long v = strtol(s, &end, 10);
    if (end == s || *end != '\0') {
        die("not an integer", s);
    }
    return v;
}

static enum ggml_type parse_type(const char * s) {
    const long t = parse_int(s);
    if (t < 0 || t >= GGML_TYPE_COUNT || ggml_get_type_traits((enum ggml_type) t)->blck_size == 0) {
        die("not a ggml type id", s);
    }
    return (enum ggml_type) t;
}

static void read_exact(const char * path, void * dst, size_t n) {
    FILE * f = fopen(path, "rb");
    if (!f) {
        die("cannot open", path);
    }
    if (fread(dst, 1, n, f) != n || fgetc(f) != EOF) {
        die("wrong size", path);
    }
    fclose(f);
}

static void write_all(FILE * f, const void * src, size_t n) {
    if (fwrite(src, 1, n, f) != n) {
        die("write failed", NULL);
    }
}

static struct ggml_context * new_context(size_t data_bytes) {
    struct ggml_init_params p = { data_bytes + 64*ggml_tensor_overhead() + ggml_graph_overhead() + (1 << 20), NULL, false };
    struct ggml_context * ctx = ggml_init(p);
    if (!ctx) {
        die("ggml_init failed", NULL);
    }
    return ctx;
}

static void compute(struct ggml_context * ctx, struct ggml_tensor * out, int n_threads, int use_ref) {
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    struct ggml_cplan plan = ggml_graph_plan(gf, n_threads, NULL);
    void * work = plan.work_size ? malloc(plan.work_size) : NULL;
    plan.work_data = work;
    plan.use_ref = use_ref != 0;
    if (ggml_graph_compute(gf, &plan) != GGML_STATUS_SUCCESS) {
        die("ggml_graph_compute failed", NULL);
    }
    free(work);
}

// a [n_rows] I32 tensor holding 0..n_rows-1 (GET_ROWS takes I32 ids, SET_ROWS I32 or I64)
static struct ggml_tensor * row_ids(struct ggml_context * ctx, int64_t n_rows) {
    struct ggml_tensor * ids = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_rows);
    for (int64_t i = 0; i < n_rows; ++i) {
        ((int32_t *) ids->data)[i] = (int32_t) i;
    }
    return ids;
}

// SET_ROWS of x (f32, n_per_row x n_rows) into a new cache of the given type
static struct ggml_tensor * store_rows(struct ggml_context * ctx, enum ggml_type type, struct ggml_tensor * x) {
    struct ggml_tensor * cache = ggml_new_tensor_2d(ctx, type, x->ne[0], x->ne[1]);
    return ggml_set_rows(ctx, cache, x, row_ids(ctx, x->ne[1]));
}

static int cmd_codec(int argc, char ** argv) {
    if (argc != 7) {
        die("usage: codec TYPE N_PER_ROW N_ROWS in.f32 out.bin", NULL);
    }
    const enum ggml_type type = parse_type(argv[2]);
    const int64_t n_per_row = parse_int(argv[3]), n_rows = parse_int(argv[4]);
    if (n_per_row <= 0 || n_rows <= 0 || n_per_row % ggml_blck_size(type)) {
        die("bad shape", NULL);
    }
    const size_t n = (size_t) (n_per_row * n_rows);
    struct ggml_context * ctx = new_context(n * 4 * 3 + (size_t) n_rows * 4 * 2);
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_per_row, n_rows);
    read_exact(argv[5], x->data, n * 4);

    struct ggml_tensor * cache = store_rows(ctx, type, x);
    struct ggml_tensor * back = ggml_get_rows(ctx, cache, row_ids(ctx, n_rows));
    compute(ctx, back, 1, 0);

    FILE * f = fopen(argv[6], "wb");
    if (!f) {
        die("cannot write", argv[6]);
    }
    write_all(f, cache->data, ggml_nbytes(cache));
    write_all(f, back->data, ggml_nbytes(back));
    fclose(f);
    ggml_free(ctx);
    return 0;
}

static int cmd_fa(int argc, char ** argv) {
    if (argc != 18) {
        die("usage: fa TYPE_K TYPE_V DK DV N_HEAD N_HEAD_KV N_Q N_KV N_THREADS USE_REF SOFTCAP q k v mask|- out", NULL);
    }
    const enum ggml_type tk = parse_type(argv[2]), tv = parse_type(argv[3]);
    const int64_t dk = parse_int(argv[4]), dv = parse_int(argv[5]);
    const int64_t n_head = parse_int(argv[6]), n_head_kv = parse_int(argv[7]);
    const int64_t n_q = parse_int(argv[8]), n_kv = parse_int(argv[9]);
    const int n_threads = (int) parse_int(argv[10]), use_ref = (int) parse_int(argv[11]);
    const float softcap = strtof(argv[12], NULL);
    if (dk <= 0 || dv <= 0 || n_head <= 0 || n_head_kv <= 0 || n_head % n_head_kv || n_q <= 0 || n_kv <= 0 || n_threads <= 0) {
        die("bad shape", NULL);
    }
    const size_t nq = (size_t) (dk*n_q*n_head), nk = (size_t) (dk*n_kv*n_head_kv), nv = (size_t) (dv*n_kv*n_head_kv);
    struct ggml_context * ctx = new_context((nq + 3*nk + 3*nv + (size_t) (dv*n_q*n_head) + (size_t) (n_q*n_kv)) * 4 + (size_t) n_kv*n_head_kv*8);

    struct ggml_tensor * q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, dk, n_q, n_head);
    struct ggml_tensor * k = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, dk, n_kv*n_head_kv);
    struct ggml_tensor * v = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, dv, n_kv*n_head_kv);
    read_exact(argv[13], q->data, nq*4);
    read_exact(argv[14], k->data, nk*4);
    read_exact(argv[15], v->data, nv*4);
    struct ggml_tensor * mask = NULL;
    if (strcmp(argv[16], "-") != 0) {
        mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_q);
        read_exact(argv[16], mask->data, (size_t) (n_kv*n_q)*2);
    }

    struct ggml_tensor * kc = store_rows(ctx, tk, k);
    struct ggml_tensor * vc = store_rows(ctx, tv, v);
    struct ggml_tensor * k3 = ggml_reshape_3d(ctx, kc, dk, n_kv, n_head_kv);
    struct ggml_tensor * v3 = ggml_reshape_3d(ctx, vc, dv, n_kv, n_head_kv);
    struct ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k3, v3, mask, 1.0f/sqrtf((float) dk), 0.0f, softcap);
    compute(ctx, out, n_threads, use_ref);

    FILE * f = fopen(argv[17], "wb");
    if (!f) {
        die("cannot write", argv[17]);
    }
    write_all(f, kc->data, ggml_nbytes(kc));
    write_all(f, vc->data, ggml_nbytes(vc));
    write_all(f, out->data, ggml_nbytes(out));
    fclose(f);
    ggml_free(ctx);
    return 0;
}

static int cmd_packed(int argc, char ** argv) {
    if (argc != 10) {
        die("usage: packed TYPE N NQ NK q.f32 cache.bin p.f32 out.bin", NULL);
    }
    const enum ggml_type type = parse_type(argv[2]);
    const int64_t n = parse_int(argv[3]), nq = parse_int(argv[4]), nk = parse_int(argv[5]);
    if (!ggml_turboq_fa_packed(type)) {
        fprintf(stderr, "turboq-check: no packed kernels for %s in this build\n", ggml_type_name(type));
        return 3;
    }
    if (n <= 0 || n > 576 || n % 64 != 0 || n % ggml_blck_size(type) != 0 || nq < 1 || nq > 16 || nk < 1 || nk > 64) {
        die("bad shape", NULL);
    }
    ggml_cpu_init();  // the F16 tables, which a graph's plan would have set up
    const size_t bk = ggml_row_size(type, n);
    float * q = malloc(nq*n*sizeof(float)), * p = malloc(nq*64*sizeof(float));
    float * s = calloc(nq*nk, sizeof(float)), * o = calloc(nq*n, sizeof(float));
    void  * cache = malloc(nk*bk);
    void  * w = aligned_alloc(64, (ggml_turboq_fa_q8_size(n) + 63)/64*64);
    read_exact(argv[6], q, nq*n*sizeof(float));
    read_exact(argv[7], cache, nk*bk);
    read_exact(argv[8], p, nq*64*sizeof(float));
    ggml_turboq_fa_q8(type, q, nq, n, w);
    ggml_turboq_fa_kq_packed(type, cache, bk, nk, w, nq, n, s, nk);
    ggml_turboq_fa_pv_packed(type, cache, bk, nk, p, 64, nq, n, o);
    FILE * f = fopen(argv[9], "wb");
    if (!f) {
        die("cannot open", argv[9]);
    }
    write_all(f, s, nq*nk*sizeof(float));
    write_all(f, o, nq*n*sizeof(float));
    fclose(f);
    free(q); free(p); free(s); free(o); free(cache); free(w);
    return 0;
}

static double seconds_since(const struct timespec * t0) {
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double) (t1.tv_sec - t0->tv_sec) + 1e-9*(double) (t1.tv_nsec - t0->tv_nsec);
}

static int cmd_speed(int argc, char ** argv) {
    if (argc != 5 && argc != 6) {
        die("usage: speed TYPE N_ROWS REPS [FA_REPS]", NULL);
    }
    const enum ggml_type type = parse_type(argv[2]);
    const int64_t n_rows = parse_int(argv[3]), reps = parse_int(argv[4]);
    const int64_t fa_reps = argc == 6 ? parse_int(argv[5]) : reps;
    if (n_rows <= 0 || reps <= 0 || fa_reps <= 0) {
        die("bad shape", NULL);
    }
    struct ggml_context * ctx = new_context((size_t) n_rows * 128 * 4 * 4 + (size_t) n_rows * 8 + 4096);
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 128, n_rows);
    uint32_t s = 12345;
    for (int64_t i = 0; i < 128*n_rows; ++i) {
        s = s*1664525u + 1013904223u;
        ((float *) x->data)[i] = (float) ((int32_t) s) / 2147483648.0f;
    }
    struct ggml_tensor * stored = store_rows(ctx, type, x);
    struct ggml_tensor * back = ggml_get_rows(ctx, stored, row_ids(ctx, n_rows));
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t r = 0; r < reps; ++r) {
        compute(ctx, back, 1, 0);
    }
    const double t_codec = seconds_since(&t0);

    // decode-time attention over that cache: one query row, 4 heads sharing the one KV head
    struct ggml_tensor * q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 128, 1, 4);
    memcpy(q->data, x->data, 4*128*sizeof(float));
    struct ggml_tensor * kv = ggml_reshape_3d(ctx, stored->view_src, 128, n_rows, 1);
    struct ggml_tensor * out = ggml_flash_attn_ext(ctx, q, kv, kv, NULL, 1.0f/sqrtf(128.0f), 0.0f, 0.0f);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t r = 0; r < fa_reps; ++r) {
        compute(ctx, out, 1, 0);
    }
    printf("%.6f %.6f\n", t_codec, seconds_since(&t0));
    ggml_free(ctx);
    return 0;
}

int main(int argc, char ** argv) {
    if (argc >= 2 && strcmp(argv[1], "codec") == 0) {
        return cmd_codec(argc, argv);
    }
    if (argc >= 2 && strcmp(argv[1], "fa") == 0) {
        return cmd_fa(argc, argv);
    }
    if (argc >= 2 && strcmp(argv[1], "packed") == 0) {
        return cmd_packed(argc, argv);
    }
    if (argc == 3 && strcmp(argv[1], "is-packed") == 0) {
        printf("%d\n", ggml_turboq_fa_packed(parse_type(argv[2])) ? 1 : 0);
        return 0;
    }
    if (argc >= 2 && strcmp(argv[1], "speed") == 0) {
        return cmd_speed(argc, argv);
    }
    die("usage: turboq-check codec|fa|packed|is-packed|speed ...", NULL);
    return 1;
}
