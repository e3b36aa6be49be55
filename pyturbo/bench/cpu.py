"""`pyturbo bench quality|speed`: llama-perplexity and llama-bench tables, ratios measured in one run.

  pyturbo bench quality [--model M] [--text botchan|pydoc|FILE] [--ctx 512] [--chunks N]
                        [--types f16 q4_0 turboq3/turboq4:3 ...]
                                                          # PPL, KLD vs f16 (mean, median, p99.9), same top
                                                          # token, KV MiB (default: Gemma 3 270M, botchan, c=512)
  pyturbo bench speed [--model M] [--threads 1] [--reps 2] [--depth 16384]
                                                          # llama-bench pp512, pp2048, tg64; pp512/tg32 at depth 4096;
                                                          # tg32 at --depth: ratios to f16, and each decode
                                                          # figure beside its read-bandwidth bound (bench.bandwidth)

Speed runs interleave the cache types type by type, `--rounds` times, and report the median of
each, so that drift of a shared machine hits every type alike.
"""
from __future__ import annotations

import argparse
import csv
import io
import re
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .. import data, exact_window, k_centering
from ..tools import llama_perplexity, run_tool
from ..layer_adaptive import layer_cache_types, needs_gains, stored_type
from ..memory import kv_geometry, layer_cells, pad_cells, window_bytes
from ..types import layer_cache_type, requested_cache_type

QUALITY_TYPES = ["f16", "q8_0", "q4_0", "turboq8", "turboq4", "turboq3", "turboq2"]
SPEED_TYPES = ["f16", "q8_0", "q4_0", "turboq4", "turboq3", "q8_0/turboq3", "turboq3:onerow", "q8_0/turboq3:onerow"]
# one llama-bench process per depth, so that each depth is filled once per type (llama-bench keeps
# the filled state for the reps of one depth)
SPEED_RUNS = [["-p", "512,2048", "-n", "64"], ["-p", "512", "-n", "32", "-d", "4096"], ["-p", "0", "-n", "32", "-d", "{depth}"]]


OPTIONS = {"uncentered": {k_centering.ENV: "off"},      # K centering (and its channel scale) off
           "unscaled": {k_centering.SCALE_ENV: "off"},  # K centering without the channel scale
           "scaled": {k_centering.SCALE_ENV: "on"},     # with it, whatever the calibration's trial chose
           "onerow": {"TURBOQ_FA_TILED": "0"}}       # CPU flash attention without the quantized tiled path


# ':tailW': the last W positions of each sequence read exact within a ubatch (the window's oracle, a
# debug switch)
EXACT_ROWS = {"tail": "TURBOQ_EXACT_TAIL"}
WINDOW = re.compile(r"(\d+|auto)(?:m(\d+))?")  # ':winW', ':winauto' or ':winWmM' after 'win'


def parse_config(c: str) -> tuple[str, str, str, dict[str, str]]:
    """'t' (K = V = t) or 'k/v', then any of ':N' (a LLAMA_ARG_LAYER_ADAPTIVE mode), ':uncentered'
    (--kv-k-center off), ':unscaled' and ':scaled' (--kv-k-scale off and on; without either, auto),
    ':onerow' (TURBOQ_FA_TILED=0),
    ':winW' (the exact window, --kv-exact-window W through its alias LLAMA_ARG_KV_EXACT_WINDOW;
    ':win0' for none, as without it a turboq cache keeps auto's window;
    ':winWmM' with a margin of M, --kv-exact-window-margin M), ':sinkS' (sink rows, --kv-exact-sink S
    through LLAMA_ARG_KV_EXACT_SINK; ':sink0' for none, as without it a turboq cache keeps auto's
    one), ':tailW' (TURBOQ_EXACT_TAIL=W): (label, K, V, environment)."""
    spec, *opts = c.split(":")
    k, _, v = spec.partition("/")
    v = v or k
    for t in (k, v):
        requested_cache_type(t)  # a clear error before any tool runs
    env: dict[str, str] = {}
    for opt in opts:
        if opt in OPTIONS:
            env.update(OPTIONS[opt])
        elif opt.isdigit():
            env["LLAMA_ARG_LAYER_ADAPTIVE"] = opt
        elif opt[:4] in EXACT_ROWS and opt[4:].isdigit() and int(opt[4:]) > 0:
            env[EXACT_ROWS[opt[:4]]] = opt[4:]
        elif opt[:4] == "sink" and opt[4:].isdigit() and 0 <= int(opt[4:]) <= exact_window.max_positions():
            env[exact_window.SINK_ENV] = opt[4:]
        elif opt[:3] == "win" and (m := WINDOW.fullmatch(opt[3:])) and \
                (m[1] == "auto" or 0 <= int(m[1]) <= exact_window.max_positions()) and \
                (m[2] is None or int(m[2]) <= exact_window.max_positions()):
            env[exact_window.ENV] = m[1]
            if m[2] is not None:
                env[exact_window.MARGIN_ENV] = m[2]
        else:
            raise SystemExit(f"{c}: unknown option {opt!r} (a layer mode number, winW, winWmM, tailW, sinkS, or one of "
                             f"{', '.join(OPTIONS)})")
    return c, k, v, env


def _auto_keeps(env: dict[str, str], mla: bool) -> bool:
    """Whether libllama's defaults (the sink rows' auto, the unset window) keep rows for a
    configuration: none on an MLA model, which keeps no exact rows, or beside the debug tail,
    which they leave alone (patches 45 and 54)."""
    return not mla and int(env.get(EXACT_ROWS["tail"]) or 0) <= 0


def sink_rows(env: dict[str, str], k: str, v: str, mla: bool = False) -> int:
    """The sink rows per sequence that a configuration's environment keeps: LLAMA_ARG_KV_EXACT_SINK,
    else auto's (one beside a turboq cache, where _auto_keeps)."""
    s = exact_window.setting(env.get(exact_window.SINK_ENV))
    if s is None or s == exact_window.SINK_AUTO:
        return exact_window.sink_count(None, k, v) if _auto_keeps(env, mla) else 0
    return exact_window.check_sink(s)


def window_positions(env: dict[str, str], k: str, v: str, mla: bool = False) -> int:
    """The exact window that a configuration's environment keeps: LLAMA_ARG_KV_EXACT_WINDOW, else
    libllama's default (auto's beside a turboq cache, where _auto_keeps)."""
    w = exact_window.env_window(env)
    if w is None:
        return exact_window.window_default(k, v) if _auto_keeps(env, mla) else 0
    return w


def window_margin(env: dict[str, str]) -> int | None:
    """The exact window's margin that a configuration's environment sets (None: the default)."""
    m = env.get(exact_window.MARGIN_ENV)
    return int(m) if m is not None else None


def config_bpw(model_layers: int, k: str, v: str, env: dict[str, str], ctx: int, head_dim_k: int = 128,
               head_dim_v: int = 128, mla: bool = False, sliding: Sequence[bool] | None = None,
               cells: Sequence[int] | None = None) -> float:
    """Bits per value of K and V together, of the types a layer of these head sizes stores (a
    turboq type's _g64 twin where the head size is a multiple of 64 but not of 128, its _g32 twin
    where it is a multiple of 32 but not of 64, its _g16 twin where it is a multiple of 16 but not of 32), averaged over
    the layers, each with the types the layer-adaptive mode gives it (libllama's table and rule,
    pyturbo.layer_adaptive; `sliding`, one bool per layer, picks mode 4's layers, none sliding if
    left out). W + S exact
    positions (a tail) count as that many of the context's ctx positions held in f16 instead of
    the type (a token is quantized as it leaves the window), as the K/V lab counts it. An exact
    window (':winW') and sink rows (':sinkS') keep their rows besides: each layer with a quantized
    K or V holds rows_per_sequence(W, M, S) F16 rows of K and of V per sequence on top of the cache,
    weighed against the layer's cells (`cells`, one per layer, as pyturbo.memory.layer_cells gives
    them; ctx for every layer if left out); an auto window (':winauto') is sized by ctx on every
    layer, as libllama sizes a sliding-window cache's by its sibling's. An MLA model
    (mla) caches K alone, so its bits per value are K's."""
    tail = min(sum(int(env.get(var) or 0) for var in EXACT_ROWS.values()), ctx)
    w = window_positions(env, k, v, mla)
    sink = sink_rows(env, k, v, mla)
    rows = exact_window.rows_per_sequence(w, window_margin(env), sink, pad_cells(ctx))
    rings = [16 * rows / c for c in (cells or [ctx] * model_layers)]

    def quantized(t: str, hd: int) -> bool:
        return layer_cache_type(t, hd).bpw < 16

    def bpw(t: str, hd: int = head_dim_k, ring: float = 0.0, requested: str | None = None) -> float:
        b = stored_type(t, requested or t, hd).bpw
        return b + (16 - b) * tail / ctx + ring

    window = quantized(k, head_dim_k) or quantized(v, head_dim_v)
    mode = int(env.get("LLAMA_ARG_LAYER_ADAPTIVE") or 0)
    # a mode that ranks layers by K gain (3) takes n_layer // k_gain_div of them: which ones does
    # not change an average over the layers, so equal gains stand in for the model's weights
    gains = [0.0] * model_layers if needs_gains(mode) else None
    layers = layer_cache_types(mode, model_layers, k, v, gains, sliding or [False] * model_layers)
    total = 0.0
    for (tk, tv), ring in zip(layers, rings):
        ring = ring if window else 0.0
        bk = bpw(tk, ring=ring, requested=k)
        total += bk if mla else (bk + bpw(tv, head_dim_v, ring, requested=v)) / 2  # MLA caches no V
    return total / model_layers


def quality(args: argparse.Namespace) -> None:
    args.types = quality_types(args.types)
    model, text = data.model_path(args.model), data.corpus_path(args.text)
    chunks = args.chunks or max(1, 10240 // args.ctx)
    batch = args.batch or min(args.ctx, 2048)
    if args.ctx % batch:
        raise SystemExit(f"--batch {batch} must divide --ctx {args.ctx} (llama-perplexity's rule)")
    if args.ctx > 2048:
        print(f"# the f16 logits base for the KLD is about {args.ctx // 2 * chunks * 4 * 262144 / 2**30:.1f} GiB "
              "at Gemma's vocabulary (in a temporary directory)", file=sys.stderr, flush=True)
    from tqdm import tqdm

    # a tail reads exact only the rows of the ubatch at hand, so a run that measures one takes each
    # batch in one ubatch (every configuration of it, the f16 base included, the same way)
    ubatch = ("-ub", str(batch)) if any(set(parse_config(c)[3]) & set(EXACT_ROWS.values()) for c in args.types) else ()

    geo = kv_geometry(model)
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        base = Path(tmp) / "f16.kld"
        rows = []
        for c in (bar := tqdm(args.types, desc="bench quality", unit="config")):
            bar.set_postfix_str(c)
            label, k, v, env = parse_config(c)
            r = llama_perplexity(model, text, k, v, ctx=args.ctx, batch=batch, chunks=chunks, threads=args.threads,
                                 kld_base=base, write_base=(c == "f16"), env=env, timeout=6 * 3600, extra=ubatch)
            w = window_positions(env, k, v, geo.mla)
            sink = sink_rows(env, k, v, geo.mla)
            mode = int(env.get("LLAMA_ARG_LAYER_ADAPTIVE") or 0)
            # one sequence of --ctx positions (an auto window's size), its sliding-window layers as llama-perplexity keeps them
            cells = layer_cells(geo, args.ctx, 1, int(ubatch[1]) if ubatch else 512)
            ring_mib = window_bytes(model, k, v, mode, 1, w, window_margin(env), sink, pad_cells(args.ctx)) / 2 ** 20 \
                if w or sink else 0.0
            rows.append((label, config_bpw(geo.n_layer, k, v, env, args.ctx, geo.head_dim_k, geo.head_dim_v, geo.mla,
                                            geo.sliding(), cells),
                         r.kv_mib + ring_mib, r))
            tqdm.write(f"# {label}: PPL {r.ppl:.4f} KLD {r.kld} median {r.kld_median} p99.9 {r.kld_p999} "
                       f"KV {r.kv_mib:.2f} MiB", file=sys.stderr)
    f16_kv = rows[0][2]
    q4 = next((r for label, _, _, r in rows if label == "q4_0"), None)
    print(f"\n{model.name}, {text.name}, c={args.ctx} (-b {batch}), {chunks} chunk(s) (the second half of each "
          "scored), -fa on; KLD against the f16 cache; K/V, ':N' = LLAMA_ARG_LAYER_ADAPTIVE=N, ':uncentered' = "
          "--kv-k-center off, ':unscaled'/':scaled' = --kv-k-scale off/on (else auto), ':winW' = --kv-exact-window W (KV MiB with its "
          "F16 rows; ':winauto': auto), ':winWmM' = with --kv-exact-window-margin M, ':sinkS' = --kv-exact-sink S (KV MiB with its "
          "F16 rows; without it a turboq cache keeps auto's one, ':sink0' none)" +
          (f", ':tailW' = TURBOQ_EXACT_TAIL=W (-ub {batch}; KV MiB without "
           "those f16 rows, bpw per layer with them)" if ubatch else "") + ". bpw in memory: 16 x the KV bytes over "
          "the f16 cache's (the log's MiB, to two decimals); bpw per layer: the types' bits averaged over the layers, which differ where layers hold "
          "different numbers of cells (sliding windows)\n")
    print("| K/V | bpw in memory | bpw per layer | PPL | mean KLD | mean vs q4_0 | median KLD | p99.9 KLD | p99.9 vs q4_0 "
          "| same top token | KV MiB | KV vs f16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")

    def ratio(x: float | None, ref: float | None) -> str:
        return f"{x / ref:.2f}x" if x is not None and ref else ""

    def num(x: float | None, fmt: str) -> str:
        return "missing" if x is None else format(x, fmt)

    for label, bpw, kv, r in rows:
        mem = 16 * kv / f16_kv
        if label == "f16":
            print(f"| f16 | {mem:.2f} | {bpw:.3f} | {r.ppl:.3f} | 0 | | 0 | 0 | | 100% | {kv:.2f} | 1.0000 |")
            continue
        kld = "missing" if r.kld is None else f"{r.kld:.5f} ± {r.kld_err:.5f}"
        print(f"| {label} | {mem:.2f} | {bpw:.3f} | {r.ppl:.3f} | {kld} | {ratio(r.kld, q4 and q4.kld)} | "
              f"{num(r.kld_median, '.5f')} | {num(r.kld_p999, '.4f')} | {ratio(r.kld_p999, q4 and q4.kld_p999)} | "
              f"{'missing' if r.same_top is None else f'{r.same_top:.1f}%'} | {kv:.2f} | {kv / f16_kv:.4f} |")
    if args.plot != "none":
        path = Path(args.plot or f"bench-out/quality-{model.stem}-{text.stem}-c{args.ctx}.png")
        # tails and sinks are debug rows whose f16 copies the cache does not hold: their per-layer bits count them
        points = [(label, bpw if set(parse_config(label)[3]) & set(EXACT_ROWS.values()) else 16 * kv / f16_kv, r.kld)
                  for label, bpw, kv, r in rows if label != "f16" and r.kld is not None and bpw == bpw]
        try:
            from .plot import plot_kld_per_bit
            plot_kld_per_bit(points, path, f"{model.name}, {text.name}, c={args.ctx}, {chunks} chunk(s): "
                                           "mean KLD vs f16 cache")
            print(f"\nplot: {path}")
        except ImportError as e:  # the table above is the result; the plot needs the [bench] extra
            print(f"\nno plot: {e} (pip install '.[bench]')", file=sys.stderr)


def bench_once(model: Path, config: str, threads: int, reps: int, extra: list[str]) -> dict[str, float]:
    _, k, v, env = parse_config(config)
    r = run_tool("llama-bench", "-m", str(model), "-fa", "1", "-t", str(threads), "-r", str(reps),
                 "-ctk", k, "-ctv", v, "-o", "csv", *extra, env=env)
    return bench_rows(r.stdout)


def bench_rows(csv_text: str) -> dict[str, float]:
    """llama-bench's `-o csv` as {"pp512": t/s, "tg32@d4096": t/s, ...}"""
    out = {}
    for row in csv.DictReader(io.StringIO(csv_text)):
        key = f"pp{row['n_prompt']}" if int(row["n_prompt"]) else f"tg{row['n_gen']}"
        depth = int(row.get("n_depth") or 0)
        if depth:
            key += f"@d{depth}"
        out[key] = float(row["avg_ts"])
    return out


def speed(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from .bandwidth import read_gbps

    model = data.model_path(args.model)
    args.types = quality_types(args.types)  # the ratios are to f16
    for t in args.types:
        parse_config(t)  # a clear error before any tool runs
    gbps = read_gbps(args.threads)  # before the runs, on the same idle machine
    runs = [[a.format(depth=args.depth) for a in cfg] for cfg in SPEED_RUNS]
    samples: dict[str, dict[str, list[float]]] = {t: {} for t in args.types}
    bar = tqdm(total=args.rounds * len(runs) * len(args.types), desc="bench speed", unit="run")
    for rnd in range(args.rounds):
        for cfg in runs:
            for t in args.types:
                bar.set_postfix_str(f"round {rnd} {t}")
                results = bench_once(model, t, args.threads, args.reps, cfg)
                bar.update()
                for k, v in results.items():
                    samples[t].setdefault(k, []).append(v)
                    tqdm.write(f"# round {rnd} {t} {k}: {v:.2f} t/s", file=sys.stderr)
    bar.close()
    keys = list(samples[args.types[0]])
    med = {t: {k: statistics.median(v) for k, v in s.items()} for t, s in samples.items()}
    print(f"\n{model.name}, llama-bench -fa 1 -t {args.threads} -r {args.reps}, median of {args.rounds} interleaved rounds;"
          " ':onerow' = TURBOQ_FA_TILED=0 (the one-row flash attention of before)\n")
    for title, fmt in (("t/s", lambda t, k: f"{med[t][k]:.2f}"), ("vs f16", lambda t, k: f"{med[t][k] / med['f16'][k]:.3f}")):
        print("| K/V | " + " | ".join(f"{k} {title}" for k in keys) + " |")
        print("|---|" + "---|" * len(keys))
        for t in args.types:
            print(f"| {t} | " + " | ".join(fmt(t, k) for k in keys) + " |")
        print()
    print_bounds(model, args.types, med, gbps, args.threads)
    for t in args.types:
        base = f"{t}:onerow"
        if base in med:
            print(f"{t} vs {base}: " + ", ".join(f"{k} {med[t][k] / med[base][k]:.3f}" for k in keys))
    if "q4_0" in med:
        for t in args.types:
            if t.startswith("turboq") and "/" not in t and ":" not in t:
                print(f"{t} vs q4_0: " + ", ".join(f"{k} {med[t][k] / med['q4_0'][k]:.3f}" for k in keys))


def print_bounds(model: Path, types: list[str], med: dict[str, dict[str, float]], gbps: float, threads: int) -> None:
    """Each decode figure (tgN, tgN@dD) beside its bound: the bytes a token reads at that depth
    (bench.bandwidth.token_bytes, at the run's middle token) over the read bandwidth measured with
    as many threads."""
    from .bandwidth import PROBE_MIB, token_bytes

    keys = [k for k in med[types[0]] if k.startswith("tg")]
    if not keys:
        return
    print(f"Decode against its read-bandwidth bound: {gbps:.1f} GB/s read by {threads} thread(s) ({PROBE_MIB} MiB "
          "in 4 KiB pages, best of 3); bound = that over the bytes a token reads (the model file once, K and V up to the depth)\n")
    print("| K/V | " + " | ".join(f"{k} t/s | bound | % of bound" for k in keys) + " |")
    print("|---|" + "---|---|---|" * len(keys))
    for t in types:
        _, k, v, env = parse_config(t)
        cells = []
        for key in keys:
            n, _, d = key[2:].partition("@d")
            bound = gbps * 1e9 / token_bytes(model, k, v, env, int(d or 0) + int(n) // 2)
            cells.append(f"{med[t][key]:.2f} | {bound:.1f} | {100 * med[t][key] / bound:.0f}%")
        print(f"| {t} | " + " | ".join(cells) + " |")
    print()


def add_parsers(sub) -> None:
    q = sub.add_parser("quality", help="PPL, KLD vs f16 (mean, median, p99.9), same top token, KV MiB per cache type "
                                       "(llama-perplexity)")
    q.add_argument("--model", help="a GGUF path or gemma3-270m / smollm2-135m (default: Gemma 3 270M)")
    q.add_argument("--text", help="a text file, or botchan / pydoc (Python's help topics; default: botchan)")
    q.add_argument("--ctx", type=int, default=512, help="context per chunk (default 512)")
    q.add_argument("--batch", type=int, help="llama-perplexity -b (default: min(ctx, 2048))")
    q.add_argument("--chunks", type=int, help="default: 20 at c=512, else as many as hold 10240 tokens (at least 1)")
    q.add_argument("--threads", type=int, default=2)
    q.add_argument("--tmp", help="directory for the f16 logits base (GBs at long context; default: the system's)")
    q.add_argument("--plot", help="PNG of KLD against bits per value with the Pareto front (default: "
                                  "bench-out/quality-MODEL-TEXT-cCTX.png; 'none': no plot)")
    q.add_argument("--types", nargs="+", default=QUALITY_TYPES,
                   help="'t', 'k/v', plus ':N' (LLAMA_ARG_LAYER_ADAPTIVE), ':uncentered', ':unscaled', ':scaled', ':onerow', ':winW', ':winauto' or ':winWmM' (margin M), ':tailW' or ':sinkS'")
    q.set_defaults(func=quality)
    s = sub.add_parser("speed", help="llama-bench prompt and generation speed vs f16, interleaved rounds, and "
                                     "decode beside its read-bandwidth bound")
    s.add_argument("--model", help="a GGUF path or gemma3-270m / smollm2-135m (default: Gemma 3 270M)")
    s.add_argument("--depth", type=int, default=16384, help="the depth of the last run, tg32 only (default 16384)")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--reps", type=int, default=2)
    s.add_argument("--rounds", type=int, default=2)
    s.add_argument("--types", nargs="+", default=SPEED_TYPES)
    s.set_defaults(func=speed)


def quality_types(types: list[str]) -> list[str]:
    """f16 first: it writes the KLD base that the others are compared with."""
    return ["f16", *[t for t in types if t != "f16"]]
