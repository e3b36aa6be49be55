"""Transformers models from the bundled GGUFs, offline.

transformers' own GGUF loader (`from_pretrained(..., gguf_file=...)`, which dequantizes every
tensor with the gguf package; it needs accelerate) reads both models: Gemma 3 270M (gemma3) and
SmolLM2-135M (llama). The result is saved once as a float32 safetensors checkpoint in the pyturbo
cache (about 1.1 GB for Gemma 3 270M) and loaded from there afterwards (about 8 s instead of 45 s).

Text goes through llama.cpp's tokenizer, read from the same GGUF (llama-cpp-python, vocab only),
not through transformers': transformers 5.17 turns Gemma 3's SentencePiece vocabulary (scores, no
merges) into a Unigram model that splits English into single characters (12001 tokens for the
first 12000 characters of botchan.txt, llama.cpp: 2813), and a cross-check must score the same
tokens in both implementations anyway.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import data
from .._paths import cache_dir

_FORMAT = 2  # bump to rebuild every converted checkpoint


@dataclass
class LoadedModel:
    model: torch.nn.Module
    gguf: Path
    _vocab: object = field(default=None, repr=False)

    @property
    def vocab(self):
        """llama.cpp's tokenizer for this GGUF (a vocab-only pyturbo.Llama)."""
        if self._vocab is None:
            from ..llama import Llama
            self._vocab = Llama(str(self.gguf), vocab_only=True, verbose=False)
        return self._vocab

    @property
    def bos_id(self) -> int | None:
        bos = self.vocab.token_bos()
        return bos if bos >= 0 else None

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        return self.vocab.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)

    def detokenize(self, tokens: list[int]) -> str:
        return self.vocab.detokenize(tokens).decode("utf-8", errors="replace")


def converted_dir(gguf: Path) -> Path:
    return cache_dir() / "hf" / f"{gguf.stem}-{gguf.stat().st_size}-v{_FORMAT}"


def convert(gguf: Path) -> Path:
    """Convert a GGUF into a float32 transformers checkpoint in the cache (once); returns its folder."""
    from transformers import AutoModelForCausalLM

    target = converted_dir(gguf)
    if (target / "config.json").exists():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # the weights are dequantized now: saved with the GGUF quantization config they would be
    # refused (not serializable) or read as a GGUF again
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(tmp)
    tmp.replace(target)
    return target


def load(model: str | Path | None = None, attn_implementation: str = "sdpa") -> LoadedModel:
    """A float32 transformers model from a GGUF (a path, gemma3-270m or smollm2-135m; None: the
    bundled Gemma 3 270M), on the CPU, converted on first use."""
    from transformers import AutoModelForCausalLM

    gguf = data.model_path(model)
    m = AutoModelForCausalLM.from_pretrained(convert(gguf), dtype=torch.float32, attn_implementation=attn_implementation)
    m.eval()
    return LoadedModel(m, gguf)
