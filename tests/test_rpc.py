"""turboq caches on llama.cpp's RPC backend: two ggml-rpc-server processes on 127.0.0.1 stand for
two machines, llama-perplexity offloads every layer (and so its KV cache) to them, and the result
must match the same run on the local CPU.

The local run uses --no-repack: an RPC server's CPU backend keeps weights in plain buffers, while a
local run repacks Q4_K weights for its AVX2 kernels, which sum in another order (that alone moves
Gemma's f16 PPL by ~0.5%, with or without turboq). With the same weight layout the two runs
execute the same kernels on the same bytes, so the bound below is far looser than what is needed.
"""
from __future__ import annotations

import ctypes
import re
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest

from pyturbo import data
from pyturbo._paths import binary, tool_env
from pyturbo.bench.local_server import free_port
from pyturbo.tools import llama_perplexity as perplexity
from helpers import assert_reads_beside, decode_step_ops

REL_PPL_TOL = 1e-3   # the bound on |dPPL|/PPL
KLD_TOL = 1e-3       # mean KLD of the RPC run's logits against the local run's


def _wait_listening(port: int, proc: subprocess.Popen, log: Path, timeout: float = 30) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"ggml-rpc-server exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"ggml-rpc-server on port {port} did not listen within {timeout} s")


@pytest.fixture(scope="module")
def rpc_endpoints(build_info, tmp_path_factory):
    """Two ggml-rpc-server processes, each with its own tensor cache directory (-c, LLAMA_CACHE)."""
    procs, endpoints = [], []
    try:
        for i in range(2):
            d = tmp_path_factory.mktemp(f"rpc{i}")
            port = free_port()
            log = d / "server.log"
            env = tool_env({"LLAMA_CACHE": str(d / "cache")})
            p = subprocess.Popen([str(binary("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port), "-t", "1", "-c"],
                                 stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            procs.append(p)
            _wait_listening(port, p, log)
            endpoints.append(f"127.0.0.1:{port}")
        yield endpoints
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


_KV_BUF_RE = re.compile(r"llama_kv_cache: +(\S+?)(?:\[([\d.:]+)\])? KV buffer size = +([\d.]+) MiB")


def kv_buffers(log: str) -> list[tuple[str, str | None, float]]:
    """(device, endpoint, MiB) for each KV buffer llama.cpp allocated."""
    return [(m.group(1), m.group(2), float(m.group(3))) for m in _KV_BUF_RE.finditer(log)]


CASES = [("tiny128x4", "turboq3", "turboq3"), ("tiny128x4", "q8_0", "turboq4"),
         ("gemma", "turboq3", "turboq3"), ("gemma", "q8_0", "turboq4")]


@pytest.mark.parametrize("model,type_k,type_v", [pytest.param(*c, marks=[pytest.mark.slow] if c[0] == "gemma" else [])
                                                 for c in CASES], ids=["-".join(c) for c in CASES])
def test_rpc_matches_local_cpu(rpc_endpoints, model, type_k, type_v, tmp_path):
    path = data.default_model() if model == "gemma" else data.tiny_model(head_dim=128, n_layer=4)
    text = data.corpus_slice(12000)
    chunks = 3 if model == "gemma" else 4
    base = tmp_path / "local.kld"
    local = perplexity(path, text, type_k, type_v, ctx=256, chunks=chunks, kld_base=base, write_base=True,
                       extra=("--no-repack",))
    # -ts 1,1: one half of the layers on each server, so both hold part of the cache
    remote = perplexity(path, text, type_k, type_v, ctx=256, chunks=chunks, kld_base=base,
                        extra=("--rpc", ",".join(rpc_endpoints), "-ngl", "99", "-ts", "1,1"))
    # the default sink row is kept on the servers too: their CPU backend, asked through the client's
    # supports_op (patch 50), reads it beside the cache, as the local run does
    beside = "sink rows: the first 1 positions of each sequence read exact by every query (F16 rows beside the cache"
    assert beside in remote.log and beside in local.log, remote.log[-3000:]

    bufs = kv_buffers(remote.log)
    assert bufs, remote.log[-3000:]
    assert all(ep in rpc_endpoints for _, ep, _ in bufs), f"a KV buffer is not on an RPC device: {bufs}"
    assert {ep for _, ep, _ in bufs} == set(rpc_endpoints), f"the cache is not spread over both servers: {bufs}"
    assert f"K ({type_k})" in remote.log and f"V ({type_v})" in remote.log
    local_bufs = kv_buffers(local.log)
    assert local_bufs and all(dev == "CPU" for dev, _, _ in local_bufs)
    assert abs(sum(b[2] for b in bufs) - sum(b[2] for b in local_bufs)) < 0.02, (bufs, local_bufs)

    rel = abs(remote.ppl - local.ppl) / local.ppl
    assert rel < REL_PPL_TOL, f"PPL local {local.ppl} vs RPC {remote.ppl}"
    assert remote.kld is not None and remote.kld < KLD_TOL, f"mean KLD {remote.kld} of RPC vs local"
    print(f"{model} {type_k}/{type_v}: PPL local {local.ppl:.4f} RPC {remote.ppl:.4f} (rel {rel:.1e}), "
          f"KLD {remote.kld:.2e}, KV on {sorted({ep for _, ep, _ in bufs})}")


@pytest.mark.parametrize("copy", [False, True], ids=["beside", "copy"])
def test_an_exact_window_on_rpc_matches_local_cpu(rpc_endpoints, tmp_path, copy, monkeypatch):
    """A window of 16 with the cache spread over both servers, in ubatches of 64 (rows come from the
    rings there too). The servers' CPU backend, asked through the client's supports_op (patch 50),
    reads the rows beside the cache as the local run does: the same logits, and the servers' graphs
    hold no copy of the cache. With the copy forced (TURBOQ_WINDOW_COPY=1, the path a server whose
    backend declines the node takes) each layer reads them after an F16 copy of its cache: the local
    run's logits up to the F16 rounding of the cache's rows. Either way not those of the remote run
    without the window."""
    path, text = data.tiny_model(head_dim=128, n_layer=4), data.corpus_slice(12000)
    base = tmp_path / "local.kld"
    run = dict(ctx=256, chunks=3, kld_base=base)
    win = ("--kv-exact-window", "16", "-ub", "64")
    rpc = ("--rpc", ",".join(rpc_endpoints), "-ngl", "99", "-ts", "1,1")
    local = perplexity(path, text, "turboq3", "turboq2", write_base=True, extra=(*win, "--no-repack"), **run)
    if copy:
        monkeypatch.setenv("TURBOQ_WINDOW_COPY", "1")
    remote = perplexity(path, text, "turboq3", "turboq2", extra=(*win, *rpc), **run)
    plain = perplexity(path, text, "turboq3", "turboq2", extra=("--kv-exact-window", "0", "-ub", "64", *rpc), **run)
    assert {ep for _, ep, _ in kv_buffers(remote.log)} == set(rpc_endpoints), remote.log[-3000:]
    reads = "F16 rows after an F16 copy of the cache" if copy else "F16 rows beside the cache"
    assert reads in remote.log and "F16 rows beside the cache" in local.log, remote.log[-3000:]
    assert abs(remote.ppl / local.ppl - 1) < REL_PPL_TOL
    assert remote.kld is not None and plain.kld is not None
    print(f"\nwindow 16 on RPC ({'copy' if copy else 'beside'}): PPL local {local.ppl:.4f} RPC {remote.ppl:.4f} "
          f"(KLD {remote.kld:.2g}), no window {plain.ppl:.4f} (KLD {plain.kld:.2g})")
    assert remote.kld < (1e-5 if copy else 1e-6) and plain.kld > 20 * max(remote.kld, 1e-6), (remote.kld, plain.kld)


def test_a_decode_step_on_rpc_reads_the_window_without_copying_the_cache(rpc_endpoints, tiny128, short_text):
    """The graph of a decode step with a window of 16 and every layer on an RPC server: the
    server's CPU backend takes the flash attention with the rows beside the cache (asked through the
    client's supports_op, patch 50), so the step holds no CPY or PAD of the cache, as on a local CPU;
    with the copy forced (the path of a server that declines the node), each layer's whole K and V
    cache is converted."""
    exe, rpc = binary("llama-perplexity"), ("--rpc", rpc_endpoints[0], "-ngl", "99")
    beside = decode_step_ops(exe, tiny128, short_text, tool_env(), rpc)
    copy = decode_step_ops(exe, tiny128, short_text, tool_env({"TURBOQ_WINDOW_COPY": "1"}), rpc)
    assert_reads_beside(beside, copy, "RPC0[")  # the listing shows 5 letters of "RPC0[host:port]"
    print(f"\ndecode step nodes on RPC: {len(beside)} beside the cache, {len(copy)} through the copy")


class _RpcTensor(ctypes.Structure):
    """ggml-rpc.cpp's rpc_tensor (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10, GGML_MAX_NAME 64),
    packed as the protocol's messages are (#pragma pack(1))."""
    _pack_ = 1
    _fields_ = [("id", ctypes.c_uint64), ("type", ctypes.c_uint32), ("buffer", ctypes.c_uint64),
                ("ne", ctypes.c_uint32 * 4), ("nb", ctypes.c_uint32 * 4), ("op", ctypes.c_uint32),
                ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32), ("src", ctypes.c_uint64 * 10),
                ("view_src", ctypes.c_uint64), ("view_offs", ctypes.c_uint64), ("data", ctypes.c_uint64),
                ("name", ctypes.c_char * 64), ("use_count", ctypes.c_int32)]


def _rpc_call(sock: socket.socket, cmd: int, payload: bytes, reply: int) -> bytes:
    """One command in ggml-rpc's framing: | cmd (1 byte) | size (8) | data |, answered | size (8) | data |."""
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    data = b""
    while len(data) < 8 + reply:
        chunk = sock.recv(8 + reply - len(data))
        assert chunk, "the server closed the connection"
        data += chunk
    assert struct.unpack("<Q", data[:8])[0] == reply
    return data[8:]


def test_rpc_server_answers_a_malformed_question_no_and_stays_up(rpc_endpoints):
    """RPC_CMD_SUPPORTS_OP (patch 50) from a client that is not llama.cpp's: a node that is not a
    flash attention with its sources, and one whose shape's element count overflows, are answered no
    on the same connection, which then still answers; the server would otherwise reach an assert or
    a null dereference in its backend's supports_op."""
    from pyturbo._paths import library
    op_name = library("ggml-base").ggml_op_name
    op_name.restype, op_name.argtypes = ctypes.c_char_p, [ctypes.c_int]
    fa_op = next(i for i in range(200) if op_name(i) == b"FLASH_ATTN_EXT")
    assert ctypes.sizeof(_RpcTensor) == 296  # the server takes a question only at its exact size
    host, port = rpc_endpoints[0].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        hello = _rpc_call(sock, 14, bytes(24), 28)  # RPC_CMD_HELLO: no transport capabilities asked
        assert hello[:2] == bytes([7, 1]), hello[:3]  # protocol 7.1: the server takes the question

        def ask(*tensors: _RpcTensor) -> int:
            body = struct.pack("<II", 0, len(tensors)) + b"".join(bytes(t) for t in tensors)
            return _rpc_call(sock, 18, body, 1)[0]  # RPC_CMD_SUPPORTS_OP

        assert ask(_RpcTensor(id=1, op=0)) == 0  # not a flash attention
        fa = _RpcTensor(id=1, op=fa_op)
        for i in (0, 1, 2, 5, 6, 7):
            fa.src[i] = 2
        assert ask(fa) == 0  # its sources are missing from the question
        huge = _RpcTensor(id=2, type=0)
        huge.ne[:] = [0xFFFFFFFF] * 4
        assert ask(fa, huge) == 0  # an element count past int64
        assert _rpc_call(sock, 15, b"", 4) == struct.pack("<I", 1)  # RPC_CMD_DEVICE_COUNT: still answering


def test_rpc_server_refuses_a_bad_flag(build_info):
    r = subprocess.run([str(binary("ggml-rpc-server")), "--threads", "0"], capture_output=True, text=True,
                       env=tool_env(), timeout=30, stdin=subprocess.DEVNULL)
    assert r.returncode != 0 and "invalid number of threads" in r.stderr, r.stderr


@pytest.mark.seeded
def test_a_seeded_build_refuses_turboq_layers_on_rpc(rpc_endpoints, seeded_build, monkeypatch):
    """A build with other rotation signs (cmake -DPYTURBO_SIGN_SEED, a debug option) cannot know
    an RPC server's signs, so a turboq context with a layer there is refused, naming the option
    and the device, whether its cache is there or kept here (--no-kv-offload: measured, its turboq
    ops then mix both signs), and its own rpc-server does not start (a shipped client's cache would
    be noise there). On its own devices the seeded build works, with another result."""
    path, text = data.tiny_model(head_dim=128, n_layer=4), data.corpus_slice(12000)
    shipped = perplexity(path, text, "turboq3", "turboq3", ctx=256, chunks=1)
    bin_dir, seed = seeded_build
    monkeypatch.setenv("PYTURBO_BUILD_DIR", str(bin_dir.parent))
    rpc = ("--rpc", ",".join(rpc_endpoints), "-ngl", "99")
    for extra in (rpc, (*rpc, "--no-kv-offload")):
        with pytest.raises(RuntimeError, match=rf"PYTURBO_SIGN_SEED={seed} \(a debug build option\).*runs on RPC"):
            perplexity(path, text, "turboq3", "turboq3", ctx=256, chunks=1, extra=extra)
    seeded = perplexity(path, text, "turboq3", "turboq3", ctx=256, chunks=1)
    assert seeded.ppl > 0 and seeded.ppl != shipped.ppl  # other signs, another (valid) result
    r = subprocess.run([str(bin_dir / "ggml-rpc-server"), "--port", str(free_port())], capture_output=True, text=True,
                       env=tool_env(libs=bin_dir), timeout=30, stdin=subprocess.DEVNULL)
    assert r.returncode != 0 and f"PYTURBO_SIGN_SEED={seed} (a debug build option)" in r.stderr, r.stderr


@pytest.mark.parametrize("head_dim,g", [(64, 64), (96, 32)])
def test_a_twin_turboq_cache_is_refused_on_rpc(rpc_endpoints, head_dim, g):
    """Head size 64 takes the _g64 twins, 96 the _g32 twins, which an RPC server's build may lack
    (issue 22): a layer on an RPC server is refused, naming the layer, the head size and what works,
    with its cache there and with it kept here (--no-kv-offload: the layer's flash attention would
    still run on the server, which claims every op and may have a GPU or an older build); the same
    model runs on this machine."""
    path, text = data.tiny_model(head_dim=head_dim, n_layer=4), data.corpus_slice(12000)
    rpc = ("--rpc", ",".join(rpc_endpoints), "-ngl", "99")
    for extra in (rpc, (*rpc, "--no-kv-offload")):
        with pytest.raises(RuntimeError, match=rf"layer 0: head size {head_dim}: its turboq cache stores {g}-value groups "
                                               rf"\(turboq3_g{g}\).*RPC.*an RPC server, whose build may lack them.*q8_0"):
            perplexity(path, text, "turboq3", "turboq3", ctx=256, chunks=1, extra=extra)
    assert perplexity(path, text, "turboq3", "turboq3", ctx=256, chunks=1).ppl > 0


def test_a_trellis_cache_is_refused_on_rpc(rpc_endpoints):
    """The trellis types (issue 21) are refused on a layer that runs on an RPC server, whose device
    may decline them (CUDA without its switch), with its cache there and with it kept here, naming
    the scalar type of the same bits; the same model runs with them on this machine."""
    path, text = data.tiny_model(head_dim=128, n_layer=4), data.corpus_slice(12000)
    rpc = ("--rpc", ",".join(rpc_endpoints), "-ngl", "99")
    for extra in (rpc, (*rpc, "--no-kv-offload")):
        with pytest.raises(RuntimeError, match=r"layer 0: its KV cache is K turboq3t, V turboq2t, and this layer runs on "
                                               r"RPC.*an RPC server, whose device may decline the trellis types.*"
                                               r"use turboq3"):
            perplexity(path, text, "turboq3t", "turboq2t", ctx=256, chunks=1, extra=extra)
    assert perplexity(path, text, "turboq3t", "turboq2t", ctx=256, chunks=1).ppl > 0
    # at head size 64 their _g64 forms: the scalar type's twin would be refused there too, so the
    # refusal names q8_0 and q4_0
    path64 = data.tiny_model(head_dim=64, n_layer=4)
    with pytest.raises(RuntimeError, match=r"layer 0: its KV cache is K turboq3t_g64, V turboq3t_g64, and this layer "
                                           r"runs on RPC.*use q8_0 or q4_0"):
        perplexity(path64, text, "turboq3t", "turboq3t", ctx=256, chunks=1, extra=rpc)
