#!/usr/bin/env python3
"""Produce the patched llama.cpp source tree that the build compiles.

Steps: fetch the pinned llama-cpp-python sdist (cached), check its sha256,
extract vendor/llama.cpp, apply the series with `git apply` (new files enter with the patch
that introduces them); with --sign-seed N (CMake's PYTURBO_SIGN_SEED, a debug option), swap the rotation
signs of the generated tables for seed N's (pyturbo/format/signs.py). The result is synced into
--dest file by file, so an unchanged file keeps its mtime and a rebuild after a patch edit
recompiles only what the patch touched.
"""
from __future__ import annotations

import argparse
import filecmp
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(name: str, rel: str):
    # modules of pyturbo that use the standard library only, loaded by file so that this script
    # runs before pyturbo is installed and without touching sys.path
    spec = importlib.util.spec_from_file_location(name, HERE.parent / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_series_io = _load("pyturbo_series_io", "ggml_patches/series_io.py")  # the series and its new files
SERIES = _series_io.SERIES
series = _series_io.series
_paths = _load("pyturbo_paths", "pyturbo/_paths.py")  # the pin and the cache location
_signs = _load("pyturbo_signs", "pyturbo/format/signs.py")  # a seeded build's rotation signs
SIGNED_TABLES = {  # the generated tables whose sign blocks a seeded build replaces; True: GLSL
    Path("ggml/src/ggml-turboq-tables.h"): False,
    Path("ggml/src/ggml-vulkan/vulkan-shaders/turboq_tables.glsl"): True,
}
cache_dir = _paths.cache_dir
_PIN = _paths.pin()
UPSTREAM_COMMIT = _PIN["llama_cpp_commit"]
UPSTREAM_SDIST = f"{_PIN['sdist_project']}=={_PIN['sdist_version']}"
UPSTREAM_SDIST_SHA256 = _PIN["sdist_sha256"]
_SDIST_STEM = f"{_PIN['sdist_project'].replace('-', '_')}-{_PIN['sdist_version']}"
UPSTREAM_SDIST_NAME = f"{_SDIST_STEM}.tar.gz"
VENDOR_PREFIX = f"{_SDIST_STEM}/vendor/llama.cpp/"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_from_index(tmp: str) -> Path | None:
    """The sdist straight from the package index's simple page (PIP_INDEX_URL, else PyPI), or None.
    `pip download` of an sdist first builds its metadata in an isolated environment, which on a
    fresh machine (no pip cache) downloads and installs scikit-build-core, cmake and ninja: minutes
    for a file whose bytes the pinned sha256 already vouches for."""
    import http.client
    import re
    import urllib.error
    import urllib.parse
    import urllib.request

    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    page = f"{index}/{_PIN['sdist_project']}/"
    try:
        with urllib.request.urlopen(page, timeout=30) as r:
            html = r.read().decode("utf-8", "replace")
        link = re.search(r'href="([^"]*/' + re.escape(UPSTREAM_SDIST_NAME) + r'[^"]*)"', html)
        if not link:
            return None
        url = urllib.parse.urljoin(page, link.group(1).replace("&amp;", "&")).split("#")[0]
        got = Path(tmp) / UPSTREAM_SDIST_NAME
        with urllib.request.urlopen(url, timeout=120) as r, open(got, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
        return got
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        print(f"prepare: {page}: {e}; trying pip download", file=sys.stderr)
        return None


def fetch_sdist() -> Path:
    dest = cache_dir() / UPSTREAM_SDIST_NAME
    if dest.exists() and sha256_of(dest) == UPSTREAM_SDIST_SHA256:
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        got = _download_from_index(tmp)
        digest = sha256_of(got) if got is not None else None
        if digest != UPSTREAM_SDIST_SHA256:
            pip_dir = Path(tmp) / "pip"  # not beside a bad download, which pip would take as its own
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "--quiet", UPSTREAM_SDIST, "-d", str(pip_dir)], check=True)
            got = pip_dir / UPSTREAM_SDIST_NAME
            digest = sha256_of(got)
        if digest != UPSTREAM_SDIST_SHA256:
            sys.exit(f"prepare: {UPSTREAM_SDIST_NAME} sha256 {digest} != pinned {UPSTREAM_SDIST_SHA256}")
        shutil.copyfile(got, dest)
    return dest


def extract_upstream(sdist: Path, out: Path) -> None:
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(VENDOR_PREFIX):
                continue
            m.name = m.name[len(VENDOR_PREFIX):]
            # the sdist keeps llama.cpp's submodule gitlink; it points nowhere here
            if m.name and m.name != ".git":
                members.append(m)
        tar.extractall(out, members=members, filter="data")


def apply_series(tree: Path) -> None:
    for patch in series():
        # inside another work tree (build/ is in the checkout) `git apply` would silently skip every
        # path outside the current directory; the ceiling keeps it from finding that repository
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.resolve().parent)}
        r = subprocess.run(["git", "apply", "--whitespace=nowarn", "-p1", str(patch)],
                           cwd=tree, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            sys.exit(f"prepare: patch {patch.name} does not apply to llama.cpp {UPSTREAM_COMMIT}:\n{r.stderr}")


def seed_signs(tree: Path, seed: int) -> None:
    """Draw the rotation signs from seed in every generated table, so all backends agree."""
    for rel, glsl in SIGNED_TABLES.items():
        path = tree / rel
        path.write_text(_signs.seeded(path.read_text(), seed, glsl))


def sync_tree(src: Path, dest: Path) -> int:
    """Mirror src into dest, touching only files whose content differs. Returns the count changed."""
    changed = 0
    seen: set[Path] = set()
    for root, _dirs, files in os.walk(src):
        rel_root = Path(root).relative_to(src)
        (dest / rel_root).mkdir(parents=True, exist_ok=True)
        for name in files:
            rel = rel_root / name
            seen.add(rel)
            s, d = src / rel, dest / rel
            if d.exists() and filecmp.cmp(s, d, shallow=False):
                continue
            shutil.copy2(s, d)
            changed += 1
    for root, _dirs, files in os.walk(dest):
        rel_root = Path(root).relative_to(dest)
        for name in files:
            rel = rel_root / name
            if rel not in seen:
                (dest / rel).unlink()
                changed += 1
    return changed


def inputs_digest(sign_seed: int | None = None) -> str:
    h = hashlib.sha256(UPSTREAM_SDIST_SHA256.encode())
    if sign_seed is not None:
        h.update(f"sign seed {sign_seed}".encode())
        h.update((HERE.parent / "pyturbo" / "format" / "signs.py").read_bytes())
    for p in [SERIES, *series()]:
        h.update(str(p.relative_to(HERE)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dest", type=Path, help="directory that receives the patched tree")
    ap.add_argument("--print-sdist", action="store_true", help="fetch the pinned sdist (cached) and print its path")
    ap.add_argument("--pristine", action="store_true", help="extract upstream only, apply nothing")
    ap.add_argument("--sign-seed", default="", metavar="N",
                    help="draw the rotation signs from seed N (CMake's PYTURBO_SIGN_SEED; a debug option)")
    args = ap.parse_args()
    try:
        sign_seed = _signs.parse_seed(args.sign_seed) if args.sign_seed else None
    except ValueError as e:
        ap.error(str(e))
    if sign_seed is not None and args.pristine:
        ap.error("--sign-seed applies to the patched tree, not to --pristine")
    if args.print_sdist:
        print(fetch_sdist())
        return
    if args.dest is None:
        ap.error("--dest is required")
    dest: Path = args.dest.resolve()
    stamp = dest.parent / (dest.name + ".stamp")
    digest = "pristine" if args.pristine else inputs_digest(sign_seed)
    if stamp.exists() and stamp.read_text() == digest and dest.is_dir():
        return
    sdist = fetch_sdist()
    with tempfile.TemporaryDirectory(dir=dest.parent if dest.parent.exists() else None) as tmp:
        staging = Path(tmp) / "llama.cpp"
        extract_upstream(sdist, staging)
        if not args.pristine:
            apply_series(staging)
        if sign_seed is not None:
            seed_signs(staging, sign_seed)
        dest.mkdir(parents=True, exist_ok=True)
        n = sync_tree(staging, dest)
    stamp.write_text(digest)
    seeded = f", rotation signs from seed {sign_seed}" if sign_seed is not None else ""
    print(f"prepare: llama.cpp {UPSTREAM_COMMIT} + {len(series())} patches{seeded} -> {dest} ({n} files updated)")


if __name__ == "__main__":
    main()
