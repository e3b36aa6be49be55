"""`pyturbo bench serve`, `kv-memory` and `soak`: `python -m server` under concurrent clients.

serve: one client alone, then --clients clients at once, against the same server (--parallel
slots); each request generates exactly --max-tokens tokens (ignore_eos) from its own slice of
botchan.txt. Prints generated tokens/s of both and their ratio.

kv-memory: starts the server once per cache type at --n-ctx per slot and --parallel slots, reads
the KV MiB that llama-server reports, and how many such slots fit in 1 GiB of KV (kv_bytes,
which the report is checked against). Without --kv-unified, each slot of llama-server is a cache
of its own: --n-ctx cells, and its own sliding-window cells.

soak: a bounded run of mixed traffic (issue 11), kept for the record, not run in CI.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import data
from ..memory import kv_bytes
from .local_server import free_port, post_json, wait_healthy
from ..tools import kv_mib


class Server:
    """`python -m server` with the given flags on a free port of 127.0.0.1; its log is collected."""

    def __init__(self, flags: list[str], timeout: float = 300) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "pyturbo.server", "--port", str(self.port), *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()
        try:
            wait_healthy(self.url, self.proc, timeout, log=self._log_after_exit)
        except BaseException:
            self.close()
            raise

    def _log_after_exit(self) -> str:
        self._drainer.join(timeout=5)  # the drainer ends at EOF: the whole log of a server that exited
        return "".join(self.log)

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def post(self, path: str, body: dict) -> dict:
        status, out = post_json(self.url + path, body, timeout=600)
        if status != 200:
            raise RuntimeError(f"POST {path}: HTTP {status}: {out}")
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._drainer.join(timeout=10)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _run_clients(srv: Server, prompts: list[str], clients: int, per_client: int, max_tokens: int) -> tuple[int, float]:
    def client(c: int) -> int:
        n = 0
        for r in range(per_client):
            out = srv.post("/v1/completions", {"prompt": prompts[(c * per_client + r) % len(prompts)],
                                               "max_tokens": max_tokens, "temperature": 0.8, "ignore_eos": True})
            n += out["usage"]["completion_tokens"]
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(client, range(clients)))
    return tokens, time.perf_counter() - t0


def serve(args: argparse.Namespace) -> None:
    text = data.corpus().read_text(encoding="utf-8")
    prompts = [text[20000 + 700 * i: 20000 + 700 * i + 400] for i in range(64)]  # ~100 tokens each
    flags = ["--engine", args.engine, "-ctk", args.cache_type_k, "-ctv", args.cache_type_v,
             "--layer-adaptive", str(args.layer_adaptive), "--n-ctx", str(args.n_ctx), "--quiet"]
    if args.threads:
        flags += ["--n-threads", str(args.threads)]
    rows = []
    for parallel in args.parallel:
        with Server([*flags, "--parallel", str(parallel)]) as srv:
            _run_clients(srv, prompts, 1, 1, 8)  # warm-up
            one = _run_clients(srv, prompts, 1, args.requests, args.max_tokens)
            many = _run_clients(srv, prompts, args.clients, args.requests, args.max_tokens)
        rows.append((parallel, one, many))
        print(f"# --parallel {parallel}: 1 client {one[0] / one[1]:.1f} t/s, {args.clients} clients "
              f"{many[0] / many[1]:.1f} t/s", file=sys.stderr, flush=True)
    print(f"\n`python -m server --engine {args.engine} -ctk {args.cache_type_k} -ctv {args.cache_type_v} "
          f"--layer-adaptive {args.layer_adaptive} --n-ctx {args.n_ctx}`, {args.requests} requests per client, "
          f"{args.max_tokens} generated tokens each (ignore_eos)\n")
    print(f"| --parallel | 1 client t/s | {args.clients} clients t/s | aggregate vs 1 client |")
    print("|---|---|---|---|")
    for parallel, (t1, s1), (tn, sn) in rows:
        print(f"| {parallel} | {t1 / s1:.1f} | {tn / sn:.1f} | {(tn / sn) / (t1 / s1):.2f}x |")


def kv_memory(args: argparse.Namespace) -> None:
    model = Path(args.model) if args.model else data.default_model()
    gib = 2 ** 30
    print(f"\n{model.name}: `python -m server --n-ctx {args.n_ctx} --parallel {args.parallel} -ctk T -ctv T`; "
          f"KV as llama-server reports it (global + sliding-window caches)\n")
    print(f"| K/V | KV MiB, {args.parallel} slots | vs f16 | {args.n_ctx}-token slots in 1 GiB of KV |")
    print("|---|---|---|---|")
    f16 = None
    for t in args.types:
        with Server(["--model", str(model), "-ctk", t, "-ctv", t, "--n-ctx", str(args.n_ctx),
                     "--parallel", str(args.parallel), "--", "-lv", "4"]) as srv:  # -lv 4: llama.cpp's KV lines
            pass
        reported = kv_mib("".join(srv.log))
        expect = kv_bytes(model, args.n_ctx * args.parallel, t, t, n_seq=args.parallel, n_stream=args.parallel) / 2 ** 20
        if abs(reported - expect) > 0.02:
            raise RuntimeError(f"{t}: llama-server reports {reported} MiB, kv_bytes says {expect:.2f}")
        slots = gib // kv_bytes(model, args.n_ctx, t, t)  # each slot is a cache of its own (no --kv-unified)
        f16 = f16 or reported
        print(f"| {t} | {reported:.2f} | {reported / f16:.3f} | {slots} |", flush=True)


def speculative(args: argparse.Namespace) -> None:
    """Per cache configuration: the same greedy requests to a server without and with the draft
    model (whose cache gets the same types); is the text identical, what share of the drafted
    tokens the main model accepted, and generated tokens/s of both."""
    from .cpu import parse_config

    model = Path(args.model) if args.model else data.default_model()
    draft = Path(args.draft) if args.draft else model
    text = data.corpus().read_text(encoding="utf-8")
    prompts = [text[30000 + 900 * i: 30000 + 900 * i + 300] for i in range(args.prompts)]
    rows = []
    for config in args.types:
        label, k, v, env = parse_config(config)
        unknown = set(env) - {"LLAMA_ARG_LAYER_ADAPTIVE"}
        if unknown:
            raise SystemExit(f"{config}: only a layer mode can be set through the server ({', '.join(unknown)})")
        flags = ["--model", str(model), "-ctk", k, "-ctv", v, "--layer-adaptive", env.get("LLAMA_ARG_LAYER_ADAPTIVE", "0"),
                 "--n-ctx", "1024", "--parallel", "1", "--quiet"]
        if args.threads:
            flags += ["--n-threads", str(args.threads)]
        runs = []
        ubatch = ["--", "-ub", str(args.ubatch), "-b", str(max(args.ubatch, 512))] if args.ubatch else []
        for extra in ([], ["--draft-model", str(draft)] + (["--draft-max", str(args.draft_max)] if args.draft_max else [])):
            texts, n, seconds, drafted, accepted = [], 0, 0.0, 0, 0
            with Server(flags + extra + ubatch) as srv:
                for prompt in prompts:
                    out = srv.post("/v1/completions", {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0})
                    t = out["timings"]
                    texts.append(out["choices"][0]["text"])
                    n += t["predicted_n"]
                    seconds += t["predicted_ms"] / 1000
                    drafted += t.get("draft_n", 0)
                    accepted += t.get("draft_n_accepted", 0)
            runs.append((texts, n / seconds, drafted, accepted))
        (base_texts, base_tps, _, _), (spec_texts, spec_tps, drafted, accepted) = runs
        same = sum(a == b for a, b in zip(base_texts, spec_texts))
        rows.append((label, same, base_tps, spec_tps, accepted / drafted if drafted else float("nan")))
        print(f"# {label}: {same}/{len(prompts)} identical, acceptance {rows[-1][4]:.3f}, "
              f"{base_tps:.1f} -> {spec_tps:.1f} t/s", file=sys.stderr, flush=True)
    print(f"\nmain model {model.name}, draft {draft.name} (its cache of the same types); {len(prompts)} greedy "
          f"completions of {args.max_tokens} tokens from botchan.txt, one slot"
          f"{f', -ub {args.ubatch}' if args.ubatch else ''}\n")
    print("| K/V | text identical to no draft | draft tokens accepted | t/s without draft | t/s with draft | ratio |")
    print("|---|---|---|---|---|---|")
    for label, same, base, spec, acc in rows:
        print(f"| {label} | {same}/{len(prompts)} | {acc:.3f} | {base:.1f} | {spec:.1f} | {spec / base:.2f}x |")


def add_parsers(sub) -> None:
    p = sub.add_parser("speculative", help="speculative decoding: identical greedy text?, acceptance, t/s vs no draft")
    p.add_argument("--model", help="main model (default: the bundled Gemma 3 270M)")
    p.add_argument("--draft", help="draft model (default: the main model itself)")
    p.add_argument("--types", nargs="+", default=["f16", "turboq3", "turboq3/turboq4:3"])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--draft-max", type=int, default=None)
    p.add_argument("--ubatch", type=int, default=None,
                   help="llama-server's -ub for both servers; 1 computes every token alone, as plain decoding does")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=speculative)

    p = sub.add_parser("serve", help="aggregate generated tokens/s: N concurrent clients vs one, per --parallel")
    p.add_argument("--engine", default="llama-server", choices=["llama-server", "python"])
    p.add_argument("--parallel", type=int, nargs="+", default=[8])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=3, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("-ctk", "--cache-type-k", default="turboq3")
    p.add_argument("-ctv", "--cache-type-v", default="turboq4")
    p.add_argument("--layer-adaptive", type=int, default=3)
    p.set_defaults(func=serve)
    p = sub.add_parser("soak", help="minutes of concurrent mixed traffic with cancelled streams; failures counted")
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("-ctk", "--cache-type-k", default="turboq3")
    p.add_argument("-ctv", "--cache-type-v", default="turboq3")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: llama-server flags (e.g. --cache-ram 0)")
    p.set_defaults(func=soak)
    p = sub.add_parser("kv-memory", help="KV MiB that llama-server reports per cache type, and slots per GiB")
    p.add_argument("--model")
    p.add_argument("--n-ctx", type=int, default=32768, help="per slot")
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--types", nargs="+", default=["f16", "q8_0", "turboq4", "turboq3", "turboq2"])
    p.set_defaults(func=kv_memory)


def _rss_mib(pid: int) -> float:
    """Resident memory of a process and its children (the supervisor and llama-server)."""
    pids = [str(pid), *subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def soak(args: argparse.Namespace) -> None:
    """--minutes of --clients concurrent clients, each looping over completions, chat and streams
    (a share of the streams hung up mid-way), against one server. Any 5xx, connection error or
    wrong answer is counted; the server's memory is sampled; a counting check runs at the end."""
    import http.client
    import random

    text = data.corpus().read_text(encoding="utf-8")
    flags = ["-ctk", args.cache_type_k, "-ctv", args.cache_type_v, "--parallel", str(args.parallel),
             "--n-ctx", str(args.n_ctx), "--quiet"]
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    if extra:
        flags += ["--", *extra]
    stats: dict[str, int] = {}
    latencies: list[float] = []
    lock = threading.Lock()

    def count(key: str) -> None:
        with lock:
            stats[key] = stats.get(key, 0) + 1

    with Server(flags) as srv:
        rss = [_rss_mib(srv.proc.pid)]
        stop_at = time.time() + 60 * args.minutes

        def client(c: int) -> None:
            rng = random.Random(c)
            while time.time() < stop_at:
                kind = rng.choice(["completion", "chat", "stream", "stream-cancel"])
                start = rng.randrange(0, len(text) - 2000)
                prompt = text[start:start + rng.randrange(50, 1500)]
                body: dict = {"max_tokens": rng.randrange(4, 64), "temperature": 0.7}
                if kind == "chat":
                    body["messages"] = [{"role": "user", "content": prompt[:400]}]
                    path = "/v1/chat/completions"
                else:
                    body["prompt"] = prompt
                    path = "/v1/completions"
                body["stream"] = kind.startswith("stream")
                t0 = time.perf_counter()
                try:
                    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
                    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
                    r = conn.getresponse()
                    if r.status >= 400:
                        count(f"{kind} HTTP {r.status}")
                    elif kind == "stream-cancel":
                        for _ in range(rng.randrange(1, 4)):
                            r.fp.readline()
                        conn.sock.close()
                        count(f"{kind} ok")
                    else:
                        raw = r.read()
                        if kind == "stream":
                            ok = b"data: [DONE]" in raw
                        else:
                            ok = bool(json.loads(raw).get("choices"))
                        count(f"{kind} {'ok' if ok else 'BAD BODY'}")
                        with lock:
                            latencies.append(time.perf_counter() - t0)
                    conn.close()
                except (OSError, http.client.HTTPException, ValueError) as e:
                    count(f"{kind} ERROR {type(e).__name__}")

        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(30)
            rss.append(_rss_mib(srv.proc.pid))
            print(f"# {time.strftime('%H:%M:%S')} {sum(stats.values())} requests, RSS {rss[-1]:.0f} MiB, {stats}",
                  file=sys.stderr, flush=True)
        out = srv.post("/v1/completions", {"prompt": "41, 42, 43, 44, 45, 46,", "max_tokens": 4, "temperature": 0})
        final_ok = out["choices"][0]["text"].strip().startswith("47")
        alive = srv.proc.poll() is None
    lat = sorted(latencies)
    bad = {k: v for k, v in stats.items() if not k.endswith(" ok")}
    print(f"\nsoak: {args.minutes} min, {args.clients} clients, `python -m server {' '.join(flags)}`\n")
    print("| requests | " + " | ".join(sorted(stats)) + " |")
    print("|---|" + "---|" * len(stats))
    print(f"| {sum(stats.values())} | " + " | ".join(str(stats[k]) for k in sorted(stats)) + " |")
    if lat:
        print(f"\nlatency of completed non-cancelled requests: p50 {lat[len(lat) // 2]:.2f} s, "
              f"p95 {lat[int(len(lat) * 0.95)]:.2f} s, max {lat[-1]:.2f} s")
    print(f"server RSS (supervisor + llama-server): start {rss[0]:.0f} MiB, max {max(rss):.0f} MiB, end {rss[-1]:.0f} MiB")
    print(f"failures (5xx, connection errors, bad bodies): {bad or 'none'}; server alive at the end: {alive}; "
          f"counting check after: {'right' if final_ok else 'WRONG'}")
    if bad or not final_ok or not alive:
        sys.exit(1)
