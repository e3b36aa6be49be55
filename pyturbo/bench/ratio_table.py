"""Ratio tables from llama-bench jsonl files: t/s per test and configuration, and the ratio to
the f16/f16 configuration of the same model in the same run. Standard library only, so that a
bare GPU machine runs it as a script:

    python3 pyturbo/bench/ratio_table.py DIR            # every bench-*.jsonl under DIR, markdown
    python3 pyturbo/bench/ratio_table.py --one FILE     # one line: test t/s ...

A file name bench-<model>-<K>-<V>-m<MODE>[-w<W>].jsonl carries the layer mode and the exact window
(llama-bench does not record the environment; no -w: libllama's default window, -w0: none).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def _test(r: dict) -> str:
    kind = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
    return f"{kind} @ d{r['n_depth']}"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def one(path: Path) -> str:
    return "  ".join(f"{_test(r)}: {r['avg_ts']:.1f}" for r in _rows(path))


def table(out_dir: Path) -> str:
    models: dict[str, dict[str, dict[str, float]]] = {}
    for path in sorted(out_dir.glob("bench-*.jsonl")):
        m = re.match(r"bench-(.+)-([^-]+)-([^-]+)-m(\d+)(?:-w(\d+))?$", path.stem)
        if not m:
            continue
        model, k, v, mode, win = m.groups()
        # no -w: libllama's default window (auto's beside a turboq cache); -w0: none
        cfg = f"{k}/{v}" + (f" mode {mode}" if mode != "0" else "") + (f" window {win}" if win is not None else "")
        for r in _rows(path):
            models.setdefault(model, {}).setdefault(cfg, {})[_test(r)] = float(r["avg_ts"])
    out = []
    for model, cfgs in models.items():
        tests = list(dict.fromkeys(t for c in cfgs.values() for t in c))
        base = cfgs.get("f16/f16", {})
        out.append(f"\n{model}: t/s, and the ratio to f16/f16 of this run\n")
        out.append("| K/V | " + " | ".join(tests) + " |")
        out.append("|---|" + "---|" * len(tests))
        for cfg, res in cfgs.items():
            cells = []
            for t in tests:
                if t not in res:
                    cells.append("-")
                elif base.get(t):
                    cells.append(f"{res[t]:.1f} ({res[t] / base[t]:.2f}x)")
                else:
                    cells.append(f"{res[t]:.1f}")
            out.append(f"| {cfg} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--one":
        print(one(Path(argv[1])))
        return 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(table(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
