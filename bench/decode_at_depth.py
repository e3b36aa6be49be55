"""Decode at depth with one prefill: the prefill runs once (two threads), then decode steps at one
thread and at two (llama_set_n_threads), each beside its bound, `bench speed`'s: the read probe's
GB/s over the bytes a token reads (the model file, the K/V llama.cpp allocates for the cells).
llama-bench prefills again for every thread count, which at depth 32768 costs 16-19 minutes a
time on a 2-core machine (bench/results/cpu-decode.md).

    PYTHONPATH=. python3 bench/decode_at_depth.py MODEL CONFIG DEPTH [STEPS]

CONFIG as `pyturbo bench speed --types` takes it (turboq3, turboq3:4:win32, ...). The model is read
without mmap, so that a zero-weight GGUF (pyturbo.bench.zero_model) reads memory, not one page.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from pyturbo import Llama
from pyturbo.bench.bandwidth import read_gbps, token_bytes
from pyturbo.bench.cpu import parse_config


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    model, cfg, depth = argv[0], argv[1], int(argv[2])
    steps = int(argv[3]) if len(argv) == 4 else 32
    import llama_cpp  # after pyturbo, which points it at this build's libraries

    _, k, v, env = parse_config(cfg)
    kw: dict[str, int] = {}
    if "LLAMA_ARG_LAYER_ADAPTIVE" in env:
        kw["layer_adaptive"] = int(env["LLAMA_ARG_LAYER_ADAPTIVE"])
    if "LLAMA_ARG_KV_EXACT_WINDOW" in env:
        kw["kv_exact_window"] = int(env["LLAMA_ARG_KV_EXACT_WINDOW"])
    if "LLAMA_ARG_KV_EXACT_WINDOW_MARGIN" in env:
        kw["kv_exact_window_margin"] = int(env["LLAMA_ARG_KV_EXACT_WINDOW_MARGIN"])
    gbps = {t: read_gbps(t) for t in (1, 2)}  # before the model takes memory, on the idle machine
    llm = Llama(model, n_ctx=depth + 4 * steps + 64, n_batch=2048, n_ubatch=512, n_threads=2, n_threads_batch=2,
                use_mmap=False, cache_type_k=k, cache_type_v=v, flash_attn=True, verbose=False, **kw)
    rng = np.random.default_rng(0)
    hi = min(llm.n_vocab(), 128000) - 1
    lo = min(300, hi // 2)  # past the special and byte tokens
    t0 = time.perf_counter()
    llm.eval([int(t) for t in rng.integers(lo, hi, depth)])
    pre = time.perf_counter() - t0
    print(f"{model} {cfg}: prefill of {depth} tokens {pre:.0f} s; read probe {gbps[1]:.1f} / {gbps[2]:.1f} GB/s (1 / 2 threads)")
    for threads in (1, 2, 1, 2):
        llama_cpp.llama_set_n_threads(llm._ctx.ctx, threads, 2)
        llm.eval([int(rng.integers(lo, hi))])  # one step at the new thread count first
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.eval([int(rng.integers(lo, hi))])
        tps = steps / (time.perf_counter() - t0)
        bound = gbps[threads] * 1e9 / token_bytes(model, k, v, env, llm.n_tokens - steps // 2)
        print(f"  -t {threads}: {tps:.2f} t/s, bound {bound:.2f} t/s ({100 * tps / bound:.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
