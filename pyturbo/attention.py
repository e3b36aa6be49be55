"""ggml's flash attention on the CPU over NumPy arrays, with K/V stored in any cache type: the
tests compare its optimized kernels with its reference path and with NumPy.
"""
from __future__ import annotations

import ctypes as C

import numpy as np

from .codec import encode
from .ggml import InitParams, ggml, ptr
from .types import cache_type

__all__ = ["flash_attn"]


def flash_attn(q: np.ndarray, k: np.ndarray, v: np.ndarray, type_k: str, type_v: str,
               scale: float | None = None, n_threads: int = 1, mask: np.ndarray | None = None,
               softcap: float = 0.0, reference: bool = False, v_in_k: bool = False) -> np.ndarray:
    """ggml_flash_attn_ext on the CPU with K/V stored as type_k/type_v.

    q: [n_head, n_q, d_k]; k: [n_head_kv, n_kv, d_k]; v: [n_head_kv, n_kv, d_v] (float32).
    mask: additive, [n_q, n_kv] or [n_head, n_q, n_kv] (-inf hides a cached row); stored as f16.
    reference: run ggml's reference path (the one-row kernel) instead of the optimized ones.
    v_in_k: V is not stored on its own but read as a view of K's first d_v values in each row, K's
    type and K's row stride, as llama.cpp runs MLA (v must equal k[..., :d_v]; type_v is type_k).
    Returns [n_head, n_q, d_v].
    """
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
        C.memmove(b.ggml_get_data(tq), ptr(np.ascontiguousarray(q, dtype=np.float32)), q.size * 4)
        stored = [(tk_, k, tk)]
        if v_in_k:
            if type_v != type_k or not np.array_equal(v, k[..., :dv]):
                raise ValueError("v_in_k: v must be k[..., :d_v] and type_v must be type_k")
            row = b.ggml_row_size(tk.ggml_id, dk)
            tv_ = b.ggml_view_4d(ctx, tk_, dv, n_kv, n_head_kv, 1, row, row * n_kv, row * n_kv * n_head_kv, 0)
        else:
            tv_ = b.ggml_new_tensor_4d(ctx, tv.ggml_id, dv, n_kv, n_head_kv, 1)
            stored.append((tv_, v, tv))
        for tensor, arr, t in stored:
            raw = encode(np.ascontiguousarray(arr, dtype=np.float32).reshape(-1), t)
            assert raw.size == b.ggml_nbytes(tensor)
            C.memmove(b.ggml_get_data(tensor), ptr(raw), raw.size)
        tm = None
        if mask is not None:
            tm = b.ggml_new_tensor_4d(ctx, 1, n_kv, n_q, mask.shape[0], 1)
            C.memmove(b.ggml_get_data(tm), ptr(np.ascontiguousarray(mask)), mask.nbytes)
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
        C.memmove(ptr(res), b.ggml_get_data(out), res.size * 4)
        # result is [dv, n_head, n_q]
        return res.reshape(n_q, n_head, dv).transpose(1, 0, 2).copy()
    finally:
        b.ggml_free(ctx)
