"""The CUDA backend's turboq codec kernels, run on the CPU under emulation, against the NumPy reference.

tests/harness/turboq_cuda_emulation.cpp compiles ggml-cuda/turboq-device.cuh (the SET_ROWS,
GET_ROWS and CPY kernels and the warp-level codec they share) for the host, with each warp run as
32 threads whose shuffles pass through a barrier. It needs no GPU and no nvcc, so this is where the
CUDA codec of every type, the _g64 and _g32 twins included, is checked bit for bit where CI runs.
What it cannot show: the GPU's flush-to-zero of subnormals (-use_fast_math), timing and races
beyond the barriers, flash attention, and the host launches in turboq.cu (bench/cuda_check.sh runs
those on a GPU).
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pyturbo import _paths
from pyturbo.lab import reference
from pyturbo.types import TURBOQ_TWIN_TYPES, TURBOQ_TYPES, cache_type

from helpers import special_groups  # tests/ is on sys.path (pytest prepend mode)

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


@pytest.mark.parametrize("type_name", [*TURBOQ_TYPES, *TURBOQ_TWIN_TYPES])
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
