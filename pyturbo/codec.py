"""The C codec: quantize and dequantize NumPy arrays with the patched ggml's own functions.

`pyturbo.format.reference` is its NumPy twin; tests hold the two equal bit for bit.
"""
from __future__ import annotations

import numpy as np

from .ggml import ggml, ptr
from .types import CacheType, cache_type

__all__ = ["quantize", "dequantize", "encode"]


def quantize(x: np.ndarray, type_name: str | CacheType) -> np.ndarray:
    """Quantize float values (length a multiple of the block size) into a flat uint8 array."""
    t = cache_type(type_name)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if x.size % t.block_size:
        raise ValueError(f"{t.name} needs a multiple of {t.block_size} values, got {x.size}")
    nblocks = x.size // t.block_size
    out = np.empty(nblocks * t.block_bytes, dtype=np.uint8)
    n_per_row = t.block_size
    g = ggml()
    written = g.base.ggml_quantize_chunk(t.ggml_id, ptr(x), ptr(out), 0, nblocks, n_per_row, None)
    assert written == out.size
    return out


def dequantize(blocks: np.ndarray, type_name: str | CacheType) -> np.ndarray:
    """Decode a flat uint8 block array into float32 values (original domain)."""
    t = cache_type(type_name)
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1)
    if b.size % t.block_bytes:
        raise ValueError(f"{t.name} blocks are {t.block_bytes} bytes, got {b.size} bytes")
    n = b.size // t.block_bytes * t.block_size
    out = np.empty(n, dtype=np.float32)
    ggml().to_float(t.ggml_id)(ptr(b), ptr(out), n)
    return out


def encode(x: np.ndarray, type_name: str | CacheType) -> np.ndarray:
    """The bytes a tensor of this type holds for x: f32/f16/bf16 conversions, else quantize."""
    t = cache_type(type_name)
    if t.name == "f32":
        return x.view(np.uint8)
    if t.name == "f16":
        return x.astype(np.float16).view(np.uint8)
    if t.name == "bf16":
        u = x.view(np.uint32)
        rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        return rounded.view(np.uint8)
    return quantize(x, t)
