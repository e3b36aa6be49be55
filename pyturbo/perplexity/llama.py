"""`pyturbo perplexity --backend llama`: the window scheme of pyturbo.perplexity on llama.cpp,
in-process through llama-cpp-python's logits, with the KV cache cleared between windows.

Only the rows that score a target get logits: on a model with a large vocabulary (Gemma 3: 262k)
the output layer is most of a window's work, and `logits_all` would also keep an n_ctx x n_vocab
float array (2 GiB at a 2048 window).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from . import PerplexityRun, log_softmax_at, score_windows


def sliding_window_perplexity(model: str | Path, text: str, cache_type_k: str = "f16", cache_type_v: str = "f16",
                              layer_adaptive: int = 0, max_length: int = 2048, stride: int = 512,
                              max_tokens: int | None = None, n_threads: int | None = None,
                              show_progress: bool = True, score_from: int = 0) -> PerplexityRun:
    """llama.cpp through llama-cpp-python; score_from as in score_windows."""
    from ..llama import Llama

    llm = Llama(str(model), cache_type_k=cache_type_k, cache_type_v=cache_type_v, layer_adaptive=layer_adaptive,
                n_ctx=max_length, n_batch=min(max_length, 512), flash_attn=True,
                n_threads=n_threads, n_threads_batch=n_threads, verbose=False)
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True)
    if max_tokens:
        tokens = tokens[:max_tokens]

    n_batch, n_vocab = llm.n_batch, llm.n_vocab()

    def window_nll(window: list[int], first: int) -> tuple[float, int]:
        # Llama.eval's batches (n_batch tokens from position 0), with outputs at positions
        # first - 1 .. len(window) - 2 only: the rows that predict window[first:]
        llm.reset()
        llm._ctx.kv_cache_seq_rm(-1, 0, -1)
        targets = np.asarray(window[first:])
        lp, done = [], 0
        for i in range(0, len(window), n_batch):
            chunk = window[i:i + n_batch]
            llm._batch.set_batch(batch=chunk, n_past=i, logits_all=False)
            wanted = [first - 1 <= i + j < len(window) - 1 for j in range(len(chunk))]
            for j, w in enumerate(wanted):
                llm._batch.batch.logits[j] = w
            llm._ctx.decode(llm._batch)
            if n := sum(wanted):
                logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n, n_vocab))
                lp.append(log_softmax_at(logits, targets[done:done + n]))
                done += n
        return -float(np.concatenate(lp).sum()), len(window) - first

    label = f"{cache_type_k}/{cache_type_v}" + (f" LA{layer_adaptive}" if layer_adaptive else "")
    nll_sum, n_scored = score_windows(tokens, llm.token_bos() if llm.token_bos() >= 0 else None, window_nll,
                                      max_length, stride, score_from, label, show_progress)
    nll = nll_sum / n_scored
    return PerplexityRun(cache_type_k, cache_type_v, layer_adaptive, math.exp(nll), nll, n_scored)
