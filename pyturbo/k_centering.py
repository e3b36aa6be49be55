"""K centering: a turboq K cache stores (k - mu) * s, mu the model's calibrated mean K and s a
per-channel scale, and attention reads it with q / s (llama-turboq-center.h).

It is on by default. It is a setting of the model, the key `key()` ("turboq.k_center", a bool):
llama.cpp's tools set it with `--kv-k-center on|off` (environment alias LLAMA_ARG_KV_K_CENTER),
llama-cpp-python with `kv_overrides`, pyturbo.Llama with `k_center=`, `python -m server` with
`--kv-k-center`, and pyturbo.hf's cache with its own `k_center=`.

The channel scale s is a second setting, the key `scale_key()` ("turboq.k_scale", a string):
"auto" (the default) takes it where the model's calibration measured that it lowers the attention
error, with or without sink rows as the model's setting has them; "on" and "off" force it.
`--kv-k-scale auto|on|off` (alias LLAMA_ARG_KV_K_SCALE), `k_scale=` on pyturbo.Llama, and
`--kv-k-scale` on `python -m server`. pyturbo.hf's cache has no channel scale.
"""
from __future__ import annotations

import ctypes as C
from functools import lru_cache

from ._paths import llama_function

ENV = "LLAMA_ARG_KV_K_CENTER"  # common's set_env alias of --kv-k-center
SCALE_ENV = "LLAMA_ARG_KV_K_SCALE"  # and of --kv-k-scale
SCALES = ("auto", "on", "off")


@lru_cache(maxsize=1)
def key() -> str:
    """The model key that holds the setting, as libllama names it."""
    return llama_function("llama_turboq_k_center_key", C.c_char_p)().decode()


def kv_override(on: bool) -> dict[str, bool]:
    """The kv_overrides entry that sets it (llama-cpp-python's bool override)."""
    if not isinstance(on, bool):
        raise TypeError(f"k_center must be True or False, not {on!r}")
    return {key(): on}


def flag(on: bool) -> str:
    """The tools' value for --kv-k-center."""
    return "on" if on else "off"


@lru_cache(maxsize=1)
def scale_key() -> str:
    """The model key of the channel scale, as libllama names it."""
    return llama_function("llama_turboq_k_scale_key", C.c_char_p)().decode()


def check_scale(value: str) -> str:
    """The setting's value (auto, on or off), or a ValueError that says which are."""
    if value not in SCALES:
        raise ValueError(f"k_scale must be one of {', '.join(SCALES)}, not {value!r}")
    return value


def scale_override(value: str) -> dict[str, str]:
    """The kv_overrides entry that sets the channel scale (llama-cpp-python's str override)."""
    return {scale_key(): check_scale(value)}
