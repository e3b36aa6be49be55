"""ctypes bindings to the patched ggml: type traits, graph compute, and flash attention on the CPU.

`pyturbo.codec` quantizes and dequantizes through these bindings.
"""
from __future__ import annotations

import ctypes as C
from functools import lru_cache

import numpy as np

from ._paths import library
from .types import cache_type


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
                ("abort_callback_data", C.c_void_p), ("use_ref", C.c_bool)]


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
        b.ggml_init.restype = vp
        b.ggml_init.argtypes = [InitParams]
        b.ggml_free.argtypes = [vp]
        b.ggml_new_tensor_4d.restype = vp
        b.ggml_new_tensor_4d.argtypes = [vp, C.c_int, i64, i64, i64, i64]
        b.ggml_get_data.restype = vp
        b.ggml_get_data.argtypes = [vp]
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
        b.ggml_nbytes.restype = C.c_size_t
        b.ggml_nbytes.argtypes = [vp]
        cpu.ggml_graph_compute_with_ctx.restype = C.c_int
        cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, C.c_int]
        cpu.ggml_graph_plan.restype = CPlan
        cpu.ggml_graph_plan.argtypes = [vp, C.c_int, vp]
        cpu.ggml_graph_compute.restype = C.c_int
        cpu.ggml_graph_compute.argtypes = [vp, C.POINTER(CPlan)]
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


def _ptr(a: np.ndarray) -> C.c_void_p:
    return C.c_void_p(a.ctypes.data)


def flash_attn(q: np.ndarray, k: np.ndarray, v: np.ndarray, type_k: str, type_v: str,
               scale: float | None = None, n_threads: int = 1, mask: np.ndarray | None = None,
               softcap: float = 0.0, reference: bool = False) -> np.ndarray:
    """ggml_flash_attn_ext on the CPU with K/V stored as type_k/type_v.

    q: [n_head, n_q, d_k]; k: [n_head_kv, n_kv, d_k]; v: [n_head_kv, n_kv, d_v] (float32).
    mask: additive, [n_q, n_kv] or [n_head, n_q, n_kv] (-inf hides a cached row); stored as f16.
    reference: run ggml's reference path (the one-row kernel) instead of the optimized ones.
    Returns [n_head, n_q, d_v].
    """
    from .codec import encode

    g = ggml()
    b = g.base
    n_head, n_q, dk = q.shape
    n_head_kv, n_kv, _ = k.shape
    dv = v.shape[2]
    tk, tv = cache_type(type_k), cache_type(type_v)
    mem = 64 * 1024 * 1024 + 4 * (q.size + k.size + v.size + n_head * n_q * dv) * 2
    if mask is not None:
        mask = np.asarray(mask, dtype=np.float16)
        if mask.ndim == 2:
            mask = mask[None]
        if mask.shape[1:] != (n_q, n_kv) or mask.shape[0] not in (1, n_head):
            raise ValueError(f"mask must be [n_q, n_kv] or [n_head, n_q, n_kv], got {mask.shape}")
        mem += mask.nbytes
    ctx = b.ggml_init(InitParams(mem, None, False))
    try:
        tq = b.ggml_new_tensor_4d(ctx, 0, dk, n_q, n_head, 1)
        tk_ = b.ggml_new_tensor_4d(ctx, tk.ggml_id, dk, n_kv, n_head_kv, 1)
        tv_ = b.ggml_new_tensor_4d(ctx, tv.ggml_id, dv, n_kv, n_head_kv, 1)
        C.memmove(b.ggml_get_data(tq), _ptr(np.ascontiguousarray(q, dtype=np.float32)), q.size * 4)
        for tensor, arr, t in ((tk_, k, tk), (tv_, v, tv)):
            raw = encode(np.ascontiguousarray(arr, dtype=np.float32).reshape(-1), t)
            assert raw.size == b.ggml_nbytes(tensor)
            C.memmove(b.ggml_get_data(tensor), _ptr(raw), raw.size)
        tm = None
        if mask is not None:
            tm = b.ggml_new_tensor_4d(ctx, 1, n_kv, n_q, mask.shape[0], 1)
            C.memmove(b.ggml_get_data(tm), _ptr(np.ascontiguousarray(mask)), mask.nbytes)
        sc = float(scale if scale is not None else 1.0 / np.sqrt(dk))
        out = b.ggml_flash_attn_ext(ctx, tq, tk_, tv_, tm, sc, 0.0, float(softcap))
        graph = b.ggml_new_graph(ctx)
        b.ggml_build_forward_expand(graph, out)
        plan = g.cpu.ggml_graph_plan(graph, n_threads, None)
        work = np.empty(max(plan.work_size, 1), dtype=np.uint8)
        plan.work_data = work.ctypes.data
        plan.use_ref = reference
        rc = g.cpu.ggml_graph_compute(graph, C.byref(plan))
        if rc != 0:
            raise RuntimeError(f"ggml_graph_compute failed: {rc}")
        res = np.empty(n_q * n_head * dv, dtype=np.float32)
        C.memmove(_ptr(res), b.ggml_get_data(out), res.size * 4)
        # result is [dv, n_head, n_q]
        return res.reshape(n_q, n_head, dv).transpose(1, 0, 2).copy()
    finally:
        b.ggml_free(ctx)
