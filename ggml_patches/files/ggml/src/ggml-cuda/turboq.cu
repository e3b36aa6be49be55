// The host side of the TurboQuant KV-cache types (pyturbo) on CUDA: launches of SET_ROWS / CPY
// quantization, GET_ROWS / CPY / contiguous dequantization, and the flash-attention dispatch.
// Codec kernels and device helpers: turboq-device.cuh; flash-attention kernels: fattn-turboq.cuh.

#include "turboq-device.cuh"
#include "fattn-turboq.cuh"

#include <cstring>

// ---- host side ----

static tq_nd tq_nd_of(const ggml_tensor * t) {
    return { t->ne[0], t->ne[1], t->ne[2], (int64_t) t->nb[0], (int64_t) t->nb[1], (int64_t) t->nb[2], (int64_t) t->nb[3] };
}

static tq_nd tq_nd_contiguous(const int64_t k, const size_t type_size) {
    return { k, 1, 1, (int64_t) type_size, (int64_t) type_size*k, (int64_t) type_size*k, (int64_t) type_size*k };
}


static dim3 tq_grid(const int64_t n_groups) {
    const int64_t nb = (n_groups + TQ_WARPS_PER_BLOCK - 1) / TQ_WARPS_PER_BLOCK;
    GGML_ASSERT(nb <= INT_MAX);
    return dim3((unsigned int) nb, 1, 1);
}

#define TQ_TYPE_CASE(F, T, ...) case T: F<T>(__VA_ARGS__); break;
#define TQ_TYPE_SWITCH(type, F, ...)                                                \
    switch (type) {                                                                 \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ2_0,   __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ3_0,   __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ4_0,   __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ8_0,   __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ2_G64, __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ3_G64, __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ4_G64, __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ8_G64, __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ2_G32, __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ3_G32, __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ4_G32, __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ8_G32, __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ2_G16, __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ3_G16, __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ4_G16, __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ8_G16, __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ3_T,   __VA_ARGS__)                         \
        TQ_TYPE_CASE(F, GGML_TYPE_TURBOQ2_T,   __VA_ARGS__)                         \
        default: GGML_ABORT("not a turboq type: %s", ggml_type_name(type));         \
    }

// The kernels of the _g64, _g32 and _g16 twins and of the trellis types (turboq3t, turboq2t) have
// run only under CPU emulation (tests/harness/turboq_cuda_emulation.cpp), never on a GPU, so this
// backend declines them unless it was built with -DGGML_CUDA_TURBOQ_TWINS=ON (off by default;
// bench/cuda_check.sh turns it on to test them); llama.cpp then refuses a layer that needs them,
// naming the device.
static constexpr bool tq_twins_enabled() {
#ifdef GGML_CUDA_TURBOQ_TWINS
    return true;
#else
    return false;
#endif
}

// The _g16 twins' flash attention (head size 80, which the packed kernel's 32-lane rows do not
// divide) runs in the mainline kernels on K/V converted to f16 (fattn.cu).
bool ggml_cuda_turboq_type(const ggml_type type) {
    return ggml_is_turboq(type) || (ggml_turboq_group(type) != 0 && tq_twins_enabled());
}

template <ggml_type type, typename src_t, typename idx_t>
static void tq_set_rows_launch(const ggml_tensor * src0, const ggml_tensor * src1, ggml_tensor * dst, cudaStream_t stream) {
    const int64_t ng0      = src0->ne[0] / tq_traits<type>::G;
    const int64_t n_groups = ng0*src0->ne[1]*src0->ne[2]*src0->ne[3];
    if (n_groups == 0) {
        return;
    }
    const size_t ts = ggml_type_size(src1->type);
    k_tq_set_rows<type, src_t, idx_t><<<tq_grid(n_groups), dim3(WARP_SIZE, TQ_WARPS_PER_BLOCK, 1), 0, stream>>>(
        (const char *) src0->data, (const idx_t *) src1->data, (char *) dst->data,
        n_groups, ng0, src0->ne[1], src0->ne[2], src1->ne[1], src1->ne[2],
        src0->nb[1], src0->nb[2], src0->nb[3],
        src1->nb[0]/ts, src1->nb[1]/ts, src1->nb[2]/ts,
        dst->nb[1], dst->nb[2], dst->nb[3]);
    CUDA_CHECK(cudaGetLastError());
}

template <ggml_type type>
static void tq_set_rows_type(const ggml_tensor * src0, const ggml_tensor * src1, ggml_tensor * dst, cudaStream_t stream) {
    if (src0->type == GGML_TYPE_F16) {
        if (src1->type == GGML_TYPE_I64) {
            tq_set_rows_launch<type, half, int64_t>(src0, src1, dst, stream);
        } else {
            tq_set_rows_launch<type, half, int32_t>(src0, src1, dst, stream);
        }
    } else {
        if (src1->type == GGML_TYPE_I64) {
            tq_set_rows_launch<type, float, int64_t>(src0, src1, dst, stream);
        } else {
            tq_set_rows_launch<type, float, int32_t>(src0, src1, dst, stream);
        }
    }
}

bool ggml_cuda_turboq_set_rows_supported(const ggml_tensor * op) {
    const ggml_tensor * src0 = op->src[0];
    const ggml_tensor * src1 = op->src[1];
    return ggml_cuda_turboq_type(op->type) && (src0->type == GGML_TYPE_F32 || src0->type == GGML_TYPE_F16) &&
        src0->nb[0] == ggml_type_size(src0->type) &&
        src0->ne[0] % ggml_turboq_group(op->type) == 0 && (src1->type == GGML_TYPE_I64 || src1->type == GGML_TYPE_I32);
}

void ggml_cuda_turboq_set_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * src0 = dst->src[0];
    const ggml_tensor * src1 = dst->src[1];
    GGML_ASSERT(ggml_cuda_turboq_set_rows_supported(dst));
    TQ_TYPE_SWITCH(dst->type, tq_set_rows_type, src0, src1, dst, ctx.stream());
}

template <ggml_type type, typename dst_t>
static void tq_get_rows_launch(const ggml_tensor * src0, const ggml_tensor * src1, ggml_tensor * dst, cudaStream_t stream) {
    const int64_t ng0 = src0->ne[0] / tq_traits<type>::G;
    const int64_t n   = ng0*src1->ne[0];
    if (n == 0 || src1->ne[1] == 0 || src1->ne[2] == 0) {
        return;
    }
    const int64_t nb = (n + TQ_WARPS_PER_BLOCK - 1) / TQ_WARPS_PER_BLOCK;
    GGML_ASSERT(nb <= INT_MAX && src1->ne[1] <= 65535 && src1->ne[2] <= 65535);
    const size_t ts = ggml_type_size(src1->type);
    k_tq_get_rows<type, dst_t><<<dim3((unsigned int) nb, (unsigned int) src1->ne[1], (unsigned int) src1->ne[2]),
                                 dim3(WARP_SIZE, TQ_WARPS_PER_BLOCK, 1), 0, stream>>>(
        (const char *) src0->data, (const int32_t *) src1->data, (char *) dst->data,
        ng0, src1->ne[0],
        src0->nb[1], src0->nb[2], src0->nb[3],
        src1->nb[0]/ts, src1->nb[1]/ts, src1->nb[2]/ts,
        dst->nb[1], dst->nb[2], dst->nb[3]);
    CUDA_CHECK(cudaGetLastError());
}

template <ggml_type type>
static void tq_get_rows_type(const ggml_tensor * src0, const ggml_tensor * src1, ggml_tensor * dst, cudaStream_t stream) {
    if (dst->type == GGML_TYPE_F16) {
        tq_get_rows_launch<type, half>(src0, src1, dst, stream);
    } else {
        tq_get_rows_launch<type, float>(src0, src1, dst, stream);
    }
}

bool ggml_cuda_turboq_get_rows_supported(const ggml_tensor * op) {
    const ggml_tensor * src0 = op->src[0];
    const ggml_tensor * src1 = op->src[1];
    return ggml_cuda_turboq_type(src0->type) && src0->ne[0] % ggml_turboq_group(src0->type) == 0 && src1->type == GGML_TYPE_I32 &&
        (op->type == GGML_TYPE_F32 || op->type == GGML_TYPE_F16) && op->nb[0] == ggml_type_size(op->type) &&
        src1->ne[3] == 1 && src1->ne[1] <= 65535 && src1->ne[2] <= 65535;
}

void ggml_cuda_turboq_get_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * src0 = dst->src[0];
    const ggml_tensor * src1 = dst->src[1];
    GGML_ASSERT(ggml_cuda_turboq_get_rows_supported(dst));
    TQ_TYPE_SWITCH(src0->type, tq_get_rows_type, src0, src1, dst, ctx.stream());
}

template <ggml_type type, typename dst_t>
static void tq_dequantize_launch(const void * src, void * dst, const int64_t n_groups, const tq_nd & s, const tq_nd & d, cudaStream_t stream) {
    if (n_groups == 0) {
        return;
    }
    k_tq_dequantize_nd<type, dst_t><<<tq_grid(n_groups), dim3(WARP_SIZE, TQ_WARPS_PER_BLOCK, 1), 0, stream>>>(
        (const char *) src, (char *) dst, n_groups, s, d);
    CUDA_CHECK(cudaGetLastError());
}

template <ggml_type type, typename src_t>
static void tq_quantize_launch(const void * src, void * dst, const int64_t n_groups, const tq_nd & s, const tq_nd & d, cudaStream_t stream) {
    if (n_groups == 0) {
        return;
    }
    k_tq_quantize_nd<type, src_t><<<tq_grid(n_groups), dim3(WARP_SIZE, TQ_WARPS_PER_BLOCK, 1), 0, stream>>>(
        (const char *) src, (char *) dst, n_groups, s, d);
    CUDA_CHECK(cudaGetLastError());
}

template <ggml_type type>
static void tq_cpy_type(const ggml_tensor * src0, ggml_tensor * src1, cudaStream_t stream) {
    const int64_t n_groups = ggml_nelements(src0) / tq_traits<type>::G;
    if (ggml_turboq_group(src0->type)) {
        if (src1->type == GGML_TYPE_F16) {
            tq_dequantize_launch<type, half>(src0->data, src1->data, n_groups, tq_nd_of(src0), tq_nd_of(src1), stream);
        } else {
            tq_dequantize_launch<type, float>(src0->data, src1->data, n_groups, tq_nd_of(src0), tq_nd_of(src1), stream);
        }
    } else {
        if (src0->type == GGML_TYPE_F16) {
            tq_quantize_launch<type, half>(src0->data, src1->data, n_groups, tq_nd_of(src0), tq_nd_of(src1), stream);
        } else {
            tq_quantize_launch<type, float>(src0->data, src1->data, n_groups, tq_nd_of(src0), tq_nd_of(src1), stream);
        }
    }
}

bool ggml_cuda_turboq_cpy_supported(const ggml_tensor * src0, const ggml_tensor * src1) {
    const ggml_tensor * q = ggml_turboq_group(src0->type) ? src0 : src1;
    const ggml_tensor * f = ggml_turboq_group(src0->type) ? src1 : src0;
    if (!ggml_cuda_turboq_type(q->type) || ggml_turboq_group(f->type)) {
        return false;
    }
    return (f->type == GGML_TYPE_F32 || f->type == GGML_TYPE_F16) && q->ne[0] % ggml_turboq_group(q->type) == 0 &&
        q->nb[0] == ggml_type_size(q->type) && ggml_nelements(src0) == ggml_nelements(src1);
}

void ggml_cuda_turboq_cpy(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, ggml_tensor * src1) {
    GGML_ASSERT(ggml_cuda_turboq_cpy_supported(src0, src1));
    const ggml_type type = ggml_turboq_group(src0->type) ? src0->type : src1->type;
    TQ_TYPE_SWITCH(type, tq_cpy_type, src0, src1, ctx.stream());
}

template <ggml_type type, typename dst_t>
static void tq_to_float_cont(const void * x, dst_t * y, const int64_t k, cudaStream_t stream) {
    GGML_ASSERT(k % tq_traits<type>::G == 0);
    tq_dequantize_launch<type, dst_t>(x, y, k / tq_traits<type>::G,
        tq_nd_contiguous(k, sizeof(typename tq_traits<type>::block)), tq_nd_contiguous(k, sizeof(dst_t)), stream);
}

// tq_nd_contiguous(k, block size) above: ne0 = k values, nb0 = the block size, so the block of
// value i0 sits at (i0/G)*nb0, which is what the kernels compute.

void (*ggml_cuda_turboq_get_to_fp32(ggml_type type))(const void * x, float * y, int64_t k, cudaStream_t stream) {
    switch (type) {
        case GGML_TYPE_TURBOQ2_0: return tq_to_float_cont<GGML_TYPE_TURBOQ2_0, float>;
        case GGML_TYPE_TURBOQ3_0: return tq_to_float_cont<GGML_TYPE_TURBOQ3_0, float>;
        case GGML_TYPE_TURBOQ4_0: return tq_to_float_cont<GGML_TYPE_TURBOQ4_0, float>;
        case GGML_TYPE_TURBOQ8_0: return tq_to_float_cont<GGML_TYPE_TURBOQ8_0, float>;
        case GGML_TYPE_TURBOQ2_G64: return tq_to_float_cont<GGML_TYPE_TURBOQ2_G64, float>;
        case GGML_TYPE_TURBOQ3_G64: return tq_to_float_cont<GGML_TYPE_TURBOQ3_G64, float>;
        case GGML_TYPE_TURBOQ4_G64: return tq_to_float_cont<GGML_TYPE_TURBOQ4_G64, float>;
        case GGML_TYPE_TURBOQ8_G64: return tq_to_float_cont<GGML_TYPE_TURBOQ8_G64, float>;
        case GGML_TYPE_TURBOQ2_G32: return tq_to_float_cont<GGML_TYPE_TURBOQ2_G32, float>;
        case GGML_TYPE_TURBOQ3_G32: return tq_to_float_cont<GGML_TYPE_TURBOQ3_G32, float>;
        case GGML_TYPE_TURBOQ4_G32: return tq_to_float_cont<GGML_TYPE_TURBOQ4_G32, float>;
        case GGML_TYPE_TURBOQ8_G32: return tq_to_float_cont<GGML_TYPE_TURBOQ8_G32, float>;
        case GGML_TYPE_TURBOQ2_G16: return tq_to_float_cont<GGML_TYPE_TURBOQ2_G16, float>;
        case GGML_TYPE_TURBOQ3_G16: return tq_to_float_cont<GGML_TYPE_TURBOQ3_G16, float>;
        case GGML_TYPE_TURBOQ4_G16: return tq_to_float_cont<GGML_TYPE_TURBOQ4_G16, float>;
        case GGML_TYPE_TURBOQ8_G16: return tq_to_float_cont<GGML_TYPE_TURBOQ8_G16, float>;
        case GGML_TYPE_TURBOQ3_T:   return tq_to_float_cont<GGML_TYPE_TURBOQ3_T, float>;
        case GGML_TYPE_TURBOQ2_T:   return tq_to_float_cont<GGML_TYPE_TURBOQ2_T, float>;
        default:                  return nullptr;
    }
}

void (*ggml_cuda_turboq_get_to_fp16(ggml_type type))(const void * x, half * y, int64_t k, cudaStream_t stream) {
    switch (type) {
        case GGML_TYPE_TURBOQ2_0: return tq_to_float_cont<GGML_TYPE_TURBOQ2_0, half>;
        case GGML_TYPE_TURBOQ3_0: return tq_to_float_cont<GGML_TYPE_TURBOQ3_0, half>;
        case GGML_TYPE_TURBOQ4_0: return tq_to_float_cont<GGML_TYPE_TURBOQ4_0, half>;
        case GGML_TYPE_TURBOQ8_0: return tq_to_float_cont<GGML_TYPE_TURBOQ8_0, half>;
        case GGML_TYPE_TURBOQ2_G64: return tq_to_float_cont<GGML_TYPE_TURBOQ2_G64, half>;
        case GGML_TYPE_TURBOQ3_G64: return tq_to_float_cont<GGML_TYPE_TURBOQ3_G64, half>;
        case GGML_TYPE_TURBOQ4_G64: return tq_to_float_cont<GGML_TYPE_TURBOQ4_G64, half>;
        case GGML_TYPE_TURBOQ8_G64: return tq_to_float_cont<GGML_TYPE_TURBOQ8_G64, half>;
        case GGML_TYPE_TURBOQ2_G32: return tq_to_float_cont<GGML_TYPE_TURBOQ2_G32, half>;
        case GGML_TYPE_TURBOQ3_G32: return tq_to_float_cont<GGML_TYPE_TURBOQ3_G32, half>;
        case GGML_TYPE_TURBOQ4_G32: return tq_to_float_cont<GGML_TYPE_TURBOQ4_G32, half>;
        case GGML_TYPE_TURBOQ8_G32: return tq_to_float_cont<GGML_TYPE_TURBOQ8_G32, half>;
        case GGML_TYPE_TURBOQ2_G16: return tq_to_float_cont<GGML_TYPE_TURBOQ2_G16, half>;
        case GGML_TYPE_TURBOQ3_G16: return tq_to_float_cont<GGML_TYPE_TURBOQ3_G16, half>;
        case GGML_TYPE_TURBOQ4_G16: return tq_to_float_cont<GGML_TYPE_TURBOQ4_G16, half>;
        case GGML_TYPE_TURBOQ8_G16: return tq_to_float_cont<GGML_TYPE_TURBOQ8_G16, half>;
        case GGML_TYPE_TURBOQ3_T:   return tq_to_float_cont<GGML_TYPE_TURBOQ3_T, half>;
        case GGML_TYPE_TURBOQ2_T:   return tq_to_float_cont<GGML_TYPE_TURBOQ2_T, half>;
        default:                  return nullptr;
    }
}

// Strided source (a KV-cache view whose streams are not adjacent): s01..s03 count blocks, as in
// convert.cu's non-contiguous converters; y is contiguous.
template <ggml_type type>
static void tq_to_fp16_nc(const void * x, half * y, const int64_t ne00, const int64_t ne01, const int64_t ne02, const int64_t ne03,
        const int64_t s01, const int64_t s02, const int64_t s03, cudaStream_t stream) {
    GGML_ASSERT(ne00 % tq_traits<type>::G == 0);
    const int64_t bs = sizeof(typename tq_traits<type>::block);
    const tq_nd s = { ne00, ne01, ne02, bs, s01*bs, s02*bs, s03*bs };
    const int64_t h = sizeof(half);
    const tq_nd d = { ne00, ne01, ne02, h, h*ne00, h*ne00*ne01, h*ne00*ne01*ne02 };
    tq_dequantize_launch<type, half>(x, y, ne00*ne01*ne02*ne03 / tq_traits<type>::G, s, d, stream);
}

void (*ggml_cuda_turboq_get_to_fp16_nc(ggml_type type))(const void * x, half * y,
        int64_t ne00, int64_t ne01, int64_t ne02, int64_t ne03, int64_t s01, int64_t s02, int64_t s03, cudaStream_t stream) {
    switch (type) {
        case GGML_TYPE_TURBOQ2_0: return tq_to_fp16_nc<GGML_TYPE_TURBOQ2_0>;
        case GGML_TYPE_TURBOQ3_0: return tq_to_fp16_nc<GGML_TYPE_TURBOQ3_0>;
        case GGML_TYPE_TURBOQ4_0: return tq_to_fp16_nc<GGML_TYPE_TURBOQ4_0>;
        case GGML_TYPE_TURBOQ8_0: return tq_to_fp16_nc<GGML_TYPE_TURBOQ8_0>;
        case GGML_TYPE_TURBOQ2_G64: return tq_to_fp16_nc<GGML_TYPE_TURBOQ2_G64>;
        case GGML_TYPE_TURBOQ3_G64: return tq_to_fp16_nc<GGML_TYPE_TURBOQ3_G64>;
        case GGML_TYPE_TURBOQ4_G64: return tq_to_fp16_nc<GGML_TYPE_TURBOQ4_G64>;
        case GGML_TYPE_TURBOQ8_G64: return tq_to_fp16_nc<GGML_TYPE_TURBOQ8_G64>;
        case GGML_TYPE_TURBOQ2_G32: return tq_to_fp16_nc<GGML_TYPE_TURBOQ2_G32>;
        case GGML_TYPE_TURBOQ3_G32: return tq_to_fp16_nc<GGML_TYPE_TURBOQ3_G32>;
        case GGML_TYPE_TURBOQ4_G32: return tq_to_fp16_nc<GGML_TYPE_TURBOQ4_G32>;
        case GGML_TYPE_TURBOQ8_G32: return tq_to_fp16_nc<GGML_TYPE_TURBOQ8_G32>;
        case GGML_TYPE_TURBOQ2_G16: return tq_to_fp16_nc<GGML_TYPE_TURBOQ2_G16>;
        case GGML_TYPE_TURBOQ3_G16: return tq_to_fp16_nc<GGML_TYPE_TURBOQ3_G16>;
        case GGML_TYPE_TURBOQ4_G16: return tq_to_fp16_nc<GGML_TYPE_TURBOQ4_G16>;
        case GGML_TYPE_TURBOQ8_G16: return tq_to_fp16_nc<GGML_TYPE_TURBOQ8_G16>;
        case GGML_TYPE_TURBOQ3_T:   return tq_to_fp16_nc<GGML_TYPE_TURBOQ3_T>;
        case GGML_TYPE_TURBOQ2_T:   return tq_to_fp16_nc<GGML_TYPE_TURBOQ2_T>;
        default:                  return nullptr;
    }
}

// ---- flash attention dispatch ----

// the instances: fattn-turboq-cases.inc, generated with them by pyturbo/format/cuda_instances.py
#define TQ_FA_CASE(D, type_K, type_V) EXTERN_DECL_TQ_FA_CASE(D, type_K, type_V);
#include "fattn-turboq-cases.inc"
#undef TQ_FA_CASE

static bool tq_fa_has_case(const int64_t D, const ggml_type type_K, const ggml_type type_V) {
#define TQ_FA_CASE(D_, type_K_, type_V_) if (D == (D_) && type_K == (type_K_) && type_V == (type_V_)) { return true; }
#include "fattn-turboq-cases.inc"
#undef TQ_FA_CASE
    return false;
}

bool ggml_cuda_turboq_fa_applies(const ggml_tensor * dst) {
    return ggml_turboq_group(dst->src[1]->type) || ggml_turboq_group(dst->src[2]->type);
}

bool ggml_cuda_turboq_fa_supported(const ggml_tensor * dst) {
    const ggml_tensor * Q     = dst->src[0];
    const ggml_tensor * K     = dst->src[1];
    const ggml_tensor * V     = dst->src[2];
    const ggml_tensor * mask  = dst->src[3];
    const ggml_tensor * sinks = dst->src[4];

    if (!ggml_cuda_turboq_fa_applies(dst)) {
        return false;
    }
    for (const ggml_tensor * t : { K, V }) {
        if (ggml_turboq_group(t->type) && !ggml_cuda_turboq_type(t->type)) {
            return false; // a twin in a build without GGML_CUDA_TURBOQ_TWINS
        }
    }
    const int64_t D = Q->ne[0];
    if (!tq_fa_has_case(D, K->type, V->type) || K->ne[0] != D || V->ne[0] != D) {
        return false;
    }
    if (Q->type != GGML_TYPE_F32 || Q->nb[0] != sizeof(float) || dst->type != GGML_TYPE_F32 || !ggml_is_contiguous(dst)) {
        return false;
    }
    if (K->nb[0] != ggml_type_size(K->type) || V->nb[0] != ggml_type_size(V->type) || K->ne[1] != V->ne[1]) {
        return false;
    }
    if (K->ne[2] == 0 || V->ne[2] == 0 || Q->ne[2] % K->ne[2] != 0 || Q->ne[2] % V->ne[2] != 0 ||
        Q->ne[2]/K->ne[2] != Q->ne[2]/V->ne[2]) {
        return false;
    }
    if (K->ne[3] == 0 || V->ne[3] == 0 || Q->ne[3] % K->ne[3] != 0 || Q->ne[3] % V->ne[3] != 0) {
        return false;
    }
    if (Q->ne[1] > INT_MAX || K->ne[1] > INT_MAX || Q->ne[2] > 65535 || Q->ne[3] > 65535) {
        return false;
    }
    if (mask && (mask->type != GGML_TYPE_F16 || mask->ne[0] < K->ne[1] || mask->ne[1] < Q->ne[1])) {
        return false;
    }
    if (sinks && sinks->type != GGML_TYPE_F32) {
        return false;
    }
    return true;
}

// Debug switch GGML_CUDA_TURBOQ_FA: "packed" or "f16" forces one path (for A/B benches).
static int tq_fa_forced_path() {
    static const int forced = [] {
        const char * e = getenv("GGML_CUDA_TURBOQ_FA");
        if (e == nullptr || *e == '\0') {
            return 0;
        }
        if (strcmp(e, "packed") == 0) {
            return 1;
        }
        if (strcmp(e, "f16") == 0) {
            return 2;
        }
        GGML_LOG_WARN("%s: GGML_CUDA_TURBOQ_FA=%s is neither 'packed' nor 'f16'; ignored\n", __func__, e);
        return 0;
    }();
    return forced;
}

bool ggml_cuda_turboq_fa_prefers_packed(const ggml_tensor * dst) {
    // Decode and small batches read the packed blocks once per (query group, KV slice), at a
    // fraction of f16's bytes. A batch of more queries is compute-bound: converting K/V to f16
    // once and running the tensor-core kernels costs less than the scalar dot products.
    switch (tq_fa_forced_path()) {
        case 1:  return true;
        case 2:  return false;
        default: return dst->src[0]->ne[1] <= TQ_FA_PACKED_MAX_BATCH;
    }
}

void ggml_cuda_turboq_flash_attn_ext(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    GGML_ASSERT(ggml_cuda_turboq_fa_supported(dst));
    const int       D      = dst->src[0]->ne[0];
    const ggml_type type_K = dst->src[1]->type;
    const ggml_type type_V = dst->src[2]->type;

#define TQ_FA_CASE(D_, type_K_, type_V_)                                       \
    if (D == (D_) && type_K == (type_K_) && type_V == (type_V_)) {             \
        ggml_cuda_turboq_fa_case<D_, type_K_, type_V_>(ctx, dst);              \
        return;                                                                \
    }
#include "fattn-turboq-cases.inc"
#undef TQ_FA_CASE

    GGML_ABORT("turboq flash attention: no kernel for D=%d K=%s V=%s", D, ggml_type_name(type_K), ggml_type_name(type_V));
}
