"""Context shift with turboq K: llama.cpp's K-shift dequantizes, applies RoPE and requantizes.

Like llama.cpp's context shift, BOS is kept, the next 64 tokens are dropped and the rest moved
back. The logits of the next N_NEXT tokens (teacher-forced) are compared with a fresh evaluation
of the kept tokens, as a mean KL: one position alone is too noisy a sample. A turboq cache
must shift as well as an f16 cache does (up to its own quantization error); a K-shift in the
wrong domain would be off by nats. The f16 shift is not exact either: on the tiny llama model it
is off by ~0.002 nats, on Gemma 3 by ~0.2 (upstream behaviour, the same with every cache type).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest

from pyturbo import data
from helpers import kl, last_logits

N_DROP, N_KEEP, N_NEXT = 64, 160, 16


@lru_cache(maxsize=None)
def shifted_and_fresh(model: str, t: str) -> tuple[np.ndarray, np.ndarray]:
    from pyturbo.llama import Llama  # first: it points llama_cpp at the patched library
    import llama_cpp

    def new():
        # no window: a shift drops the window's rows, and pyturbo.Llama would then process the
        # prefix again from scratch, which the shifted cache must not be compared through
        return Llama(model, n_ctx=512, cache_type_k=t, cache_type_v=t, flash_attn=True, verbose=False, n_threads=2,
                     kv_exact_window=0)

    llm = new()
    toks = llm.tokenize(data.corpus_slice(3000).read_text().encode())  # starts with BOS
    bos, head = toks[:1], toks[1:1 + N_DROP]
    kept, nxt = toks[1 + N_DROP:1 + N_DROP + N_KEEP], toks[1 + N_DROP + N_KEEP:1 + N_DROP + N_KEEP + N_NEXT]
    assert len(nxt) == N_NEXT

    def continuation(m) -> np.ndarray:
        out = []
        for tok in nxt:
            m.eval([tok])
            out.append(last_logits(m))
        return np.stack(out)

    llm.eval(bos + head + kept)
    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    assert llama_cpp.llama_memory_seq_rm(mem, 0, 1, 1 + N_DROP)
    llama_cpp.llama_memory_seq_add(mem, 0, 1 + N_DROP, -1, -N_DROP)
    llm.n_tokens = 1 + N_KEEP
    llm.input_ids[:1 + N_KEEP] = bos + kept
    shifted = continuation(llm)
    fresh_llm = new()
    fresh_llm.eval(bos + kept)
    return shifted, continuation(fresh_llm)


def mean_kl(p: np.ndarray, q: np.ndarray) -> float:
    return float(np.mean([kl(a, b) for a, b in zip(p, q)]))


MODELS = {"tiny-llama-hd128": lambda: data.tiny_model(head_dim=128), "gemma3-270m": data.default_model,
          "tiny-mla-k576": data.tiny_mla_model}  # MLA: RoPE on the last 64 of K's 576 values, in 64-value groups


@pytest.mark.parametrize("model_name", [pytest.param(m, marks=pytest.mark.slow) if m == "gemma3-270m" else m
                                        for m in MODELS])
@pytest.mark.parametrize("t", ["turboq8", "turboq4", "turboq3"])
def test_turboq_cache_shifts_like_f16(build_info, model_name, t):
    model = str(MODELS[model_name]())
    shifted, fresh = shifted_and_fresh(model, t)
    f16_shifted, f16_fresh = shifted_and_fresh(model, "f16")
    assert np.std(shifted) > 0.1 and np.std(fresh) > 0.1  # real logits, not an empty buffer
    shift_err = mean_kl(fresh, shifted)
    f16_shift_err, quant_err = mean_kl(f16_fresh, f16_shifted), mean_kl(f16_fresh, fresh)
    print(f"{model_name} {t}: mean KL(fresh || shifted) {shift_err:.5f} (f16: {f16_shift_err:.5f}), "
          f"KL(f16 || {t}) {quant_err:.5f}")
    # fresh and shifted are two independent quantization draws (the shift requantizes K), so their
    # KL is about twice the quantization error by itself; a shift in the wrong domain is off by nats
    assert shift_err <= 1.5 * f16_shift_err + 3 * quant_err + 0.005
