"""pyturbo: TurboQuant KV-cache types (turboq2/3/4/8) for llama.cpp, driven from Python."""
from __future__ import annotations

from . import data
from ._paths import pin as _pin
from .types import CACHE_TYPES, TURBOQ_TYPES, CacheType, cache_type

UPSTREAM_COMMIT: str = _pin()["llama_cpp_commit"]
UPSTREAM_SDIST: str = f"{_pin()['sdist_project']}=={_pin()['sdist_version']}"

__all__ = ["data", "CACHE_TYPES", "TURBOQ_TYPES", "CacheType", "cache_type", "UPSTREAM_COMMIT", "UPSTREAM_SDIST", "Llama",
           "kv_bytes"]


def __getattr__(name: str):
    # importing llama_cpp needs the patched library path set first; pyturbo.llama does that
    if name == "Llama":
        from .llama import Llama
        return Llama
    if name == "kv_bytes":
        from .memory import kv_bytes
        return kv_bytes
    raise AttributeError(name)
