"""pyturbo for Hugging Face transformers: TurboQuantCache keeps K/V as llama.cpp's turboq rows.

    from pyturbo.hf import TurboQuantCache, load
    lm = load("gemma3-270m")                      # transformers model from the bundled GGUF
    cache = TurboQuantCache(lm.model.config, "turboq3", "turboq4")
    out = lm.model.generate(ids, past_key_values=cache, max_new_tokens=32)

Needs the [hf] extra (torch, transformers): pip install '.[hf]'.
"""
from __future__ import annotations

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"pyturbo.hf needs torch and transformers ({e}): pip install '.[hf]'") from e

from .cache import TurboQuantCache, TurboQuantLayer, TurboQuantSlidingWindowLayer, k_gains_from_gguf, layer_cache_types
from .models import LoadedModel, load

__all__ = ["TurboQuantCache", "TurboQuantLayer", "TurboQuantSlidingWindowLayer", "k_gains_from_gguf",
           "layer_cache_types", "LoadedModel", "load"]
