"""pyturbo command line: `python -m pyturbo <command>`."""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import UPSTREAM_COMMIT, UPSTREAM_SDIST, data
from ._paths import binary, lib_dir, library, tool_env
from .types import REQUESTABLE_TYPES

LLAMA_TOOLS = ("llama-server", "llama-perplexity", "llama-bench", "llama-cli", "test-backend-ops", "ggml-rpc-server")


def cmd_tool(args: argparse.Namespace) -> None:
    argv = list(args.args)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if args.default_model:
        argv = ["-m", str(data.default_model()), *argv]
    exe = str(binary(args.tool))
    os.execve(exe, [exe, *argv], tool_env())


def cmd_doctor(args: argparse.Namespace) -> None:
    import numpy as np

    report: dict = {
        "upstream": {"commit": UPSTREAM_COMMIT, "sdist": UPSTREAM_SDIST},
        "lib_dir": str(lib_dir()),
        "binaries": {t: str(lib_dir() / t) if (lib_dir() / t).exists() else None for t in LLAMA_TOOLS},
        "types": [{"name": t.name, "id": t.ggml_id, "block_values": t.block_size, "block_bytes": t.block_bytes,
                   "bpw": t.bpw} for t in REQUESTABLE_TYPES.values()],
    }
    try:
        import ctypes as C
        lib = library("ggml")
        lib.ggml_backend_reg_count.restype = C.c_size_t
        lib.ggml_backend_reg_get.restype = C.c_void_p
        lib.ggml_backend_reg_get.argtypes = [C.c_size_t]
        lib.ggml_backend_reg_name.restype = C.c_char_p
        lib.ggml_backend_reg_name.argtypes = [C.c_void_p]
        report["backends"] = [lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i)).decode()
                              for i in range(lib.ggml_backend_reg_count())]
    except OSError as e:
        report["backends"] = f"libggml not loadable: {e}"
    ok = True
    try:
        from . import layer_adaptive
        report["layer_adaptive_modes"] = list(layer_adaptive.modes())
    except OSError as e:
        report["layer_adaptive_modes"] = f"libllama not loadable: {e}"
        ok = False
    try:
        import ctypes as C
        base = library("ggml-base")
        base.ggml_turboq_sign_seed.restype = C.c_char_p
        seed = base.ggml_turboq_sign_seed()
        report["rotation_signs"] = f"PYTURBO_SIGN_SEED={seed.decode()} (a debug build)" if seed else "shipped"
    except (OSError, AttributeError) as e:
        report["rotation_signs"] = f"libggml-base not loadable: {e}"
        seed = None
        ok = False
    try:
        from . import codec
        from .format import reference
        if seed:
            raise LookupError("skipped: the NumPy reference has the shipped rotation signs")
        x = np.random.default_rng(0).standard_normal(256).astype(np.float32)
        for t in ("turboq2", "turboq3", "turboq4", "turboq8"):
            same = np.array_equal(codec.quantize(x, t), reference.quantize(x, t))
            report.setdefault("roundtrip", {})[t] = "ok" if same else "MISMATCH"
            ok &= same
    except OSError as e:
        report["roundtrip"] = f"library not loadable: {e}"
        ok = False
    except LookupError as e:
        report["roundtrip"] = str(e)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"upstream llama.cpp {UPSTREAM_COMMIT} ({UPSTREAM_SDIST})")
        print(f"libraries: {report['lib_dir']}")
        print(f"backends: {report['backends']}")
        print(f"layer-adaptive modes: {report['layer_adaptive_modes']}")
        print(f"rotation signs: {report['rotation_signs']}")
        for t, p in report["binaries"].items():
            print(f"  {t:18s} {p or 'MISSING'}")
        print(f"{'type':8s} {'id':>3s} {'bytes/block':>11s} {'values':>6s} {'bpw':>6s}")
        for t in report["types"]:
            print(f"{t['name']:8s} {t['id']:3d} {t['block_bytes']:11d} {t['block_values']:6d} {t['bpw']:6.3f}")
        print(f"C codec vs NumPy reference: {report['roundtrip']}")
    if not ok:
        sys.exit(1)


def cmd_fetch(args: argparse.Namespace) -> None:
    from .fetch import fetch
    for path in fetch(args.names).values():
        print(path)


def cmd_perplexity(args: argparse.Namespace) -> None:
    from .types import requested_cache_type

    # newline="": the bytes llama-perplexity reads (botchan.txt has \r\n line ends)
    text = open(args.file or data.corpus(), encoding="utf-8", newline="").read()
    configs = ([(f"turboq{b}", f"turboq{b}") for b in args.bits] if args.bits
               else [(requested_cache_type(args.cache_type_k).name, requested_cache_type(args.cache_type_v).name)])
    if args.backend == "hf":
        from .hf.models import load
        from .perplexity.hf import hf_perplexity
        from .hf.torch_codec import check_type

        for tk, tv in configs:  # a bad name fails before the model loads
            check_type(tk), check_type(tv)
        if args.threads:
            import torch
            torch.set_num_threads(args.threads)
        model = load(args.model)

        def run(tk: str, tv: str):
            return hf_perplexity(model, text, tk, tv, args.layer_adaptive, args.max_length, args.stride,
                                 args.max_tokens, args.threads, score_from=args.score_from)
    else:
        from .perplexity.llama import sliding_window_perplexity

        model_path = str(data.model_path(args.model))

        def run(tk: str, tv: str):
            return sliding_window_perplexity(model_path, text, tk, tv, args.layer_adaptive, args.max_length, args.stride,
                                             args.max_tokens, args.threads, score_from=args.score_from)
    print("| K | V | layer_adaptive | tokens scored | PPL |")
    print("|---|---|---|---|---|")
    for tk, tv in configs:
        r = run(tk, tv)
        print(f"| {tk} | {tv} | {args.layer_adaptive} | {r.n_scored} | {r.ppl:.4f} |", flush=True)


def _layer_adaptive_mode(text: str) -> int:
    from .layer_adaptive import parse_mode
    return parse_mode(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="pyturbo", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    for tool in LLAMA_TOOLS:
        p = sub.add_parser(tool, help=f"run the patched {tool} (arguments after --)")
        p.add_argument("--default-model", action="store_true", help="add -m <bundled Gemma 3 270M>")
        p.add_argument("args", nargs=argparse.REMAINDER)
        p.set_defaults(func=cmd_tool, tool=tool)
    p = sub.add_parser("doctor", help="paths, pin, type table and a codec round trip")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)
    p = sub.add_parser("perplexity", help="sliding-window perplexity through llama-cpp-python or transformers")
    p.add_argument("--model", help="GGUF, or gemma3-270m / smollm2-135m (default: bundled Gemma 3 270M)")
    p.add_argument("--backend", choices=["llama", "hf"], default="llama",
                   help="llama: llama.cpp through llama-cpp-python; hf: transformers with pyturbo.hf.TurboQuantCache "
                        "(pip install '.[hf]')")
    p.add_argument("-f", "--file", help="text file (default: botchan.txt)")
    p.add_argument("--cache-type-k", "-ctk", default="f16")
    p.add_argument("--cache-type-v", "-ctv", default="f16")
    p.add_argument("--layer-adaptive", type=_layer_adaptive_mode, default=0, metavar="MODE",
                   help="layer-adaptive mode, its number or name (default 0 = off)")
    p.add_argument("--bits", type=int, nargs="+", choices=[2, 3, 4, 8],
                   help="run turboq<bits> for K and V for each value (overrides the cache types)")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--stride", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--score-from", type=int, default=0,
                   help="score only targets at window offsets >= N; --max-length 512 --stride 512 --score-from 257 "
                        "is llama-perplexity -c 512 exactly")
    p.set_defaults(func=cmd_perplexity)
    p = sub.add_parser("bench", help="benchmarks: matrix, quality, speed, serve (ratios measured in one run)")
    from .bench import add_parsers as add_bench_parsers
    add_bench_parsers(p.add_subparsers(dest="bench", required=True))
    p = sub.add_parser("kvlab", help="K/V lab: real Q/K/V replayed with encoder variants (pyturbo.lab.kvlab)")
    p.add_argument("action", choices=["dump", "replay", "validate"],
                   help="dump Q/K/V; replay the variant table; validate = replay + llama-perplexity KLD and rank correlation")
    p.add_argument("--model", help="GGUF (default: bundled Gemma 3 270M)")
    p.add_argument("--chunks", type=int, default=2, help="chunks to dump/replay")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (a sliding-window model's windows are applied)")
    p.add_argument("--seeds", type=int, default=3, help="rotation draws per variant (the shipped one + N-1 others)")
    p.add_argument("--only", nargs="+", help="variants whose name contains one of these")
    p.add_argument("--attn-scale", type=float, default=256 ** -0.5, help="logit scale (Gemma 3: query_pre_attn_scalar^-1/2)")
    p.add_argument("--e2e-chunks", type=int, default=20, help="llama-perplexity chunks for validate")
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(func=lambda a: __import__("pyturbo.lab.kvlab", fromlist=["main"]).main(a))
    p = sub.add_parser("fetch", help="download the real data once: the models and botchan.txt (default: all)")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"any of: {', '.join(data.FETCHED)}")
    p.set_defaults(func=cmd_fetch)
    p = sub.add_parser("model-path", help="print the path of the bundled default model (after `pyturbo fetch`)")
    p.set_defaults(func=lambda a: print(data.default_model()))
    p = sub.add_parser("corpus-path", help="print the path of botchan.txt (after `pyturbo fetch`)")
    p.set_defaults(func=lambda a: print(data.corpus()))
    args = ap.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, OSError, ImportError) as e:
        # bad input (a type name, a model path, a missing extra), missing data, a failed download:
        # the reason, not a traceback
        ap.exit(2, f"pyturbo {args.command}: {e}\n")
