#!/usr/bin/env python3
"""The files that the patch series creates, read from the patches and written back into them.

Each new file enters the series with the patch that introduces it (a diff from /dev/null), and
later patches change it as diffs. There is no copy of the new files anywhere else, so:

- `new_files()` rebuilds their final content from the patches alone (no upstream tree needed:
  `git apply --include` applies only their hunks), for tests and tools that read them;
- `write_new_files()` rewrites generated files (codebook tables, CUDA instances) inside the patch
  that creates them, which is allowed only where no later patch changes them.

Standard library only: prepare.py, worktree.py and pyturbo's generators load it by path.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERIES = HERE / "series"

_SECTION = re.compile(r"^diff --git a/(\S+) b/(\S+)\n", re.MULTILINE)


def series() -> list[Path]:
    names = [ln.strip() for ln in SERIES.read_text().splitlines()]
    return [HERE / n for n in names if n and not n.startswith("#")]


def _split(text: str) -> tuple[str, list[tuple[str, str]]]:
    """A patch as (header, [(path, section text)]), in order; joined back they are the patch."""
    starts = [(m.start(), m.group(2)) for m in _SECTION.finditer(text)]
    if not starts:
        return text, []
    head = text[:starts[0][0]]
    sections = []
    for i, (pos, path) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        sections.append((path, text[pos:end]))  # worktree.py exports without a signature
    return head, sections


def _is_creation(section: str) -> bool:
    return "\nnew file mode " in section.split("\n@@", 1)[0] or "\n--- /dev/null\n" in section


def creators() -> dict[str, Path]:
    """new file (upstream path) -> the patch that creates it"""
    out: dict[str, Path] = {}
    for patch in series():
        _, sections = _split(patch.read_text())
        for path, body in sections:
            if path and _is_creation(body):
                out.setdefault(path, patch)
    return out


@lru_cache(maxsize=1)
def _new_files_cached(key: tuple) -> dict[str, str]:
    made = creators()
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(Path(tmp).parent)}
        for patch in series():
            text = patch.read_text()
            paths = {p for p, _ in _split(text)[1] if p in made}
            if not paths:
                continue
            args = ["git", "apply", "--whitespace=nowarn", "-p1", *(f"--include={p}" for p in sorted(paths)), str(patch)]
            r = subprocess.run(args, cwd=tmp, capture_output=True, text=True, env=env)
            if r.returncode != 0:
                raise RuntimeError(f"series_io: {patch.name}: {r.stderr.strip()}")
        for rel in made:
            p = Path(tmp) / rel
            if p.exists():
                out[rel] = p.read_text()
    return out


def new_files() -> dict[str, str]:
    """upstream path -> final content, for every file the series creates (and does not delete)"""
    key = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in [SERIES, *series()])
    return dict(_new_files_cached(key))


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _creation_section(rel: str, text: str) -> str:
    lines = text.split("\n")
    no_eol = not text.endswith("\n")
    if not no_eol:
        lines = lines[:-1]
    out = [f"diff --git a/{rel} b/{rel}", "new file mode 100644",
           f"index 0000000000000000000000000000000000000000..{_blob_id(text.encode())}",
           "--- /dev/null", f"+++ b/{rel}", f"@@ -0,0 +1,{len(lines)} @@" if len(lines) != 1 else "@@ -0,0 +1 @@"]
    out += ["+" + ln for ln in lines]
    if no_eol:
        out.append("\\ No newline at end of file")
    return "\n".join(out) + "\n"


def write_new_files(patch_glob: str, files: dict[str, str], remove: str | None = None) -> list[str]:
    """Set the content of generated new files in the one patch matching patch_glob (adding a
    creation for a file it lacks); with remove (a glob over upstream paths), drop the creations it
    matches that `files` does not name. Refused where a later patch touches one of them. Returns
    the paths whose content changed."""
    patches = series()
    found = [p for p in patches if fnmatch.fnmatch(p.name, patch_glob)]
    if len(found) != 1:
        raise ValueError(f"series_io: {patch_glob!r} matches {len(found)} patches of the series, not one")
    patch = found[0]
    later = patches[patches.index(patch) + 1:]
    touched_later = {path for p in later for path, _ in _split(p.read_text())[1]}
    head, sections = _split(patch.read_text())
    current = {path: i for i, (path, _) in enumerate(sections)}
    changed = []
    for rel, text in files.items():
        if rel in touched_later:
            raise ValueError(f"series_io: a later patch changes {rel}; edit the series in a work tree instead")
        new = _creation_section(rel, text)
        if rel in current:
            old = sections[current[rel]][1]
            if not _is_creation(old):
                raise ValueError(f"series_io: {patch.name} changes {rel} but does not create it")
            if old != new:
                sections[current[rel]] = (rel, new)
                changed.append(rel)
        else:
            sections.append((rel, new))
            changed.append(rel)
    if remove is not None:
        keep = []
        for path, body in sections:
            if fnmatch.fnmatch(path, remove) and path not in files and _is_creation(body):
                changed.append(path)
                continue
            keep.append((path, body))
        sections = keep
    if changed:
        patch.write_text(head + "".join(s for _, s in sections))
    return sorted(changed)
