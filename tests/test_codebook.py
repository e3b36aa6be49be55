"""The C tables are generated from pyturbo.codebook; the codebooks are what the paper prescribes."""
from __future__ import annotations

import numpy as np
import pytest

from pyturbo import codebook


def test_header_is_regenerated_identically():
    for path, text in codebook.generated_files().items():
        assert path.read_text() == text, f"{path.name} is stale: run `python -m pyturbo.codebook --write` and commit it"


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
