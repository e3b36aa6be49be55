"""`pyturbo bench matrix`: the configuration matrix users of the TurboQuant forks ask for.

For every K/V configuration: PPL and mean KLD vs the f16 cache (llama-perplexity on the same
chunks), prompt and generation speed (llama-bench, -fa 1), and KV memory vs f16 (kv_bytes,
which matches llama.cpp's allocation). Prints a Markdown table and writes a PNG plot of mean KLD
against bits per K/V value.
"""
from __future__ import annotations

import csv
import io
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import data
from ..memory import kv_bytes
from ..tools import llama_perplexity, run_tool
from ..types import cache_type

CONFIGS: list[tuple[str, str]] = [
    ("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"),
    ("f16", "turboq4"), ("f16", "turboq3"), ("f16", "turboq2"),
    ("q8_0", "turboq4"), ("q8_0", "turboq3"), ("q8_0", "turboq2"),
    ("turboq4", "turboq3"), ("turboq4", "turboq2"), ("turboq3", "turboq3"), ("turboq3", "turboq2"), ("turboq2", "turboq2"),
]
QUICK_CONFIGS: list[tuple[str, str]] = [("f16", "f16"), ("q8_0", "turboq3"), ("turboq3", "turboq3"), ("turboq2", "turboq2")]


@dataclass
class Row:
    type_k: str
    type_v: str
    bpv: float
    ppl: float
    kld: float | None  # None: llama-perplexity printed none (shown as missing, never as 0)
    kld_err: float | None
    pp: float
    tg: float
    kv_ratio: float


def _speed(model: Path, tk: str, tv: str, threads: int, n_prompt: int, n_gen: int, reps: int) -> tuple[float, float]:
    r = run_tool("llama-bench", "-m", str(model), "-fa", "1", "-t", str(threads), "-r", str(reps), "-p", str(n_prompt),
                 "-n", str(n_gen), "-ctk", tk, "-ctv", tv, "-o", "csv")
    pp = tg = float("nan")
    for row in csv.DictReader(io.StringIO(r.stdout)):
        if int(row["n_prompt"]):
            pp = float(row["avg_ts"])
        else:
            tg = float(row["avg_ts"])
    return pp, tg


def run(model: Path, text: Path, configs: list[tuple[str, str]], ctx: int, chunks: int, threads: int,
        n_prompt: int, n_gen: int, reps: int, n_ctx_mem: int = 32768) -> list[Row]:
    rows: list[Row] = []
    f16_bytes = kv_bytes(model, n_ctx_mem, "f16", "f16")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "f16.kld"
        llama_perplexity(model, text, "f16", "f16", ctx=ctx, chunks=chunks, threads=threads, kld_base=base, write_base=True)
        for tk, tv in configs:
            r = llama_perplexity(model, text, tk, tv, ctx=ctx, chunks=chunks, threads=threads, kld_base=base)
            pp, tg = _speed(model, tk, tv, threads, n_prompt, n_gen, reps)
            ratio = kv_bytes(model, n_ctx_mem, tk, tv) / f16_bytes
            bpv = (cache_type(tk).bpw + cache_type(tv).bpw) / 2
            rows.append(Row(tk, tv, bpv, r.ppl, r.kld, r.kld_err, pp, tg, ratio))
            print(f"# {tk}/{tv}: PPL {r.ppl:.3f} KLD {r.kld} pp {pp:.1f} tg {tg:.1f} KV {ratio:.3f}", file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[Row], title: str) -> str:
    f16 = next((r for r in rows if r.type_k == r.type_v == "f16"), rows[0])
    out = [title, "", "| K | V | bits/value | PPL | mean KLD vs f16 | PP t/s | TG t/s | PP vs f16 | TG vs f16 | KV vs f16 |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if (r.type_k, r.type_v) == ("f16", "f16"):
            kld = "0 (reference)"
        else:
            kld = "missing" if r.kld is None else f"{r.kld:.4f} ± {r.kld_err:.4f}"
        out.append(f"| {r.type_k} | {r.type_v} | {r.bpv:.3f} | {r.ppl:.3f} | {kld} | {r.pp:.1f} | {r.tg:.1f} | "
                   f"{r.pp / f16.pp:.2f} | {r.tg / f16.tg:.2f} | {r.kv_ratio:.3f} |")
    return "\n".join(out) + "\n"


def plot(rows: list[Row], path: Path, title: str) -> None:
    from .plot import plot_kld_per_bit

    points = [(f"{r.type_k}/{r.type_v}", r.bpv, r.kld) for r in rows
              if (r.type_k, r.type_v) != ("f16", "f16") and r.kld is not None]
    plot_kld_per_bit(points, path, title)


def main(model: str | None, text: str | None, quick: bool, threads: int, out_dir: str) -> None:
    m = Path(model) if model else data.default_model()
    t = Path(text) if text else data.corpus()
    if quick:
        rows = run(m, t, QUICK_CONFIGS, ctx=256, chunks=4, threads=threads, n_prompt=64, n_gen=8, reps=1)
        title = f"{m.name}, c=256, 4 chunks (--quick)"
    else:
        rows = run(m, t, CONFIGS, ctx=512, chunks=20, threads=threads, n_prompt=512, n_gen=64, reps=2)
        title = f"{m.name}, {t.name}, c=512, 20 chunks, llama-bench -fa 1 -t {threads} pp512/tg64"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, title)
    (out / "bench.md").write_text(md)
    plot(rows, out / "bench.png", title)
    print(md)
    print(f"wrote {out / 'bench.md'} and {out / 'bench.png'}")


def add_parser(sub) -> None:
    p = sub.add_parser("matrix", help="PPL / KLD / speed / KV memory per K/V configuration, Markdown + PNG")
    p.add_argument("--model")
    p.add_argument("-f", "--file")
    p.add_argument("--quick", action="store_true", help="4 configurations, tiny runs (for CI)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench-out")
    p.set_defaults(func=lambda a: main(a.model, a.file, a.quick, a.threads, a.out))
