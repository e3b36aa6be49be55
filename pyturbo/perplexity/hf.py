"""`pyturbo perplexity --backend hf`: the sliding-window perplexity of pyturbo.perplexity, with
the model in transformers and the KV cache a TurboQuantCache (f16/f32: a DynamicCache-like cache
of that dtype through the same class, so both rows of a comparison take one code path).

The windows, the BOS at the start of every window and the scored targets come from
pyturbo.perplexity.score_windows, as for the llama backend. A window goes through the model in chunks of n_batch tokens (llama.cpp's
ubatches) with the cache carrying over between chunks; the cache is new for every window.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from . import PerplexityRun, log_softmax_at, score_windows
from ..hf.cache import TurboQuantCache, k_gains_from_gguf
from ..hf.models import LoadedModel, load


def make_cache(lm: LoadedModel, cache_type_k: str, cache_type_v: str, layer_adaptive: int = 0,
               k_center: bool = True) -> TurboQuantCache:
    gains = None
    if layer_adaptive:
        from .. import layer_adaptive as la
        la.check_mode(layer_adaptive)
        if la.policies()[layer_adaptive].k_gain_div:
            gains = k_gains_from_gguf(lm.gguf)
    return TurboQuantCache(lm.model.config, cache_type_k, cache_type_v, layer_adaptive, gains, k_center)


@torch.inference_mode()
def window_nll(lm: LoadedModel, window: list[int], first: int, cache: TurboQuantCache,
               n_batch: int = 512) -> tuple[float, int]:
    """Summed NLL of window[first:] given the tokens before each, and the count of targets."""
    nll, n = 0.0, 0
    for c0 in range(0, len(window), n_batch):
        c1 = min(c0 + n_batch, len(window))
        ids = torch.tensor([window[c0:c1]])
        # logits at positions p predict p + 1; positions first - 1 .. len - 2 are needed
        lo = max(first - 1, c0)
        hi = min(c1, len(window) - 1)
        keep = max(hi - lo, 0)
        out = lm.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=max(c1 - lo, 1))
        if keep:
            logits = out.logits[0, :keep].float().numpy()
            lp = log_softmax_at(logits, np.asarray(window[lo + 1:hi + 1]))
            nll -= float(lp.sum())
            n += keep
    return nll, n


def hf_perplexity(model: str | Path | LoadedModel | None, text: str, cache_type_k: str = "f16", cache_type_v: str = "f16",
                  layer_adaptive: int = 0, max_length: int = 2048, stride: int = 512, max_tokens: int | None = None,
                  n_threads: int | None = None, show_progress: bool = True, score_from: int = 0,
                  k_center: bool = True, n_batch: int = 512) -> PerplexityRun:
    if n_threads:
        torch.set_num_threads(n_threads)
    lm = model if isinstance(model, LoadedModel) else load(model)
    tokens = lm.tokenize(text)
    if max_tokens:
        tokens = tokens[:max_tokens]

    def fresh_cache_nll(window: list[int], first: int) -> tuple[float, int]:
        return window_nll(lm, window, first, make_cache(lm, cache_type_k, cache_type_v, layer_adaptive, k_center), n_batch)

    label = f"hf {cache_type_k}/{cache_type_v}" + (f" LA{layer_adaptive}" if layer_adaptive else "")
    nll_sum, n_scored = score_windows(tokens, lm.bos_id, fresh_cache_nll, max_length, stride, score_from, label, show_progress)
    nll = nll_sum / n_scored
    return PerplexityRun(cache_type_k, cache_type_v, layer_adaptive, math.exp(nll), nll, n_scored)
