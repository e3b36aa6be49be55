"""The generated sources: the C/GLSL tables from pyturbo.format.codebook (the codebooks being what the
paper prescribes) and the CUDA flash-attention instances from pyturbo.format.cuda_instances."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyturbo._paths import series_io
from pyturbo.format import codebook, cuda_instances


def test_header_is_regenerated_identically():
    have = series_io().new_files()
    for path, text in codebook.generated_files().items():
        assert have[path] == text, f"{path} is stale: run `python -m pyturbo.format.codebook --write` and commit it"


def test_cuda_instances_are_regenerated_identically_and_dispatched():
    """The instance files and their case list (fattn-turboq-cases.inc) are the generator's and the
    cuda patch creates them; it builds every instance file, and turboq.cu declares and dispatches
    the case list."""
    io = series_io()
    have = io.new_files()
    for path, text in cuda_instances.generated_files().items():
        assert have.get(path) == text, f"{path} is stale: run `python -m pyturbo.format.cuda_instances --write`"
    in_series = {p for p in have if p.startswith(cuda_instances.DIR + "/fattn-turboq-instance-")}
    assert in_series == {p for p in cuda_instances.generated_files() if p.startswith(cuda_instances.DIR + "/")}, \
        "instance files that the generator does not write would be built too"
    made = io.creators()
    (cuda_patch,) = {made[p] for p in cuda_instances.generated_files()}
    assert cuda_patch.match(cuda_instances.PATCH)
    assert '+    file(GLOB SRCS "template-instances/fattn-turboq-instance-*.cu")' in cuda_patch.read_text()
    cu = have["ggml/src/ggml-cuda/turboq.cu"]
    assert cu.count('#include "fattn-turboq-cases.inc"') == 3  # declared, reported as supported, dispatched


def test_generated_files_are_written_into_the_patch_that_creates_them(tmp_path, monkeypatch):
    """--write's path: a generated file's content replaced inside its creating patch, a new one
    added to it, one removed, and the series still applying to give exactly that content."""
    import shutil
    io = series_io()
    for p in [io.SERIES, *io.series()]:
        shutil.copy(p, tmp_path / p.name)
    monkeypatch.setattr(io, "SERIES", tmp_path / "series")
    monkeypatch.setattr(io, "HERE", tmp_path)
    rel = cuda_instances.CASES_FILE
    gone = sorted(p for p in cuda_instances.generated_files() if "instance-d64-" in p)[0]
    extra = cuda_instances.DIR + "/fattn-turboq-instance-d999-kx.cu"
    changed = io.write_new_files(cuda_instances.PATCH, {rel: "// one line, no newline", extra: "a\nb\n"},
                                 remove=cuda_instances.DIR + "/fattn-turboq-instance-d64-*.cu")
    assert rel in changed and extra in changed and gone in changed
    have = io.new_files()
    assert have[rel] == "// one line, no newline" and have[extra] == "a\nb\n" and gone not in have
    with pytest.raises(ValueError, match="matches 0 patches"):
        io.write_new_files("*-no-such-*.patch", {rel: ""})


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_lloyd_max_conditions(bits):
    lm = codebook.lloyd_max(bits)
    c = lm.centroids
    assert len(c) == 1 << bits
    assert np.all(np.diff(c) > 0)
    np.testing.assert_allclose(c, -c[::-1], atol=1e-15)  # symmetric density, symmetric codebook
    # centroid condition checked against an independent Monte Carlo of the coordinate density
    rng = np.random.default_rng(7)
    u = rng.standard_normal((40000, codebook.D))
    x = (u / np.linalg.norm(u, axis=1, keepdims=True)).ravel()
    idx = np.searchsorted(lm.thresholds, x)
    for k in range(len(c)):
        assert abs(x[idx == k].mean() - c[k]) < 2e-3
    mse = np.mean((x - c[idx]) ** 2)
    assert abs(mse - lm.mse) / lm.mse < 0.01


def test_theoretical_mse_matches_gaussian_limit():
    # for large d the coordinate is N(0, 1/d): Lloyd-Max Gaussian distortion 0.1175 / 0.03454 / 0.009497
    for bits, gauss in ((2, 0.1175), (3, 0.03454), (4, 0.009497)):
        assert abs(codebook.lloyd_max(bits).vector_mse - gauss) / gauss < 0.03


def test_signs_are_balanced_and_fixed():
    s1, s2 = codebook.rotation_signs()
    assert set(np.unique(s1)) == {-1.0, 1.0} and set(np.unique(s2)) == {-1.0, 1.0}
    assert 40 < (s1 > 0).sum() < 88 and 40 < (s2 > 0).sum() < 88
    assert not np.array_equal(s1, s2)


def test_a_seeded_tree_swaps_only_the_sign_blocks():
    """prepare.py's seeding (cmake -DPYTURBO_SIGN_SEED) replaces the shipped sign block of each
    generated table with the seed's, and nothing else; the C block names the seed."""
    from pyturbo.format import signs
    have = series_io().new_files()
    for path, glsl in ((codebook.HEADER_PATH, False), (codebook.GLSL_PATH, True)):
        text = have[path]
        seeded = signs.seeded(text, 7, glsl)
        block = signs.glsl_block(7) if glsl else signs.c_block(7)
        assert block in seeded and seeded.replace(block, signs.glsl_block() if glsl else signs.c_block()) == text
        assert ('#define TURBOQ_SIGN_SEED_BUILD "7"' in seeded) != glsl
        with pytest.raises(ValueError, match="no shipped sign block"):
            signs.seeded(seeded, 8, glsl)
    s1, s2 = signs.sign_lists(7)
    assert (s1, s2) != signs.sign_lists() and 40 < s1.count(-1.0) < 88


def test_prepare_refuses_a_bad_seed(tmp_path):
    import subprocess
    import sys
    script = Path(__file__).resolve().parents[1] / "ggml_patches" / "prepare.py"
    for bad, why in (("seven", "not an integer"), (str(1 << 64), "out of range")):
        r = subprocess.run([sys.executable, str(script), "--dest", str(tmp_path / "t"), "--sign-seed", bad],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and why in r.stderr and not (tmp_path / "t").exists(), r.stderr


@pytest.mark.seeded
def test_a_seeded_build_compiles_its_signs_for_every_backend(seeded_build):
    """The seeded build's ggml-base reports its seed and uses its signs, and the tree it compiled
    (CPU, CUDA: the C header; Vulkan: the GLSL) carries them."""
    import json
    import subprocess
    import sys
    from pyturbo.format import signs
    bin_dir, seed = seeded_build
    probe = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
lib.ggml_turboq_sign_seed.restype = ctypes.c_char_p
p1, p2 = ctypes.POINTER(ctypes.c_float)(), ctypes.POINTER(ctypes.c_float)()
lib.ggml_turboq_signs(ctypes.byref(p1), ctypes.byref(p2))
print(json.dumps([lib.ggml_turboq_sign_seed().decode(), [p1[i] for i in range(128)], [p2[i] for i in range(128)]]))
"""
    from pyturbo._paths import library_file
    r = subprocess.run([sys.executable, "-c", probe, str(bin_dir / library_file("ggml-base"))],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got_seed, s1, s2 = json.loads(r.stdout)
    assert got_seed == seed and (s1, s2) == signs.sign_lists(int(seed))
    tree = Path(json.loads((bin_dir.parent / "pyturbo-build.json").read_text())["upstream_src"])
    assert signs.c_block(int(seed)) in (tree / "ggml/src/ggml-turboq-tables.h").read_text()
    assert signs.glsl_block(int(seed)) in (tree / "ggml/src/ggml-vulkan/vulkan-shaders/turboq_tables.glsl").read_text()
    import os
    env = {**os.environ, "PYTURBO_BUILD_DIR": str(bin_dir.parent)}
    env.pop("LLAMA_CPP_LIB_PATH", None)
    r = subprocess.run([sys.executable, "-m", "pyturbo", "doctor"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and f"rotation signs: PYTURBO_SIGN_SEED={seed} (a debug build)" in r.stdout, r.stdout + r.stderr
