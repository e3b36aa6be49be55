"""The CUDA backend's turboq kernels, run on the CPU under emulation, against the NumPy reference.

tests/harness/turboq_cuda_emulation.cpp compiles ggml-cuda/turboq-device.cuh (the SET_ROWS,
GET_ROWS and CPY kernels and the warp-level codec they share) and fattn-turboq.cuh (the packed-block
flash-attention kernel, its combine kernel and its launch plan) for the host, with each warp run as
32 threads whose shuffles pass through a barrier. It needs no GPU and no nvcc, so this is where CI
checks the CUDA codec of every type (the _g64, _g32 and _g16 twins and the trellis types' warp-wide
Viterbi search included) bit for bit, the
flash-attention kernel within the CPU tests' tolerance, and the F16 K, V and mask that a larger
batch with exact rows hands to mainline's kernels (fattn-turboq-f16.cuh) bit for bit. What it cannot show: the GPU's
flush-to-zero of subnormals (-use_fast_math), timing and races beyond the barriers, the mainline
kernels that larger batches and the _g16 twins' flash attention (head size 80) take on K/V
converted to f16, and the CUDA launches themselves (bench/cuda_check.sh runs those on a GPU).
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pyturbo import _paths
from pyturbo.format import reference
from pyturbo.types import TRELLIS_TYPES, TURBOQ_TWIN_TYPES, TURBOQ_TYPES, cache_type

from helpers import causal_mask, decoded, special_groups  # tests/ is on sys.path (pytest prepend mode)

pytestmark = pytest.mark.cuda_emulation

HARNESS = Path(__file__).resolve().parent / "harness" / "turboq_cuda_emulation.cpp"


@pytest.fixture(scope="session")
def emulated_cuda(build_info, tmp_path_factory) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.fail("a C++20 compiler is needed for the CUDA emulation harness")
    src = Path(build_info["upstream_src"]) / "ggml"
    lib = _paths.lib_dir()
    exe = tmp_path_factory.mktemp("cuda-emulation") / "turboq-cuda-emulation"
    # -ffp-contract=off: nvcc never fuses the kernels' __fmul_rn/__fadd_rn into an FMA
    subprocess.run([cxx, "-std=c++20", "-O1", "-ffp-contract=off", "-pthread", f"-I{src / 'include'}", f"-I{src / 'src'}",
                    str(HARNESS), f"-L{lib}", "-lggml-base", f"-Wl,-rpath,{lib}", "-o", str(exe)], check=True)
    return exe


def codec_inputs(seed: int) -> np.ndarray:
    """24 groups of 128 values: the first row of each of helpers.special_groups' kinds (zero,
    constant, huge, max float, tiny, subnormal, one-hot, KV-like), its NaN, Inf and -Inf rows, and
    random rows (3072 values, which rows of 256 and of 192 both divide)."""
    g = special_groups(np.random.default_rng(seed))
    rows = [x[0] for k, x in g.items() if k != "nan_inf"] + list(g["nan_inf"])
    rows += list(g["random"][1:1 + 24 - len(rows)])
    return np.stack(rows).astype(np.float32)


def run_codec(exe: Path, type_name: str, x: np.ndarray, tmp_path: Path) -> dict[str, np.ndarray]:
    t = cache_type(type_name)
    x.tofile(tmp_path / "in.f32")
    r = subprocess.run([str(exe), "codec", str(t.ggml_id), str(x.shape[1]), str(x.shape[0]), str(tmp_path / "in.f32"),
                        str(tmp_path / "out.bin")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"exited {r.returncode}: {r.stderr[-2000:]}"
    raw = np.fromfile(tmp_path / "out.bin", dtype=np.uint8)
    n_blocks = x.size // t.block_size * t.block_bytes
    parts, at = {}, 0
    for name, size, dtype in [("set_rows", n_blocks, np.uint8), ("get_rows_f32", x.size * 4, np.float32),
                              ("get_rows_f16", x.size * 2, np.float16), ("cpy_from_f32", n_blocks, np.uint8),
                              ("cpy_to_f16", x.size * 2, np.float16)]:
        parts[name] = raw[at:at + size].view(dtype)
        at += size
    assert at == raw.size, f"{raw.size} bytes written, {at} expected"
    return parts


# every type: CUDA has codec kernels for all of them (a 16-value group on half a warp)
CUDA_TYPES = [*TURBOQ_TYPES, *TURBOQ_TWIN_TYPES, *TRELLIS_TYPES]


@pytest.mark.parametrize("type_name", CUDA_TYPES)
def test_cuda_codec_kernels_match_reference(emulated_cuda, type_name, tmp_path):
    t = cache_type(type_name)
    groups = codec_inputs(sum(map(ord, type_name)))
    # rows of 256 values for every type; of 192 (3 or 6 groups a row, as head size 192) for the twins.
    # The harness scatters rows through a permutation (i*7 + 3 mod n), so 7 must not divide n.
    for ne0 in ([256] if t.block_size == 128 else [256, 192]):
        x = groups.reshape(-1, ne0)
        got = run_codec(emulated_cuda, type_name, x, tmp_path)
        want = reference.quantize(x.reshape(-1), type_name)
        bad = np.flatnonzero((got["set_rows"] != want).reshape(-1, t.block_bytes).any(axis=1))
        assert bad.size == 0, f"SET_ROWS: {bad.size} of {want.size // t.block_bytes} blocks differ, first group {bad[0]}"
        assert np.array_equal(got["cpy_from_f32"], want), "CPY f32 -> turboq differs from the reference"

        back = reference.dequantize(want, type_name).astype(np.float32)
        assert np.array_equal(got["get_rows_f32"].view(np.uint32), back.view(np.uint32)), "GET_ROWS to f32 differs"
        with np.errstate(over="ignore"):  # the huge rows are out of f16's range, as on the GPU
            back16 = back.astype(np.float16)
        assert np.array_equal(got["get_rows_f16"].view(np.uint16), back16.view(np.uint16)), "GET_ROWS to f16 differs"
        assert np.array_equal(got["cpy_to_f16"].view(np.uint16), back16.view(np.uint16)), "CPY turboq -> f16 differs"
    # zero groups stay zero, and a group with NaN or Inf is stored as a zero block
    xin, out = groups.reshape(-1, t.block_size), back.reshape(-1, t.block_size)
    special = (xin == 0).all(axis=1) | ~np.isfinite(xin).all(axis=1)
    assert special.sum() >= 4 and not out[special].any()


def test_harness_refuses_bad_input(emulated_cuda, tmp_path):
    (tmp_path / "in.f32").write_bytes(b"\0" * 4 * 128 * 8)
    for args in (["codec", "1", "128", "8"],                                      # q4_1 is not a turboq type
                 ["codec", str(cache_type("turboq3").ggml_id), "96", "8"],        # not a multiple of 128
                 ["codec", str(cache_type("turboq3").ggml_id), "128", "14"],      # 7 divides the rows
                 ["codec", str(cache_type("turboq3").ggml_id), "128", "9"]):      # too few floats
        r = subprocess.run([str(emulated_cuda), *args, str(tmp_path / "in.f32"), str(tmp_path / "out.bin")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr, (args, r.returncode, r.stderr)


# (type_k, type_v, d, n_head, n_head_kv, n_q, n_kv, softcap, max_bias, sinks, resident): the K/V
# pairs and head sizes of the harness's TQ_EMU_FA_CASES. `resident` stands for the GPU's resident
# blocks, which set how many KV slices the combine kernel merges.
FA_CASES = [
    ("turboq3", "turboq3", 128, 4, 1, 1, 300, 0.0, 0.0, False, 64),   # decode, GQA 4: 4 heads a block, 8 slices
    ("turboq4", "turboq2", 256, 4, 2, 3, 200, 0.0, 0.0, False, 4),    # 8 columns (3 queries x 2 heads), 2 slices
    ("q8_0", "turboq4", 128, 8, 2, 5, 130, 5.0, 0.0, False, 1),       # soft cap, one slice
    ("f16", "turboq3", 256, 4, 1, 1, 300, 0.0, 0.0, True, 16),        # attention sinks
    ("turboq8", "turboq8", 128, 2, 2, 8, 64, 0.0, 8.0, False, 8),     # ALiBi, no GQA
    ("turboq2", "f16", 128, 4, 4, 2, 40, 0.0, 0.0, False, 64),        # a partial last chunk
    ("turboq3", "q8_0", 128, 4, 2, 1, 33, 0.0, 0.0, True, 64),
    # the _g64 twins at head size 64, the _g32 twins at 96
    ("turboq3_g64", "turboq3_g64", 64, 9, 3, 1, 300, 0.0, 0.0, False, 64),
    ("turboq4_g64", "f16", 64, 4, 1, 5, 130, 5.0, 0.0, False, 4),
    ("q8_0", "turboq2_g64", 64, 8, 2, 2, 100, 0.0, 0.0, True, 16),
    ("turboq3_g32", "turboq3_g32", 96, 8, 2, 1, 300, 0.0, 0.0, False, 64),
    ("f16", "turboq8_g32", 96, 4, 2, 3, 200, 0.0, 8.0, False, 8),
    ("turboq4_g32", "q8_0", 96, 4, 1, 8, 64, 0.0, 0.0, True, 1),
    # the trellis types: with each other, beside a finer V, and as V beside f16
    ("turboq3t", "turboq3t", 128, 4, 1, 1, 300, 0.0, 0.0, False, 64),
    ("turboq2t", "turboq4", 256, 4, 2, 3, 200, 0.0, 0.0, True, 4),
    ("f16", "turboq2t", 128, 8, 2, 5, 130, 5.0, 0.0, False, 1),
]


def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """ggml's ALiBi slope per head (1 without a bias)."""
    if max_bias <= 0:
        return np.ones(n_head)
    n_log2 = 2 ** int(np.floor(np.log2(n_head)))
    m0, m1 = 2.0 ** (-max_bias / n_log2), 2.0 ** (-(max_bias / 2) / n_log2)
    return np.array([m0 ** (h + 1) if h < n_log2 else m1 ** (2 * (h - n_log2) + 1) for h in range(n_head)])


@pytest.mark.parametrize("case", FA_CASES, ids=[f"{c[0]}-{c[1]}-d{c[2]}-q{c[5]}-kv{c[6]}" for c in FA_CASES])
def test_cuda_flash_attention_matches_reference(emulated_cuda, case, tmp_path):
    type_k, type_v, d, n_head, n_head_kv, n_q, n_kv, softcap, max_bias, with_sinks, resident = case
    rng = np.random.default_rng(n_q * 31 + d + n_kv)
    q = rng.standard_normal((n_head, n_q, d)).astype(np.float32) * (4.0 if softcap else 1.0)
    k = (rng.standard_normal((n_head_kv, n_kv, d)) * 0.5).astype(np.float32)
    v = rng.standard_normal((n_head_kv, n_kv, d)).astype(np.float32)
    mask = causal_mask(n_q, n_kv, hidden_prefix=min(16, n_kv // 2), hidden_row=1 if n_q > 2 else None)
    if max_bias:
        mask = np.where(np.isfinite(mask), -np.abs(np.arange(n_kv) - (n_kv - n_q) - np.arange(n_q)[:, None]), mask)
    mask = mask.astype(np.float16)
    sinks = rng.standard_normal(n_head).astype(np.float32) * 2 if with_sinks else None
    for arr, f in ((q, "q.f32"), (k, "k.f32"), (v, "v.f32"), (mask, "mask.f16"), (sinks, "sinks.f32")):
        if arr is not None:
            arr.tofile(tmp_path / f)
    r = subprocess.run([str(emulated_cuda), "fa", str(cache_type(type_k).ggml_id), str(cache_type(type_v).ggml_id),
                        *map(str, (d, n_head, n_head_kv, n_q, n_kv, softcap, max_bias, resident)),
                        *(str(tmp_path / f) for f in ("q.f32", "k.f32", "v.f32", "mask.f16")),
                        str(tmp_path / "sinks.f32") if with_sinks else "-", str(tmp_path / "out.f32")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"exited {r.returncode}: {r.stderr[-2000:]}"
    out = np.fromfile(tmp_path / "out.f32", dtype=np.float32).reshape(n_q, n_head, d).transpose(1, 0, 2)

    # the reference: ALiBi as a per-head mask, a sink as one more key whose logit is the sink and whose value is 0
    m = alibi_slopes(n_head, max_bias)[:, None, None] * mask.astype(np.float64)[None]
    kd, vd = decoded(k, type_k), decoded(v, type_v)
    if with_sinks:
        m = np.concatenate([m, np.broadcast_to(sinks[:, None, None], (n_head, n_q, 1))], axis=2)
        kd = np.concatenate([kd, np.zeros((n_head_kv, 1, d), np.float32)], axis=1)
        vd = np.concatenate([vd, np.zeros((n_head_kv, 1, d), np.float32)], axis=1)
    want = reference.attention(q, kd, vd, 1.0 / np.sqrt(d), m, softcap)
    bound = 1e-4 * max(1.0, float(np.abs(want).max()))  # test_portable_kernels' tolerance
    err = float(np.abs(out - want).max())
    assert err < bound, f"max abs err {err:.3g} > {bound:.3g} ({r.stderr.strip()})"
    if n_q > 2 and not with_sinks:
        assert not out[:, 1].any(), "a fully masked query row must come out as zeros"


# Exact rows (ggml-fa-exact.h) beside the cache: (type_k, type_v, d, n_head, n_head_kv, n_q, n_kv,
# n_exact, exact type, sequences, sinks, resident). The exact rows run as one more KV slice; the
# combine adds their V after rotating the cache's back.
EXACT_CASES = [
    ("turboq3", "turboq3", 128, 4, 1, 1, 300, 49, "f32", 1, False, 64),   # decode, GQA 4, window 32 + margin 16 + a sink
    ("turboq4", "turboq2", 256, 4, 2, 3, 200, 40, "f16", 2, True, 4),     # two sequences' rows, attention sinks
    ("turboq3", "q8_0", 128, 4, 4, 2, 130, 20, "f32", 2, False, 1),       # no GQA, one cache slice
    ("f16", "turboq3", 256, 8, 2, 5, 64, 70, "f32", 1, False, 8),         # more exact rows than a chunk
    ("turboq3_g64", "turboq3_g64", 64, 9, 3, 1, 300, 49, "f32", 1, False, 64),  # SmolLM2's shape
]


@pytest.mark.parametrize("case", EXACT_CASES, ids=[f"{c[0]}-{c[1]}-d{c[2]}-q{c[5]}-exact{c[7]}-{c[8]}-seq{c[9]}" for c in EXACT_CASES])
def test_cuda_flash_attention_reads_exact_rows_beside_the_cache(emulated_cuda, case, tmp_path):
    type_k, type_v, d, n_head, n_head_kv, n_q, n_kv, n_exact, exact_type, n_seq, with_sinks, resident = case
    rng = np.random.default_rng(n_exact * 7 + d + n_kv)
    q = rng.standard_normal((n_head, n_q, d)).astype(np.float32)
    k = (rng.standard_normal((n_head_kv, n_kv, d)) * 0.5).astype(np.float32)
    v = rng.standard_normal((n_head_kv, n_kv, d)).astype(np.float32)
    # the exact rows as llama.cpp holds them, position-major ([n_exact][n_head_kv][d]); larger than
    # the cache's, as a sink's key is, so that a wrong scale or domain shows
    ek = (rng.standard_normal((n_exact, n_head_kv, d)) * 1.5).astype(np.float32)
    ev = (rng.standard_normal((n_exact, n_head_kv, d)) * 2.0).astype(np.float32)
    # the cache's copies of the last rows are hidden (they are read exact); query i belongs to
    # sequence i % n_seq and sees the exact rows of its sequence (row r belongs to r % n_seq), the
    # ubatch's own rows up to its position; one query row sees nothing at all
    mask = causal_mask(n_q, n_kv, hidden_prefix=0, hidden_row=None)
    mask[:, n_kv - 24:] = -np.inf
    emask = np.zeros((n_q, n_exact), np.float32)
    for i in range(n_q):
        emask[i, np.arange(n_exact) % n_seq != i % n_seq] = -np.inf
        emask[i, n_exact - n_q + i + 1:] = -np.inf
    if n_q > 2:
        mask[1] = -np.inf
        emask[1] = -np.inf
    mask, emask = mask.astype(np.float16), emask.astype(np.float16)
    sinks = rng.standard_normal(n_head).astype(np.float32) * 2 if with_sinks else None
    for arr, f in ((q, "q.f32"), (k, "k.f32"), (v, "v.f32"), (mask, "mask.f16"), (sinks, "sinks.f32"),
                   (ek, "ek.f32"), (ev, "ev.f32"), (emask, "emask.f16")):
        if arr is not None:
            arr.tofile(tmp_path / f)
    r = subprocess.run([str(emulated_cuda), "fa", str(cache_type(type_k).ggml_id), str(cache_type(type_v).ggml_id),
                        *map(str, (d, n_head, n_head_kv, n_q, n_kv, 0.0, 0.0, resident)),
                        *(str(tmp_path / f) for f in ("q.f32", "k.f32", "v.f32", "mask.f16")),
                        str(tmp_path / "sinks.f32") if with_sinks else "-", str(tmp_path / "out.f32"),
                        str(n_exact), str(cache_type(exact_type).ggml_id),
                        *(str(tmp_path / f) for f in ("ek.f32", "ev.f32", "emask.f16"))],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"exited {r.returncode}: {r.stderr[-2000:]}"
    out = np.fromfile(tmp_path / "out.f32", dtype=np.float32).reshape(n_q, n_head, d).transpose(1, 0, 2)

    # the reference: one softmax over the decoded cache and the exact rows, rounded to F16 as read
    def exact(x):
        return x.astype(np.float16).astype(np.float32).transpose(1, 0, 2)
    kd = np.concatenate([decoded(k, type_k), exact(ek)], axis=1)
    vd = np.concatenate([decoded(v, type_v), exact(ev)], axis=1)
    m = np.concatenate([mask, emask], axis=1).astype(np.float64)
    if with_sinks:
        m = np.concatenate([np.broadcast_to(m, (n_head, n_q, m.shape[1])), np.broadcast_to(sinks[:, None, None], (n_head, n_q, 1))], axis=2)
        kd = np.concatenate([kd, np.zeros((n_head_kv, 1, d), np.float32)], axis=1)
        vd = np.concatenate([vd, np.zeros((n_head_kv, 1, d), np.float32)], axis=1)
    want = reference.attention(q, kd, vd, 1.0 / np.sqrt(d), m)
    bound = 1e-4 * max(1.0, float(np.abs(want).max()))
    err = float(np.abs(out - want).max())
    assert err < bound, f"max abs err {err:.3g} > {bound:.3g} ({r.stderr.strip()})"
    # and the exact rows count: without them the result is another
    without = reference.attention(q, kd[:, :n_kv], vd[:, :n_kv], 1.0 / np.sqrt(d), m[..., :n_kv])
    assert float(np.abs(out - without).max()) > 100 * bound
    if n_q > 2:
        assert not out[:, 1].any(), "a fully masked query row must come out as zeros"


# A larger batch over exact rows (fattn-turboq-f16.cuh): the cache converted to F16 as mainline's
# kernels read it, each KV head's exact rows after its cache rows, zeros up to a multiple of 256,
# the two masks side by side and their rows padded to 128, hidden. The harness runs the shape
# check and the fill that CUDA runs, with the launches emulated. (type_k, type_v, d, n_head_kv,
# n_stream, n_q, n_kv, n_exact, exact type, the exact rows' streams)
F16_CASES = [
    ("turboq3", "turboq3", 128, 2, 1, 64, 512, 113, "f32", 1),             # padded to 768
    ("turboq4", "turboq2", 256, 1, 2, 16, 256, 40, "f16", 1),              # two streams read one set of exact rows
    ("turboq3", "turboq4", 128, 2, 3, 24, 256, 33, "f32", 3),              # each stream its own rows and mask
    ("f16", "turboq3", 128, 2, 1, 24, 300, 70, "f32", 1),                  # an f16 K is copied
    ("turboq3_g64", "turboq3_g64", 64, 3, 1, 130, 256, 49, "f32", 1),      # SmolLM2's shape; 130 queries: 256 mask rows
    ("turboq3t", "turboq3t", 128, 1, 1, 16, 200, 56, "f32", 1),            # 256 rows: no padding
]


@pytest.mark.parametrize("case", F16_CASES,
                         ids=[f"{c[0]}-{c[1]}-d{c[2]}-s{c[4]}-kv{c[6]}-exact{c[7]}-{c[8]}-es{c[9]}" for c in F16_CASES])
def test_cuda_prefill_appends_exact_rows_to_the_f16_conversion(emulated_cuda, case, tmp_path):
    type_k, type_v, d, n_head_kv, n_stream, n_q, n_kv, n_exact, exact_type, n_es = case
    rng = np.random.default_rng(n_kv + n_exact + d + n_stream)
    # the cache as llama.cpp holds it (a stream's rows, the KV heads of a row together), the exact
    # rows likewise; masks with hidden rows, -inf and finite values (ALiBi's distances)
    k = (rng.standard_normal((n_stream, n_kv, n_head_kv, d)) * 0.5).astype(np.float32)
    v = rng.standard_normal((n_stream, n_kv, n_head_kv, d)).astype(np.float32)
    ek = (rng.standard_normal((n_es, n_exact, n_head_kv, d)) * 1.5).astype(np.float32)
    ev = (rng.standard_normal((n_es, n_exact, n_head_kv, d)) * 2.0).astype(np.float32)
    mask = np.where(rng.random((n_stream, n_q, n_kv)) < 0.3, -np.inf, -rng.random((n_stream, n_q, n_kv))).astype(np.float16)
    emask = np.where(rng.random((n_es, n_q, n_exact)) < 0.3, -np.inf, -rng.random((n_es, n_q, n_exact))).astype(np.float16)
    for arr, f in ((k, "k.f32"), (v, "v.f32"), (mask, "mask.f16"), (ek, "ek.f32"), (ev, "ev.f32"), (emask, "emask.f16")):
        arr.tofile(tmp_path / f)
    r = subprocess.run([str(emulated_cuda), "fa-f16", str(cache_type(type_k).ggml_id), str(cache_type(type_v).ggml_id),
                        *map(str, (d, n_head_kv, n_stream, n_q, n_kv, n_exact, cache_type(exact_type).ggml_id, n_es)),
                        *(str(tmp_path / f) for f in ("k.f32", "v.f32", "mask.f16", "ek.f32", "ev.f32", "emask.f16")),
                        str(tmp_path / "out.bin")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"exited {r.returncode}: {r.stderr[-2000:]}"
    n_tot = -(-(n_kv + n_exact) // 256) * 256
    n_rows = -(-n_q // 128) * 128
    out = np.fromfile(tmp_path / "out.bin", dtype=np.float16)
    nk = n_stream * n_head_kv * n_tot * d
    assert out.size == 2 * nk + n_stream * n_rows * n_tot
    k16 = out[:nk].reshape(n_stream, n_head_kv, n_tot, d)
    v16 = out[nk:2 * nk].reshape(n_stream, n_head_kv, n_tot, d)
    m16 = out[2 * nk:].reshape(n_stream, n_rows, n_tot)

    for got, cache, exact, t in ((k16, k, ek, type_k), (v16, v, ev, type_v)):
        want = np.zeros_like(got)
        want[:, :, :n_kv] = decoded(cache, t).astype(np.float16).transpose(0, 2, 1, 3)
        want[:, :, n_kv:n_kv + n_exact] = exact.astype(np.float16).transpose(0, 2, 1, 3)  # rounded as read
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), f"the F16 {t} rows differ"
    want = np.full_like(m16, -np.inf)
    want[:, :n_q, :n_kv] = mask
    want[:, :n_q, n_kv:n_kv + n_exact] = emask
    assert np.array_equal(m16.view(np.uint16), want.view(np.uint16)), "the mask differs"
