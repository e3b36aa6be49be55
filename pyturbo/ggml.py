"""ctypes bindings to the patched ggml: type traits and graph compute on the CPU.

`pyturbo.codec` quantizes and dequantizes through these bindings, and `pyturbo.attention` runs
flash attention through them.
"""
from __future__ import annotations

import ctypes as C
from functools import lru_cache

import numpy as np

from ._paths import library


class InitParams(C.Structure):
    _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", C.c_void_p), ("no_alloc", C.c_bool)]


class TypeTraits(C.Structure):
    _fields_ = [("type_name", C.c_char_p), ("blck_size", C.c_int64), ("blck_size_interleave", C.c_int64),
                ("type_size", C.c_size_t), ("is_quantized", C.c_bool),
                ("to_float", C.c_void_p), ("from_float_ref", C.c_void_p)]


class CPlan(C.Structure):
    """struct ggml_cplan (ggml-cpu.h)"""
    _fields_ = [("work_size", C.c_size_t), ("work_data", C.c_void_p), ("n_threads", C.c_int),
                ("threadpool", C.c_void_p), ("abort_callback", C.c_void_p),
                ("abort_callback_data", C.c_void_p), ("use_ref", C.c_bool),
                ("fit", C.c_void_p)]  # struct ggml_threads_fit *: NULL, the threads asked for


TO_FLOAT = C.CFUNCTYPE(None, C.c_void_p, C.c_void_p, C.c_int64)


class Ggml:
    def __init__(self) -> None:
        self.base = library("ggml-base", mode=C.RTLD_GLOBAL)
        self.cpu = library("ggml-cpu", mode=C.RTLD_GLOBAL)
        b, cpu = self.base, self.cpu
        vp, i64 = C.c_void_p, C.c_int64
        b.ggml_quantize_chunk.restype = C.c_size_t
        b.ggml_quantize_chunk.argtypes = [C.c_int, vp, vp, i64, i64, i64, vp]
        b.ggml_get_type_traits.restype = C.POINTER(TypeTraits)
        b.ggml_get_type_traits.argtypes = [C.c_int]
        b.ggml_row_size.restype = C.c_size_t
        b.ggml_row_size.argtypes = [C.c_int, i64]
        b.ggml_type_name.restype = C.c_char_p
        b.ggml_type_name.argtypes = [C.c_int]
        b.ggml_is_turboq.restype = C.c_bool
        b.ggml_is_turboq.argtypes = [C.c_int]
        b.ggml_is_turboq_trellis.restype = C.c_bool
        b.ggml_is_turboq_trellis.argtypes = [C.c_int]
        b.ggml_turboq_group.restype = C.c_int
        b.ggml_turboq_group.argtypes = [C.c_int]
        b.ggml_init.restype = vp
        b.ggml_init.argtypes = [InitParams]
        b.ggml_free.argtypes = [vp]
        b.ggml_new_tensor_4d.restype = vp
        b.ggml_new_tensor_4d.argtypes = [vp, C.c_int, i64, i64, i64, i64]
        b.ggml_get_data.restype = vp
        b.ggml_get_data.argtypes = [vp]
        b.ggml_view_4d.restype = vp
        b.ggml_view_4d.argtypes = [vp, vp, i64, i64, i64, i64, C.c_size_t, C.c_size_t, C.c_size_t, C.c_size_t]
        b.ggml_flash_attn_ext.restype = vp
        b.ggml_flash_attn_ext.argtypes = [vp, vp, vp, vp, vp, C.c_float, C.c_float, C.c_float]
        b.ggml_new_graph.restype = vp
        b.ggml_new_graph.argtypes = [vp]
        b.ggml_build_forward_expand.argtypes = [vp, vp]
        for name in ("ggml_cpy", "ggml_get_rows"):
            getattr(b, name).restype = vp
            getattr(b, name).argtypes = [vp, vp, vp]
        b.ggml_set_rows.restype = vp
        b.ggml_set_rows.argtypes = [vp, vp, vp, vp]
        b.ggml_cast.restype = vp
        b.ggml_cast.argtypes = [vp, vp, C.c_int]
        b.ggml_concat.restype = vp
        b.ggml_concat.argtypes = [vp, vp, vp, C.c_int]
        b.ggml_permute.restype = vp
        b.ggml_permute.argtypes = [vp, vp, C.c_int, C.c_int, C.c_int, C.c_int]
        b.ggml_nbytes.restype = C.c_size_t
        b.ggml_nbytes.argtypes = [vp]
        cpu.ggml_graph_compute_with_ctx.restype = C.c_int
        cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, C.c_int]
        cpu.ggml_graph_plan.restype = CPlan
        cpu.ggml_graph_plan.argtypes = [vp, C.c_int, vp]
        cpu.ggml_graph_compute.restype = C.c_int
        cpu.ggml_graph_compute.argtypes = [vp, C.POINTER(CPlan)]
        # a decode step's packed turboq kernels (ggml-cpu/turboq-cpu.h, patch 46), for the tests
        cpu.ggml_turboq_fa_packed.restype = C.c_bool
        cpu.ggml_turboq_fa_packed.argtypes = [C.c_int]
        cpu.ggml_turboq_fa_q8_size.restype = C.c_size_t
        cpu.ggml_turboq_fa_q8_size.argtypes = [i64]
        cpu.ggml_turboq_fa_q8.argtypes = [C.c_int, vp, i64, i64, vp]
        cpu.ggml_turboq_fa_kq_packed.argtypes = [C.c_int, vp, C.c_size_t, i64, vp, i64, i64, vp, i64]
        cpu.ggml_turboq_fa_pv_packed.argtypes = [C.c_int, vp, C.c_size_t, i64, vp, i64, i64, i64, vp]
        cpu.ggml_cpu_init.argtypes = []
        cpu.ggml_cpu_init()

    def traits(self, type_id: int) -> TypeTraits:
        return self.base.ggml_get_type_traits(type_id).contents

    def to_float(self, type_id: int):
        ptr = self.traits(type_id).to_float
        if not ptr:
            raise ValueError(f"ggml type {type_id} has no to_float")
        return TO_FLOAT(ptr)


@lru_cache(maxsize=1)
def ggml() -> Ggml:
    return Ggml()


def ptr(a: np.ndarray) -> C.c_void_p:
    return C.c_void_p(a.ctypes.data)
