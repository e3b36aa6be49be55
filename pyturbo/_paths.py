"""Where the patched llama.cpp build lives.

Default: <checkout>/build (what `cmake -S . -B build` makes). PYTURBO_BUILD_DIR overrides it.
"""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def build_dir() -> Path:
    env = os.environ.get("PYTURBO_BUILD_DIR")
    return Path(env).resolve() if env else REPO_ROOT / "build"


def lib_dir() -> Path:
    """Directory with libllama.so and libggml*.so (llama.cpp puts them beside the binaries)."""
    return build_dir() / "bin"


def binary(name: str) -> Path:
    path = lib_dir() / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: build it with `cmake --build {build_dir()} --target pyturbo`")
    return path


def cache_dir() -> Path:
    """Where fetched inputs live (the upstream sdist, models, corpus): $PYTURBO_CACHE or ~/.cache/pyturbo."""
    base = os.environ.get("PYTURBO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pyturbo")
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path
