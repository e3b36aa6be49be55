"""ggml-turboq.c under ASan + UBSan, fuzzed against the NumPy reference with hypothesis."""
from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pyturbo.format import reference
from pyturbo.types import TURBOQ_STORED_TYPES, cache_type

HARNESS = Path(__file__).resolve().parent / "harness" / "turboq_fuzz.c"


@pytest.fixture(scope="session")
def sanitized_codec(build_info, tmp_path_factory) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.fail("a C compiler is needed for the sanitizer harness")
    src = Path(build_info["upstream_src"]) / "ggml"
    exe = tmp_path_factory.mktemp("asan") / "turboq_fuzz"
    subprocess.run([cc, "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    "-fno-omit-frame-pointer", "-ffp-contract=off",
                    f"-I{src / 'include'}", f"-I{src / 'src'}", str(HARNESS), str(src / "src" / "ggml-turboq.c"),
                    "-lm", "-o", str(exe)], check=True)
    return exe


def run_harness(exe: Path, type_name: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = cache_type(type_name)
    groups = x.size // 128
    payload = struct.pack("<ii", t.ggml_id, groups) + x.astype("<f4").tobytes()
    r = subprocess.run([str(exe)], input=payload, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-3000:]
    nbytes = x.size // t.block_size * t.block_bytes
    blocks = np.frombuffer(r.stdout[:nbytes], dtype=np.uint8)
    values = np.frombuffer(r.stdout[nbytes:], dtype="<f4")
    assert values.size == x.size
    return blocks, values


special = st.sampled_from([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, -1e-45, 1e-38, 3.4e38, -3.4e38, 1.0, 65504.0, 1e-8])
floats = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True), special)


@st.composite
def groups(draw):
    n = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["any", "normal", "constant", "sparse"]))
    if kind == "any":
        return draw(hnp.arrays(np.float32, n * 128, elements=floats))
    if kind == "constant":
        return np.full(n * 128, draw(floats), dtype=np.float32)
    if kind == "sparse":
        x = np.zeros(n * 128, dtype=np.float32)
        for _ in range(draw(st.integers(1, 5))):
            x[draw(st.integers(0, n * 128 - 1))] = draw(floats)
        return x
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30]))
    return (np.random.default_rng(seed).standard_normal(n * 128) * scale).astype(np.float32)


@pytest.mark.parametrize("type_name", TURBOQ_STORED_TYPES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(x=groups())
def test_sanitized_codec_matches_reference(sanitized_codec, type_name, x):
    blocks, values = run_harness(sanitized_codec, type_name, x)
    np.testing.assert_array_equal(blocks, reference.quantize(x, type_name))
    np.testing.assert_array_equal(values.view(np.uint32), reference.dequantize(blocks, type_name).view(np.uint32))
    # a group with NaN/Inf decodes to zeros; every other group is untouched by it
    g = x.reshape(-1, cache_type(type_name).block_size)
    v = values.reshape(-1, cache_type(type_name).block_size)
    assert np.all(np.isfinite(v))
    bad = ~np.all(np.isfinite(g), axis=1)
    assert np.all(v[bad] == 0)
