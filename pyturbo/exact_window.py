"""The exact window: each sequence's last W positions read exact beside a quantized KV cache.

Every token is still quantized into the cache; each layer whose K or V is quantized also keeps
the rows of each sequence's last W + margin positions in F16 (llama-turboq-window.h), and a query
reads the last W positions of its sequence from them instead of from the cache. It is a setting of
the model, the GGUF key `key()` ("turboq.exact_window"): llama.cpp's tools set it with
`--kv-exact-window W` (or its environment alias LLAMA_ARG_KV_EXACT_WINDOW), llama-cpp-python with
`kv_overrides`, pyturbo.Llama with `kv_exact_window=W`, and `python -m server` with
`--kv-exact-window W`. CPU only, with flash attention.
"""
from __future__ import annotations

import ctypes as C
from functools import lru_cache

from ._paths import library

ENV = "LLAMA_ARG_KV_EXACT_WINDOW"  # common's set_env alias of --kv-exact-window
MAX = 4096                          # the largest window libllama and common take


@lru_cache(maxsize=1)
def key() -> str:
    """The model key that holds the window, as libllama names it."""
    fn = library("llama").llama_turboq_exact_window_key
    fn.restype = C.c_char_p
    fn.argtypes = []
    return fn().decode()


def rows_per_sequence(w: int) -> int:
    """F16 rows each window layer keeps per sequence for a window of w positions (0 for none)."""
    if w <= 0:
        return 0
    fn = library("llama").llama_turboq_exact_window_rows
    fn.restype = C.c_uint32
    fn.argtypes = [C.c_uint32]
    return int(fn(w))


def can_continue(ctx: int, seq: int, n_past: int) -> bool:
    """Whether the context's caches hold exact rows for the window's positions before n_past of
    seq, so that decoding can go on after them as after a fresh pass (true without a window)."""
    fn = library("llama").llama_turboq_window_can_continue
    fn.restype = C.c_bool
    fn.argtypes = [C.c_void_p, C.c_int32, C.c_int32]
    return bool(fn(ctx, seq, n_past))


def check(w: int) -> int:
    if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= MAX:
        raise ValueError(f"exact window {w!r}: a number of positions, 0 (off) to {MAX}")
    return w


def kv_override(w: int) -> dict[str, int]:
    """The window as llama-cpp-python's kv_overrides (Llama(..., kv_overrides=...))."""
    return {key(): check(w)}
