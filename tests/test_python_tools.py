"""pyturbo's Python-side tools: kv_bytes, the perplexity and bench CLIs, doctor."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pyturbo import data
from pyturbo.llamacpp import perplexity
from pyturbo.memory import kv_bytes

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def gemma(build_info):
    return data.default_model()


@pytest.mark.parametrize("tk,tv,la", [("f16", "f16", 0), ("turboq3", "turboq3", 0), ("q8_0", "turboq2", 0),
                                      ("turboq3", "turboq3", 7), ("turboq4", "turboq4", 1)])
def test_kv_bytes_matches_llama_cpp(gemma, tk, tv, la, monkeypatch):
    if la:
        monkeypatch.setenv("TURBO_LAYER_ADAPTIVE", str(la))
    r = perplexity(gemma, data.corpus_slice(4000), tk, tv, ctx=512, chunks=1)
    # the log prints each cache (global, sliding-window) rounded to 0.01 MiB
    assert r.kv_mib == pytest.approx(kv_bytes(gemma, 512, tk, tv, la) / 2**20, abs=0.011)


def test_kv_bytes_swa_full_matches_llama_cpp_python(gemma, capfd):
    from pyturbo.llama import Llama
    llm = Llama(str(gemma), n_ctx=2048, cache_type_k="turboq3", cache_type_v="q8_0", verbose=True)
    log = capfd.readouterr().err
    from pyturbo.llamacpp import kv_mib
    assert kv_mib(log) == pytest.approx(kv_bytes(gemma, 2048, "turboq3", "q8_0", swa_full=True) / 2**20, abs=0.011)
    del llm


def test_kv_bytes_server_defaults(gemma):
    # llama-server's defaults for this model: 4 slots, n_ctx 32768 -> 133.5 MiB of f16 KV (research notes)
    assert kv_bytes(gemma, 32768, n_seq=4) / 2**20 == pytest.approx(133.5)


def run_cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyturbo", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.mark.parametrize("t", ["f16", "turboq3"])
def test_perplexity_cli_agrees_with_llama_perplexity(gemma, t):
    text = data.corpus_slice(9000)
    # llama-perplexity's scheme: 512-token chunks starting with BOS; targets at chunk offsets 257..511
    r = run_cli("perplexity", "--model", str(gemma), "-f", str(text), "--max-length", "512", "--stride", "512",
                "--score-from", "257", "--max-tokens", str(3 * 512), "--cache-type-k", t, "--cache-type-v", t,
                "--threads", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    ours = float(r.stdout.strip().splitlines()[-1].split("|")[-2])
    ref = perplexity(gemma, text, t, t, ctx=512, chunks=3).ppl
    print(f"{t}: pyturbo perplexity {ours:.4f} vs llama-perplexity {ref:.4f}")
    # same tokens, same engine; only batch split and float summation order differ: stated tolerance 0.5%
    assert ours == pytest.approx(ref, rel=0.005)


def test_perplexity_cli_sliding_window(gemma):
    r = run_cli("perplexity", "--model", str(gemma), "-f", str(data.corpus_slice(6000)), "--max-length", "512",
                "--stride", "256", "--threads", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    ppl = float(r.stdout.strip().splitlines()[-1].split("|")[-2])
    assert 5 < ppl < 100


def test_perplexity_cli_bits(gemma):
    r = run_cli("perplexity", "--model", str(gemma), "-f", str(data.corpus_slice(4000)), "--max-length", "256",
                "--stride", "256", "--bits", "2", "3", "4", "--threads", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| turboq")]
    ppl = {ln.split("|")[1].strip(): float(ln.split("|")[-2]) for ln in rows}
    assert set(ppl) == {"turboq2", "turboq3", "turboq4"}
    assert ppl["turboq4"] < ppl["turboq2"]


def test_bench_quick_writes_table_and_plot(tmp_path, gemma):
    r = run_cli("bench", "--quick", "--out", str(tmp_path), timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    md = (tmp_path / "bench.md").read_text()
    assert "| turboq3 | turboq3 |" in md and "KV vs f16" in md
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_doctor_json(build_info):
    r = run_cli("doctor", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["upstream"]["commit"] == "0c1e57098"
    types = {t["name"]: t for t in rep["types"]}
    assert types["turboq3"]["id"] == 61 and types["turboq3"]["block_bytes"] == 50
    assert all(v == "ok" for v in rep["roundtrip"].values())
    assert "CPU" in rep["backends"]
