"""Decode at depth with one prefill: the prefill runs once (two threads), then decode steps at one
thread and at two (llama_set_n_threads), twice, each beside its bound, `bench speed`'s: the read
probe's GB/s over the bytes a token reads (the model file, the K/V llama.cpp allocates for the
cells). llama-bench prefills again for every thread count, which at depth 32768 costs 16-19 minutes
a time on a 2-core machine (bench/results/cpu-decode.md).

    PYTHONPATH=. python3 bench/decode_at_depth.py MODEL CONFIG DEPTH [--steps N] [--probe-mib M]

CONFIG as `pyturbo bench speed --types` takes it (turboq3, turboq3:4:win32, turboq3:sink0, ...):
the settings reach pyturbo.Llama's arguments, TURBOQ_* switches the process's environment. The
model is read without mmap, so that a zero-weight GGUF (pyturbo.bench.zero_model) reads memory,
not one page.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from pyturbo import Llama, exact_window, k_centering
from pyturbo.bench.bandwidth import PROBE_MIB, read_gbps, token_bytes
from pyturbo.bench.cpu import parse_config

# a configuration's settings (bench.cpu.parse_config's environment) as pyturbo.Llama's arguments
SETTINGS = {"LLAMA_ARG_LAYER_ADAPTIVE": ("layer_adaptive", int), exact_window.ENV: ("kv_exact_window", exact_window.setting),
            exact_window.MARGIN_ENV: ("kv_exact_window_margin", int), exact_window.SINK_ENV: ("kv_exact_sink", exact_window.setting),
            k_centering.ENV: ("k_center", lambda s: s == "on"), k_centering.SCALE_ENV: ("k_scale", str)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/decode_at_depth.py", description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("config")
    ap.add_argument("depth", type=int)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--probe-mib", type=int, default=PROBE_MIB, help="the read probe's buffer")
    a = ap.parse_args(argv)
    import llama_cpp  # after pyturbo, which points it at this build's libraries

    _, k, v, env = parse_config(a.config)
    kw = {}
    for name, value in env.items():
        if name in SETTINGS:
            arg, conv = SETTINGS[name]
            kw[arg] = conv(value)
        else:
            os.environ[name] = value  # a TURBOQ_* switch, read by the library
    gbps = {t: read_gbps(t, a.probe_mib) for t in (1, 2)}  # before the model takes memory
    llm = Llama(a.model, n_ctx=a.depth + 4 * a.steps + 64, n_batch=2048, n_ubatch=512, n_threads=2, n_threads_batch=2,
                use_mmap=False, cache_type_k=k, cache_type_v=v, flash_attn=True, verbose=False, **kw)
    rng = np.random.default_rng(0)
    hi = min(llm.n_vocab(), 128000) - 1
    lo = min(300, hi // 2)  # past the special and byte tokens
    t0 = time.perf_counter()
    llm.eval([int(t) for t in rng.integers(lo, hi, a.depth)])
    pre = time.perf_counter() - t0
    print(f"{a.model} {a.config}: prefill of {a.depth} tokens {pre:.0f} s; read probe {gbps[1]:.1f} / {gbps[2]:.1f} GB/s "
          "(1 / 2 threads)")
    for threads in (1, 2, 1, 2):
        llama_cpp.llama_set_n_threads(llm._ctx.ctx, threads, 2)
        llm.eval([int(rng.integers(lo, hi))])  # one step at the new thread count first
        t0 = time.perf_counter()
        for _ in range(a.steps):
            llm.eval([int(rng.integers(lo, hi))])
        tps = a.steps / (time.perf_counter() - t0)
        bound = gbps[threads] * 1e9 / token_bytes(a.model, k, v, env, llm.n_tokens - a.steps // 2)
        print(f"  -t {threads}: {tps:.2f} t/s, bound {bound:.2f} t/s ({100 * tps / bound:.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
