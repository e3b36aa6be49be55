"""Layer-adaptive modes: per-layer K/V types, from the patched libllama's own table and rule.

The table is `policies[]` in llama-turboq.cpp; llama_turboq_layer_policy hands its rows out, and
llama_turboq_boundary_from_gains applies its selection rule to K gains that Python measured
(from a GGUF, or a transformers model), so Python keeps no copy of either that could drift. A mode is a setting of the model, the GGUF key
`key()` ("turboq.layer_adaptive"): llama.cpp's tools set it with `--layer-adaptive N` (or its
environment alias LLAMA_ARG_LAYER_ADAPTIVE), llama-cpp-python with `kv_overrides`, and
pyturbo.Llama with `layer_adaptive=N`. Each mode also has a name (names(): "k4-global" for 4, ...)
that those take beside the number. On a head size that q8_0's 32-value blocks do not divide
(80), a mode's q8_0 is turboq8 in the twin the head size calls for (stored_type, from libllama's
llama_turboq_mode_type_for_head).
"""
from __future__ import annotations

import ctypes as C
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ._paths import lib_dir, library, library_file, llama_function
from .types import CACHE_TYPES, CacheType, cache_type, layer_cache_type, type_by_id


@dataclass(frozen=True)
class LayerPolicy:
    mode: int
    n_first: int     # boundary layers at the start
    n_last: int      # boundary layers at the end
    k_gain_div: int  # > 0: the n_layer // k_gain_div (at least 1) layers of largest K gain are the boundary
    k_boundary: str | None  # None: the requested type
    v_boundary: str | None
    v_other: str | None
    full_context: bool  # the ranking's candidates are only the layers without a sliding window

    def types(self, boundary: bool, type_k: str, type_v: str) -> tuple[str, str]:
        if boundary:
            return self.k_boundary or type_k, self.v_boundary or type_v
        return type_k, self.v_other or type_v


@lru_cache(maxsize=1)
def policies() -> dict[int, LayerPolicy]:
    lib = library("llama")
    try:
        fn = lib.llama_turboq_layer_policy
    except AttributeError:
        raise OSError(f"{lib_dir() / library_file('llama')} has no llama_turboq_layer_policy: an unpatched or older "
                      f"build; rebuild with `bash scripts/setup.sh`") from None
    fn.restype = C.c_bool
    fn.argtypes = [C.c_int32, C.POINTER(C.c_int32)]
    by_id = {t.ggml_id: t.name for t in CACHE_TYPES.values()}
    out: dict[int, LayerPolicy] = {}
    row = (C.c_int32 * 8)()
    i = 0
    while fn(i, row):
        mode, n_first, n_last, div, k_b, v_b, v_o, full = row
        out[mode] = LayerPolicy(mode, n_first, n_last, div, *(by_id[t] if t >= 0 else None for t in (k_b, v_b, v_o)),
                                bool(full))
        i += 1
    return out


@lru_cache(maxsize=1)
def _boundary_from_gains():
    fn = library("llama").llama_turboq_boundary_from_gains
    fn.restype = C.c_bool
    fn.argtypes = [C.c_int32, C.c_int32, C.POINTER(C.c_double), C.POINTER(C.c_bool)]
    return fn


@lru_cache(maxsize=1)
def key() -> str:
    """The model key that holds the mode, as libllama names it."""
    return llama_function("llama_turboq_layer_adaptive_key", C.c_char_p)().decode()


def kv_override(mode: int) -> dict[str, int]:
    """The mode as llama-cpp-python's kv_overrides (Llama(..., kv_overrides=...))."""
    return {key(): int(check_mode(mode))}  # an int: llama-cpp-python tags a bool as a bool


def modes() -> tuple[int, ...]:
    """The valid modes (0 = every layer as requested)."""
    return (0, *sorted(policies()))


@lru_cache(maxsize=1)
def names() -> dict[int, str]:
    """Each mode's name, as libllama names it ("off", ..., "k4-global", ...): the flag and
    `layer_adaptive=` take it beside the number."""
    fn = llama_function("llama_turboq_layer_adaptive_name", C.c_char_p, C.c_int32)
    return {m: fn(m).decode() for m in modes()}


def check_mode(mode: int | str) -> int:
    """A mode given as its number or its name, as its number; ValueError naming the valid ones."""
    by_name = {n: m for m, n in names().items()}
    if isinstance(mode, str) and mode in by_name:
        return by_name[mode]
    if isinstance(mode, bool) or not isinstance(mode, int) or mode not in modes():
        valid = ", ".join(f"{m} ({n})" for m, n in names().items())
        raise ValueError(f"layer-adaptive mode {mode!r}: valid modes are {valid}")
    return mode


def parse_mode(text: str) -> int:
    """A mode from a command line: its number or its name (argparse's type=)."""
    try:
        return check_mode(int(text) if text.lstrip("-").isdigit() else text)
    except ValueError as e:
        import argparse
        raise argparse.ArgumentTypeError(str(e)) from None


def needs_gains(mode: int) -> bool:
    """Whether the mode's layers depend on the model's K gains: a ranking mode picks the
    n_layer // k_gain_div (at least 1) candidates of largest gain, so one with k_gain_div 1 (4)
    picks every candidate whatever the gains."""
    p = policies().get(mode)
    return p is not None and p.k_gain_div > 1


def boundary_layers(mode: int, n_layer: int, k_gains: Sequence[float] | None = None,
                    sliding: Sequence[bool] | None = None) -> list[bool]:
    """Which layers are the mode's boundary layers, by llama.cpp's own rule
    (llama_turboq_boundary_from_gains): by position, or for the modes that rank K gain (3, 4) the
    n_layer // k_gain_div (at least 1) largest of k_gains, ties to the lower layer, plus the
    positional ones; k_gains may be left out where they do not change the pick (needs_gains). A
    mode whose candidates are the layers that attend over the whole context (4) also needs
    `sliding`, one bool per layer, True for a sliding-window layer. All False for mode 0."""
    if mode == 0:
        return [False] * n_layer
    p = policies()[check_mode(mode)]
    if p.k_gain_div and k_gains is None and not needs_gains(mode):
        k_gains = [0.0] * n_layer  # every candidate is picked: any gains give the same layers
    if p.k_gain_div and (k_gains is None or len(k_gains) != n_layer):
        raise ValueError(f"layer-adaptive mode {mode} ranks layers by K gain: pass k_gains, one per layer "
                         f"({n_layer}), e.g. pyturbo.hf.k_gains_from_gguf(model.gguf)")
    if p.full_context:
        if sliding is None or len(sliding) != n_layer:
            raise ValueError(f"layer-adaptive mode {mode} picks the layers without a sliding window: pass sliding, "
                             f"one bool per layer ({n_layer})")
        k_gains = [-1.0 if s else g for g, s in zip(k_gains, sliding)]  # < 0: no candidate, as libllama marks them
    fn = _boundary_from_gains()
    gains = (C.c_double * n_layer)(*k_gains) if p.k_gain_div else None
    out = (C.c_bool * n_layer)()
    if not fn(mode, n_layer, gains, out):
        raise ValueError(f"libllama refused layer-adaptive mode {mode} for {n_layer} layers")
    return list(out)


def layer_cache_types(mode: int, n_layer: int, type_k: str, type_v: str,
                      k_gains: Sequence[float] | None = None,
                      sliding: Sequence[bool] | None = None) -> list[tuple[str, str]]:
    """(K type, V type) of every layer under the mode (k_gains, sliding: see boundary_layers)."""
    if mode == 0:
        return [(type_k, type_v)] * n_layer
    p = policies()[check_mode(mode)]
    return [p.types(b, type_k, type_v) for b in boundary_layers(mode, n_layer, k_gains, sliding)]


@lru_cache(maxsize=None)
def _mode_type_for_head(name: str, head_dim: int) -> CacheType:
    fn = library("llama").llama_turboq_mode_type_for_head
    fn.restype = C.c_int32
    fn.argtypes = [C.c_int32, C.c_uint32]
    stored = int(fn(cache_type(name).ggml_id, head_dim))
    return type_by_id(stored)


def stored_type(name: str, requested: str, head_dim: int) -> CacheType:
    """The type a layer of this head size stores for `name`, the mode's type where `requested` was
    asked for: the requested type fitted as pyturbo.types.layer_cache_type fits it, a type the mode
    chose by libllama's rule (llama_turboq_mode_type_for_head: q8_0 where its blocks do not divide
    the head size is turboq8, in the twin the head size calls for)."""
    t = cache_type(name)
    if t.name == cache_type(requested).name:
        return layer_cache_type(t, head_dim)
    return _mode_type_for_head(t.name, head_dim)
