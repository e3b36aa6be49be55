"""Where the patched llama.cpp build lives, and the one place that points processes at it.

The libraries and tools are looked for, in order:
1. $PYTURBO_BUILD_DIR/bin, when PYTURBO_BUILD_DIR is set;
2. pyturbo/native, where `pip install .` puts them;
3. <checkout>/build/bin, what `bash scripts/setup.sh` (or `cmake -S . -B build`) makes.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
from functools import lru_cache
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent  # meaningful in a checkout (and an editable install) only
PIN_FILE = PACKAGE_DIR / "upstream.json"

def library_file(name: str) -> str:
    """The file name of built library `name` ("llama", "ggml-base", ...) on this platform."""
    return {"win32": f"{name}.dll", "darwin": f"lib{name}.dylib"}.get(sys.platform, f"lib{name}.so")


_MARKER = library_file("ggml-base")


@lru_cache(maxsize=1)
@lru_cache(maxsize=None)
def series_io():
    """ggml_patches/series_io.py (a checkout only): the new files of the patch series, read from and
    written into the patches; loaded by path, as prepare.py loads it, since ggml_patches is no package."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("pyturbo_series_io", REPO_ROOT / "ggml_patches" / "series_io.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pin() -> dict:
    """The upstream pin (pyturbo/upstream.json): llama.cpp commit and the sdist that vendors it."""
    return json.loads(PIN_FILE.read_text())


def build_dirs() -> dict[str, Path]:
    """The checkout's build directories by variable name (PYTURBO_BUILD_DIR, PYTURBO_VULKAN_BUILD_DIR,
    ...): scripts/build_dirs.sh's defaults, each overridden by its environment variable."""
    import re

    defaults = {"PYTURBO_BUILD_DIR": "build"}  # an installed package has no scripts/
    script = REPO_ROOT / "scripts" / "build_dirs.sh"
    if script.exists():
        defaults.update(re.findall(r'^: "\$\{(\w+):=([^}]+)\}"', script.read_text(), re.MULTILINE))
    return {name: Path(os.environ.get(name) or REPO_ROOT / value).resolve() for name, value in defaults.items()}


def build_dir() -> Path:
    """The CMake build directory of a checkout build (PYTURBO_BUILD_DIR, else scripts/build_dirs.sh's)."""
    return build_dirs()["PYTURBO_BUILD_DIR"]


def lib_dir() -> Path:
    """Directory with libllama.so, libggml*.so and the tools (llama.cpp puts them side by side)."""
    if os.environ.get("PYTURBO_BUILD_DIR"):
        return build_dir() / "bin"
    installed = PACKAGE_DIR / "native"
    if (installed / _MARKER).exists():
        return installed
    return build_dir() / "bin"


def library(name: str, directory: Path | None = None, mode: int = ctypes.DEFAULT_MODE) -> ctypes.CDLL:
    """Load built library `name` ("llama", "ggml", "ggml-base", "ggml-cpu") from directory (lib_dir())."""
    return ctypes.CDLL(str((directory or lib_dir()) / library_file(name)), mode=mode)


@lru_cache(maxsize=None)
def llama_function(name: str, restype, *argtypes):
    """libllama's function `name`, typed once: the rules and keys that pyturbo asks the library for
    rather than keeping copies (restype/argtypes: ctypes types)."""
    fn = getattr(library("llama"), name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def binary(name: str) -> Path:
    path = lib_dir() / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: build it with `bash scripts/setup.sh` "
                                f"(or `cmake --build {build_dir()} --target pyturbo`), or `pip install .`")
    return path


def tool_env(extra: dict[str, str] | None = None, libs: Path | None = None) -> dict[str, str]:
    """The environment for a child process that runs a built tool (libs: another build's bin, e.g. Vulkan)."""
    env = dict(os.environ)
    libs = libs or lib_dir()
    env["LD_LIBRARY_PATH"] = str(libs) + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    env.update(extra or {})
    return env


class UnpatchedLibraryError(ImportError):
    """The libllama that llama-cpp-python would load is not this project's patched build."""


def use_patched_llama_cpp() -> Path:
    """Point llama-cpp-python at the patched libllama (LLAMA_CPP_LIB_PATH), before llama_cpp is imported.

    A LLAMA_CPP_LIB_PATH that the user set is kept, but it must hold a patched build: an
    unpatched libllama would abort on the first turboq cache instead of refusing it.
    """
    path = Path(os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(lib_dir())))
    base = path / _MARKER
    if not base.exists():
        raise UnpatchedLibraryError(f"LLAMA_CPP_LIB_PATH={path}: no {_MARKER} there; build pyturbo "
                                    f"(bash scripts/setup.sh) or point it at a pyturbo build's bin directory")
    try:
        lib = library("ggml-base", path)
        patched = hasattr(lib, "ggml_is_turboq")
    except OSError as e:
        raise UnpatchedLibraryError(f"LLAMA_CPP_LIB_PATH={path}: {base} does not load: {e}") from None
    if not patched:
        raise UnpatchedLibraryError(f"LLAMA_CPP_LIB_PATH={path}: {base} is an unpatched llama.cpp build "
                                    f"(no turboq types); unset LLAMA_CPP_LIB_PATH or point it at a pyturbo build")
    return path


def cache_dir() -> Path:
    """Where fetched inputs live (the upstream sdist, models, corpus): $PYTURBO_CACHE or ~/.cache/pyturbo."""
    base = os.environ.get("PYTURBO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pyturbo")
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path
