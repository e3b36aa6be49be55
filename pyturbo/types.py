"""KV-cache type names, ggml ids and block geometry.

Mirrors `enum ggml_type` of the patched ggml for every type that llama.cpp accepts as a
KV-cache type. Names are the strings that llama.cpp's `-ctk/-ctv` take.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheType:
    name: str
    ggml_id: int
    block_size: int  # values per block
    block_bytes: int  # bytes per block

    @property
    def bpw(self) -> float:
        return 8.0 * self.block_bytes / self.block_size

    @property
    def is_turboq(self) -> bool:
        return self.name.startswith("turboq")


TURBOQ_GROUP = 128  # values per rotation group and per turboq block

CACHE_TYPES: dict[str, CacheType] = {t.name: t for t in (
    CacheType("f32", 0, 1, 4),
    CacheType("f16", 1, 1, 2),
    CacheType("q4_0", 2, 32, 18),
    CacheType("q4_1", 3, 32, 20),
    CacheType("q5_0", 6, 32, 22),
    CacheType("q5_1", 7, 32, 24),
    CacheType("q8_0", 8, 32, 34),
    CacheType("iq4_nl", 20, 32, 18),
    CacheType("bf16", 30, 1, 2),
    CacheType("turboq2", 60, TURBOQ_GROUP, 34),
    CacheType("turboq3", 61, TURBOQ_GROUP, 50),
    CacheType("turboq4", 62, TURBOQ_GROUP, 68),
    CacheType("turboq8", 63, TURBOQ_GROUP, 130),
)}

TURBOQ_TYPES = tuple(n for n, t in CACHE_TYPES.items() if t.is_turboq)

TURBOQ_G64 = 64  # values per group of the _g64 twins
# The turboq codecs on 64-value groups: llama.cpp stores a requested turboq type as its _g64 twin on
# each layer whose head size is a multiple of 64 but not of 128 (llama_turboq_type_for_head; CPU
# only). Not names for -ctk/-ctv; the codec, the reference and kv_bytes take them.
G64_TYPES: dict[str, CacheType] = {t.name: t for t in (
    CacheType("turboq2_g64", 64, TURBOQ_G64, 18),
    CacheType("turboq3_g64", 65, TURBOQ_G64, 26),
    CacheType("turboq4_g64", 66, TURBOQ_G64, 34),
    CacheType("turboq8_g64", 67, TURBOQ_G64, 66),
)}
TURBOQ_G64_TYPES = tuple(G64_TYPES)


def layer_cache_type(name: str | CacheType, head_dim: int) -> CacheType:
    """The type a layer of this head size stores for a requested cache type (llama.cpp's rule)."""
    t = cache_type(name)
    if t.is_turboq and t.block_size == TURBOQ_GROUP and head_dim % TURBOQ_GROUP and head_dim % TURBOQ_G64 == 0:
        return G64_TYPES[f"{t.name}_g64"]
    return t


def requested_cache_type(name: str | CacheType) -> CacheType:
    """A cache type as a user asks for one (-ctk/-ctv, cache_type_k=): the names llama.cpp's tools take.
    A _g64 twin is refused, saying which name to ask for: llama.cpp picks the twin per layer, and
    given one directly it would skip the per-layer rule (and the flash-attention check)."""
    t = cache_type(name)
    if t.name in G64_TYPES:
        base = t.name.removesuffix("_g64")
        raise ValueError(f"KV cache type {t.name!r} is the 64-value form that llama.cpp stores for {base} on layers "
                         f"whose head size is a multiple of 64 but not of 128; ask for {base!r}")
    return t


def cache_type(name: str | CacheType) -> CacheType:
    """Look a cache type up by name, case-insensitively, the _g64 twins included (the codec, the
    reference, memory sizes); ValueError lists the valid names. User settings go through
    requested_cache_type."""
    if isinstance(name, CacheType):
        return name
    key = str(name).strip().lower()
    try:
        return CACHE_TYPES[key] if key in CACHE_TYPES else G64_TYPES[key]
    except KeyError:
        valid = ", ".join(CACHE_TYPES)
        raise ValueError(f"unknown KV cache type {name!r}; valid types: {valid}") from None
