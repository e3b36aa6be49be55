"""NumPy reference codec for the turboq types, bit for bit equal to ggml-turboq.c.

Every float operation is float32 and in the same order as the C code: the group sums are a
fixed halving tree, the Walsh-Hadamard butterflies run h = 1, 2, ..., 64, and nothing is fused
(the C file is built with -ffp-contract=off).

Block layouts (little endian, one block per 128 values):
  turboq2 (34 B): f16 norm | qs[32]: byte i holds the 2-bit indices of values i, i+32, i+64, i+96
  turboq3 (50 B): f16 norm | qs[32]: low 2 bits as turboq2 | qh[16]: byte i bit k = high bit of value i+16k
  turboq4 (68 B): f16 norm | f16 rnorm (reserved, always 0) | qs[64]: byte i = value i (low nibble), i+64 (high)
  turboq8 (130 B): f16 scale | qs[128]: one grid index per value
Decoding a block: y_i = norm * centroid[idx_i]; x = D1 . H . D2 . y / sqrt(128).
The twins are the same on smaller groups, with the first g signs of each table, scale 1/sqrt(g),
their own codebooks (turboq8's grid for turboq8_gN) and no reserved field in turboq4_gN:
  _g64 (64 values): read 64 for 128, 16 for 32 and so on (18, 26, 34, 66 B)
  _g32 (32 values): read 32 for 128, 8 for 32 and so on (10, 14, 18, 34 B): turboq2_g32's qs[8]
    byte i holds values i, i+8, i+16, i+24; turboq3_g32's qh[4] byte i bit k the high bit of value
    i+4k; turboq4_g32's qs[16] byte i values i (low nibble) and i+16 (high)
  _g16 (16 values): read 16 for 128 (6, 8, 10, 18 B): turboq2_g16's qs[4] byte i holds values i,
    i+4, i+8, i+12; turboq3_g16's qh[2] byte i bit k the high bit of value i+2k; turboq4_g16's
    qs[8] byte i values i (low nibble) and i+8 (high)
  turboq3t (50 B), turboq2t (34 B): f16 norm | the 3- (2-) bit codes c_0..c_127, most significant bit
    first; the "index" of value t is the state s_t = (s_(t-1) << bits | c_t) mod 64 (s_-1 = 0), chosen by
    pyturbo.format.trellis.viterbi (the same float32 operations as ggml-turboq-trellis.h), and decodes
    through the type's 64-entry trellis codebook.
  turboq3t_g64 (26 B), turboq2t_g64 (18 B): the same for 64 values, through the 128-value type's
    codebook, the search run on the rotated coordinates times TRELLIS_G64_FIT.
"""
from __future__ import annotations

import numpy as np

from . import trellis
from .codebook import D, TRELLIS_BITS, TRELLIS_G64_FIT, TRELLIS_L, codebooks, rotation_signs, thresholds, trellis_codebooks
from ..types import cache_type, turboq_base


def _group(type_name: str) -> int:
    return cache_type(type_name).block_size


def _signs(g: int) -> tuple[np.ndarray, np.ndarray]:
    s1, s2 = rotation_signs()
    return s1[:g], s2[:g]


def _base(type_name: str) -> str:
    """turboq2/3/4/8 for a type and its twins (their layouts differ only in size)."""
    return turboq_base(type_name)


FP16_MAX = np.float32(65504.0)
_f32 = np.float32


def tree_sum(v: np.ndarray) -> np.ndarray:
    """Sum over the last axis (length 128, 64, 32 or 16) by repeated halving, as the C code does."""
    while v.shape[-1] > 1:
        h = v.shape[-1] // 2
        v = v[..., :h] + v[..., h:]
    return v[..., 0]


def fwht(v: np.ndarray) -> np.ndarray:
    """Unnormalised Walsh-Hadamard transform over the last axis (length 128, 64, 32 or 16)."""
    lead, g = v.shape[:-1], v.shape[-1]
    h = 1
    while h < g:
        x = v.reshape(*lead, g // (2 * h), 2, h)
        a, b = x[..., 0, :], x[..., 1, :]
        v = np.stack((a + b, a - b), axis=-2).reshape(*lead, g)
        h *= 2
    return v


def rotate(v: np.ndarray) -> np.ndarray:
    """Each group over the last axis (128, 64, 32 or 16 values) rotated."""
    s1, s2 = _signs(v.shape[-1])
    return (fwht(v * s1) * np.float32(1.0 / np.sqrt(v.shape[-1]))) * s2


def unrotate(y: np.ndarray) -> np.ndarray:
    s1, s2 = _signs(y.shape[-1])
    return (fwht(y * s2) * np.float32(1.0 / np.sqrt(y.shape[-1]))) * s1


def levels(type_name: str) -> np.ndarray:
    """The values an index (a state, for the trellis types) decodes to."""
    return trellis_codebooks()[_base(type_name)] if type_name in TRELLIS_BITS else codebooks()[type_name]


def _indices(type_name: str, y: np.ndarray) -> np.ndarray:
    if type_name in TRELLIS_BITS:
        fit = y if y.shape[-1] == D else y * TRELLIS_G64_FIT
        return trellis.viterbi(fit, levels(type_name), TRELLIS_BITS[type_name]).astype(np.uint8)
    if _base(type_name) == "turboq8":
        a = np.max(np.abs(y), axis=-1, keepdims=True)
        t = _f32(127.5) / a
        q = np.floor(y * t + _f32(128.0))
        return np.clip(q, 0, 255).astype(np.uint8)
    return np.searchsorted(thresholds()[type_name], y.ravel(), side="left").reshape(y.shape).astype(np.uint8)


def encode_groups(type_name: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(norm as float16 [n], indices uint8 [n,g]) for groups x [n,g] of float32 (g: the type's group)."""
    g = _group(type_name)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, g)
    n = x.shape[0]
    finite = np.all(np.isfinite(x), axis=-1)
    amax = np.max(np.abs(np.where(finite[:, None], x, _f32(0))), axis=-1)
    ok = finite & (amax > 0)
    norms = np.zeros(n, dtype=np.float16)
    idx = np.zeros((n, g), dtype=np.uint8)
    if not np.any(ok):
        return norms, idx
    xs, am = x[ok], amax[ok][:, None]
    with np.errstate(all="ignore"):
        u = xs / am
        r = np.sqrt(tree_sum(u * u))[:, None]
        v = u / r
        y = rotate(v)
        q = _indices(type_name, y)
        c = levels(type_name)[q]
        cn = np.sqrt(tree_sum(c * c))[:, None]
        corrected = (am * r) / cn
    norms[ok] = np.minimum(corrected[:, 0], FP16_MAX).astype(np.float16)
    idx[ok] = q
    return norms, idx


def pack(type_name: str, norms: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Blocks as a uint8 array [n, block_bytes]."""
    n, g = idx.shape
    base = _base(type_name)
    head = norms.astype("<f2").view(np.uint8).reshape(n, 2)
    if type_name in TRELLIS_BITS:
        k = TRELLIS_BITS[type_name]
        bits = np.zeros((n, g * k), dtype=np.uint8)
        for b in range(k):
            bits[:, b::k] = (idx >> (k - 1 - b)) & 1
        parts = [head, np.packbits(bits, axis=1)]
    elif base in ("turboq2", "turboq3"):
        lo = idx & 3
        q = g // 4
        qs = (lo[:, 0:q] | (lo[:, q:2 * q] << 2) | (lo[:, 2 * q:3 * q] << 4) | (lo[:, 3 * q:] << 6)).astype(np.uint8)
        parts = [head, qs]
        if base == "turboq3":
            hi = (idx >> 2) & 1
            e = g // 8
            qh = np.zeros((n, e), dtype=np.uint8)
            for k in range(8):
                qh |= (hi[:, e * k:e * (k + 1)] << k).astype(np.uint8)
            parts.append(qh)
    elif base == "turboq4":
        qs = (idx[:, :g // 2] | (idx[:, g // 2:] << 4)).astype(np.uint8)
        parts = [head, np.zeros((n, 2), dtype=np.uint8), qs] if g == D else [head, qs]
    else:
        parts = [head, idx]
    return np.concatenate(parts, axis=1)


def unpack(type_name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    g, base = _group(type_name), _base(type_name)
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, cache_type(type_name).block_bytes)
    norms = b[:, 0:2].copy().view("<f2")[:, 0]
    if type_name in TRELLIS_BITS:
        k = TRELLIS_BITS[type_name]
        bits = np.unpackbits(b[:, 2:], axis=1).reshape(len(b), g, k)
        codes = sum(bits[:, :, j].astype(np.int64) << (k - 1 - j) for j in range(k))
        idx = np.zeros_like(codes)
        for j in range(-(-TRELLIS_L // k)):  # s_t holds c_t, c_(t-1), ... up to TRELLIS_L bits
            idx[:, j:] |= codes[:, :g - j] << (j * k)
        idx &= (1 << TRELLIS_L) - 1
    elif base in ("turboq2", "turboq3"):
        qs = b[:, 2:2 + g // 4]
        idx = np.concatenate([(qs >> s) & 3 for s in (0, 2, 4, 6)], axis=1)
        if base == "turboq3":
            qh = b[:, 2 + g // 4:2 + g // 4 + g // 8]
            hi = np.concatenate([(qh >> k) & 1 for k in range(8)], axis=1)
            idx = idx | (hi << 2)
    elif base == "turboq4":
        qs = b[:, 4:68] if g == D else b[:, 2:2 + g // 2]
        idx = np.concatenate([qs & 15, qs >> 4], axis=1)
    else:
        idx = b[:, 2:2 + g]
    return norms, idx.astype(np.uint8)


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """Quantize float values (length a multiple of the type's group) into a flat uint8 block array."""
    type_name = cache_type(type_name).name
    norms, idx = encode_groups(type_name, x)
    return pack(type_name, norms, idx).reshape(-1)


def dequantize(blocks: np.ndarray, type_name: str) -> np.ndarray:
    """Decode a flat uint8 block array into float32 values in the original domain."""
    type_name = cache_type(type_name).name
    norms, idx = unpack(type_name, blocks)
    g = _group(type_name)
    y = levels(type_name)[idx]
    k = norms.astype(np.float32)[:, None] * np.float32(1.0 / np.sqrt(g))
    s1, s2 = _signs(g)
    return ((fwht(y * s2) * k) * s1).reshape(-1)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, mask: np.ndarray,
              softcap: float = 0.0) -> np.ndarray:
    """Flash attention's result in float64, as ggml defines it: q [n_head, n_q, d], k/v
    [n_head_kv, n_kv, d] (query heads grouped over KV heads), an additive mask [n_q, n_kv] or
    [n_head, n_q, n_kv], optional tanh soft-capping; a fully masked row gives zeros."""
    rep = q.shape[0] // k.shape[0]
    k = np.repeat(k.astype(np.float64), rep, axis=0)
    v = np.repeat(v.astype(np.float64), rep, axis=0)
    s = np.einsum("hqd,hkd->hqk", q.astype(np.float64), k) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    s = s + mask.astype(np.float64)
    m = s.max(axis=-1, keepdims=True)
    m[~np.isfinite(m)] = 0.0
    p = np.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    den[den == 0] = 1.0
    return np.einsum("hqk,hkd->hqd", p / den, v)
