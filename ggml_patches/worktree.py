#!/usr/bin/env python3
"""Edit the patch series as ordinary git work.

  python3 ggml_patches/worktree.py apply DIR    # DIR becomes a git repo: upstream, one commit per patch
  python3 ggml_patches/worktree.py export DIR   # the commits after upstream -> ggml_patches/*.patch + series
  python3 ggml_patches/worktree.py prefixes DIR BUILD   # build every prefix of the series (DIR from `apply`)

The pristine upstream is tagged `pyturbo-upstream`; every commit after it is a patch. A new file
belongs to the commit that adds it (a diff from /dev/null in its patch), and a later commit that
changes it exports as a diff.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import prepare  # beside this script, so on sys.path when it runs

HERE = prepare.HERE


def git(tree: Path, *args: str, capture: bool = False) -> str:
    r = subprocess.run(["git", "-C", str(tree), *args], check=True, text=True,
                       capture_output=capture)
    return r.stdout if capture else ""


def cmd_apply(tree: Path) -> None:
    if tree.exists() and any(tree.iterdir()):
        sys.exit(f"worktree: {tree} exists and is not empty")
    tree.mkdir(parents=True, exist_ok=True)
    prepare.extract_upstream(prepare.fetch_sdist(), tree)
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "--no-verify", "-m", f"llama.cpp {prepare.UPSTREAM_COMMIT} ({prepare.UPSTREAM_SDIST} sdist)")
    git(tree, "tag", "pyturbo-upstream")
    for patch in prepare.series():
        git(tree, "am", "-q", "--keep-cr", str(patch))
    print(f"worktree: {tree} at {len(prepare.series())} patches on top of pyturbo-upstream")


def cmd_export(tree: Path) -> None:
    for old in HERE.glob("*.patch"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        git(tree, "format-patch", "-q", "--no-signature", "--zero-commit", "--no-stat", "-N", "-o", tmp,
            "pyturbo-upstream..HEAD")
        names = []
        for p in sorted(Path(tmp).glob("*.patch")):
            shutil.copyfile(p, HERE / p.name)
            names.append(p.name)
    prepare.SERIES.write_text("".join(n + "\n" for n in names))
    print(f"worktree: exported {len(names)} patches to {HERE}")


def cmd_prefixes(tree: Path, build: Path, first: int, last: int | None, targets: list[str], jobs: int) -> int:
    """Checks out each prefix of the series in `tree` (upstream + patches 1..k) and builds it in `build`, one after the other, so that each step recompiles what patch k
    changed (and ccache serves what an earlier build saw). The tree returns to where it was."""
    if git(tree, "status", "--porcelain", "--untracked-files=no", capture=True).strip():
        sys.exit(f"worktree: {tree} has uncommitted changes")
    head = git(tree, "rev-parse", "--abbrev-ref", "HEAD", capture=True).strip()
    if head == "HEAD":
        head = git(tree, "rev-parse", "HEAD", capture=True).strip()
    commits = git(tree, "rev-list", "--reverse", "pyturbo-upstream..HEAD", capture=True).split()
    last = len(commits) if last is None else last
    if not (1 <= first <= last <= len(commits)):
        sys.exit(f"worktree: prefixes {first}..{last} are not within 1..{len(commits)}")
    if not (build / "CMakeCache.txt").exists():
        subprocess.run(["cmake", "-S", str(HERE.parent), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        f"-DPYTURBO_UPSTREAM_DIR={tree}"], check=True, stdout=subprocess.DEVNULL)
    failed = []
    try:
        for k in range(first, last + 1):
            git(tree, "checkout", "-q", commits[k - 1])
            subject = git(tree, "log", "-1", "--format=%s", capture=True).strip()
            t0 = time.monotonic()
            log = build / f"prefix-{k:02d}.log"
            with log.open("w") as out:
                rc = subprocess.run(["cmake", "--build", str(build), f"-j{jobs}", "--target", *targets],
                                    stdout=out, stderr=subprocess.STDOUT).returncode
            print(f"{k:2d} {'ok    ' if rc == 0 else 'FAILED'} {time.monotonic() - t0:6.0f} s  {subject}"
                  + ("" if rc == 0 else f"  (log: {log})"), flush=True)
            if rc != 0:
                failed.append(k)
    finally:
        git(tree, "checkout", "-q", head)
    print(f"worktree: prefixes {first}..{last}: " + (f"{len(failed)} failed: {failed}" if failed else "all built"))
    if last < len(commits) or failed:
        print(f"worktree: {build} holds prefix {last}'s build; build it again before using it")
    return 1 if failed else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["apply", "export", "prefixes"])
    ap.add_argument("tree", type=Path)
    ap.add_argument("build", type=Path, nargs="?", help="prefixes: the build directory (configured when absent)")
    ap.add_argument("--first", type=int, default=1, help="prefixes: the first prefix to build (patches 1..first)")
    ap.add_argument("--last", type=int, help="prefixes: the last one (default: the whole series)")
    ap.add_argument("--target", action="append", help="prefixes: build targets (default: pyturbo)")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    args = ap.parse_args()
    tree = args.tree.resolve()
    if args.command == "prefixes":
        if args.build is None:
            ap.error("prefixes needs a build directory")
        sys.exit(cmd_prefixes(tree, args.build.resolve(), args.first, args.last, args.target or ["pyturbo"], args.jobs))
    (cmd_apply if args.command == "apply" else cmd_export)(tree)


if __name__ == "__main__":
    main()
