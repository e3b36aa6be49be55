"""The CPU's tiled flash attention for quantized and mixed K/V (ggml-cpu/fattn-tiled-q.cpp).

Every case is checked against float64 NumPy attention over the cache as ggml decodes it, with f32 Q.
The tolerance (1e-4 of the output scale) is far below what the one-row path reaches on q8_0/q4_0 K
(it quantizes Q to q8_0, about 1e-3) or f16 V (f16 accumulators), so these cases fail if the tiled
path is not the one that ran. The one-row path (ggml's use_ref) is compared as well, where it computes
in f32 too (turboq K and V).

A decode step (a tile of fewer than 16 query rows, as the last tile of a batch may be too) over a turboq2/3/4 or
trellis K or V takes the packed path where the CPU has it (x86 AVX-512 BW + VNNI or AVX2, AArch64 NEON:
ggml_turboq_fa_packed): Q, the softmax weights and the
codebook rounded to 8 bits, so its bound is TOL_PACKED, and it must give the same floats on any
number of threads and wherever the rows lie.

Shapes: batches of 1 and 8 (decode, one tile of grouped heads), 35, 64, 65 and 200 (one, a partial
and several query tiles), head sizes 128 and 256, 4 query heads per KV head, masks with fully masked
K/V tiles and a fully masked query row, and 1 or 2 threads (2 splits the KV range in decode).
"""
from __future__ import annotations

import numpy as np
import pytest

from pyturbo import attention, codec
from pyturbo.format.reference import attention as numpy_attention
from pyturbo.types import cache_type
from helpers import TOL_PACKED, TOL_PACKED_LARGE, causal_mask, fa_packed, fa_tolerance

TOL = 1e-4

PAIRS = [("turboq3", "turboq3"), ("turboq4", "turboq4"), ("turboq2", "turboq2"), ("turboq8", "turboq8"),
         ("f16", "turboq3"), ("q8_0", "turboq3"), ("turboq4", "f16"), ("turboq3", "q8_0"),
         ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("bf16", "turboq4"), ("turboq4", "turboq2")]


def decoded(x: np.ndarray, type_name: str) -> np.ndarray:
    t = cache_type(type_name)
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if t.name == "f16":
        return flat.astype(np.float16).astype(np.float32).reshape(x.shape)
    if t.name == "bf16":
        u = flat.view(np.uint32)
        return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32).reshape(x.shape)
    return codec.dequantize(codec.quantize(flat, t), t).reshape(x.shape)


def tol(lib, type_k: str, type_v: str, rows: int) -> float:
    return fa_tolerance(lib, type_k, type_v, rows, TOL)


def case(seed: int, n_head: int, n_head_kv: int, n_q: int, n_kv: int, dk: int):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_head, n_q, dk)).astype(np.float32)
    k = (rng.standard_normal((n_head_kv, n_kv, dk)) * 0.5).astype(np.float32)
    v = rng.standard_normal((n_head_kv, n_kv, dk)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("type_k,type_v", PAIRS)
@pytest.mark.parametrize("dk", [128, 256])
@pytest.mark.parametrize("n_q", [1, 8, 35, 64, 65, 200])
def test_tiled_flash_attention_matches_numpy(lib, type_k, type_v, dk, n_q):
    n_kv = 700
    q, k, v = case(n_q * 7 + dk, 4, 1, n_q, n_kv, dk)
    mask = causal_mask(n_q, n_kv, hidden_prefix=200, hidden_row=3 if n_q > 3 else None)
    scale = 1.0 / np.sqrt(dk)
    want = numpy_attention(q, decoded(k, type_k), decoded(v, type_v), scale, mask.astype(np.float16))
    bound = tol(lib, type_k, type_v, 4 * n_q) * max(1.0, float(np.abs(want).max()))
    for n_threads in (1, 2):
        out = attention.flash_attn(q, k, v, type_k, type_v, scale=scale, n_threads=n_threads, mask=mask)
        err = float(np.abs(out - want).max())
        assert err < bound, f"{n_threads} threads: max abs err {err:.3g} > {bound:.3g}"
    if n_q > 3:
        assert not out[:, 3].any(), "a fully masked query row must come out as zeros"
    if cache_type(type_k).is_turboq and cache_type(type_v).is_turboq:
        ref = attention.flash_attn(q, k, v, type_k, type_v, scale=scale, n_threads=1, mask=mask, reference=True)
        err = float(np.abs(out - ref).max())
        assert err < bound, f"one-row path differs by {err:.3g}"


@pytest.mark.parametrize("type_k,type_v", [("turboq3", "turboq3"), ("q8_0", "turboq4")])
def test_tiled_flash_attention_grouping_per_head_mask_and_softcap(lib, type_k, type_v):
    # 8 query heads over 2 KV heads, a mask that differs per head (ALiBi-free, so each row of the
    # tile needs its own mask row) and Gemma 2's logit soft-capping
    n_q, n_kv, dk = 70, 300, 128
    q, k, v = case(11, 8, 2, n_q, n_kv, dk)
    q *= 4.0  # large logits, so that the soft cap matters
    rng = np.random.default_rng(5)
    mask = np.where(rng.random((8, n_q, n_kv)) < 0.3, -np.inf, 0.0).astype(np.float32)
    mask[:, :, :64] = -np.inf
    scale, softcap = 1.0 / np.sqrt(dk), 5.0
    want = numpy_attention(q, decoded(k, type_k), decoded(v, type_v), scale, mask.astype(np.float16), softcap)
    bound = TOL * max(1.0, float(np.abs(want).max()))
    without_cap = numpy_attention(q, decoded(k, type_k), decoded(v, type_v), scale, mask.astype(np.float16))
    assert np.abs(without_cap - want).max() > 100 * bound, "the case must be sensitive to the soft cap"
    for n_threads in (1, 2):
        out = attention.flash_attn(q, k, v, type_k, type_v, scale=scale, n_threads=n_threads, mask=mask, softcap=softcap)
        err = float(np.abs(out - want).max())
        assert err < bound, f"{n_threads} threads: max abs err {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("type_k,type_v,dk", [("turboq3_g64", "turboq3_g64", 64), ("turboq4", "turboq2", 128),
                                              ("turboq3", "turboq3", 256), ("turboq2_g64", "turboq8_g64", 192)])
@pytest.mark.parametrize("n_q", [1, 3])
def test_a_decode_steps_turboq_tile_with_per_head_masks_and_softcap(lib, type_k, type_v, dk, n_q):
    """Decode steps (fewer query rows than a GEMM fills) read a turboq K tile through
    ggml_turboq_fa_kq_rows, 16 cached rows' scores at a time: 3 query heads per KV head (SmolLM2's
    grouping), head sizes 64 to 256, KV lengths that leave partial groups of 16 and of 64, a mask
    per head, and with the soft cap; 1 and 2 threads (2 split the KV range)."""
    n_kv = 357
    q, k, v = case(dk + n_q, 6, 2, n_q, n_kv, dk)
    q *= 3.0
    rng = np.random.default_rng(dk)
    mask = np.where(rng.random((6, n_q, n_kv)) < 0.2, -np.inf, 0.0).astype(np.float32)
    mask[:, :, :70] = -np.inf
    scale = 1.0 / np.sqrt(dk)
    for softcap in (0.0, 5.0):
        want = numpy_attention(q, decoded(k, type_k), decoded(v, type_v), scale, mask.astype(np.float16), softcap)
        # q x 3: the packed path's score errors grow with the logits (Q is rounded against its
        # row's largest value), 2.2e-2 of the output scale at most here
        t = tol(lib, type_k, type_v, 3 * n_q)
        bound = (TOL_PACKED_LARGE if t == TOL_PACKED else t) * max(1.0, float(np.abs(want).max()))
        for n_threads in (1, 2):
            out = attention.flash_attn(q, k, v, type_k, type_v, scale=scale, n_threads=n_threads, mask=mask,
                                       softcap=softcap)
            err = float(np.abs(out - want).max())
            assert err < bound, f"softcap {softcap}, {n_threads} threads: max abs err {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("type_k,type_v,dk", [("turboq3_g64", "turboq3_g64", 64), ("turboq4_g64", "turboq2_g64", 64),
                                              ("turboq2", "turboq4", 128), ("turboq3", "turboq3", 256),
                                              ("turboq3t_g64", "turboq2t_g64", 64), ("turboq2t", "turboq3t", 128)])
def test_a_packed_decode_step_is_the_same_on_any_thread_count_and_position(lib, type_k, type_v, dk):
    """The packed path's sums are integers, so a decode step's floats do not depend on the thread
    count (1 to 3: the KV range is split in chunks) nor on where a sequence's run of cells lies in
    the cache (tiles start at its first visible row). It is the path that ran: the float one-row
    path differs from it (by its 8-bit roundings), and both stay within TOL_PACKED of NumPy."""
    if not fa_packed(lib, type_k):
        pytest.skip("this CPU build has no packed path (x86: AVX-512 BW + VNNI, or AVX2; AArch64 NEON)")
    n_kv, run, scale = 1500, 1100, 1.0 / np.sqrt(dk)
    q, k, v = case(dk, 6, 2, 1, n_kv, dk)
    outs = []
    for offset in (0, 37, 400):
        # the sequence's rows at [offset, offset + run); other rows hold another sequence's
        mask = np.full((1, n_kv), -np.inf, dtype=np.float32)
        mask[0, offset:offset + run] = 0.0
        kk, vv = k.copy(), v.copy()
        kk[:, offset:offset + run], vv[:, offset:offset + run] = k[:, :run], v[:, :run]
        for n_threads in (1, 2, 3):
            outs.append(attention.flash_attn(q, kk, vv, type_k, type_v, scale=scale, n_threads=n_threads, mask=mask))
    for i, out in enumerate(outs[1:], 1):
        np.testing.assert_array_equal(out, outs[0], err_msg=f"offset/threads case {i} against the first")
    mask = np.zeros((1, run), dtype=np.float32)
    want = numpy_attention(q, decoded(k[:, :run], type_k), decoded(v[:, :run], type_v), scale, mask)
    ref = attention.flash_attn(q, k[:, :run], v[:, :run], type_k, type_v, scale=scale, mask=mask, reference=True)
    scale_out = max(1.0, float(np.abs(want).max()))
    assert np.abs(outs[0] - want).max() < TOL_PACKED * scale_out
    assert np.abs(ref - want).max() < TOL * scale_out
    assert np.abs(outs[0] - ref).max() > 1e-6 * scale_out, "the packed path did not run"


def test_a_deep_decode_step_in_cache_sized_chunks_is_the_same_on_any_thread_count_and_cache_size(lib):
    """At depth a decode step's KV range is cut into chunks of about 256 KiB of K and V rows
    (fattn-tiled-q.cpp's CHUNK_BYTES; this helper holds each KV head's rows contiguously, so a row
    counts one head's 50 + 50 bytes: 8 KV heads of 128 turboq3 values over 16184 visible rows make 7
    chunks a head, where the split for the threads alone made 4), run chunk by chunk across the
    heads. The floats do not depend on the thread count, nor on how many other rows (another
    sequence's, hidden) the cache holds, which sets how the whole range would be cut; they stay
    within TOL_PACKED of the float one-row path."""
    if not fa_packed(lib, "turboq3"):
        pytest.skip("this CPU build has no packed path (x86: AVX-512 BW + VNNI, or AVX2; AArch64 NEON)")
    n_kv, dk = 16384, 128
    rng = np.random.default_rng(7)
    q = rng.standard_normal((8, 1, dk)).astype(np.float32)
    k = (rng.standard_normal((8, 2 * n_kv, dk)) * 0.5).astype(np.float32)
    v = rng.standard_normal((8, 2 * n_kv, dk)).astype(np.float32)
    mask = np.zeros((1, 2 * n_kv), np.float32)
    mask[0, n_kv - 200:] = -np.inf  # a padded cache's tail; past n_kv, another sequence's rows
    kk, vv, mm = k[:, :n_kv], v[:, :n_kv], mask[:, :n_kv]
    outs = [attention.flash_attn(q, kk, vv, "turboq3", "turboq3", n_threads=t, mask=mm) for t in (1, 2, 3)]
    outs.append(attention.flash_attn(q, k, v, "turboq3", "turboq3", n_threads=2, mask=mask))
    for name, out in zip(("2 threads", "3 threads", "a cache twice the size"), outs[1:]):
        np.testing.assert_array_equal(out, outs[0], err_msg=f"{name} against 1 thread")
    ref = attention.flash_attn(q, kk, vv, "turboq3", "turboq3", mask=mm, reference=True)
    scale_out = max(1.0, float(np.abs(ref).max()))
    assert np.abs(outs[0] - ref).max() < TOL_PACKED * scale_out
    assert np.abs(outs[0] - ref).max() > 1e-6 * scale_out, "the packed path did not run"


@pytest.mark.parametrize("n_kv", [512, 700, 4100])
def test_f16_decode_gives_the_same_floats_on_any_number_of_threads(lib, n_kv):
    """Upstream's decode path for F16 K/V (one query row, 512 cached rows or more) split the KV
    range into one chunk per thread, so 1, 2 and 3 threads gave different floats; its chunks now
    follow the KV length alone (patch 2). Against float64 NumPy: its f16 accumulators reach about
    1.5e-3 of the output scale here."""
    rng = np.random.default_rng(n_kv)
    q = rng.standard_normal((8, 1, 128)).astype(np.float32)
    k = rng.standard_normal((2, n_kv, 128)).astype(np.float32)
    v = rng.standard_normal((2, n_kv, 128)).astype(np.float32)
    scale = 1 / np.sqrt(128)
    mask = np.zeros((1, n_kv), np.float32)
    mask[0, n_kv - 37:] = -np.inf  # a padded cache's tail
    want = numpy_attention(q, decoded(k, "f16"), decoded(v, "f16"), scale, mask.astype(np.float16))
    outs = [attention.flash_attn(q, k, v, "f16", "f16", scale=scale, n_threads=t, mask=mask) for t in (1, 2, 3)]
    err = float(np.abs(outs[0] - want).max() / np.abs(want).max())
    assert err < 5e-3, err
    for t, out in zip((2, 3), outs[1:]):
        np.testing.assert_array_equal(out, outs[0], err_msg=f"{t} threads against 1")


def test_one_row_path_is_still_reachable(lib):
    # use_ref forces the one-row kernel: on q8_0 K it quantizes Q, so it must differ from the tiled
    # result by more than the tiled path's own error (this is what keeps the test above meaningful)
    q, k, v = case(3, 4, 1, 8, 300, 128)
    mask = np.zeros((8, 300), dtype=np.float32)
    tiled = attention.flash_attn(q, k, v, "q8_0", "q8_0", mask=mask)
    ref = attention.flash_attn(q, k, v, "q8_0", "q8_0", mask=mask, reference=True)
    want = numpy_attention(q, decoded(k, "q8_0"), decoded(v, "q8_0"), 1 / np.sqrt(128), mask)
    assert np.abs(tiled - want).max() < TOL
    assert np.abs(ref - want).max() > 3 * TOL


def test_the_decode_node_bench_builds_and_prints_its_bound(build_info, tmp_path):
    """bench/fa_decode_node.cpp (issue 62's measurement): it builds against the libraries as its
    header says, and a small node prints its time beside the read-bandwidth bound; its output is
    the CPU backend's, finite."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    from pyturbo import _paths

    cxx = shutil.which("g++") or shutil.which("c++")
    src = Path(__file__).resolve().parents[1] / "bench" / "fa_decode_node.cpp"
    lib = _paths.lib_dir()
    exe = tmp_path / "fa_decode_node"
    subprocess.run([cxx, "-O2", "-march=native", "-std=c++17", f"-I{Path(build_info['upstream_src']) / 'ggml' / 'include'}", str(src),
                    f"-L{lib}", "-lggml-base", "-lggml-cpu", "-lggml", f"-Wl,-rpath,{lib}", "-pthread", "-o", str(exe)],
                   check=True)
    out = tmp_path / "out.f32"
    r = subprocess.run([str(exe), "turboq3_g64", "turboq3_g64", "64", "9", "3", "300", "1", "2", "1", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert re.search(r"us a node; K\+V [\d.]+ MB, read bandwidth [\d.]+ GB/s, bound [\d.]+ us \(\d+% of it\)", r.stdout), r.stdout
    o = np.fromfile(out, dtype=np.float32)
    assert o.size == 64 * 9 and np.isfinite(o).all() and np.abs(o).max() > 0
    bad = subprocess.run([str(exe), "turboq9", "turboq3", "64", "9", "3", "300", "1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown type turboq9" in bad.stderr
