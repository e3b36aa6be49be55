"""GGUF headers with a real model's shapes and no weights, for GPU speed benches.

A device machine gets the header (a few MB) and fills the tensor data with zeros
(`truncate -s SIZE`): the same shapes and quantization types, so the same kernels and the same
throughput as the real model; the outputs are meaningless, which llama-bench ignores. On the CPU
load it without mmap (llama-bench `-lm none`, llama-cpp-python `use_mmap=False`): mapped, the
file's holes all read one zero page from the cache, and decode runs faster than memory allows.

    python3 -m pyturbo.bench.zero_model DIR        # writes DIR/<name>.header and DIR/<name>.size
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rope_theta: float


# Llama-3.1-8B: head_dim 128, GQA 4, Q4_K_M-like weights (Q4_K, with Q6_K for the output and
# the V / FFN-down projections)
LLAMA_8B = Shape("llama-8b-shape-q4_k_m", 32, 4096, 32, 8, 14336, 128256, 131072, 500000.0)

# Llama-3.2-1B: head_dim 64 (the _g64 twins), GQA 4, 16 layers; its output layer is tied to the
# embeddings in the real model, a tensor of its own here (as an untied export would have it)
LLAMA_1B = Shape("llama-1b-shape-q4_k_m", 16, 2048, 32, 8, 8192, 128256, 131072, 500000.0)

SHAPES = {s.name: s for s in (LLAMA_8B, LLAMA_1B)}


def _tensors(s: Shape) -> list[tuple[str, tuple[int, ...], "gguf.GGMLQuantizationType"]]:
    import gguf
    Q4K, Q6K, F32 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.F32
    d_kv = s.n_embd // s.n_head * s.n_head_kv
    out = [("token_embd.weight", (s.n_embd, s.n_vocab), Q4K)]
    for i in range(s.n_layer):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", (s.n_embd,), F32),
            (p + "attn_q.weight", (s.n_embd, s.n_embd), Q4K),
            (p + "attn_k.weight", (s.n_embd, d_kv), Q4K),
            (p + "attn_v.weight", (s.n_embd, d_kv), Q6K),
            (p + "attn_output.weight", (s.n_embd, s.n_embd), Q4K),
            (p + "ffn_norm.weight", (s.n_embd,), F32),
            (p + "ffn_gate.weight", (s.n_embd, s.n_ff), Q4K),
            (p + "ffn_up.weight", (s.n_embd, s.n_ff), Q4K),
            (p + "ffn_down.weight", (s.n_ff, s.n_embd), Q6K),
        ]
    out += [("output_norm.weight", (s.n_embd,), F32), ("output.weight", (s.n_embd, s.n_vocab), Q6K)]
    return out


def write_header(s: Shape, out_dir: Path) -> tuple[Path, int]:
    """Write OUT_DIR/<name>.header (the GGUF up to its tensor data) and <name>.size (the full file size)."""
    import gguf
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{s.name}.header"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(s.name)
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_dimension_count(s.n_embd // s.n_head)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    # an SPM vocabulary of the real size: the 256 byte tokens (the loader looks up "<0x0A>"),
    # then placeholders; llama-bench only draws random token ids
    special = ["<unk>", "<s>", "</s>"]
    tokens = special + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(s.n_vocab - len(tokens))]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (s.n_vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * s.n_vocab)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    data = 0
    for name, shape, qtype in _tensors(s):
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(shape))
        nbytes = n // block * type_size
        # numpy order (the writer reverses it back to ggml's ne); a dtype other than uint8 keeps
        # the shape in elements
        w.add_tensor_info(name, tuple(reversed(shape)), np.dtype(np.float32), nbytes, raw_dtype=qtype)
        data += (nbytes + w.data_alignment - 1) // w.data_alignment * w.data_alignment
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    # the data section starts at the next multiple of the alignment; truncate -s writes the zeros
    head = -(-path.stat().st_size // w.data_alignment) * w.data_alignment
    size = head + data
    path.with_suffix(".size").write_text(f"{size}\n")
    return path, size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m pyturbo.bench.zero_model", description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=LLAMA_8B.name)
    a = ap.parse_args(argv)
    path, size = write_header(SHAPES[a.shape], a.out_dir)
    print(f"{path} ({path.stat().st_size} bytes of header, {size} bytes in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
