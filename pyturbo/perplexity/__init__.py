"""`pyturbo perplexity`: sliding-window perplexity, one window scheme over two in-process backends.

- `pyturbo.perplexity.llama`: llama.cpp through llama-cpp-python's logits (`--backend llama`);
- `pyturbo.perplexity.hf`: transformers with a TurboQuantCache (`--backend hf`).

Not llama-perplexity (that is `pyturbo.tools.llama_perplexity`), though `score_from` reproduces
its chunk scheme.

Windows of --max-length tokens advance by --stride; each window scores only the tokens not
scored before (Hugging Face's recipe), with the KV cache cleared between windows, so every
scored token sees between max_length - stride and max_length - 1 tokens of context. Each window
starts with BOS, as llama-perplexity's chunks do.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass
class PerplexityRun:
    cache_type_k: str
    cache_type_v: str
    layer_adaptive: int
    ppl: float
    nll: float
    n_scored: int


def log_softmax_at(logits: np.ndarray, targets: np.ndarray, rows: int = 16) -> np.ndarray:
    """log p(target) per row; exp in float32 (vocabularies reach 262k), sums in float64. A few rows
    at a time: the temporaries of a whole window (hundreds of MB at 262k) cost more in page faults
    than the arithmetic, and each row's result does not depend on the others."""
    out = np.empty(len(targets), dtype=np.float64)
    for i in range(0, len(targets), rows):
        x = logits[i:i + rows]
        m = x.max(axis=1, keepdims=True)
        lse = m[:, 0].astype(np.float64) + np.log(np.exp(x - m).sum(axis=1, dtype=np.float64))
        out[i:i + rows] = x[np.arange(len(x)), targets[i:i + rows]].astype(np.float64) - lse
    return out


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
