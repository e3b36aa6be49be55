"""Run the patched llama.cpp tools (llama-perplexity, llama-bench, ...) and read their numbers."""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ._paths import binary, tool_env


def run_tool(name: str, *args: str, timeout: float = 1800, check: bool = True,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run build/bin/<name>; env adds variables (LLAMA_ARG_KV_K_CENTER, LLAMA_ARG_LAYER_ADAPTIVE, ...)."""
    r = subprocess.run([str(binary(name)), *args], capture_output=True, text=True, env=tool_env(env), stdin=subprocess.DEVNULL,
                       timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{name} {' '.join(args)} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return r


@dataclass
class PerplexityResult:
    ppl: float
    kld: float | None = None
    kld_err: float | None = None
    kld_median: float | None = None
    kld_p999: float | None = None  # the 99.9th percentile of the per-token KLD
    same_top: float | None = None
    kv_mib: float | None = None
    log: str = ""


_KV_RE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB")


def kv_mib(log: str) -> float:
    """Total KV cache MiB over all caches the log reports (Gemma 3 has a global and an SWA cache)."""
    return sum(float(m) for m in _KV_RE.findall(log))


def llama_perplexity(model: Path, text: Path, type_k: str = "f16", type_v: str = "f16", ctx: int = 512,
               chunks: int | None = None, threads: int = 2, kld_base: Path | None = None,
               write_base: bool = False, extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
               batch: int | None = None, timeout: float = 1800) -> PerplexityResult:
    """batch: llama-perplexity's -b (default ctx; a long context may take it in several batches)."""
    args = ["-m", str(model), "-f", str(text), "-c", str(ctx), "-b", str(batch or ctx), "-fa", "on", "-t", str(threads),
            "-ctk", type_k, "-ctv", type_v, "-lv", "4"]
    if chunks:
        args += ["--chunks", str(chunks)]
    if kld_base is not None:
        args += (["--kl-divergence-base", str(kld_base)] if write_base else ["--kl-divergence-base", str(kld_base), "--kl-divergence"])
    r = run_tool("llama-perplexity", *args, *extra, env=env, timeout=timeout)
    log = r.stdout + r.stderr
    res = PerplexityResult(ppl=float("nan"), log=log, kv_mib=kv_mib(log))
    m = re.search(r"Final estimate: PPL = ([\d.]+)", log) or re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", log)
    running = re.findall(r"\[\d+\]([\d.]+),", log)  # the running estimate after each chunk
    if m:
        res.ppl = float(m.group(1))
    elif running:
        res.ppl = float(running[-1])
    m = re.search(r"Mean +KLD:\s*([-\d.]+)\s*±\s*([\d.]+)", log)
    if m:
        res.kld, res.kld_err = float(m.group(1)), float(m.group(2))
    m = re.search(r"Median +KLD:\s*([-\d.]+)", log)
    if m:
        res.kld_median = float(m.group(1))
    m = re.search(r"99\.9% +KLD:\s*([-\d.]+)", log)
    if m:
        res.kld_p999 = float(m.group(1))
    m = re.search(r"Same top p:\s*([\d.]+)", log)
    if m:
        res.same_top = float(m.group(1))
    return res
