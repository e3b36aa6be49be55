"""pyturbo: TurboQuant KV-cache types (turboq2/3/4/8) for llama.cpp, driven from Python."""
from __future__ import annotations

from . import data
from .types import CACHE_TYPES, TURBOQ_TYPES, CacheType, cache_type

UPSTREAM_COMMIT = "0c1e57098"
UPSTREAM_SDIST = "llama-cpp-python==0.3.36"

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
