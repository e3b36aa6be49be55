"""The turboq CPU paths on other instruction sets: AArch64 NEON under qemu-user (the armv8-a
baseline, and with the dot-product extension), x86 with AVX2 and FMA off (the generic kernels),
x86 with AVX2 but without AVX-512 (the AVX2 kernels, which the native build does not compile on an
AVX-512 machine), and x86 with AVX-512 BW and VNNI but without VBMI (the packed kernels' trellis
lookups without vpermb, which the native build does not compile on a VBMI machine).

scripts/build_portable.sh builds tests/portable/turboq_check.c against the patched ggml five
times: build-aarch64/ and build-aarch64-dotprod/ (cross-compiled, run with qemu-aarch64),
build-scalar/, build-avx2/ and build-avx512/ (each x86 build skips on a machine that cannot run it). Inputs are generated
here, written to files, and the harness's results are compared with pyturbo.format.reference:
- the codec (SET_ROWS into the cache, GET_ROWS back) bit for bit, over a few hundred groups (128
  values, or 64/32/16 for the _g64/_g32/_g16 twins; the trellis types too) that include zeros, NaN/Inf rows, huge and subnormal values;
- flash attention within the x86 tests' tolerance (1e-4 of the output scale, as in
  test_flash_attn_tiled.py; helpers.TOL_PACKED where a short query tile reads the packed rows in
  8-bit integers) against float64 attention over the reference-decoded cache, on the tiled path
  and on the one-row path (TURBOQ_FA_TILED=0, and ggml's use_ref);
- the packed kernels alone (the AVX2, AVX-512 and both AArch64 builds have them; the scalar one does not):
  against float64 sums over the decoded rows, and bit for bit against the native build's, where
  that has them too (here AVX-512 BW + VNNI): every arch computes the same integers and the same
  floats from them.

Without the builds the tests skip, except under CI=true or PYTURBO_REQUIRE_PORTABLE=1.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pyturbo.format import reference
from pyturbo._paths import build_dirs
from pyturbo.types import TURBOQ_STORED_TYPES, cache_type

from helpers import TOL_PACKED, TOL_PACKED_LARGE, causal_mask, decoded, fa_packed, packed_kernels  # tests/ is on sys.path

pytestmark = pytest.mark.portable

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = os.environ.get("CI") == "true" or os.environ.get("PYTURBO_REQUIRE_PORTABLE") == "1"
TOL = 1e-4
TURBOQ = list(TURBOQ_STORED_TYPES)


def _runner(name: str) -> list[str]:
    exe = build_dirs()[f"PYTURBO_{name.upper()}_BUILD_DIR"] / "bin" / "turboq-check"
    prefix = ["qemu-aarch64"] if name.startswith("aarch64") else []
    missing = [] if exe.exists() else [str(exe)]
    if prefix and shutil.which(prefix[0]) is None:
        missing.append(prefix[0])
    if missing:
        msg = f"missing {', '.join(missing)}: run `bash scripts/build_portable.sh`"
        if REQUIRED:
            pytest.fail(msg)
        pytest.skip(msg)
    return [*prefix, str(exe)]


# the CPU flags (/proc/cpuinfo) that each x86 build needs to run
_RUNS_ON = {"avx2": {"avx2", "fma", "f16c", "bmi2"},
            "avx512": {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw",
                       "avx512_vnni"}}


def _runs_here(name: str) -> bool:
    if name not in _RUNS_ON:  # qemu runs the AArch64 builds, and the scalar one runs on any x86
        return True
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return _RUNS_ON[name] <= flags


@pytest.fixture(params=["aarch64", "aarch64_dotprod", "scalar", "avx2", "avx512"])
def harness(request):
    if not _runs_here(request.param):
        pytest.skip(f"this machine cannot run the {request.param} build")  # which still compiles its kernels
    return request.param, _runner(request.param)


def is_packed(cmd: list[str], type_name: str) -> bool:
    """Whether a decode step of this harness's build reads a cache of this type through the packed kernels."""
    if not type_name.startswith("turboq"):
        return False
    r = subprocess.run([*cmd, "is-packed", str(cache_type(type_name).ggml_id)], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip() == "1"


def run(cmd: list[str], *args, env: dict[str, str] | None = None) -> None:
    r = subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"{' '.join(cmd)} {args[0]} exited {r.returncode}: {r.stderr[-2000:]}"


def codec_inputs(seed: int) -> np.ndarray:
    """96 rows of 256 values (192 groups): scales over 1e-6..1e4, a zero row, NaN and Inf rows,
    huge and subnormal rows, a single spike, and a constant row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((96, 256)) * np.exp(rng.uniform(np.log(1e-6), np.log(1e4), (96, 1)))
    x[1] = 0.0
    x[2, 7] = np.nan
    x[3, 200] = np.inf
    x[4] *= 1e30
    x[5] = rng.standard_normal(256) * 1e-40   # subnormal in f32
    x[6] = 0.0
    x[6, 129] = 3.0
    x[7] = -2.5
    return x.astype(np.float32)


@pytest.mark.parametrize("type_name", TURBOQ)
def test_codec_bit_exact_with_reference(harness, type_name, tmp_path):
    name, cmd = harness
    t = cache_type(type_name)
    x = codec_inputs(sum(map(ord, type_name)))
    x.tofile(tmp_path / "in.f32")
    run(cmd, "codec", t.ggml_id, x.shape[1], x.shape[0], tmp_path / "in.f32", tmp_path / "out.bin")
    raw = np.fromfile(tmp_path / "out.bin", dtype=np.uint8)
    n_blocks = x.size // t.block_size * t.block_bytes
    assert raw.size == n_blocks + x.size * 4
    blocks, back = raw[:n_blocks], raw[n_blocks:].view(np.float32)

    want = reference.quantize(x.reshape(-1), type_name)
    bad = np.flatnonzero((blocks != want).reshape(-1, t.block_bytes).any(axis=1))
    assert bad.size == 0, f"{name}: {bad.size} of {want.size // t.block_bytes} blocks differ, first group {bad[0]}"
    want_back = reference.dequantize(want, type_name).astype(np.float32)
    assert np.array_equal(back.view(np.uint32), want_back.view(np.uint32)), f"{name}: GET_ROWS differs"
    rows, g = back.reshape(x.shape), t.block_size
    inf_group = slice(200 // g * g, 200 // g * g + g)
    assert not rows[2, :g].any() and not rows[3, inf_group].any(), "a group with a NaN or Inf must decode to zeros"
    assert rows[2, g:].any() and rows[3, :inf_group.start].any(), "only that group"


# (type_k, type_v, d, n_head, n_head_kv, n_q, n_kv, threads, path, softcap)
# path: tiled (the default), onerow (TURBOQ_FA_TILED=0: the turboq dot/mad kernels), ref (use_ref)
FA_CASES = [
    ("turboq3", "turboq3", 128, 4, 1, 1, 300, 2, "tiled", 0.0),
    ("turboq4", "turboq2", 256, 4, 1, 8, 300, 1, "tiled", 0.0),
    ("turboq8", "turboq8", 128, 4, 1, 65, 300, 2, "tiled", 0.0),
    ("q8_0", "turboq4", 128, 8, 2, 35, 200, 1, "tiled", 5.0),
    ("f16", "turboq3", 256, 4, 1, 1, 300, 1, "tiled", 0.0),
    ("turboq3", "turboq3", 128, 8, 2, 8, 300, 2, "onerow", 5.0),
    ("turboq2", "turboq4", 256, 4, 1, 1, 300, 1, "onerow", 0.0),
    ("turboq8", "turboq3", 128, 4, 1, 8, 200, 1, "ref", 0.0),
    # the _g64 twins (head sizes 64 and 192)
    ("turboq3_g64", "turboq3_g64", 64, 9, 3, 1, 300, 2, "tiled", 0.0),
    ("turboq4_g64", "turboq2_g64", 64, 4, 1, 8, 300, 1, "tiled", 5.0),
    ("turboq8_g64", "turboq4_g64", 192, 4, 2, 35, 200, 2, "tiled", 0.0),
    ("turboq2_g64", "turboq3_g64", 64, 8, 2, 8, 300, 1, "onerow", 0.0),
    ("turboq3_g64", "turboq8_g64", 192, 4, 1, 1, 300, 1, "onerow", 0.0),
    # the _g32 twins (head sizes 96 and 160)
    ("turboq3_g32", "turboq3_g32", 96, 8, 2, 1, 300, 2, "tiled", 0.0),
    ("turboq4_g32", "turboq2_g32", 160, 4, 1, 8, 300, 1, "tiled", 5.0),
    ("turboq8_g32", "turboq4_g32", 96, 4, 2, 35, 200, 2, "tiled", 0.0),
    ("turboq2_g32", "turboq3_g32", 96, 8, 2, 8, 300, 1, "onerow", 0.0),
    ("turboq3_g32", "turboq8_g32", 160, 4, 1, 1, 300, 1, "onerow", 0.0),
    # the _g16 twins (head sizes 80 and 48)
    ("turboq3_g16", "turboq3_g16", 80, 8, 2, 1, 300, 2, "tiled", 0.0),
    ("turboq4_g16", "turboq2_g16", 48, 4, 1, 8, 300, 1, "tiled", 5.0),
    ("turboq2_g16", "turboq8_g16", 80, 8, 2, 8, 300, 1, "onerow", 0.0),
    # the trellis types: their decoders on each instruction set
    ("turboq3t", "turboq2t", 128, 4, 1, 8, 300, 2, "tiled", 0.0),
    ("turboq2t", "turboq3t", 256, 4, 1, 1, 200, 1, "onerow", 0.0),
    # and their 64-value forms (head sizes 64 and 192)
    ("turboq3t_g64", "turboq2t_g64", 64, 9, 3, 8, 300, 2, "tiled", 0.0),
    ("turboq2t_g64", "turboq3t_g64", 192, 4, 1, 1, 200, 1, "onerow", 0.0),
]


@pytest.mark.parametrize("case", FA_CASES, ids=[f"{c[0]}-{c[1]}-d{c[2]}-q{c[5]}-{c[8]}" for c in FA_CASES])
def test_flash_attention_matches_numpy(harness, case, tmp_path):
    name, cmd = harness
    type_k, type_v, d, n_head, n_head_kv, n_q, n_kv, threads, path, softcap = case
    rng = np.random.default_rng(n_q * 31 + d + n_kv)
    q = rng.standard_normal((n_head, n_q, d)).astype(np.float32)
    if softcap:
        q *= 4.0  # large logits, so that the cap matters
    k = (rng.standard_normal((n_head_kv, n_kv, d)) * 0.5).astype(np.float32)
    v = rng.standard_normal((n_head_kv, n_kv, d)).astype(np.float32)
    mask = causal_mask(n_q, n_kv, hidden_prefix=64, hidden_row=3 if n_q > 3 else None).astype(np.float16)
    for arr, f in ((q, "q.f32"), (k, "k.f32"), (v, "v.f32"), (mask, "mask.f16")):
        arr.tofile(tmp_path / f)
    env = {"TURBOQ_FA_TILED": "0"} if path == "onerow" else {}
    run(cmd, "fa", cache_type(type_k).ggml_id, cache_type(type_v).ggml_id, d, d, n_head, n_head_kv, n_q, n_kv,
        threads, int(path == "ref"), softcap, *(tmp_path / f for f in ("q.f32", "k.f32", "v.f32", "mask.f16", "out.bin")),
        env=env)

    raw = np.fromfile(tmp_path / "out.bin", dtype=np.uint8)
    nk = k.size // cache_type(type_k).block_size * cache_type(type_k).block_bytes
    nv = v.size // cache_type(type_v).block_size * cache_type(type_v).block_bytes
    assert raw.size == nk + nv + n_q * n_head * d * 4
    for blocks, arr, t in ((raw[:nk], k, type_k), (raw[nk:nk + nv], v, type_v)):
        if t in TURBOQ:
            assert np.array_equal(blocks, reference.quantize(arr.reshape(-1), t)), f"{name}: the {t} cache differs"
    out = raw[nk + nv:].view(np.float32).reshape(n_q, n_head, d).transpose(1, 0, 2)

    want = reference.attention(q, decoded(k, type_k), decoded(v, type_v), 1.0 / np.sqrt(d), mask, softcap)
    rows = n_q * (n_head // n_head_kv)  # a KV head's query rows: a short last tile takes the packed kernels
    short = path == "tiled" and 0 < rows % 64 < 16 and (is_packed(cmd, type_k) or is_packed(cmd, type_v))
    tol = (TOL_PACKED_LARGE if softcap else TOL_PACKED) if short else TOL  # softcap's cases have q x 4
    bound = tol * max(1.0, float(np.abs(want).max()))
    err = float(np.abs(out - want).max())
    assert err < bound, f"{name} {path}: max abs err {err:.3g} > {bound:.3g}"
    if softcap:
        uncapped = reference.attention(q, decoded(k, type_k), decoded(v, type_v), 1.0 / np.sqrt(d), mask)
        assert np.abs(uncapped - want).max() > 100 * TOL * max(1.0, float(np.abs(want).max())), \
            "the case must be sensitive to the soft cap"
    if n_q > 3:
        assert not out[:, 3].any(), "a fully masked query row must come out as zeros"


PACKED = ["turboq2", "turboq3", "turboq4", "turboq2_g64", "turboq3_g64", "turboq4_g64",
          "turboq3t", "turboq2t", "turboq3t_g64", "turboq2t_g64"]
# (type, head size, query rows): two blocks a row with 3 queries (a GQA group), one with 16 and 1
PACKED_CASES = [(t, n * cache_type(t).block_size, nq) for t in PACKED for n, nq in ((2, 3), (1, 16), (1, 1))]
PACKED_ROWS = 61  # a tile's rows: odd, and not a multiple of the 8 or 16 rows the kernels take at once
# Against float64 sums over the decoded rows, relative to the largest: Q's, the weights' and the
# codebook's rounding to 8 bits (over five draws of these cases, up to 2.1e-2 for the scores and
# 1.3e-2 for the V sums)
TOL_PACKED_SCORES = 3e-2
TOL_PACKED_SUMS = 2.5e-2


@pytest.mark.parametrize("case", PACKED_CASES, ids=[f"{c[0]}-d{c[1]}-q{c[2]}" for c in PACKED_CASES])
def test_packed_kernels_match_float64_and_the_native_build(harness, lib, case, tmp_path):
    name, cmd = harness
    type_name, n, nq = case
    if not is_packed(cmd, type_name):
        assert name == "scalar", f"the {name} build must read {type_name} through the packed kernels"
        pytest.skip(f"no packed kernels in the {name} build")
    rng = np.random.default_rng(n * 7 + nq)
    q = rng.standard_normal((nq, n)).astype(np.float32)
    x = rng.standard_normal((PACKED_ROWS, n)) * np.exp(rng.uniform(-2.0, 2.0, (PACKED_ROWS, 1)))
    cache = reference.quantize(x.astype(np.float32).reshape(-1), type_name)
    p = np.zeros((nq, 64), dtype=np.float32)
    p[:, :PACKED_ROWS] = rng.exponential(1.0, (nq, PACKED_ROWS)) ** 3  # a softmax's spread: a few large
    for arr, f in ((q, "q.f32"), (cache, "cache.bin"), (p, "p.f32")):
        arr.tofile(tmp_path / f)
    run(cmd, "packed", cache_type(type_name).ggml_id, n, nq, PACKED_ROWS,
        *(tmp_path / f for f in ("q.f32", "cache.bin", "p.f32", "out.bin")))
    out = np.fromfile(tmp_path / "out.bin", dtype=np.float32)
    assert out.size == nq * (PACKED_ROWS + n)
    s, o = out[:nq * PACKED_ROWS].reshape(nq, PACKED_ROWS), out[nq * PACKED_ROWS:].reshape(nq, n)

    norms, idx = reference.unpack(type_name, cache)  # the rotated domain, where the kernels sum
    y = (reference.levels(type_name)[idx] * norms.astype(np.float64)[:, None]).reshape(PACKED_ROWS, n)
    want_s, want_o = q.astype(np.float64) @ y.T, p[:, :PACKED_ROWS].astype(np.float64) @ y
    err_s = float(np.abs(s - want_s).max() / np.abs(want_s).max())
    err_o = float(np.abs(o - want_o).max() / np.abs(want_o).max())
    assert err_s < TOL_PACKED_SCORES and err_o < TOL_PACKED_SUMS, f"{name}: scores {err_s:.3g}, V sums {err_o:.3g}"

    if fa_packed(lib, type_name):  # the native build has them too: the same integers, the same floats
        s_native, o_native = packed_kernels(lib, type_name, q, cache, PACKED_ROWS, p)
        np.testing.assert_array_equal(s.view(np.uint32), s_native.view(np.uint32), err_msg=f"{name}: scores")
        np.testing.assert_array_equal(o.view(np.uint32), o_native.view(np.uint32), err_msg=f"{name}: V sums")

    # a tile whose largest weight is below 1e-30 (255/max would overflow, and each arch's conversion
    # of an infinity differs): zeros on every arch, as a softmax tile that small weighs nothing
    (p * np.float32(1e-36)).astype(np.float32).tofile(tmp_path / "p.f32")
    run(cmd, "packed", cache_type(type_name).ggml_id, n, nq, PACKED_ROWS,
        *(tmp_path / f for f in ("q.f32", "cache.bin", "p.f32", "out.bin")))
    o_tiny = np.fromfile(tmp_path / "out.bin", dtype=np.float32)[nq * PACKED_ROWS:]
    assert not o_tiny.any(), f"{name}: a tile of weights below 1e-30 must add nothing"


def test_harness_refuses_bad_input(harness, tmp_path):
    _, cmd = harness
    r = subprocess.run([*cmd, "codec", "999", "128", "1", tmp_path / "none", tmp_path / "out"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "not a ggml type id" in r.stderr
    np.zeros(100, dtype=np.float32).tofile(tmp_path / "short.f32")
    r = subprocess.run([*cmd, "codec", str(cache_type("turboq3").ggml_id), "128", "1", tmp_path / "short.f32",
                        tmp_path / "out"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "wrong size" in r.stderr
