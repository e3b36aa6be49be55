"""Sliding-window perplexity through llama-cpp-python's logits (`pyturbo perplexity`).

Not llama-perplexity (that is `pyturbo.tools.llama_perplexity`): this one runs in-process, on
Hugging Face's sliding-window recipe.

Windows of --max-length tokens advance by --stride; each window scores only the tokens not
scored before (Hugging Face's recipe), with the KV cache cleared between windows, so every
scored token sees between max_length - stride and max_length - 1 tokens of context. Each window
starts with BOS, as llama-perplexity's chunks do.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class PerplexityRun:
    cache_type_k: str
    cache_type_v: str
    layer_adaptive: int
    ppl: float
    nll: float
    n_scored: int


def _log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log p(target) per row; exp in float32 (vocabularies reach 262k), sums in float64."""
    m = logits.max(axis=1, keepdims=True)
    lse = m[:, 0].astype(np.float64) + np.log(np.exp(logits - m).sum(axis=1, dtype=np.float64))
    return logits[np.arange(len(targets)), targets].astype(np.float64) - lse


def score_windows(tokens: list[int], bos: int | None, window_nll: Callable[[list[int], int], tuple[float, int]],
                  max_length: int, stride: int, score_from: int = 0, label: str = "",
                  show_progress: bool = True) -> tuple[float, int]:
    """The window scheme, for any backend: returns the summed NLL and the number of scored targets.

    window_nll(window, first) must return the summed NLL of window[first:], each token given the
    ones before it in the window, and how many targets that was (len(window) - first).
    score_from > 0 scores only targets at window offsets >= score_from: with stride == max_length
    and score_from = max_length // 2 + 1 this is exactly llama-perplexity's scheme."""
    n = len(tokens)
    if n < 2:
        raise ValueError("the text is too short to score")
    from tqdm import tqdm

    starts = list(range(0, max(n - 1, 1), stride))
    nll_sum, n_scored, prev_end = 0.0, 0, 0
    bar = tqdm(total=len(starts), desc=label or None, unit="window", disable=not show_progress, leave=False)
    for i, begin in enumerate(starts):
        end = min(begin + max_length, n)
        # like llama-perplexity, every window starts with BOS (models such as Gemma need it);
        # the token it replaces is context only, never a scored target after the first window
        window = [bos, *tokens[begin + 1:end]] if begin > 0 and bos is not None else tokens[begin:end]
        first_scored = max(prev_end, begin + 1, begin + score_from)  # positions [first_scored, end) get scored
        s, k = window_nll(window, first_scored - begin)
        nll_sum += s
        n_scored += k
        prev_end = end
        bar.update()
        if end == n or (score_from and end - begin < max_length):
            break
    bar.close()
    return nll_sum, n_scored


def sliding_window_perplexity(model: str | Path, text: str, cache_type_k: str = "f16", cache_type_v: str = "f16",
                              layer_adaptive: int = 0, max_length: int = 2048, stride: int = 512,
                              max_tokens: int | None = None, n_threads: int | None = None,
                              show_progress: bool = True, score_from: int = 0) -> PerplexityRun:
    """llama.cpp through llama-cpp-python; score_from as in score_windows."""
    from .llama import Llama

    llm = Llama(str(model), cache_type_k=cache_type_k, cache_type_v=cache_type_v, layer_adaptive=layer_adaptive,
                n_ctx=max_length, n_batch=min(max_length, 512), logits_all=True, flash_attn=True,
                n_threads=n_threads, n_threads_batch=n_threads, verbose=False)
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True)
    if max_tokens:
        tokens = tokens[:max_tokens]

    def window_nll(window: list[int], first: int) -> tuple[float, int]:
        llm.reset()
        llm.eval(window)
        lp = _log_softmax_at(llm.scores[first - 1:len(window) - 1], np.asarray(window[first:]))
        return -float(lp.sum()), len(window) - first

    label = f"{cache_type_k}/{cache_type_v}" + (f" LA{layer_adaptive}" if layer_adaptive else "")
    nll_sum, n_scored = score_windows(tokens, llm.token_bos() if llm.token_bos() >= 0 else None, window_nll,
                                      max_length, stride, score_from, label, show_progress)
    nll = nll_sum / n_scored
    return PerplexityRun(cache_type_k, cache_type_v, layer_adaptive, math.exp(nll), nll, n_scored)
