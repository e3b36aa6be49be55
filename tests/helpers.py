"""Helpers shared by the test modules (which never import each other): starting and stopping
servers, KL of logit rows, codec input groups, attention masks, refused saved states, greedy
continuations. tests/test_vulkan.py's subprocesses import it too, on the Vulkan build."""
from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from pyturbo import codec, data
from pyturbo.format import reference
from pyturbo.bench import local_server
from pyturbo.bench.local_server import free_port, post_json  # noqa: F401 (for the test modules)

ROOT = Path(__file__).resolve().parent.parent
D = 128  # values per turboq group
ENGINES = ["llama-server", "python"]


def _recommended() -> tuple[str, ...]:
    """The cache flags that scripts/serve.sh gives `python -m server` (the recommended configuration's one definition)."""
    line = next(ln for ln in (ROOT / "scripts" / "serve.sh").read_text().splitlines()
                if ln.startswith("exec python3 -m server "))
    argv = [x for a in shlex.split(line)[4:] for x in a.split("=", 1)]
    alias = {"-ctk": "--cache-type-k", "-ctv": "--cache-type-v"}
    keep = ("--cache-type-k", "--cache-type-v", "--layer-adaptive", "--kv-exact-window", "--kv-exact-sink")
    flags = [alias.get(a, a) for a in argv]
    out = tuple(a for i, a in enumerate(flags) if a in keep or (i and flags[i - 1] in keep))
    # a serve.sh that this parse misreads must not leave the tests on the default cache
    assert {"--cache-type-k", "--cache-type-v"} <= set(out[::2]) and len(out) % 2 == 0, (line, out)
    return out


RECOMMENDED = _recommended()


# ---- servers (`python -m server`) ----

def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    local_server.wait_healthy(url, proc, timeout, log=lambda: output(proc))


def server_cmd(engine: str, port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "server", "--engine", engine, "--model", str(data.default_model()),
            "--port", str(port), "--n-threads", "2", "--alias", "gemma", "--quiet", *flags]


def start(cmd: list[str]) -> subprocess.Popen:
    # the log goes to a file: a pipe that nobody reads while a server lives for a whole module
    # would fill up with its per-request error lines and stall it
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    proc.log = log
    return proc


def output(proc: subprocess.Popen) -> str:
    proc.log.flush()
    proc.log.seek(0)
    return proc.log.read()


def stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return output(proc)


def post(url: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
    return post_json(url, body, headers)


# ---- numbers ----

def last_logits(llm) -> np.ndarray:
    """The logits of a pyturbo.Llama's last evaluated token, from llama.cpp itself. (llm.scores
    holds them only with logits_all=True; otherwise it is an uninitialised buffer.)"""
    import llama_cpp  # loaded by pyturbo.llama (which sets LLAMA_CPP_LIB_PATH) before this runs
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    lp = p_logits.astype(np.float64) - p_logits.max()
    lq = q_logits.astype(np.float64) - q_logits.max()
    lp -= np.log(np.exp(lp).sum())
    lq -= np.log(np.exp(lq).sum())
    return float(np.sum(np.exp(lp) * (lp - lq)))


def special_groups(rng) -> dict[str, np.ndarray]:
    g = {
        "random": rng.standard_normal((64, D)).astype(np.float32),
        "zero": np.zeros((2, D), np.float32),
        "constant": np.full((2, D), 0.37, np.float32),
        "negative_constant": np.full((1, D), -3.0, np.float32),
        "huge": (rng.standard_normal((4, D)) * 1e30).astype(np.float32),
        "max_float": np.full((1, D), np.finfo(np.float32).max, np.float32),
        "tiny": (rng.standard_normal((4, D)) * 1e-30).astype(np.float32),
        "denormal": (rng.standard_normal((4, D)) * 1e-40).astype(np.float32),
        "one_hot": np.eye(D, dtype=np.float32)[:8] * 5.0,
        "kv_like": (rng.standard_normal((16, D)) * np.linspace(0.1, 20, D)).astype(np.float32),
    }
    bad = rng.standard_normal((3, D)).astype(np.float32)
    bad[0, 5] = np.nan
    bad[1, 17] = np.inf
    bad[2, 99] = -np.inf
    g["nan_inf"] = bad
    return g


def decoded(x: np.ndarray, type_name: str) -> np.ndarray:
    """The cache as ggml holds it: the reference codec for turboq, f16 rounding, else the C codec (q8_0)."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if type_name.startswith("turboq"):
        out = reference.dequantize(reference.quantize(flat, type_name), type_name)
    elif type_name == "f16":
        out = flat.astype(np.float16)
    else:
        out = codec.dequantize(codec.quantize(flat, type_name), type_name)
    return np.asarray(out, dtype=np.float32).reshape(x.shape)


def causal_mask(n_q: int, n_kv: int, hidden_prefix: int, hidden_row: int | None) -> np.ndarray:
    """Causal over the last n_q cached rows, the first hidden_prefix rows hidden from every query
    (whole K/V tiles the path must skip), and one query row that sees nothing."""
    m = np.zeros((n_q, n_kv), dtype=np.float32)
    for i in range(n_q):
        m[i, n_kv - n_q + i + 1:] = -np.inf
    m[:, :hidden_prefix] = -np.inf
    if hidden_row is not None:
        m[hidden_row] = -np.inf
    return m


# ---- saved state: the turboq K records (llama-turboq-center.cpp) ----

K_RECORD = b"TQKS"           # per turboq-K layer: magic, n (uint32), n floats: the mean, then the channel scale
K_RECORDS_EARLIER = (b"TQKC", b"TQKM")  # earlier builds' records: a mean only


def k_records(state: bytes) -> list[tuple[int, np.ndarray]]:
    """(offset of the magic, the record's floats) for every K record of a saved state."""
    out, i = [], state.find(K_RECORD)
    while i >= 0:
        n = int.from_bytes(state[i + 4:i + 8], "little")
        out.append((i, np.frombuffer(bytes(state[i + 8:i + 8 + 4 * n]), np.float32)))
        i = state.find(K_RECORD, i + 8 + 4 * n)
    return out


def assert_state_refused(llm, state, match: str) -> str:
    """llm.load_state(state) raises pyturbo.llama.StateError with a message that `match` (a regex)
    finds, and llm keeps what it held: its tokens and its state's bytes. Returns the message."""
    import pytest

    from pyturbo.llama import StateError

    before, n_before = bytes(llm.save_state().llama_state), llm.n_tokens
    with pytest.raises(StateError, match=match) as e:
        llm.load_state(state)
    assert llm.n_tokens == n_before and bytes(llm.save_state().llama_state) == before
    return str(e.value)


def continuation(llm, first: int, n: int = 6) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and their logits from a llama-cpp-python Llama (logits_all), fed one at a time
    from `first`."""
    tokens, logits = [first], []
    for _ in range(n):
        llm.eval([tokens[-1]])
        logits.append(llm.scores[llm.n_tokens - 1].copy())
        tokens.append(int(np.argmax(logits[-1])))
    return tokens, logits


def decode_step_ops(exe: Path, model: Path, text: Path, env: dict[str, str], extra: tuple[str, ...] = ()) -> list[str]:
    """The ops of the last graph that llama-perplexity (exe, run with env) computes in ubatches of one
    token (a decode step) with a turboq3/turboq2 cache and a window of 16, with the tensors each
    writes, from the scheduler's debug listing (GGML_SCHED_DEBUG=2, -v)."""
    r = subprocess.run([str(exe), "-m", str(model), "-f", str(text), "-c", "64", "-b", "64", "-ub", "1", "--chunks", "1",
                        "-fa", "on", "-t", "2", "-ctk", "turboq3", "-ctv", "turboq2", "--kv-exact-window", "16", *extra, "-v"],
                       capture_output=True, env={**env, "GGML_SCHED_DEBUG": "2"}, stdin=subprocess.DEVNULL, timeout=600)
    log = (r.stdout + r.stderr).decode(errors="replace")
    assert r.returncode == 0, log[-3000:]
    last = log.split("## SPLIT #0")[-1]
    return [line.split("node #", 1)[1] for line in last.splitlines() if "node #" in line]


def assert_reads_beside(beside: list[str], copy: list[str], backend: str) -> None:
    """A decode step of the tiny llama (2 layers) whose window is read beside the cache (beside) and
    the same through the F16 copy (copy), from decode_step_ops: beside, no CPY or PAD, only the
    CONCATs of the ring's rows with the step's (K and V, per layer), and two flash-attention nodes,
    which run on `backend` (the scheduler's listing shows its first 5 letters: the cache's device);
    through the copy, each layer's whole K and V cache converted (so the check can tell them apart)."""
    op = lambda node: node.split("(", 1)[1].split(")", 1)[0].strip()  # noqa: E731
    assert not [n for n in beside if op(n) in ("CPY", "PAD")], beside
    assert [op(n) for n in beside].count("CONCAT") == 4, beside
    attn = [n for n in beside if op(n) == "FLASH_ATTN"]
    assert len(attn) == 2 and all(n.split("[", 1)[1].split("]", 1)[0].strip() == backend[:5] for n in attn), attn
    assert sum(op(n) == "CPY" and "cache_k_l" in n for n in copy) == 2, copy
    assert sum(op(n) == "CPY" and "cache_v_l" in n for n in copy) == 2, copy
    assert len(copy) > len(beside)


# ---- the CPU's packed decode path (patches 46 and 49) ----

# A tile of fewer than 16 query rows over a turboq2/3/4 or trellis K or V reads the packed rows in
# 8-bit integers where the CPU has AVX-512 BW + VNNI, AVX2 or NEON: Q rounded to int8 per row, the softmax weights to
# 0..255 per tile, query and group, the codebook to int8. Against float64 attention over the same
# decoded cache it reached 1.8e-3 of the output scale on unit-scale logits.
TOL_PACKED = 4e-3
# ... with logits a few times larger (Q is rounded against its row's largest value, the weights
# against the tile's): 2.2e-2 of the output scale at most with logits 3x larger
TOL_PACKED_LARGE = 3e-2


def fa_packed(lib, type_name: str) -> bool:
    """Whether this CPU build reads a decode step's cache of this type through the packed path."""
    from pyturbo.types import cache_type
    return bool(lib.cpu.ggml_turboq_fa_packed(cache_type(type_name).ggml_id))


def packed_kernels(lib, type_name: str, q: np.ndarray, cache: np.ndarray, n_rows: int,
                   p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The packed kernels of this CPU build alone (ggml-cpu/turboq-cpu.h), as turboq-check's `packed`
    runs them: q [nq][n] rounded once, the scores [nq][n_rows] of the rows held in cache (TYPE's
    blocks), and the V sums [nq][n] of the same rows with the weights p [nq][64], from zeros."""
    from pyturbo.types import cache_type
    cpu, t = lib.cpu, cache_type(type_name).ggml_id  # signatures: pyturbo.ggml.Ggml
    q = np.ascontiguousarray(q, dtype=np.float32)
    p = np.ascontiguousarray(p, dtype=np.float32)
    cache = np.ascontiguousarray(cache, dtype=np.uint8)
    nq, n = q.shape
    raw = np.zeros(cpu.ggml_turboq_fa_q8_size(n) + 64, dtype=np.uint8)
    w = raw.ctypes.data + (-raw.ctypes.data) % 64  # the contract asks for 64-byte alignment
    s = np.zeros((nq, n_rows), dtype=np.float32)
    o = np.zeros((nq, n), dtype=np.float32)
    bk = cache.size // n_rows
    cpu.ggml_turboq_fa_q8(t, q.ctypes.data, nq, n, w)
    cpu.ggml_turboq_fa_kq_packed(t, cache.ctypes.data, bk, n_rows, w, nq, n, s.ctypes.data, n_rows)
    cpu.ggml_turboq_fa_pv_packed(t, cache.ctypes.data, bk, n_rows, p.ctypes.data, 64, nq, n, o.ctypes.data)
    return s, o


def fa_tolerance(lib, type_k: str, type_v: str, rows: int, tol: float) -> float:
    """tol, or TOL_PACKED where some query tile of a KV head's `rows` query rows (tokens x the heads
    of its GQA group; 64 a tile, the last one the rest) has fewer than 16 rows and K or V takes the
    packed path."""
    short = 0 < rows % 64 < 16
    return max(tol, TOL_PACKED) if short and (fa_packed(lib, type_k) or fa_packed(lib, type_v)) else tol
