"""Prints the requirements of pyproject.toml's dependencies and the named extras, one per line,
for `pip install -r`; pyproject.toml is their one source.
--exclude NAME leaves a package out (llama-cpp-python, which
scripts/setup.sh builds from the pinned sdist against our libraries instead)."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        sys.exit("requirements.py: reading pyproject.toml needs Python 3.11 or the tomli package (pip install tomli)")

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def name_of(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def requirements(extras: list[str], exclude: set[str]) -> list[str]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"requirements.py: no extra {', '.join(unknown)} in pyproject.toml "
                         f"(extras: {', '.join(optional)})")
    out: list[str] = []
    for req in project["dependencies"] + [r for e in extras for r in optional[e]]:
        if name_of(req) not in exclude and req not in out:
            out.append(req)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("extras", nargs="*")
    ap.add_argument("--all", action="store_true", help="every extra")
    ap.add_argument("--exclude", action="append", default=[])
    args = ap.parse_args()
    extras = args.extras
    if args.all:
        extras = list(tomllib.loads(PYPROJECT.read_text())["project"].get("optional-dependencies", {}))
    print("\n".join(requirements(extras, {name_of(e) for e in args.exclude})))


if __name__ == "__main__":
    main()
