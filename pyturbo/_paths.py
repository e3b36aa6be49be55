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
