"""python -m server [--engine llama-server|python] [--model M.gguf] [--cache-type-k turboq3] ... [-- llama-server flags]

An OpenAI-compatible server (/v1/models, /v1/completions, /v1/chat/completions, streaming,
/health) with pyturbo's KV-cache types. Every flag is checked here first; a bad one ends with
a message, not a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pyturbo import data, exact_window, k_centering, layer_adaptive
from pyturbo._paths import UnpatchedLibraryError, binary
from pyturbo.types import REQUESTABLE_TYPES, requested_cache_type

ENGINES = ("llama-server", "python")


def _prog() -> str:
    """`python -m server` (the checkout's entry point) or `python -m pyturbo.server`, as invoked."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return f"python -m {spec.name.removesuffix('.__main__')}" if spec and spec.name.endswith("server.__main__") \
        else "python -m server"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=_prog(), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=ENGINES, default="llama-server",
                    help="llama-server: the patched C++ server, parallel slots (default); "
                         "python: llama-cpp-python's server, one request at a time")
    ap.add_argument("--model", help="GGUF path (default: the bundled Gemma 3 270M)")
    names = ", ".join(REQUESTABLE_TYPES)
    ap.add_argument("--cache-type-k", "-ctk", default="f16", help=f"K cache type: {names}")
    ap.add_argument("--cache-type-v", "-ctv", default="f16", help=f"V cache type: {names}")
    ap.add_argument("--layer-adaptive", type=layer_adaptive.parse_mode, default=0, metavar="MODE",
                    help="layer-adaptive mode, its number or name (4 or k4-global): per-layer K/V types "
                         "(see docs/usage.md; default 0 = off)")
    ap.add_argument("--kv-exact-window", type=exact_window.setting, default=None, metavar="W|auto",
                    help="quantized caches: each sequence's last W positions read exact, from F16 rows kept beside "
                         "the cache; auto sizes the window and its margin by --n-ctx, up to 32 and 16, so that "
                         "their rows cost at most 1/6 bit per value of its cells; 0 keeps none (see docs/usage.md; default: "
                         "the model's, else auto beside a turboq cache, none beside others)")
    ap.add_argument("--kv-exact-window-margin", type=int, default=None, metavar="M",
                    help="with an exact window: positions kept exact beyond the window, so that it stays whole "
                         "after the last M are removed again (a reused prompt, speculative drafts); 0 saves "
                         "their memory, and a prompt reused short of its end is then processed again "
                         "(default: the model's, else 16; beside an auto window, the default one included, auto's own; "
                         "with a draft model, the larger of --draft-max and 16)")
    ap.add_argument("--kv-exact-sink", type=exact_window.setting, default=None, metavar="S|auto",
                    help="quantized caches: each sequence's first S positions (the attention sink) read exact by "
                         "every query, from F16 rows kept beside the cache, with or without --kv-exact-window "
                         "(see docs/usage.md; default: the model's, else auto = 1 beside a turboq cache, 0 = none)")
    ap.add_argument("--kv-k-center", choices=("on", "off"), default=None,
                    help="turboq K caches: K centered on the model's calibrated mean and scaled per channel (on), "
                         "or stored as it comes (off, for comparisons); default: the model's, else on")
    ap.add_argument("--kv-k-scale", choices=k_centering.SCALES, default=None,
                    help="turboq K caches: the channel scale of K centering; auto takes it where the model's "
                         "calibration measured that it lowers the attention error (with --kv-exact-sink as set); "
                         "default: the model's, else auto")
    ap.add_argument("--n-ctx", type=int, default=4096, help="context of each slot, in tokens (default 4096)")
    ap.add_argument("--parallel", "-np", type=int, default=4,
                    help="slots decoding at once (llama-server engine; default 4). The python engine serves one "
                         "request at a time")
    ap.add_argument("--draft-model", "-md", default=None,
                    help="GGUF of a smaller model that drafts tokens for the main one to verify (speculative "
                         "decoding; llama-server engine). At temperature 0 the text is the same as without it")
    ap.add_argument("--cache-type-k-draft", "-ctkd", default=None, help="the draft model's K cache type (default: --cache-type-k)")
    ap.add_argument("--cache-type-v-draft", "-ctvd", default=None, help="the draft model's V cache type (default: --cache-type-v)")
    ap.add_argument("--draft-max", type=int, default=None, help="most tokens drafted per step (default: llama-server's)")
    ap.add_argument("--embeddings", nargs="?", const="mean", default=None, choices=("mean", "last", "cls"),
                    help="also serve /v1/embeddings, pooling each input's token vectors (default pooling: mean; "
                         "llama-server engine). Completions and chat keep working")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every endpoint but /health")
    ap.add_argument("--n-threads", type=int, default=None,
                    help="threads for decode and prefill (default: llama-server's, every core). While another process "
                         "holds a core, ggml-cpu runs the graphs on the threads that have one and tries them all again "
                         "once a second (patch 3); the answer does not change. Measured on a 2-core machine "
                         "(docs/server.md): every core decodes 1.8x faster than one when idle and keeps about 0.5x of "
                         "that beside a busy process or a second server, as one thread would. The server's OpenMP "
                         "threads wait passively between tokens (OMP_WAIT_POLICY=passive, unless the environment sets it)")
    ap.add_argument("--alias", default=None, help="model name clients use (default: the file name)")
    ap.add_argument("--quiet", action="store_true", help="warnings and errors only")
    ap.add_argument("extra", nargs=argparse.REMAINDER,
                    help="after --: further llama-server flags, passed as they are (llama-server engine)")
    return ap


def _check(args: argparse.Namespace) -> None:
    """Raise ValueError with the reason for the first bad flag."""
    args.cache_type_k = requested_cache_type(args.cache_type_k).name
    args.cache_type_v = requested_cache_type(args.cache_type_v).name
    layer_adaptive.check_mode(args.layer_adaptive)
    try:
        if args.kv_exact_window is not None:
            args.kv_exact_window = exact_window.check(args.kv_exact_window)
    except ValueError as e:
        raise ValueError(f"--kv-exact-window: {e}") from None
    if args.kv_exact_window_margin is not None:
        try:
            exact_window.check_margin(args.kv_exact_window_margin)
        except ValueError as e:
            raise ValueError(f"--kv-exact-window-margin: {e}") from None
        if args.kv_exact_window == 0:
            raise ValueError("--kv-exact-window-margin needs a window (--kv-exact-window 0 keeps none)")
    if args.kv_exact_sink is not None:
        try:
            args.kv_exact_sink = exact_window.check_sink(args.kv_exact_sink)
        except ValueError as e:
            raise ValueError(f"--kv-exact-sink: {e}") from None
    if args.n_ctx < 1:
        raise ValueError(f"--n-ctx {args.n_ctx}: must be at least 1")
    if args.parallel < 1:
        raise ValueError(f"--parallel {args.parallel}: must be at least 1")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: not a TCP port")
    if args.n_threads is not None and args.n_threads < 1:
        raise ValueError(f"--n-threads {args.n_threads}: must be at least 1")
    if args.model and not Path(args.model).is_file():
        raise ValueError(f"--model {args.model}: no such file")
    if args.draft_model is None and (args.cache_type_k_draft or args.cache_type_v_draft or args.draft_max is not None):
        raise ValueError("--cache-type-k-draft, --cache-type-v-draft and --draft-max need --draft-model")
    if args.draft_model is not None:
        if not Path(args.draft_model).is_file():
            raise ValueError(f"--draft-model {args.draft_model}: no such file")
        args.cache_type_k_draft = requested_cache_type(args.cache_type_k_draft or args.cache_type_k).name
        args.cache_type_v_draft = requested_cache_type(args.cache_type_v_draft or args.cache_type_v).name
        from .chat_template import gguf_metadata
        gguf_metadata(args.draft_model)  # a file that is not a GGUF is refused here, with the reason
        if args.draft_max is not None and args.draft_max < 1:
            raise ValueError(f"--draft-max {args.draft_max}: must be at least 1")
        margin = args.kv_exact_window_margin
        if args.kv_exact_window != 0 and margin is not None and (args.draft_max is None or args.draft_max > margin):
            # a rejected draft rolls the window back by up to --draft-max positions; past the margin the
            # next tokens would read some of the window's positions as stored, and the text would change
            raise ValueError(f"--kv-exact-window-margin {margin} with a draft model: give --draft-max at most {margin} "
                             f"(a rollback of rejected drafts must stay within the margin)")
        if args.kv_exact_window != 0 and margin is None:
            # auto's own margin (also the default window's) may be shorter than such a rollback:
            # the drafts' most, and at least the fixed window's 16 (llama.cpp's common does the same)
            args.kv_exact_window_margin = max(args.draft_max or 0, 16)
    if args.engine != "llama-server":
        for flag, value in (("--draft-model", args.draft_model), ("--embeddings", args.embeddings)):
            if value is not None:
                raise ValueError(f"{flag} needs the llama-server engine (llama-cpp-python's server has neither "
                                 f"draft models nor embeddings beside chat)")
    if args.extra[:1] == ["--"]:
        args.extra = args.extra[1:]
    if args.extra and args.engine != "llama-server":
        raise ValueError(f"extra flags {' '.join(args.extra)!r} are llama-server flags; the python engine takes none")
    # these set what the memory check and the cache types already decided
    for flag in ("--layer-adaptive", "--kv-exact-window", "--kv-exact-window-margin", "--kv-exact-sink", "--kv-k-center", "--kv-k-scale", "-ctk",
                 "--cache-type-k", "-ctv", "--cache-type-v"):
        if any(a == flag or a.startswith(flag + "=") for a in args.extra):
            raise ValueError(f"{flag} after '--': give it as python -m server's own option")


def mem_available() -> int | None:
    """Bytes the kernel could give without swapping (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_memory(model: str, args: argparse.Namespace) -> None:
    """A context that cannot fit is refused here, with the sizes, before llama.cpp clears a KV
    buffer larger than the machine and the kernel kills it."""
    from pyturbo.memory import kv_bytes

    from .llama_server import kv_unified

    avail = mem_available()
    if avail is None:
        return
    try:
        if args.engine == "llama-server":
            unified = kv_unified(args.extra, args.embeddings)
            kv = kv_bytes(model, args.n_ctx * args.parallel, args.cache_type_k, args.cache_type_v, args.layer_adaptive,
                          n_seq=args.parallel, n_stream=1 if unified else args.parallel, upper_bound=True,
                          exact_window=args.kv_exact_window, exact_window_margin=args.kv_exact_window_margin,
                          exact_sink="auto" if args.kv_exact_sink is None else args.kv_exact_sink)
        else:  # llama-cpp-python keeps every sliding-window cell (swa_full)
            kv = kv_bytes(model, args.n_ctx, args.cache_type_k, args.cache_type_v, args.layer_adaptive,
                          swa_full=True, upper_bound=True, exact_window=args.kv_exact_window,
                          exact_window_margin=args.kv_exact_window_margin, exact_sink="auto" if args.kv_exact_sink is None else args.kv_exact_sink)
        if args.draft_model:  # the draft model has a context of the same size, with its own cache types
            kv += kv_bytes(args.draft_model, args.n_ctx * args.parallel, args.cache_type_k_draft,
                           args.cache_type_v_draft, args.layer_adaptive, n_seq=args.parallel,
                           n_stream=1 if unified else args.parallel, upper_bound=True,
                           exact_window=args.kv_exact_window, exact_window_margin=args.kv_exact_window_margin,
                           exact_sink="auto" if args.kv_exact_sink is None else args.kv_exact_sink)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return  # an architecture kv_bytes does not know: llama.cpp decides
    weights = Path(model).stat().st_size + (Path(args.draft_model).stat().st_size if args.draft_model else 0)
    if kv + weights > avail:
        gib = 2 ** 30
        slots = f" x --parallel {args.parallel}" if args.engine == "llama-server" else ""
        raise ValueError(f"--n-ctx {args.n_ctx}{slots} needs {kv / gib:.1f} GiB of KV cache "
                         f"({args.cache_type_k} K, {args.cache_type_v} V) and {weights / gib:.1f} GiB of weights, "
                         f"but this machine has {avail / gib:.1f} GiB available: lower --n-ctx or --parallel, "
                         f"or use a smaller cache type")


def wait_passively() -> str:
    """OpenMP's worker threads (libgomp, which the default build's ggml-cpu uses) spin between one
    graph and the next unless OMP_WAIT_POLICY says otherwise; beside another busy process that spin
    takes cycles from the thread that still has work. libgomp reads the variable when it is loaded,
    so it is set here, before libllama is loaded in this process or llama-server is started; a value
    the user set is kept. Measured (bench/results/contention.md, 2 cores, Gemma 3 270M, -t 2): decode
    beside a busy process 0.38x -> 0.45x (f16) and 0.36x -> 0.43x (turboq3) of idle, idle within 2%."""
    return os.environ.setdefault("OMP_WAIT_POLICY", "passive")


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    wait_passively()
    try:
        _check(args)
        model = args.model or str(data.default_model())
        from .chat_template import fallback_for
        fallback = fallback_for(model)
        _check_memory(model, args)
    except (ValueError, OSError) as e:
        sys.exit(f"server: {e}")
    alias = args.alias or Path(model).name
    if args.engine == "llama-server":
        from . import llama_server
        try:
            spec = llama_server.LaunchSpec(model, args.cache_type_k, args.cache_type_v, args.layer_adaptive, args.n_ctx,
                                           args.parallel, args.host, args.port, alias, args.api_key, args.n_threads,
                                           fallback, args.quiet, args.extra,
                                           llama_server.Draft(args.draft_model, args.cache_type_k_draft,
                                                              args.cache_type_v_draft, args.draft_max)
                                           if args.draft_model else None,
                                           args.embeddings, args.kv_exact_window, args.kv_exact_window_margin,
                                           args.kv_k_center, args.kv_exact_sink, args.kv_k_scale)
            binary("llama-server")
        except FileNotFoundError as e:
            sys.exit(f"server: {e}")
        sys.exit(llama_server.run(spec))
    try:
        from . import python_engine
    except UnpatchedLibraryError as e:
        sys.exit(f"server: {e}")
    except ImportError as e:
        sys.exit(f"server: --engine python needs llama-cpp-python (pip install '.[python]'): {e}")
    from pyturbo.llama import ContextError
    if fallback:
        print(f"server: {fallback.describe()}", file=sys.stderr)
    if args.parallel > 1:
        print(f"server: --parallel {args.parallel}: the python engine serves one request at a time; the others queue",
              file=sys.stderr)
    try:
        app = python_engine.build_app(model, args.cache_type_k, args.cache_type_v, args.layer_adaptive, args.n_ctx,
                                      args.n_threads, alias, args.host, args.port, args.api_key, fallback,
                                      verbose=not args.quiet, kv_exact_window=args.kv_exact_window,
                                      kv_exact_window_margin=args.kv_exact_window_margin,
                                      kv_exact_sink=args.kv_exact_sink,
                                      k_center=None if args.kv_k_center is None else args.kv_k_center == "on",
                                      k_scale=args.kv_k_scale)
    except (ValueError, ContextError) as e:
        sys.exit(f"server: {e}")
    sys.exit(python_engine.run(app, args.host, args.port, args.quiet))
