from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pyturbo import _paths

ROOT = Path(__file__).resolve().parent.parent


def pytest_report_header(config):
    return f"pyturbo build: {_paths.build_dir()}"


# the tiers (pyproject.toml's markers): a test that takes one of these fixtures needs that build and
# carries its marker even where the test forgot it, so `scripts/test.sh --quick`, which does not
# build them, deselects it rather than letting it skip (or fail, under CI=true)
TREE_MARKERS = {"seeded_build": "seeded", "vk_bin": "vulkan", "emulated_cuda": "cuda_emulation"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items):
    for item in items:
        for fixture, marker in TREE_MARKERS.items():
            if fixture in getattr(item, "fixturenames", ()) and not item.get_closest_marker(marker):
                item.add_marker(marker)


@pytest.fixture(scope="session", autouse=True)
def fetched_data() -> dict[str, Path]:
    """The real data (the models, botchan.txt), downloaded once before the first test: pyturbo's
    library code finds it and never downloads (`python -m pyturbo fetch` does)."""
    from pyturbo import fetch
    try:
        return fetch.fetch()
    except fetch.FetchError as e:
        pytest.exit(f"the tests need the real data, and fetching it failed: {e}", returncode=3)


@pytest.fixture(scope="session")
def build_info() -> dict:
    path = _paths.build_dir() / "pyturbo-build.json"
    if not path.exists():
        pytest.fail(f"no build at {_paths.build_dir()}: run `bash scripts/setup.sh` first")
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def seeded_build(build_info) -> tuple[Path, str]:
    """(bin dir, seed) of scripts/build_seeded.sh's build, whose rotation signs come from
    PYTURBO_SIGN_SEED; missing, the test skips, except under CI=true, where it fails."""
    import os

    from pyturbo.format.signs import parse_seed
    path = _paths.build_dirs()["PYTURBO_SEEDED_BUILD_DIR"]
    info = path / "pyturbo-build.json"
    seed = json.loads(info.read_text()).get("sign_seed", "") if info.exists() else ""
    needed = [path / "bin" / name for name in (_paths.library_file("llama"), "llama-perplexity", "ggml-rpc-server")]
    if not seed or not all(p.exists() for p in needed):
        msg = f"no seeded build at {path}: run `bash scripts/build_seeded.sh`"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return path / "bin", str(parse_seed(seed))  # as the library spells it


@pytest.fixture(scope="session")
def lib(build_info):
    from pyturbo.ggml import ggml
    return ggml()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def Llama(build_info):
    """pyturbo.Llama (importing it sets LLAMA_CPP_LIB_PATH, so only once a build exists)."""
    from pyturbo.llama import Llama
    return Llama


@pytest.fixture(scope="session")
def short_text(build_info):
    """The first 12000 characters of botchan.txt, as a file."""
    from pyturbo import data
    return data.corpus_slice(12000)


@pytest.fixture(scope="session")
def tiny128(build_info):
    """A tiny random llama GGUF with 128-value heads (f32 weights)."""
    from pyturbo import data
    return data.tiny_model(head_dim=128)
