"""pyturbo: TurboQuant KV-cache types (turboq2/3/4/8) for llama.cpp, driven from Python."""
from __future__ import annotations

from .types import CACHE_TYPES, TURBOQ_TYPES, CacheType, cache_type

UPSTREAM_COMMIT = "0c1e57098"
UPSTREAM_SDIST = "llama-cpp-python==0.3.36"

__all__ = ["CACHE_TYPES", "TURBOQ_TYPES", "CacheType", "cache_type", "UPSTREAM_COMMIT", "UPSTREAM_SDIST"]
