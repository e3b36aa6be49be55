"""The exact window: each sequence's last W positions read exact beside a quantized KV cache.

Every token is still quantized into the cache; each layer whose K or V is quantized also keeps
the rows of each sequence's last W + M positions in F16 (llama-turboq-window.h), and a query
reads the last W positions of its sequence from them instead of from the cache. The margin M
(default 16; beside "auto", auto's) keeps the window whole after the last M positions are removed again (speculative
drafts, a prompt reused up to a few tokens before its end); past it the context is processed
again, so M = 0 saves those rows where nothing is rolled back. Both are settings of the model, the
GGUF keys `key()` ("turboq.exact_window") and `margin_key()`: llama.cpp's tools set them with
`--kv-exact-window W --kv-exact-window-margin M` (environment aliases LLAMA_ARG_KV_EXACT_WINDOW and
LLAMA_ARG_KV_EXACT_WINDOW_MARGIN), llama-cpp-python with `kv_overrides`, pyturbo.Llama with
`kv_exact_window=W, kv_exact_window_margin=M`, and `python -m server` with the same flags as
llama.cpp's. With flash attention. A q8_0 or q4_0 cache on a GPU and an RPC server whose backend
declines the rows beside the cache read the window after an F16 copy of the cache's rows (the CPU,
Vulkan and CUDA beside a turboq cache, and an RPC server whose backend takes them read the rows
beside the cache).

Unset, the window is auto's wherever the sink rows' auto keeps a row (`window_default`: beside a
turboq K or V, in a layer whose device reads the rows beside the cache), and none beside other
caches; 0 keeps none. On a dense model it took turboq3's KLD from 2.2x q4_0's to 0.48x at 8,192
positions for 0.1 bit per value (docs/quality.md).

"auto" (-1 as the key's value, `AUTO`) sizes the window and its margin by the context's cells per sequence instead
(`auto_window`, libllama's llama_turboq_exact_window_auto): their rows weigh at most a sixth of
a bit per value, from a window of 4 at 512 positions per sequence up to 32 with a margin of 16 at
4,608 and more. A fixed window's rows weigh 16 x (W + M) / positions bits per value: the
recommended configuration's 32 and 16 cost 1.5 bits at 512 positions, and auto keeps it within
4 bits there.

Sink rows: the setting `sink_key()` ("turboq.exact_sink", `--kv-exact-sink S`, alias
LLAMA_ARG_KV_EXACT_SINK, pyturbo.Llama's `kv_exact_sink=S`) keeps each sequence's first S positions
in F16 as well, and every query reads them exact, with or without a window. On a dense model the
first token's quantized K and V carry much of a 3-bit cache's error (docs/quality.md). Unset, or
"auto" (-1 as the key's value), it is libllama's default: one row beside a cache with a turboq K or
V (`sink_auto`), none beside others, and none in a layer whose device would read it after a copy.
"""
from __future__ import annotations

import ctypes as C
from functools import lru_cache

from ._paths import library, llama_function

ENV = "LLAMA_ARG_KV_EXACT_WINDOW"                # common's set_env alias of --kv-exact-window
MARGIN_ENV = "LLAMA_ARG_KV_EXACT_WINDOW_MARGIN"  # and of --kv-exact-window-margin
SINK_ENV = "LLAMA_ARG_KV_EXACT_SINK"              # and of --kv-exact-sink
SINK_AUTO = -1                                    # turboq.exact_sink's auto (LLAMA_TURBOQ_EXACT_SINK_AUTO)
AUTO = -1                                         # turboq.exact_window's auto (LLAMA_TURBOQ_EXACT_WINDOW_AUTO)


@lru_cache(maxsize=1)
def max_positions() -> int:
    """The largest window (and margin) that libllama and common take (llama_turboq_exact_window_max)."""
    return int(llama_function("llama_turboq_exact_window_max", C.c_int32)())


@lru_cache(maxsize=1)
def key() -> str:
    """The model key that holds the window, as libllama names it."""
    return llama_function("llama_turboq_exact_window_key", C.c_char_p)().decode()


@lru_cache(maxsize=1)
def margin_key() -> str:
    """The model key that holds the window's margin."""
    return llama_function("llama_turboq_exact_window_margin_key", C.c_char_p)().decode()


@lru_cache(maxsize=1)
def sink_key() -> str:
    """The model key that holds the sink rows' count."""
    return llama_function("llama_turboq_exact_sink_key", C.c_char_p)().decode()


def sink_auto(type_k: str, type_v: str) -> int:
    """The sink rows that auto keeps per sequence beside a cache of these types (cache type names)
    where they are read beside it (llama_turboq_exact_sink_auto: 1 with a turboq K or V)."""
    from .types import requested_cache_type
    fn = library("llama").llama_turboq_exact_sink_auto
    fn.restype = C.c_uint32
    fn.argtypes = [C.c_int, C.c_int]
    return int(fn(requested_cache_type(type_k).ggml_id, requested_cache_type(type_v).ggml_id))


def setting(text: str | None) -> int | str | None:
    """The text of --kv-exact-window or --kv-exact-sink (or their aliases, LLAMA_ARG_KV_EXACT_WINDOW
    and LLAMA_ARG_KV_EXACT_SINK) as a setting: None when unset, -1 (AUTO, SINK_AUTO) for "auto",
    else its number (text that is none comes back as it is, for check's and check_sink's errors)."""
    if text is None or text == "auto":
        return None if text is None else AUTO
    try:
        return int(text)
    except ValueError:
        return text


def env_window(env: dict[str, str]) -> int | None:
    """The window that a configuration's environment sets (ENV): None when unset (libllama's
    default, `window_default`), AUTO for "auto"."""
    w = setting(env.get(ENV))
    return None if w is None else check(w)


def window_default(type_k: str, type_v: str) -> int:
    """The window that an unset setting gives a cache of these types (cache type names) where its
    rows are read beside it (libllama's LLAMA_TURBOQ_EXACT_WINDOW_UNSET): AUTO wherever the sink
    rows' auto keeps a row (beside a turboq K or V), else 0."""
    return AUTO if sink_auto(type_k, type_v) > 0 else 0


def sink_count(sink: int | str | None, type_k: str, type_v: str) -> int:
    """The sink rows per sequence that a setting (a count, or None / "auto" / -1) keeps beside a
    cache of these types on the CPU."""
    s = check_sink(SINK_AUTO if sink is None else sink)
    return sink_auto(type_k, type_v) if s == SINK_AUTO else s


def auto_window(cells: int, margin: int | None = None) -> tuple[int, int]:
    """The window and margin that auto gives a cache of `cells` cells per sequence (the margin
    given, or None for auto's) (llama_turboq_exact_window_auto)."""
    fn = library("llama").llama_turboq_exact_window_auto
    fn.restype = C.c_uint32
    fn.argtypes = [C.c_uint32, C.c_int32, C.POINTER(C.c_uint32)]
    m = C.c_uint32(0)
    w = int(fn(max(int(cells), 0), -1 if margin is None else check_margin(margin), C.byref(m)))
    return w, int(m.value)


def rows_per_sequence(w: int, margin: int | None = None, sink: int = 0, cells: int | None = None) -> int:
    """F16 rows each window layer keeps per sequence for a window of w positions (0 for none; AUTO
    with `cells`, the context's cells per sequence), the given margin (None: libllama's
    default) and sink rows (a count: see sink_count for auto) (llama_turboq_exact_rows_per_seq)."""
    if check(w) == AUTO:
        if cells is None:
            raise ValueError("an auto exact window is sized by the context: give its cells per sequence")
        w, margin = auto_window(cells, margin)
    if w <= 0 and sink <= 0:
        return 0
    fn = library("llama").llama_turboq_exact_rows_per_seq
    fn.restype = C.c_uint32
    fn.argtypes = [C.c_uint32, C.c_int32, C.c_uint32]
    return int(fn(max(w, 0), -1 if margin is None else check_margin(margin), check_sink(max(sink, 0))))


def context_window(ctx: int) -> int:
    """The window's positions in a context's caches (0: none; auto's as sized, the largest of its
    caches) (llama_turboq_exact_window)."""
    fn = library("llama").llama_turboq_exact_window
    fn.restype = C.c_int32
    fn.argtypes = [C.c_void_p]
    return int(fn(ctx))


def can_continue(ctx: int, seq: int, n_past: int) -> bool:
    """Whether the context's caches hold exact rows for the window's positions before n_past of
    seq, so that decoding can go on after them as after a fresh pass (true without a window)."""
    fn = library("llama").llama_turboq_window_can_continue
    fn.restype = C.c_bool
    fn.argtypes = [C.c_void_p, C.c_int32, C.c_int32]
    return bool(fn(ctx, seq, n_past))


def check(w: int | str) -> int:
    """A window setting as the key's value: a number of positions, or -1 for "auto" (or -1)."""
    if w == "auto" or (isinstance(w, int) and not isinstance(w, bool) and w == AUTO):
        return AUTO
    if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= max_positions():
        raise ValueError(f"exact window {w!r}: a number of positions, 0 (off) to {max_positions()}, or 'auto'")
    return w


def check_margin(m: int) -> int:
    if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= max_positions():
        raise ValueError(f"exact window margin {m!r}: a number of positions, 0 to {max_positions()}")
    return m


def check_sink(s: int | str) -> int:
    """A sink-row setting as the key's value: a count, or -1 for "auto" (or -1)."""
    if s == "auto" or (isinstance(s, int) and not isinstance(s, bool) and s == SINK_AUTO):
        return SINK_AUTO
    if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= max_positions():
        raise ValueError(f"exact sink rows {s!r}: a number of positions, 0 (none) to {max_positions()}, or 'auto'")
    return s


def kv_override(w: int | str | None, margin: int | None = None) -> dict[str, int]:
    """The window (a count or "auto", None: the model's; and its margin, None: the model's) as
    llama-cpp-python's kv_overrides (Llama(..., kv_overrides=...))."""
    out = {} if w is None else {key(): check(w)}
    if margin is not None:
        out[margin_key()] = check_margin(margin)
    return out
