"""`pyturbo bench hf`: TurboQuantCache against transformers' DynamicCache at one context length,
measured in the same run: torch bytes the cache holds, and greedy decode tokens/s at that depth.

The prompt is botchan.txt (repeated when the context is longer), prefilled in 512-token steps as
llama.cpp's ubatches; then --decode greedy tokens are timed one forward pass at a time.
"""
from __future__ import annotations

import argparse
import time


def hf_bench(args: argparse.Namespace) -> None:
    import torch
    from transformers import DynamicCache

    from .. import data
    from ..hf import load
    from ..hf.cache import dynamic_cache_nbytes
    from ..perplexity.hf import make_cache

    torch.set_num_threads(args.threads)
    lm = load(args.model)
    tokens = lm.tokenize(data.corpus().read_text(encoding="utf-8"))
    while len(tokens) < args.n_ctx:
        tokens += tokens[1:]
    ids = torch.tensor([tokens[:args.n_ctx]])
    rows = []
    with torch.inference_mode():
        for name in ["dynamic", *args.types]:
            cache = DynamicCache(config=lm.model.config) if name == "dynamic" else make_cache(lm, name, name)
            for c0 in range(0, args.n_ctx, 512):
                out = lm.model(input_ids=ids[:, c0:c0 + 512], past_key_values=cache, use_cache=True, logits_to_keep=1)
            held = dynamic_cache_nbytes(cache) if name == "dynamic" else cache.nbytes()
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            for _ in range(args.decode):
                out = lm.model(input_ids=nxt, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            rows.append((name, held, args.decode / (time.perf_counter() - t0)))
            print(f"{name}: {held / 2**20:.2f} MiB, {rows[-1][2]:.2f} t/s", flush=True)
    base_bytes, base_tps = rows[0][1], rows[0][2]
    print(f"\n{lm.gguf.name}, {args.n_ctx} tokens of context, torch at {args.threads} thread(s)\n")
    print("| cache | MiB held | vs DynamicCache | decode t/s | vs DynamicCache |")
    print("|---|---|---|---|---|")
    for name, held, tps in rows:
        label = "DynamicCache (float32)" if name == "dynamic" else f"TurboQuantCache {name}"
        print(f"| {label} | {held / 2**20:.2f} | {held / base_bytes:.3f} | {tps:.2f} | {tps / base_tps:.2f} |")


def add_parsers(sub) -> None:
    p = sub.add_parser("hf", help="transformers: TurboQuantCache vs DynamicCache, bytes held and decode t/s")
    p.add_argument("--model", default="gemma3-270m", help="gemma3-270m, smollm2-135m or a GGUF path")
    p.add_argument("--n-ctx", type=int, default=8192)
    p.add_argument("--decode", type=int, default=16, help="greedy tokens timed")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--types", nargs="+", default=["f16", "q8_0", "turboq4", "turboq3", "turboq2"])
    p.set_defaults(func=hf_bench)
