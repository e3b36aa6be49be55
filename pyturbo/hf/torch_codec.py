"""The KV-cache codecs in torch: turboq2/3/4/8, their twins (_g64, _g32, _g16: 64-, 32- and 16-value groups) and
the trellis types (turboq3t, turboq2t) bit for bit equal to pyturbo.format.reference and the C codec, q8_0 equal to
ggml's reference quantizer, and the plain float types.

Rows are [..., n] float tensors; a row's bytes are [..., n // block_size * block_bytes] uint8, the
blocks of the row in order, exactly as one llama.cpp cache row holds them. Every float operation
of the turboq path is float32 and in the C order (pyturbo/format/reference.py documents it): fixed
halving-tree sums, Walsh-Hadamard butterflies h = 1..g/2, no fused multiply-add (torch's eager
elementwise ops on the CPU never fuse). A trellis group's path search and its code stream are the
NumPy reference's own (pyturbo.format.trellis.viterbi, reference.pack/unpack): a step of the search
is one operation on every group at once, which NumPy does faster than torch for a cache row's few
groups, and one copy of the search is what the C encoders are checked against.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import lru_cache

import torch

from ..format import reference, trellis
from ..format.codebook import D, SIGN_SEED, TRELLIS_BITS, TRELLIS_G64_FIT, codebooks, thresholds, trellis_codebooks
from ..format.signs import sign_lists
from ..types import TURBOQ_STORED_TYPES, CacheType, cache_type, turboq_base

FLOAT_TYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
SUPPORTED = ("f32", "f16", "bf16", "q8_0", *TURBOQ_STORED_TYPES)
QK8_0 = 32
FP16_MAX = 65504.0


def _inv_sqrt(g: int) -> float:
    """1/sqrt(g) as the C tables round it (float32)."""
    return float(torch.tensor(1.0 / g ** 0.5, dtype=torch.float32))


def _group(name: str) -> int:
    return cache_type(name).block_size


def _base(name: str) -> str:
    """turboq2/3/4/8 for a type and its twins (their layouts differ only in size)."""
    return turboq_base(name)


def check_type(name: str | CacheType) -> CacheType:
    """The cache type by name; ValueError for a name llama.cpp does not know or this codec does not do."""
    t = cache_type(name)
    if t.name not in SUPPORTED:
        raise ValueError(f"KV cache type {t.name!r} is not supported by pyturbo.hf; supported: {', '.join(SUPPORTED)}")
    return t


def row_bytes(name: str | CacheType, n: int) -> int:
    """Bytes of one row of n values; ValueError when n is not a whole number of blocks."""
    t = check_type(name)
    if n % t.block_size:
        raise ValueError(f"{t.name} stores rows of a multiple of {t.block_size} values, got {n}")
    return n // t.block_size * t.block_bytes


_sign_seed = SIGN_SEED


@contextlib.contextmanager
def rotation_seed(seed: int) -> Iterator[None]:
    """Encode and decode with the signs of another seed (pyturbo.format.signs' rule), for measuring
    how much a result moves with the rotation draw; they match a C build configured with
    -DPYTURBO_SIGN_SEED=<seed>, not the shipped one."""
    global _sign_seed
    old, _sign_seed = _sign_seed, seed
    try:
        yield
    finally:
        _sign_seed = old


def _tables(name: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    return _tables_for(name, _sign_seed)


@lru_cache(maxsize=None)
def _signs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    s1, s2 = sign_lists(seed)
    return torch.tensor(s1, dtype=torch.float32), torch.tensor(s2, dtype=torch.float32)


@lru_cache(maxsize=None)
def _tables_for(name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    s1, s2 = _signs(seed)
    thr = thresholds().get(name)
    # a trellis type's by state (a _g64 form's: its 128-value type's)
    levels = trellis_codebooks()[turboq_base(name)] if name in TRELLIS_BITS else codebooks()[name]
    return (torch.from_numpy(levels.copy()), None if thr is None else torch.from_numpy(thr.copy()), s1, s2)


def tree_sum(v: torch.Tensor) -> torch.Tensor:
    while v.shape[-1] > 1:
        h = v.shape[-1] // 2
        v = v[..., :h] + v[..., h:]
    return v[..., 0]


def fwht(v: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform over the last axis (128, 64, 32 or 16), butterflies h = 1, 2, ..."""
    lead, g = v.shape[:-1], v.shape[-1]
    h = 1
    while h < g:
        x = v.reshape(*lead, g // (2 * h), 2, h)
        a, b = x[..., 0, :], x[..., 1, :]
        v = torch.stack((a + b, a - b), dim=-2).reshape(*lead, g)
        h *= 2
    return v


def turboq_encode_groups(name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp16 norms [n], uint8 indices [n, g]) of float32 groups [n, g], g the type's group."""
    cb, thr, s1, s2 = _tables(name)
    g = _group(name)
    s1, s2 = s1[:g], s2[:g]
    x = x.to(torch.float32).reshape(-1, g)
    n = x.shape[0]
    finite = torch.isfinite(x).all(dim=-1)
    amax = torch.where(finite[:, None], x, torch.zeros((), dtype=torch.float32)).abs().amax(dim=-1)
    ok = finite & (amax > 0)
    norms = torch.zeros(n, dtype=torch.float16)
    idx = torch.zeros((n, g), dtype=torch.uint8)
    if not bool(ok.any()):
        return norms, idx
    all_ok = bool(ok.all())
    xs, am = (x, amax[:, None]) if all_ok else (x[ok], amax[ok][:, None])
    u = xs / am
    r = torch.sqrt(tree_sum(u * u))[:, None]
    v = u / r
    y = (fwht(v * s1) * _inv_sqrt(g)) * s2
    if name in TRELLIS_BITS:
        fit = y if g == D else y * float(TRELLIS_G64_FIT)  # the _g64 forms: the codebook's scale
        q = torch.from_numpy(trellis.viterbi(fit.numpy(), cb.numpy(), TRELLIS_BITS[name]))
    elif _base(name) == "turboq8":
        a = y.abs().amax(dim=-1, keepdim=True)
        # a true division: `127.5 / a` would be torch's reciprocal-then-multiply, one rounding more than C
        t = torch.div(torch.full_like(a, 127.5), a)
        q = torch.floor(y * t + 128.0).clamp_(0, 255).to(torch.int64)
    else:
        q = torch.searchsorted(thr, y.contiguous(), right=False)
    c = cb[q]
    cn = torch.sqrt(tree_sum(c * c))[:, None]
    corrected = torch.clamp_max((am * r) / cn, FP16_MAX)[:, 0].to(torch.float16)
    if all_ok:
        return corrected, q.to(torch.uint8)
    norms[ok] = corrected
    idx[ok] = q.to(torch.uint8)
    return norms, idx


def _offsets(name: str) -> tuple[int, int]:
    """(first byte of qs, first byte of qh) of a block: turboq4 (128 values) has a reserved field."""
    g = _group(name)
    qs = 4 if name == "turboq4" else 2
    return qs, qs + g // 4


def turboq_pack(name: str, norms: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    if name in TRELLIS_BITS:
        return torch.from_numpy(reference.pack(name, norms.numpy(), idx.numpy()))
    n, g = idx.shape
    base = _base(name)
    head = norms.to(torch.float16).contiguous().view(torch.uint8).reshape(n, 2)
    if base in ("turboq2", "turboq3"):
        lo = idx & 3
        q = g // 4
        qs = lo[:, 0:q] | (lo[:, q:2 * q] << 2) | (lo[:, 2 * q:3 * q] << 4) | (lo[:, 3 * q:] << 6)
        parts = [head, qs]
        if base == "turboq3":
            hi = ((idx >> 2) & 1).reshape(n, 8, g // 8)
            qh = torch.zeros((n, g // 8), dtype=torch.uint8)
            for k in range(8):
                qh |= hi[:, k] << k
            parts.append(qh)
    elif base == "turboq4":
        qs = idx[:, :g // 2] | (idx[:, g // 2:] << 4)
        parts = [head, torch.zeros((n, 2), dtype=torch.uint8), qs] if name == "turboq4" else [head, qs]
    else:
        parts = [head, idx]
    return torch.cat(parts, dim=1)


def turboq_unpack(name: str, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, base = _group(name), _base(name)
    o_qs, o_qh = _offsets(name)
    b = blocks.reshape(-1, cache_type(name).block_bytes)
    if name in TRELLIS_BITS:  # the states, from the code stream
        norms, states = reference.unpack(name, b.numpy())
        return torch.from_numpy(norms.copy()), torch.from_numpy(states)
    norms = b[:, 0:2].contiguous().view(torch.float16)[:, 0]
    if base in ("turboq2", "turboq3"):
        qs = b[:, o_qs:o_qh]
        idx = torch.cat([(qs >> s) & 3 for s in (0, 2, 4, 6)], dim=1)
        if base == "turboq3":
            qh = b[:, o_qh:o_qh + g // 8]
            idx = idx | (torch.cat([(qh >> k) & 1 for k in range(8)], dim=1) << 2)
    elif base == "turboq4":
        qs = b[:, o_qs:o_qs + g // 2]
        idx = torch.cat([qs & 15, qs >> 4], dim=1)
    else:
        idx = b[:, 2:2 + g]
    return norms, idx


def _inverse_rotation(g: int = D) -> torch.Tensor:
    return _inverse_rotation_for(_sign_seed, g)


@lru_cache(maxsize=None)
def _inverse_rotation_for(seed: int, g: int = D) -> torch.Tensor:
    """The decoding rotation as a matrix: x = y @ M, M = D2 . H . D1 / sqrt(g) (g = 128, 64, 32 or 16)."""
    s1, s2 = _signs(seed)
    s1, s2 = s1[:g], s2[:g]
    h = fwht(torch.eye(g, dtype=torch.float32))
    return (s2[:, None] * h * s1[None, :]) * _inv_sqrt(g)


# The fast read looks up whole bytes, not indices: a byte of turboq2's qs holds the indices of
# values i, i+32, i+64, i+96, so a [256, 4] table gives its four centroids at once (turboq4: a
# [256, 2] table for values i, i+64; turboq3: a [4096, 4] table indexed by the qs byte and the
# four high bits of the same four values, gathered from qh). The lookups then come out in "byte
# order" (value i + stride*k at position per_byte*i + k), which the rows of the decoding matrix
# are permuted to match, so no copy reorders them.
_PER_BYTE = {"turboq2": 4, "turboq3": 4, "turboq4": 2}  # values per byte; the stride is group / that


@lru_cache(maxsize=None)
def _byte_tables_for(name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lookup table [n_keys, per_byte], decoding matrix with rows in byte order)."""
    cb = _tables_for(name, seed)[0]
    g, base = _group(name), _base(name)
    per_byte = _PER_BYTE[base]
    stride = g // per_byte
    b = torch.arange(256)
    if base == "turboq4":
        table = cb[torch.stack([b & 15, b >> 4], dim=1)]
    else:
        lo = torch.stack([(b >> (2 * k)) & 3 for k in range(4)], dim=1)  # [256, 4]
        if base == "turboq2":
            table = cb[lo]
        else:
            h = torch.arange(16)
            hi = torch.stack([(h >> k) & 1 for k in range(4)], dim=1)  # [16, 4]
            table = cb[(lo[:, None, :] | (hi[None, :, :] << 2)).reshape(4096, 4)]
    order = torch.tensor([i + stride * k for i in range(stride) for k in range(per_byte)])
    return table.contiguous(), _inverse_rotation_for(seed, g)[order].contiguous()


def _turboq3_keys(b: torch.Tensor, g: int) -> torch.Tensor:
    """[n, g/4] keys qs[i] * 16 + the high bits of values i + (g/4)k, k = 0..3 (bit k of the key's
    low nibble, stored at qh[i % (g/8)] bit i // (g/8) + 2k)."""
    qh = b[:, 2 + g // 4:2 + g // 4 + g // 8]
    even = (qh & 1) | ((qh >> 1) & 2) | ((qh >> 2) & 4) | ((qh >> 3) & 8)       # bits 0, 2, 4, 6
    odd = ((qh >> 1) & 1) | ((qh >> 2) & 2) | ((qh >> 3) & 4) | ((qh >> 4) & 8)  # bits 1, 3, 5, 7
    return b[:, 2:2 + g // 4].to(torch.int32) * 16 + torch.cat([even, odd], dim=1)


def _decode_fast(name: str, b: torch.Tensor) -> torch.Tensor:
    g, base = _group(name), _base(name)
    norms = b[:, 0:2].contiguous().view(torch.float16)[:, 0].to(torch.float32)[:, None]
    if base == "turboq8" or name in TRELLIS_BITS:
        # one level per index (a trellis type's per state, which spans two bytes of the stream)
        idx = b[:, 2:2 + g] if base == "turboq8" else turboq_unpack(name, b)[1]
        y = torch.nn.functional.embedding(idx.to(torch.int32), _tables(name)[0][:, None]).reshape(b.shape[0], g)
        return (y @ _inverse_rotation(g)) * norms
    table, m = _byte_tables_for(name, _sign_seed)
    o_qs = _offsets(name)[0]
    if base == "turboq2":
        keys = b[:, 2:2 + g // 4].to(torch.int32)
    elif base == "turboq3":
        keys = _turboq3_keys(b, g)
    else:
        keys = b[:, o_qs:o_qs + g // 2].to(torch.int32)
    y = torch.nn.functional.embedding(keys, table).reshape(b.shape[0], g)
    return (y @ m) * norms


def turboq_decode_blocks(name: str, blocks: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """float32 groups [n, g] in the original domain (g: 128, or 64/32/16 for the _g64/_g32/_g16 types).

    exact: the C's butterflies, bit for bit. Otherwise byte lookups and one [n,g] x [g,g]
    matmul, about 15x faster on the CPU and within a few float32 ulps (another summation order),
    which is what a cache read needs.
    """
    if not exact:
        return _decode_fast(name, blocks.reshape(-1, cache_type(name).block_bytes))
    cb, _, s1, s2 = _tables(name)
    g = _group(name)
    norms, idx = turboq_unpack(name, blocks)
    y = cb[idx.to(torch.int64)]
    k = norms.to(torch.float32)[:, None] * _inv_sqrt(g)
    return (fwht(y * s2[:g]) * k) * s1[:g]


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (ties away from zero); torch.round rounds ties to even."""
    r = torch.trunc(v)
    return r + torch.where((v - r).abs() >= 0.5, torch.sign(v), torch.zeros((), dtype=v.dtype))


def q8_0_encode(x: torch.Tensor) -> torch.Tensor:
    """ggml's quantize_row_q8_0_ref: blocks of 32, fp16 d = amax/127, qs = roundf(x/d) as int8."""
    g = x.to(torch.float32).reshape(-1, QK8_0)
    d = g.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, torch.div(torch.ones_like(d), d), torch.zeros((), dtype=torch.float32))
    qs = _round_half_away(g * inv).to(torch.int8).view(torch.uint8)
    return torch.cat([d.to(torch.float16).view(torch.uint8).reshape(-1, 2), qs], dim=1)


def q8_0_decode(blocks: torch.Tensor) -> torch.Tensor:
    b = blocks.reshape(-1, 34)
    d = b[:, 0:2].contiguous().view(torch.float16).to(torch.float32)
    return b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * d


def encode(x: torch.Tensor, name: str | CacheType) -> torch.Tensor:
    """Rows [..., n] -> the bytes llama.cpp's cache holds for them, [..., row_bytes] uint8.

    The float types are kept as tensors of their own dtype ([..., n]), not bytes.
    """
    t = check_type(name)
    if t.name in FLOAT_TYPES:
        return x.to(FLOAT_TYPES[t.name])
    lead, n = x.shape[:-1], x.shape[-1]
    nb = row_bytes(t, n)
    flat = x.detach().to("cpu", torch.float32).reshape(-1, t.block_size)
    if t.name == "q8_0":
        out = q8_0_encode(flat)
    else:
        out = turboq_pack(t.name, *turboq_encode_groups(t.name, flat))
    return out.reshape(*lead, nb).to(x.device)


def decode(stored: torch.Tensor, name: str | CacheType, n: int, dtype: torch.dtype = torch.float32,
           exact: bool = True) -> torch.Tensor:
    """The inverse of encode: [..., row_bytes] uint8 (or a float tensor) -> [..., n] of dtype.
    exact=False: the fast turboq rotation (turboq_decode_blocks)."""
    t = check_type(name)
    if t.name in FLOAT_TYPES:
        return stored.to(dtype)
    lead = stored.shape[:-1]
    if stored.shape[-1] != row_bytes(t, n):
        raise ValueError(f"{t.name} rows of {n} values are {row_bytes(t, n)} bytes, got {stored.shape[-1]}")
    flat = stored.reshape(-1, t.block_bytes).cpu()
    out = q8_0_decode(flat) if t.name == "q8_0" else turboq_decode_blocks(t.name, flat, exact)
    return out.reshape(*lead, n).to(device=stored.device, dtype=dtype)
