from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pyturbo import _paths  # noqa: E402


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
    from pyturbo._ggml import ggml
    return ggml()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def run_env() -> dict:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(_paths.lib_dir()) + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env
