"""`pyturbo.Llama`: llama_cpp.Llama on the patched libllama, with cache types by name.

    from pyturbo import Llama
    llm = Llama("model.gguf", cache_type_k="turboq3", cache_type_v="turboq3", layer_adaptive=7)

Every other argument is llama_cpp.Llama's, unchanged. Flash attention defaults to on when a
turboq type is asked for (it is required); passing flash_attn=False then fails with llama.cpp's
reason. When llama.cpp refuses a context, the exception carries its error lines.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from typing import Any, Iterator

from . import layer_adaptive as _la
from ._paths import use_patched_llama_cpp
from .types import CACHE_TYPES, TURBOQ_TYPES, CacheType, cache_type

use_patched_llama_cpp()

import llama_cpp  # noqa: E402  (must come after LLAMA_CPP_LIB_PATH)

GGML_LOG_LEVEL_ERROR = 4
GGML_LOG_LEVEL_CONT = 5
_create_lock = threading.Lock()


class ContextError(RuntimeError):
    """llama.cpp refused to create the model or context; the message is llama.cpp's own."""


@contextlib.contextmanager
def _layer_adaptive_env(mode: int | None) -> Iterator[None]:
    """TURBO_LAYER_ADAPTIVE is read when a KV cache is created: set it for this model only."""
    if mode is None:
        yield
        return
    _la.check_mode(mode)
    old = os.environ.get("TURBO_LAYER_ADAPTIVE")
    os.environ["TURBO_LAYER_ADAPTIVE"] = str(mode)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TURBO_LAYER_ADAPTIVE", None)
        else:
            os.environ["TURBO_LAYER_ADAPTIVE"] = old


@contextlib.contextmanager
def captured_log(verbose: bool) -> Iterator[list[tuple[int, str]]]:
    """Collect llama.cpp's log lines as (level, text) while the block runs (and still print them when verbose)."""
    lines: list[tuple[int, str]] = []

    @llama_cpp.llama_log_callback
    def _cb(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        msg = text.decode("utf-8", errors="replace")
        if level == GGML_LOG_LEVEL_CONT and lines:
            level = lines[-1][0]
        lines.append((level, msg))
        if verbose:
            print(msg, end="", flush=True, file=sys.stderr)

    llama_cpp.llama_log_set(_cb, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        from llama_cpp._logger import llama_log_callback as _default
        llama_cpp.llama_log_set(_default, ctypes.c_void_p(0))


def _errors(lines: list[tuple[int, str]]) -> str:
    text = "".join(msg for level, msg in lines if level == GGML_LOG_LEVEL_ERROR)
    return "\n".join(dict.fromkeys(ln.strip() for ln in text.splitlines() if ln.strip()))


@contextlib.contextmanager
def creating_context(layer_adaptive: int | None = None, verbose: bool = True) -> Iterator[None]:
    """Wrap the creation of a llama_cpp.Llama (by us or by llama-cpp-python's server):
    TURBO_LAYER_ADAPTIVE set for this model only, one creation at a time (the variable is
    process-wide), and a refusal raised as ContextError with llama.cpp's reason."""
    with _create_lock, _layer_adaptive_env(layer_adaptive), captured_log(verbose) as log:
        try:
            yield
        except ValueError as e:
            reason = _errors(log)
            raise ContextError(f"{e}: {reason}" if reason else str(e)) from None


class Llama(llama_cpp.Llama):
    """llama_cpp.Llama with `cache_type_k`, `cache_type_v` (names) and `layer_adaptive`."""

    def __init__(self, model_path: str, *args: Any, cache_type_k: str | CacheType | None = None,
                 cache_type_v: str | CacheType | None = None, layer_adaptive: int | None = None,
                 **kwargs: Any) -> None:
        tk = cache_type(cache_type_k) if cache_type_k is not None else None
        tv = cache_type(cache_type_v) if cache_type_v is not None else None
        if tk is not None:
            kwargs["type_k"] = tk.ggml_id
        if tv is not None:
            kwargs["type_v"] = tv.ggml_id
        for key in ("type_k", "type_v"):
            if kwargs.get(key) is not None:
                _check_type_id(kwargs[key])
        turboq_ids = {CACHE_TYPES[n].ggml_id for n in TURBOQ_TYPES}
        policy = _la.policies().get(layer_adaptive or 0)
        la_turboq = policy is not None and any(t in TURBOQ_TYPES for t in (policy.k_boundary, policy.v_boundary, policy.v_other))
        wants_turboq = kwargs.get("type_k") in turboq_ids or kwargs.get("type_v") in turboq_ids or la_turboq
        if wants_turboq:
            kwargs.setdefault("flash_attn", True)
        self.cache_type_k = tk.name if tk else None
        self.cache_type_v = tv.name if tv else None
        self.layer_adaptive = layer_adaptive or 0
        verbose = kwargs.get("verbose", True)
        with creating_context(layer_adaptive, verbose):
            super().__init__(model_path, *args, **kwargs)

    def __del__(self) -> None:
        # llama_cpp.Llama.__del__ assumes __init__ got far enough to set up its resources
        if hasattr(self, "_stack"):
            super().__del__()


def _check_type_id(type_id: int) -> None:
    # an id llama.cpp does not know aborts the whole process in ggml; refuse it here instead
    if type_id not in {t.ggml_id for t in CACHE_TYPES.values()}:
        names = ", ".join(f"{t.name}={t.ggml_id}" for t in CACHE_TYPES.values())
        raise ValueError(f"KV cache type id {type_id} is not a llama.cpp cache type; valid: {names}")
