"""`pyturbo.Llama`: llama_cpp.Llama on the patched libllama, with cache types by name.

    from pyturbo import Llama
    llm = Llama("model.gguf", cache_type_k="turboq3", cache_type_v="turboq3", layer_adaptive=7,
                kv_exact_window=16)

Every other argument is llama_cpp.Llama's, unchanged. Flash attention defaults to on when a
turboq type is asked for (it is required); passing flash_attn=False then fails with llama.cpp's
reason. When llama.cpp refuses a context, the exception carries its error lines.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import sys
import threading
from typing import Any, Iterator

from . import exact_window as _ew
from . import k_centering as _kc
from . import layer_adaptive as _la
from ._paths import use_patched_llama_cpp
from .types import CACHE_TYPES, REQUESTABLE_TYPES, STORED_TYPES, TRELLIS_TYPES, TURBOQ_TYPES, CacheType, requested_cache_type

use_patched_llama_cpp()

import llama_cpp  # noqa: E402  (must come after LLAMA_CPP_LIB_PATH)

GGML_LOG_LEVEL_ERROR = 4
GGML_LOG_LEVEL_CONT = 5
_create_lock = threading.Lock()


class ContextError(RuntimeError):
    """llama.cpp refused to create the model or context; the message is llama.cpp's own."""


class StateError(RuntimeError):
    """llama.cpp refused a saved state (another cache type, layer mode or model, truncated,
    corrupt); the context keeps what it held before."""


@contextlib.contextmanager
def scoped_env(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, then restore them."""
    old = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, val in old.items():
            if val is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = val


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
def creating_context(*, verbose: bool = True) -> Iterator[None]:
    """Wrap the creation of a llama_cpp.Llama (by us or by llama-cpp-python's server): a refusal
    is raised as ContextError with llama.cpp's reason. One creation at a time, because the log
    callback that catches the reason is process-wide."""
    with _create_lock, captured_log(verbose) as log:
        try:
            yield
        except ValueError as e:
            reason = _errors(log)
            raise ContextError(f"{e}: {reason}" if reason else str(e)) from None


class Llama(llama_cpp.Llama):
    """llama_cpp.Llama with `cache_type_k`, `cache_type_v` (names), `layer_adaptive` (a mode's number or name),
    `kv_exact_window` (each sequence's last W positions read exact, or "auto": sized by the context;
    default: auto beside a turboq cache, 0 for none; pyturbo.exact_window),
    `kv_exact_window_margin` (positions kept beyond it for rollbacks; default 16, auto's beside "auto"), `kv_exact_sink`
    (each sequence's first S positions read exact by every query; default "auto": one row beside a
    turboq cache, 0 for none), `k_center`
    (K centering of a turboq K cache; default on) and `k_scale` (its channel scale: "auto", the
    default, "on" or "off"; pyturbo.k_centering)."""

    def __init__(self, model_path: str, *args: Any, cache_type_k: str | CacheType | None = None,
                 cache_type_v: str | CacheType | None = None, layer_adaptive: int | str | None = None,
                 kv_exact_window: int | str | None = None, kv_exact_window_margin: int | None = None,
                 kv_exact_sink: int | str | None = None, k_center: bool | None = None, k_scale: str | None = None,
                 **kwargs: Any) -> None:
        tk = requested_cache_type(cache_type_k) if cache_type_k is not None else None
        tv = requested_cache_type(cache_type_v) if cache_type_v is not None else None
        if tk is not None:
            kwargs["type_k"] = tk.ggml_id
        if tv is not None:
            kwargs["type_v"] = tv.ggml_id
        for key in ("type_k", "type_v"):
            if kwargs.get(key) is not None:
                _check_type_id(kwargs[key])
        if layer_adaptive is None and _la.key() in (kwargs.get("kv_overrides") or {}):
            layer_adaptive = kwargs["kv_overrides"][_la.key()]  # the mode given as llama-cpp-python does
        if layer_adaptive is not None:
            layer_adaptive = _la.check_mode(layer_adaptive)  # a number or a name ("k4-global")
        turboq_ids = {CACHE_TYPES[n].ggml_id for n in TURBOQ_TYPES} | {t.ggml_id for t in TRELLIS_TYPES.values()}
        policy = _la.policies().get(layer_adaptive or 0)
        la_turboq = policy is not None and any(t in TURBOQ_TYPES for t in (policy.k_boundary, policy.v_boundary, policy.v_other))
        wants_turboq = kwargs.get("type_k") in turboq_ids or kwargs.get("type_v") in turboq_ids or la_turboq
        sink = _ew.check_sink(kv_exact_sink) if kv_exact_sink is not None else None  # -1: auto
        if wants_turboq or kv_exact_window or (sink or 0) > 0:
            kwargs.setdefault("flash_attn", True)  # both need it
        self.cache_type_k = tk.name if tk else None
        self.cache_type_v = tv.name if tv else None
        self.layer_adaptive = layer_adaptive or 0
        if layer_adaptive is not None:
            # a setting of the model (the GGUF key), so it reaches this model's caches only
            kwargs["kv_overrides"] = {**(kwargs.get("kv_overrides") or {}), **_la.kv_override(layer_adaptive)}
        if kv_exact_window is not None:
            kwargs["kv_overrides"] = {**(kwargs.get("kv_overrides") or {}), **_ew.kv_override(kv_exact_window)}
        if kv_exact_window_margin is not None:
            kwargs["kv_overrides"] = {**(kwargs.get("kv_overrides") or {}),
                                      _ew.margin_key(): _ew.check_margin(kv_exact_window_margin)}
        if sink is not None:
            kwargs["kv_overrides"] = {**(kwargs.get("kv_overrides") or {}), _ew.sink_key(): sink}
        if k_center is not None:
            kwargs["kv_overrides"] = {**(kwargs.get("kv_overrides") or {}), **_kc.kv_override(k_center)}
        if k_scale is not None:
            kwargs["kv_overrides"] = {**(kwargs.get("kv_overrides") or {}), **_kc.scale_override(k_scale)}
        overrides = kwargs.get("kv_overrides") or {}
        # the setting: a count, AUTO, or None where neither it nor an override gives one (libllama's
        # default, auto beside a turboq cache; the window as sized: exact_window.context_window)
        self.kv_exact_window = _ew.check(kv_exact_window) if kv_exact_window is not None else \
            (int(overrides[_ew.key()]) if _ew.key() in overrides else None)
        self.kv_exact_sink = sink if sink is not None else int(overrides.get(_ew.sink_key(), _ew.SINK_AUTO))
        verbose = kwargs.get("verbose", True)
        with creating_context(verbose=verbose):
            super().__init__(model_path, *args, **kwargs)

    def eval(self, tokens: Any) -> None:
        """llama_cpp.Llama.eval; with an exact window or sink rows, a prefix that llama-cpp-python
        reuses is processed again when they no longer hold its positions (an answer longer than the
        window's margin pushed them out), so that the tokens after it read them exact, as a fresh
        context would, and get the same logits. Asked of libllama on every call: sink rows are on
        by default beside a turboq cache."""
        super().eval(window_tokens(self, tokens))

    def save_state(self) -> llama_cpp.LlamaState:
        """llama_cpp.Llama.save_state, plus a SHA-256 of the state bytes that load_state checks:
        llama.cpp's state format has no checksum, and a flipped count in it can load as garbage.
        A state that llama.cpp refuses to write raises StateError with its reason (upstream's
        wrapper returns it as an empty state)."""
        with captured_log(self.verbose) as log:
            state = super().save_state()
        if state.llama_state_size == 0:
            raise StateError(f"state not saved: {_errors(log) or 'llama.cpp gave no reason'}")
        state.pyturbo_sha256 = hashlib.sha256(bytes(state.llama_state)).hexdigest()
        return state

    def load_state(self, state: llama_cpp.LlamaState) -> None:
        """llama_cpp.Llama.load_state, but a refused state raises StateError with llama.cpp's
        reason and leaves this context as it was (llama.cpp clears the cache when a restore
        fails; upstream's wrapper also took over the state's token count first)."""
        size = state.llama_state_size
        if size != len(state.llama_state) or size == 0:
            raise StateError(f"saved state is {len(state.llama_state)} bytes but says {size}: truncated or corrupt")
        digest = getattr(state, "pyturbo_sha256", None)
        if digest is not None and hashlib.sha256(bytes(state.llama_state)).hexdigest() != digest:
            raise StateError("saved state is corrupt: its bytes do not match the SHA-256 taken when it was saved")
        backup = super().save_state()  # no digest needed for our own copy
        data = (ctypes.c_uint8 * size).from_buffer_copy(state.llama_state)
        with captured_log(False) as log:
            ok = llama_cpp.llama_state_set_data(self._ctx.ctx, data, size) == size
        if not ok:
            back = (ctypes.c_uint8 * backup.llama_state_size).from_buffer_copy(backup.llama_state)
            llama_cpp.llama_state_set_data(self._ctx.ctx, back, backup.llama_state_size)
            raise StateError(f"saved state refused: {_type_names(_errors(log)) or 'llama.cpp gave no reason'}")
        self.scores[: state.n_tokens, :] = state.scores.copy()
        rest = self.scores[state.n_tokens:, :]
        rest[rest > 0] = 0.0
        self.input_ids = state.input_ids.copy()
        self.n_tokens = state.n_tokens
        self._requires_eval = True
        self._seed = state.seed

    def __del__(self) -> None:
        # llama_cpp.Llama.__del__ assumes __init__ got far enough to set up its resources
        if hasattr(self, "_stack"):
            super().__del__()


def window_tokens(llm: llama_cpp.Llama, tokens: Any) -> Any:
    """The tokens to evaluate after llm's n_tokens: these, or, when the exact window no longer
    holds the positions before n_tokens, the whole prefix again (n_tokens reset to 0)."""
    if llm.n_tokens > 0 and not _ew.can_continue(llm._ctx.ctx, 0, llm.n_tokens):
        tokens = [*llm.input_ids[: llm.n_tokens].tolist(), *tokens]
        llm.n_tokens = 0
    return tokens


def _type_names(text: str) -> str:
    """'mismatched key type (8 != 61, layer 0)' -> '... (q8_0 in this context, turboq3 in the state, layer 0)'."""
    names = {t.ggml_id: t.name for t in STORED_TYPES.values()}  # a layer may store a twin

    def sub(m: re.Match) -> str:
        here, saved = int(m.group(1)), int(m.group(2))
        return f"({names.get(here, here)} in this context, {names.get(saved, saved)} in the saved state, "

    return re.sub(r"\((\d+) != (\d+), ", sub, text)


def _check_type_id(type_id: int) -> None:
    # an id llama.cpp does not know aborts the whole process in ggml; refuse it here instead
    if type_id not in {t.ggml_id for t in REQUESTABLE_TYPES.values()}:
        names = ", ".join(f"{t.name}={t.ggml_id}" for t in REQUESTABLE_TYPES.values())
        raise ValueError(f"KV cache type id {type_id} is not a llama.cpp cache type; valid: {names}")
