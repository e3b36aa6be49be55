from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pyturbo import _paths

ROOT = Path(__file__).resolve().parent.parent


def pytest_report_header(config):
    return f"pyturbo build: {_paths.build_dir()}"


@pytest.fixture(scope="session")
def build_info() -> dict:
    path = _paths.build_dir() / "pyturbo-build.json"
    if not path.exists():
        pytest.fail(f"no build at {_paths.build_dir()}: run `bash scripts/setup.sh` first")
    return json.loads(path.read_text())


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
