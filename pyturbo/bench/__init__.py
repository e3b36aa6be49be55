"""`pyturbo bench ...`: benchmarks that print ratios against mainline types measured in the same run.

- `matrix`: PPL, KLD, speed and KV memory per K/V configuration, with a plot (`bench.matrix`);
- `quality`, `speed`: llama-perplexity and llama-bench tables per cache type (`bench.cpu`);
- `serve`: concurrent clients against `python -m server`, aggregate tokens/s by --parallel, and
  the KV memory that llama-server reports (`bench.serve`);
- `hf`: transformers' TurboQuantCache against DynamicCache, bytes held and decode tokens/s (`bench.hf`);
- `needle`: retrieval of a number hidden in long filler, a hit table per cache type (`bench.needle`);
- `contention`: decode and prefill beside a busy process and beside a second llama.cpp process,
  against idle (`bench.contention`).
"""
from __future__ import annotations


def add_parsers(sub) -> None:
    from . import contention, cpu, hf, matrix, needle, serve
    matrix.add_parser(sub)
    contention.add_parsers(sub)
    cpu.add_parsers(sub)
    needle.add_parsers(sub)
    serve.add_parsers(sub)
    hf.add_parsers(sub)
