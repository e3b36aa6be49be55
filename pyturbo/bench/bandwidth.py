"""The memory-bandwidth bound of a decode step, which `pyturbo bench speed` prints beside each
decode figure: a read probe (threads reading a buffer larger than the caches) and the bytes one
token reads (the model's weights once, and its K and V cache up to the depth).

At depth the cache is most of what a token reads, so tokens/s over the bound says how far the
attention is from the speed of its bytes (issue 62). The bound is optimistic: it counts no
activations and no writes, and takes the whole file as weights read once a token (a tied output
layer is read whole; the token-embedding lookup reads one row of the same tensor).
"""
from __future__ import annotations

import mmap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .. import exact_window
from ..memory import kv_bytes

PROBE_MIB = 512  # well past the last-level cache of the machines this runs on


def read_gbps(threads: int, mib: int = PROBE_MIB, reps: int = 3) -> float:
    """GB/s (1e9 bytes) of `threads` threads reading `mib` MiB, each a contiguous share, the best
    of `reps`. NumPy's integer reduction is SIMD and releases the GIL, so a thread's read runs at
    the speed of memory, not of Python. The buffer is an anonymous mapping, in 4 KiB pages as
    ggml's CPU buffers are: NumPy's own large arrays ask for huge pages, which read 17.1 GB/s on
    one thread of the 2-core machine where 4 KiB pages read 14.2."""
    if threads < 1:
        raise ValueError(f"threads {threads}: must be at least 1")
    mem = mmap.mmap(-1, mib << 20)
    buf = np.frombuffer(mem, dtype=np.int64)
    buf[:] = 1
    parts = np.array_split(buf, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(reps):
            t0 = time.perf_counter()
            list(pool.map(np.bitwise_or.reduce, parts))
            best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best / 1e9


def token_bytes(model: str | Path, k: str, v: str, env: dict[str, str], cells: int) -> int:
    """Bytes a decode step reads with `cells` positions in the cache: the model file, and the K
    and V that llama.cpp allocates for that many cells (sliding-window layers hold their window,
    an exact window and sink rows their F16 rows; a mode that picks layers by K gain is taken at
    its upper bound). env: a configuration's environment (bench.cpu.parse_config)."""
    margin = env.get(exact_window.MARGIN_ENV)
    sink = exact_window.setting(env.get(exact_window.SINK_ENV))  # unset: llama.cpp's default, auto
    kv = kv_bytes(model, cells, k, v, int(env.get("LLAMA_ARG_LAYER_ADAPTIVE") or 0), upper_bound=True,
                  # auto sized by these cells, where libllama sizes it by the cells allocated: a few rows apart
                  exact_window=exact_window.env_window(env),  # None: llama.cpp's default
                  exact_window_margin=int(margin) if margin is not None else None,
                  exact_sink=exact_window.SINK_AUTO if sink is None else sink)
    return Path(model).stat().st_size + kv
