#!/usr/bin/env python3
"""Edit the patch series as ordinary git work.

  python3 ggml_patches/worktree.py apply DIR    # DIR becomes a git repo: upstream, new files, one commit per patch
  python3 ggml_patches/worktree.py export DIR   # commits after the new-files commit -> ggml_patches/*.patch + series

The new files (ggml_patches/files/) are committed as one commit tagged `pyturbo-files`, right on
top of the pristine upstream (tagged `pyturbo-upstream`); the patches are the commits after it.
On export, the current content of every new file is copied back to ggml_patches/files/ and the
patches are regenerated without those paths, so edits to them may live in any commit.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
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
    for rel in prepare.new_files():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(prepare.FILES_DIR / rel, tree / rel)
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "--no-verify", "--allow-empty", "-m", "pyturbo: new files from ggml_patches/files")
    git(tree, "tag", "pyturbo-files")
    for patch in prepare.series():
        git(tree, "am", "-q", "--keep-cr", str(patch))
    print(f"worktree: {tree} at {len(prepare.series())} patches on top of pyturbo-files")


def cmd_export(tree: Path) -> None:
    files = [str(r) for r in prepare.new_files()]
    # files added anywhere after pyturbo-files are new files too
    added = git(tree, "diff", "--name-only", "--diff-filter=A", "pyturbo-upstream", "HEAD", capture=True).split()
    for rel in sorted(set(files) | set(added)):
        src = tree / rel
        dst = prepare.FILES_DIR / rel
        if src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
        elif dst.exists():
            dst.unlink()
    files = [str(r) for r in prepare.new_files()]
    excludes = [f":(exclude){f}" for f in files]
    for old in HERE.glob("*.patch"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        git(tree, "format-patch", "-q", "--no-signature", "--zero-commit", "--no-stat", "-N", "-o", tmp,
            "pyturbo-files..HEAD", "--", ".", *excludes)
        names = []
        for p in sorted(Path(tmp).glob("*.patch")):
            shutil.copyfile(p, HERE / p.name)
            names.append(p.name)
    prepare.SERIES.write_text("".join(n + "\n" for n in names))
    print(f"worktree: exported {len(names)} patches and {len(files)} new files to {HERE}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["apply", "export"])
    ap.add_argument("tree", type=Path)
    args = ap.parse_args()
    (cmd_apply if args.command == "apply" else cmd_export)(args.tree.resolve())


if __name__ == "__main__":
    main()
