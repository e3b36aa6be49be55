"""The generated sources: the C/GLSL tables from pyturbo.lab.codebook (the codebooks being what the
paper prescribes) and the CUDA flash-attention instances from pyturbo.lab.cuda_instances."""
from __future__ import annotations

import numpy as np
import pytest

from pyturbo.lab import codebook, cuda_instances


def test_header_is_regenerated_identically():
    for path, text in codebook.generated_files().items():
        assert path.read_text() == text, f"{path.name} is stale: run `python -m pyturbo.lab.codebook --write` and commit it"


def test_cuda_instances_are_regenerated_identically_and_dispatched():
    """The instance files are the generator's; the CMake loop (the cuda patch, 20) builds exactly them and
    turboq.cu's dispatch macro declares exactly the generator's cases."""
    import re
    for path, text in cuda_instances.generated_files().items():
        assert path.read_text() == text, f"{path.name} is stale: run `python -m pyturbo.lab.cuda_instances --write`"
    patches = cuda_instances.DIR.parents[4]
    cmake = next(patches.glob("*-cuda-turboq*.patch")).read_text()
    assert re.search(r"foreach\(D (.*)\)", cmake).group(1).split() == [str(d) for d in cuda_instances.HEAD_SIZES]
    assert re.search(r"foreach\(K (.*)\)", cmake).group(1).split() == list(cuda_instances.K_TYPES)
    cu = (cuda_instances.DIR.parent / "turboq.cu").read_text()
    macro = {m.group(1): re.findall(r"X\(D, type_K, GGML_TYPE_(\w+)\)", m.group(2))
             for m in re.finditer(r"#define (TQ_FA_FOR_V_\w+)\(X, D, type_K\)((?:.*\\\n)*.*)", cu)}
    v_all = macro["TQ_FA_FOR_V_ALL"] + macro["TQ_FA_FOR_V_TQ"]
    body = re.search(r"#define TQ_FA_FOR_ALL_D\(X, D\)((?:.*\\\n)*.*)", cu).group(1)
    declared = {(k.lower(), v.lower())
                for kind, k in re.findall(r"(TQ_FA_FOR_V_\w+) *\(X, D, GGML_TYPE_(\w+)\)", body)
                for v in (v_all if kind == "TQ_FA_FOR_V_ALL" else macro[kind])}
    sizes = [int(d) for d in re.findall(r"^TQ_FA_FOR_ALL_D\(EXTERN_DECL_TQ_FA_CASE, (\d+)\)", cu, re.M)]
    assert sizes == list(cuda_instances.HEAD_SIZES)
    assert declared == {(k, v) for _, k, v in cuda_instances.cases()}


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
