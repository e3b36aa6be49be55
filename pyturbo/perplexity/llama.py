"""`pyturbo perplexity --backend llama`: the window scheme of pyturbo.perplexity on llama.cpp,
in-process through llama-cpp-python's logits, with the KV cache cleared between windows.
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
                n_ctx=max_length, n_batch=min(max_length, 512), logits_all=True, flash_attn=True,
                n_threads=n_threads, n_threads_batch=n_threads, verbose=False)
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True)
    if max_tokens:
        tokens = tokens[:max_tokens]

    def window_nll(window: list[int], first: int) -> tuple[float, int]:
        llm.reset()
        llm.eval(window)
        lp = log_softmax_at(llm.scores[first - 1:len(window) - 1], np.asarray(window[first:]))
        return -float(lp.sum()), len(window) - first

    label = f"{cache_type_k}/{cache_type_v}" + (f" LA{layer_adaptive}" if layer_adaptive else "")
    nll_sum, n_scored = score_windows(tokens, llm.token_bos() if llm.token_bos() >= 0 else None, window_nll,
                                      max_length, stride, score_from, label, show_progress)
    nll = nll_sum / n_scored
    return PerplexityRun(cache_type_k, cache_type_v, layer_adaptive, math.exp(nll), nll, n_scored)
