// Explicit instances of ggml_cuda_turboq_fa_case (fattn-turboq.cuh); keep in sync with TQ_FA_FOR_ALL_D in ../turboq.cu.

#include "../fattn-turboq.cuh"

DECL_TQ_FA_CASE(128, GGML_TYPE_Q8_0, GGML_TYPE_TURBOQ2_0);
DECL_TQ_FA_CASE(128, GGML_TYPE_Q8_0, GGML_TYPE_TURBOQ3_0);
DECL_TQ_FA_CASE(128, GGML_TYPE_Q8_0, GGML_TYPE_TURBOQ4_0);
DECL_TQ_FA_CASE(128, GGML_TYPE_Q8_0, GGML_TYPE_TURBOQ8_0);
