"""`pyturbo bench contention`: decode and prefill when the machine is shared, against the same idle.

  pyturbo bench contention [--model M] [--types f16 turboq3] [--threads 1 2] [--poll P]

For each cache type and thread count, llama-bench (`-fa 1`) measures pp128 and tg16:
- idle;
- beside one busy process pinned to one core (`busy`);
- beside a `llama-perplexity` that uses every core (`ppl`: the issue's scenario, decode only);
- beside a second llama-bench of the same configuration started at the same moment (`pair`: both
  processes' decode is reported, the slower one in the ratio).
Every figure comes from this one run; ratios are to the idle figure of the same row. The machine
should be otherwise idle. A run that does not finish within --timeout seconds is reported as such.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import data
from .._paths import binary, tool_env
from .cpu import bench_rows

BUSY = "while True: pass"


def _bench_cmd(model: Path, cache: str, threads: int, extra: list[str], poll: int | None, reps: int = 3) -> list[str]:
    cmd = [str(binary("llama-bench")), "-m", str(model), "-fa", "1", "-t", str(threads), "-r", str(reps),
           "-ctk", cache, "-ctv", cache, "-o", "csv", *extra]
    return cmd + (["--poll", str(poll)] if poll is not None else [])


def _run(cmds: list[list[str]], timeout: float) -> list[dict[str, float] | None]:
    """Runs the commands at the same moment; None for one that failed or ran out of time."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=tool_env(),
                              stdin=subprocess.DEVNULL) for c in cmds]
    out: list[dict[str, float] | None] = []
    t_end = time.monotonic() + timeout
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, t_end - time.monotonic()))
            if p.returncode != 0:
                print(f"# llama-bench exited {p.returncode}: {stderr[-500:]}", file=sys.stderr)
                out.append(None)
            else:
                out.append(bench_rows(stdout))
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            out.append(None)
    return out


class BusyCore:
    """A process that keeps one core busy: `cpu`, the last CPU this process may use, to which it is pinned."""

    def __enter__(self):
        self.cpu = cpu = max(os.sched_getaffinity(0))
        self.p = subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        self.p.kill()
        self.p.wait()


class _Perplexity:
    """A llama-perplexity over the bundled text on every core, f16 cache: another llama.cpp job."""

    def __init__(self, model: Path):
        self.cmd = [str(binary("llama-perplexity")), "-m", str(model), "-f", str(data.corpus()), "-c", "512",
                    "-t", str(os.cpu_count() or 1), "-fa", "on"]

    def __enter__(self):
        self.log = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True, env=tool_env(),
                                  stdin=subprocess.DEVNULL)
        # past the load and the tokenization: it says so before its first chunk
        t_end = time.monotonic() + 60
        while time.monotonic() < t_end and self.p.poll() is None:
            self.log.seek(0)
            if "calculating perplexity" in self.log.read():
                break
            time.sleep(0.2)
        if self.p.poll() is not None:
            self.log.seek(0)
            raise RuntimeError(f"llama-perplexity, the load, exited {self.p.returncode}: {self.log.read()[-500:]}")
        return self

    def __exit__(self, *exc):
        self.p.kill()
        self.p.wait()
        self.log.close()


def contention(args: argparse.Namespace) -> None:
    model = data.model_path(args.model)
    pp, tg = ["-p", "128", "-n", "0"], ["-p", "0", "-n", "16"]
    rows = []
    for cache in args.types:
        for threads in args.threads:
            r: dict[str, float | None] = {}
            for key, extra in (("pp128", pp), ("tg16", tg)):
                (idle,) = _run([_bench_cmd(model, cache, threads, extra, args.poll)], args.timeout)
                r[f"idle {key}"] = idle.get(key) if idle else None
                with BusyCore():
                    (busy,) = _run([_bench_cmd(model, cache, threads, extra, args.poll)], args.timeout)
                r[f"busy {key}"] = busy.get(key) if busy else None
                if key == "tg16":
                    with _Perplexity(model):
                        (ppl,) = _run([_bench_cmd(model, cache, threads, extra, args.poll)], args.timeout)
                    r["ppl tg16"] = ppl.get(key) if ppl else None
                    pair = _run([_bench_cmd(model, cache, threads, extra, args.poll)] * 2, args.timeout)
                    got = [p.get(key) if p else None for p in pair]
                    r["pair tg16"] = None if None in got else min(got)
                    r["pair tg16 other"] = None if None in got else max(got)
            rows.append((cache, threads, r))
            print(f"# {cache} -t {threads}: " + ", ".join(f"{k} {v:.2f}" if v else f"{k} -" for k, v in r.items()),
                  file=sys.stderr)

    def fmt(v: float | None) -> str:
        return f"{v:.2f}" if v else f"> {args.timeout:.0f} s"

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.3f}" if a and b else "-"

    print(f"\n{model.name}, llama-bench -fa 1 -r 3" + (f" --poll {args.poll}" if args.poll is not None else "")
          + f"; busy = one busy process pinned to one core, ppl = a llama-perplexity on every core, pair = two"
          f" llama-bench at once (the slower); {os.cpu_count()} CPUs\n")
    print("| K/V | -t | idle pp128 | idle tg16 | busy pp128 | busy tg16 | busy tg16 / idle | ppl tg16 | ppl / idle "
          "| pair tg16 (both) | pair / idle |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for cache, threads, r in rows:
        both = f"{fmt(r['pair tg16'])}, {fmt(r['pair tg16 other'])}" if r["pair tg16"] else fmt(None)
        print(f"| {cache} | {threads} | {fmt(r['idle pp128'])} | {fmt(r['idle tg16'])} | {fmt(r['busy pp128'])} | "
              f"{fmt(r['busy tg16'])} | {ratio(r['busy tg16'], r['idle tg16'])} | {fmt(r['ppl tg16'])} | "
              f"{ratio(r['ppl tg16'], r['idle tg16'])} | {both} | "
              f"{ratio(r['pair tg16'], r['idle tg16'])} |")


def add_parsers(sub) -> None:
    c = sub.add_parser("contention", help="decode and prefill beside a busy process and beside a second llama.cpp "
                                          "process, against idle, in one run")
    c.add_argument("--model", help="a GGUF path or gemma3-270m / smollm2-135m (default: Gemma 3 270M)")
    c.add_argument("--types", nargs="+", default=["f16", "turboq3"])
    c.add_argument("--threads", nargs="+", type=int, default=[1, os.cpu_count() or 1])
    c.add_argument("--poll", type=int, help="llama-bench --poll (default: llama-bench's)")
    c.add_argument("--timeout", type=float, default=120, help="seconds per llama-bench run (default 120)")
    c.set_defaults(func=contention)
