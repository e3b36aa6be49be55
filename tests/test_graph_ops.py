"""The ggml ops the KV cache relies on, run as graphs on turboq tensors.

llama.cpp's K-shift (RoPE of cached K after a context shift) dequantizes with ggml_cast, applies
RoPE in f32 and writes back with ggml_cpy; get_rows reads cached rows. All of them must see the
original (unrotated) domain, i.e. agree with the reference codec.
"""
from __future__ import annotations

import ctypes as C

import numpy as np
import pytest

from pyturbo.format import reference
from pyturbo.ggml import InitParams
from pyturbo.types import TURBOQ_STORED_TYPES, TURBOQ_TYPES, cache_type
from helpers import special_groups

# the CPU backend's quantizer (its from_float, with this machine's SIMD steps for every group size)
# writes what the reference writes: every stored type, the _g64, _g32 and _g16 twins included
CPU_TYPES = TURBOQ_STORED_TYPES


def graph_run(lib, build):
    b = lib.base
    ctx = b.ggml_init(InitParams(64 << 20, None, False))
    try:
        out, fetch = build(b, ctx)
        g = b.ggml_new_graph(ctx)
        b.ggml_build_forward_expand(g, out)
        assert lib.cpu.ggml_graph_compute_with_ctx(ctx, g, 2) == 0
        return fetch()
    finally:
        b.ggml_free(ctx)


def fill(b, t, arr: np.ndarray) -> None:
    raw = np.ascontiguousarray(arr)
    assert raw.nbytes == b.ggml_nbytes(t)
    C.memmove(b.ggml_get_data(t), raw.ctypes.data, raw.nbytes)


def read(b, t, dtype, n) -> np.ndarray:
    out = np.empty(n, dtype=dtype)
    C.memmove(out.ctypes.data, b.ggml_get_data(t), out.nbytes)
    return out


@pytest.mark.parametrize("type_name", CPU_TYPES)
@pytest.mark.parametrize("src_type", ["f32", "f16"])
def test_cpy_into_turboq_is_the_codec(lib, rng, type_name, src_type):
    t = cache_type(type_name)
    x = rng.standard_normal((6, 256)).astype(np.float32)
    src = x.astype(np.float16) if src_type == "f16" else x

    def build(b, ctx):
        a = b.ggml_new_tensor_4d(ctx, cache_type(src_type).ggml_id, 256, 6, 1, 1)
        q = b.ggml_new_tensor_4d(ctx, t.ggml_id, 256, 6, 1, 1)
        fill(b, a, src)
        out = b.ggml_cpy(ctx, a, q)
        return out, lambda: read(b, out, np.uint8, 6 * 256 // t.block_size * t.block_bytes)

    got = graph_run(lib, build)
    np.testing.assert_array_equal(got, reference.quantize(src.astype(np.float32), type_name))


@pytest.mark.parametrize("type_name", CPU_TYPES)
def test_cpy_of_special_groups_is_the_codec(lib, rng, type_name):
    """The CPU backend's quantizer (its SIMD steps, and the trellis types' AVX2 Viterbi search) on
    the groups where it could part from the reference: zeros, NaN/Inf, huge, tiny and denormal
    values, constant and one-hot groups. (Equal path costs, where the search must keep the first
    minimum, are too rare here to test; tests/test_kvlab.py makes them common for the same loop in
    bench/trellis_viterbi.c with a coarse codebook.)"""
    t = cache_type(type_name)
    x = np.concatenate(list(special_groups(rng).values())).astype(np.float32)
    n = len(x)

    def build(b, ctx):
        a = b.ggml_new_tensor_4d(ctx, cache_type("f32").ggml_id, 128, n, 1, 1)
        q = b.ggml_new_tensor_4d(ctx, t.ggml_id, 128, n, 1, 1)
        fill(b, a, x)
        out = b.ggml_cpy(ctx, a, q)
        return out, lambda: read(b, out, np.uint8, n * 128 // t.block_size * t.block_bytes)

    np.testing.assert_array_equal(graph_run(lib, build), reference.quantize(x, type_name))


@pytest.mark.parametrize("type_name", CPU_TYPES)
def test_cast_and_get_rows_return_the_original_domain(lib, rng, type_name):
    t = cache_type(type_name)
    x = rng.standard_normal((8, 256)).astype(np.float32)
    blocks = reference.quantize(x, type_name)
    want = reference.dequantize(blocks, type_name).reshape(8, 256)
    rows = np.array([5, 0, 7, 5], dtype=np.int32)

    def build_cast(b, ctx):
        q = b.ggml_new_tensor_4d(ctx, t.ggml_id, 256, 8, 1, 1)
        fill(b, q, blocks)
        out = b.ggml_cast(ctx, q, 0)
        return out, lambda: read(b, out, np.float32, 8 * 256)

    def build_rows(b, ctx):
        q = b.ggml_new_tensor_4d(ctx, t.ggml_id, 256, 8, 1, 1)
        idx = b.ggml_new_tensor_4d(ctx, 26, 4, 1, 1, 1)  # GGML_TYPE_I32
        fill(b, q, blocks)
        fill(b, idx, rows)
        out = b.ggml_get_rows(ctx, q, idx)
        return out, lambda: read(b, out, np.float32, 4 * 256)

    np.testing.assert_array_equal(graph_run(lib, build_cast).reshape(8, 256), want)
    np.testing.assert_array_equal(graph_run(lib, build_rows).reshape(4, 256), want[rows])


@pytest.mark.parametrize("type_name", TURBOQ_TYPES)
def test_requantizing_a_decoded_cache_is_stable(type_name, rng):
    """K-shift reads, ropes and rewrites K. Rewriting unchanged values must not drift much."""
    x = rng.standard_normal((64, 128)).astype(np.float32)
    once = reference.dequantize(reference.quantize(x, type_name), type_name)
    twice = reference.dequantize(reference.quantize(once, type_name), type_name)
    e1 = np.mean((x.ravel() - once) ** 2)
    e2 = np.mean((once - twice) ** 2)
    assert e2 <= e1 * 1.2


@pytest.mark.parametrize("type_name", CPU_TYPES)
@pytest.mark.parametrize("src_type", ["f32", "f16"])
def test_set_rows_writes_the_codec_into_chosen_rows(lib, rng, type_name, src_type):
    """SET_ROWS is how llama.cpp writes the KV cache."""
    t = cache_type(type_name)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    src = x.astype(np.float16) if src_type == "f16" else x
    rows = np.array([4, 1, 6], dtype=np.int64)
    cache = np.zeros(8 * 256 // t.block_size * t.block_bytes, dtype=np.uint8)

    def build(b, ctx):
        dst = b.ggml_new_tensor_4d(ctx, t.ggml_id, 256, 8, 1, 1)
        s = b.ggml_new_tensor_4d(ctx, cache_type(src_type).ggml_id, 256, 3, 1, 1)
        idx = b.ggml_new_tensor_4d(ctx, 27, 3, 1, 1, 1)  # GGML_TYPE_I64
        fill(b, dst, cache)
        fill(b, s, src)
        fill(b, idx, rows)
        out = b.ggml_set_rows(ctx, dst, s, idx)
        return out, lambda: read(b, dst, np.uint8, cache.size)

    got = graph_run(lib, build).reshape(8, -1)
    want = reference.quantize(src.astype(np.float32), type_name).reshape(3, -1)
    np.testing.assert_array_equal(got[rows], want)
    untouched = [i for i in range(8) if i not in rows]
    assert not got[untouched].any()


@pytest.mark.parametrize("type_name", TURBOQ_TYPES)
def test_cast_to_f16(lib, rng, type_name):
    t = cache_type(type_name)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    blocks = reference.quantize(x, type_name)

    def build(b, ctx):
        q = b.ggml_new_tensor_4d(ctx, t.ggml_id, 256, 2, 1, 1)
        fill(b, q, blocks)
        out = b.ggml_cast(ctx, q, 1)  # GGML_TYPE_F16
        return out, lambda: read(b, out, np.float16, 2 * 256)

    np.testing.assert_array_equal(graph_run(lib, build), reference.dequantize(blocks, type_name).astype(np.float16))


@pytest.mark.parametrize("dim", [0, 1, 2, 3])
@pytest.mark.parametrize("layout", ["rows", "permuted"])
def test_concat_f32(lib, rng, dim, layout):
    """CONCAT of F32, which the exact window runs twice per layer and step: whole rows where both
    sources' rows are contiguous (patch 15), value by value where one is a permuted view."""
    shape = [5, 4, 3, 2]  # ne0..ne3
    other = list(shape)
    other[dim] = 3
    x = rng.standard_normal(shape[::-1]).astype(np.float32)  # numpy's axes are ne3..ne0
    y = rng.standard_normal(other[::-1]).astype(np.float32)
    yt = np.ascontiguousarray(np.swapaxes(y, 2, 3)) if layout == "permuted" else y

    def build(b, ctx):
        a = b.ggml_new_tensor_4d(ctx, 0, *shape)  # GGML_TYPE_F32
        fill(b, a, x)
        if layout == "permuted":  # y stored with ne0 and ne1 swapped, read through a permuted view
            c = b.ggml_new_tensor_4d(ctx, 0, other[1], other[0], other[2], other[3])
            fill(b, c, yt)
            c = b.ggml_permute(ctx, c, 1, 0, 2, 3)
        else:
            c = b.ggml_new_tensor_4d(ctx, 0, *other)
            fill(b, c, y)
        out = b.ggml_concat(ctx, a, c, dim)
        return out, lambda: read(b, out, np.float32, x.size + y.size)

    got = graph_run(lib, build)
    want = np.concatenate([x, y], axis=3 - dim)
    np.testing.assert_array_equal(got.reshape(want.shape), want)
