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
TURBOQ_G32 = 32  # values per group of the _g32 twins
TURBOQ_G16 = 16  # values per group of the _g16 twins
# The twins' groups, largest first: a layer takes the largest that divides its head size.
TWIN_GROUPS = (TURBOQ_G64, TURBOQ_G32, TURBOQ_G16)
# The turboq codecs on 64-, 32- and 16-value groups: llama.cpp stores a requested turboq type as
# its _g64 twin on each layer whose head size is a multiple of 64 but not of 128, as its _g32 twin
# where it is a multiple of 32 but not of 64, as its _g16 twin where it is a multiple of 16 but
# not of 32 (head size 80: Phi-2) (llama_turboq_type_for_head; CPU and Vulkan). Not names for
# -ctk/-ctv; the codec, the reference and kv_bytes take them.
TWIN_TYPES: dict[str, CacheType] = {t.name: t for t in (
    CacheType("turboq2_g64", 64, TURBOQ_G64, 18),
    CacheType("turboq3_g64", 65, TURBOQ_G64, 26),
    CacheType("turboq4_g64", 66, TURBOQ_G64, 34),
    CacheType("turboq8_g64", 67, TURBOQ_G64, 66),
    CacheType("turboq2_g32", 68, TURBOQ_G32, 10),
    CacheType("turboq3_g32", 69, TURBOQ_G32, 14),
    CacheType("turboq4_g32", 70, TURBOQ_G32, 18),
    CacheType("turboq8_g32", 71, TURBOQ_G32, 34),
    CacheType("turboq2_g16", 72, TURBOQ_G16, 6),
    CacheType("turboq3_g16", 73, TURBOQ_G16, 8),
    CacheType("turboq4_g16", 74, TURBOQ_G16, 10),
    CacheType("turboq8_g16", 75, TURBOQ_G16, 18),
)}
TURBOQ_TWIN_TYPES = tuple(TWIN_TYPES)
G64_TYPES: dict[str, CacheType] = {n: t for n, t in TWIN_TYPES.items() if t.block_size == TURBOQ_G64}
G32_TYPES: dict[str, CacheType] = {n: t for n, t in TWIN_TYPES.items() if t.block_size == TURBOQ_G32}
G16_TYPES: dict[str, CacheType] = {n: t for n, t in TWIN_TYPES.items() if t.block_size == TURBOQ_G16}
TURBOQ_G64_TYPES = tuple(G64_TYPES)
TURBOQ_G32_TYPES = tuple(G32_TYPES)
TURBOQ_G16_TYPES = tuple(G16_TYPES)


# The trellis-coded types (issue 21): turboq3's and turboq2's bits and block sizes, values read through a
# 64-state trellis, for heads that are a multiple of 128 (of 64: TRELLIS_TWIN_TYPES). ggml's CPU and Vulkan
# backends compute them; CUDA's kernels have not run on a GPU, so CUDA takes them only when built with
# -DGGML_CUDA_TURBOQ_TWINS=ON.
TRELLIS_TYPES: dict[str, CacheType] = {t.name: t for t in (
    CacheType("turboq3t", 76, TURBOQ_GROUP, 50),
    CacheType("turboq2t", 77, TURBOQ_GROUP, 34),
)}
# The trellis types on 64-value groups (the _g64 twins' blocks, the 128-value types' codebooks):
# llama.cpp stores a requested trellis type so on each layer whose head size is a multiple of 64 but
# not of 128 (SmolLM2, Llama 3.2 1B); the CPU and Vulkan backends compute them, CUDA declines them. Not
# names for -ctk/-ctv.
TRELLIS_TWIN_TYPES: dict[str, CacheType] = {t.name: t for t in (
    CacheType("turboq3t_g64", 78, TURBOQ_G64, 26),
    CacheType("turboq2t_g64", 79, TURBOQ_G64, 18),
)}


# the names a user asks for (-ctk/-ctv, cache_type_k=), and every type a layer may store (the twins too)
REQUESTABLE_TYPES: dict[str, CacheType] = {**CACHE_TYPES, **TRELLIS_TYPES}
STORED_TYPES: dict[str, CacheType] = {**CACHE_TYPES, **TWIN_TYPES, **TRELLIS_TYPES, **TRELLIS_TWIN_TYPES}
# the forms that llama.cpp stores for a requested type on a smaller head (the twins, the trellis _g64 forms)
SMALL_GROUP_TYPES: dict[str, CacheType] = {**TWIN_TYPES, **TRELLIS_TWIN_TYPES}
# every turboq block format (the codec, the reference and the kernels cover each)
TURBOQ_STORED_TYPES = tuple(n for n, t in STORED_TYPES.items() if t.is_turboq)


def type_by_id(ggml_id: int) -> CacheType:
    return next(t for t in STORED_TYPES.values() if t.ggml_id == ggml_id)


def trellis_scalar(name: str | CacheType) -> str:
    """The scalar turboq type that stores a trellis type's bits in its block size (turboq3t: turboq3),
    which a refusal of the trellis type names (libllama's llama_turboq_trellis_scalar_type)."""
    import ctypes as C
    from ._paths import llama_function
    t = cache_type(name)
    scalar = llama_function("llama_turboq_trellis_scalar_type", C.c_int32, C.c_int32)(t.ggml_id)
    if scalar < 0:
        raise ValueError(f"{t.name!r} is not a trellis type")
    return type_by_id(scalar).name


def turboq_base(name: str | CacheType) -> str:
    """The requested type whose form a stored type is: turboq2/3/4/8 for a turboq type or one of its
    twins (their layouts differ only in size), turboq3t/turboq2t for a trellis type or its _g64 form;
    any other type's own name."""
    t = cache_type(name)
    return t.name.rsplit(f"_g{t.block_size}", 1)[0] if t.name in SMALL_GROUP_TYPES else t.name


def layer_cache_type(name: str | CacheType, head_dim: int) -> CacheType:
    """The type a layer of this head size stores for a requested cache type, by libllama's rule
    (llama_turboq_stored_type): a turboq type stays where the head size is a multiple of 128, else
    takes the twin of the largest group in TWIN_GROUPS that divides it (none: the type itself, which
    llama.cpp refuses there), a trellis type its _g64 form where that group is 64; TURBOQ_GROUP,
    libllama's debug switch, is followed too."""
    import ctypes as C
    from ._paths import llama_function
    t = cache_type(name)
    if not t.is_turboq:
        return t
    return type_by_id(llama_function("llama_turboq_stored_type", C.c_int32, C.c_int32, C.c_uint32)(t.ggml_id, head_dim))


def requested_cache_type(name: str | CacheType) -> CacheType:
    """A cache type as a user asks for one (-ctk/-ctv, cache_type_k=): the names llama.cpp's tools take.
    A twin (_g64, _g32, _g16) is refused, saying which name to ask for: llama.cpp picks the twin per layer,
    and given one directly it would skip the per-layer rule (and the flash-attention check)."""
    t = cache_type(name)
    if t.name in SMALL_GROUP_TYPES:
        base, g = turboq_base(t), t.block_size
        raise ValueError(f"KV cache type {t.name!r} is the {g}-value form that llama.cpp stores for {base} on layers "
                         f"whose head size is a multiple of {g} but not of {2 * g}; ask for {base!r}")
    return t


def cache_type(name: str | CacheType) -> CacheType:
    """Look a cache type up by name, case-insensitively, the twins (_g64, _g32, _g16) and the trellis types
    (and their _g64 forms) included (the codec, the reference, memory sizes); ValueError lists the valid names. User settings go
    through requested_cache_type."""
    if isinstance(name, CacheType):
        return name
    key = str(name).strip().lower()
    try:
        return STORED_TYPES[key]
    except KeyError:
        valid = ", ".join(REQUESTABLE_TYPES)
        raise ValueError(f"unknown KV cache type {name!r}; valid types: {valid}") from None
