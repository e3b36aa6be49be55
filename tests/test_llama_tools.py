"""llama.cpp's own tools with turboq caches: perplexity on real text, KV sizes, bad input."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from pyturbo import data
from pyturbo.tools import llama_perplexity as perplexity, run_tool

TYPES = ["f16", "q8_0", "q4_0", "turboq8", "turboq4", "turboq3", "turboq2"]


@pytest.fixture(scope="session")
def gemma(build_info):
    return data.default_model()


@pytest.fixture(scope="session")
def tiny72(build_info):
    return data.tiny_model(head_dim=72)  # turboq refuses it: not a multiple of 16


@pytest.fixture(scope="session")
def gemma_runs(gemma, short_text, tmp_path_factory):
    base = tmp_path_factory.mktemp("kld") / "f16.kld"
    out = {"f16": perplexity(gemma, short_text, "f16", "f16", ctx=256, chunks=6, kld_base=base, write_base=True)}
    for t in TYPES[1:]:
        out[t] = perplexity(gemma, short_text, t, t, ctx=256, chunks=6, kld_base=base)
    out["turboq3 uncentered"] = perplexity(gemma, short_text, "turboq3", "turboq3", ctx=256, chunks=6, kld_base=base,
                                           env={"LLAMA_ARG_KV_K_CENTER": "off"})
    out["turboq3 unscaled"] = perplexity(gemma, short_text, "turboq3", "turboq3", ctx=256, chunks=6, kld_base=base,
                                         env={"LLAMA_ARG_KV_K_SCALE": "off"})
    out["turboq3 tail16"] = perplexity(gemma, short_text, "turboq3", "turboq3", ctx=256, chunks=6, kld_base=base,
                                       env={"TURBOQ_EXACT_TAIL": "16"})
    for t, r in out.items():
        print(f"gemma3-270m c=256 x6 {t:8s} PPL {r.ppl:8.3f}  KLD {r.kld}  KV {r.kv_mib:.2f} MiB")
    return out


@pytest.mark.slow
def test_gemma_quality_order(gemma_runs):
    kld = {t: r.kld for t, r in gemma_runs.items() if t != "f16"}
    err = {t: r.kld_err for t, r in gemma_runs.items() if t != "f16"}
    # turboq4 <= turboq3 <= turboq2 in mean KLD vs the f16 cache, within 2 standard errors
    assert kld["turboq4"] <= kld["turboq3"] + 2 * err["turboq3"]
    assert kld["turboq3"] <= kld["turboq2"] + 2 * err["turboq2"]
    assert 0 < kld["q8_0"] < kld["turboq4"]
    f16 = gemma_runs["f16"].ppl
    assert f16 <= gemma_runs["turboq4"].ppl * 1.02
    assert gemma_runs["turboq4"].ppl <= gemma_runs["turboq3"].ppl * 1.02 <= gemma_runs["turboq2"].ppl * 1.04
    assert all(math.isfinite(r.ppl) for r in gemma_runs.values())


@pytest.mark.slow
def test_gemma_quality_per_bit_against_mainline(gemma_runs):
    """The quality targets, against mainline types measured in the same run (issue 8): they fail
    if K centering (or anything else that earns them) is lost."""
    kld = {t: r.kld for t, r in gemma_runs.items() if t != "f16"}
    err = {t: r.kld_err for t, r in gemma_runs.items() if t != "f16"}
    # measured (this build, c=256 x 6): turboq4 0.38x q4_0, turboq3 1.25x q4_0, turboq3 0.31x
    # uncentered, 0.53x without the channel scale
    assert kld["turboq4"] <= 0.6 * kld["q4_0"]                      # 4.25 bpw beats 4.5 bpw
    assert kld["turboq8"] <= kld["q8_0"] + 2 * err["q8_0"]          # 8.125 bpw no worse than 8.5
    assert kld["turboq3"] <= 0.5 * kld["turboq3 uncentered"]        # centering and channel scale
    assert kld["turboq3"] <= 0.75 * kld["turboq3 unscaled"]         # the channel scale alone
    assert kld["turboq3"] <= 1.6 * kld["q4_0"]                      # 3.125 bpw near 4.5 bpw


@pytest.mark.slow
def test_an_exact_tail_cuts_turboq3s_kld(gemma_runs):
    """TURBOQ_EXACT_TAIL=16 (issue 21's recent-token window, measured end to end): each query
    reads its sequence's last 16 positions exact. The lab measured -73% attention-output error
    for turboq3; this fails if the window's rows are not read, or not read exact."""
    kld = {t: r.kld for t, r in gemma_runs.items() if t != "f16"}
    # measured (this build, c=256 x 6): turboq3 0.1805, with the tail 0.0616 (0.34x)
    assert kld["turboq3 tail16"] <= 0.5 * kld["turboq3"]


@pytest.mark.slow
def test_an_exact_tail_over_several_ubatches(gemma, short_text, tmp_path):
    """A chunk in four ubatches: each ubatch's layers attend over more cached rows than the last
    one's, through the tail's mask, which replaces the cache's own masks. Gemma's graph was once
    reused with the previous ubatch's row count (its reuse check looked at the cache's masks
    only while they were allocated), and the window made turboq3 3x worse instead of better."""
    base = tmp_path / "f16.kld"
    ub = ("-ub", "256")
    perplexity(gemma, short_text, "f16", "f16", ctx=1024, chunks=2, kld_base=base, write_base=True, extra=ub)
    # the cache alone: a turboq cache keeps a window by default (none beside the tail)
    plain = perplexity(gemma, short_text, "turboq3", "turboq3", ctx=1024, chunks=2, kld_base=base,
                       extra=(*ub, "--kv-exact-window", "0"))
    tail = perplexity(gemma, short_text, "turboq3", "turboq3", ctx=1024, chunks=2, kld_base=base, extra=ub,
                      env={"TURBOQ_EXACT_TAIL": "16"})
    assert tail.kld <= 0.6 * plain.kld, (tail.kld, plain.kld)


@pytest.mark.parametrize("switch", ["TURBOQ_EXACT_TAIL", "LLAMA_ARG_KV_EXACT_SINK"])
def test_exact_rows_over_the_whole_chunk_are_the_f16_cache(switch, tiny128, short_text, tmp_path):
    """With every position of a chunk in the window (or among the sinks) and K stored as it comes
    (no centering), each query reads exactly the keys and values an f16 cache holds, so the tiny
    llama's logits are the f16 cache's up to float rounding (its weights are not quantized, so
    no activation quantization amplifies that rounding): a windowed row read twice, or left out,
    or its stored copy left visible, moves them by far more. Measured: PPL equal to 7 digits."""
    base = tmp_path / "f16.kld"
    ref = perplexity(tiny128, short_text, "f16", "f16", ctx=256, chunks=3, kld_base=base, write_base=True)
    got = perplexity(tiny128, short_text, "turboq3", "turboq2", ctx=256, chunks=3, kld_base=base,
                     env={"LLAMA_ARG_KV_K_CENTER": "off", switch: "256"})
    assert got.ppl == pytest.approx(ref.ppl, rel=1e-5)
    assert got.kld is not None and abs(got.kld) < 1e-6 and got.same_top == 100.0


@pytest.mark.slow
def test_exact_rows_over_the_whole_chunk_make_the_cache_type_irrelevant(gemma, short_text, tmp_path):
    """Gemma (two caches: global and sliding-window layers, each with its own mask) with every
    position exact: no stored row is read, so turboq3/turboq2 and turboq4/turboq8 give the same
    bits, and the window and the sinks too. Against the f16 cache only up to rounding: the exact
    rows go through the tiled path in f32 and the f16 cache through upstream's, which rounds Q to
    f16, and Q4_K_M's 8-bit activations turn that rounding into a KLD near q8_0's (measured
    0.0119 against q8_0's 0.0206, c=256 x 3); a stored turboq2 row read in place of an exact one
    breaks the equality."""
    base = tmp_path / "f16.kld"
    perplexity(gemma, short_text, "f16", "f16", ctx=256, chunks=3, kld_base=base, write_base=True)
    q8 = perplexity(gemma, short_text, "q8_0", "q8_0", ctx=256, chunks=3, kld_base=base)
    runs = [perplexity(gemma, short_text, k, v, ctx=256, chunks=3, kld_base=base, env={"LLAMA_ARG_KV_K_CENTER": "off", sw: "256"})
            for k, v, sw in [("turboq3", "turboq2", "TURBOQ_EXACT_TAIL"), ("turboq4", "turboq8", "TURBOQ_EXACT_TAIL"),
                             ("turboq3", "turboq2", "LLAMA_ARG_KV_EXACT_SINK")]]
    assert len({(r.ppl, r.kld, r.kld_p999) for r in runs}) == 1, [(r.ppl, r.kld) for r in runs]
    assert runs[0].kld < q8.kld, (runs[0].kld, q8.kld)


@pytest.mark.slow
def test_kld_median_and_p999_are_read(gemma_runs):
    # per-token KLD is right-skewed: median < mean < 99.9th percentile, for every cache type
    for t, r in gemma_runs.items():
        if t != "f16":
            assert r.kld_median is not None and r.kld_p999 is not None, t
            assert 0 <= r.kld_median < r.kld < r.kld_p999, (t, r.kld_median, r.kld, r.kld_p999)
    assert gemma_runs["turboq2"].kld_p999 > gemma_runs["q8_0"].kld_p999


@pytest.mark.slow
def test_kv_buffer_matches_block_sizes(gemma_runs):
    f16 = gemma_runs["f16"].kv_mib
    assert gemma_runs["turboq3"].kv_mib == pytest.approx(f16 * 3.125 / 16, rel=0.01)
    assert gemma_runs["turboq2"].kv_mib == pytest.approx(f16 * 2.125 / 16, rel=0.01)
    assert gemma_runs["turboq4"].kv_mib == pytest.approx(f16 * 4.25 / 16, rel=0.01)


@pytest.mark.parametrize("type_k,type_v", [("turboq3", "turboq3"), ("turboq8", "turboq8"), ("turboq2", "f16"),
                                           ("f16", "turboq4"), ("q8_0", "turboq2"), ("turboq4", "q4_0")])
def test_tiny_model_turboq_close_to_f16(tiny128, short_text, type_k, type_v):
    ref = perplexity(tiny128, short_text, "f16", "f16", ctx=256, chunks=3)
    got = perplexity(tiny128, short_text, type_k, type_v, ctx=256, chunks=3)
    assert math.isfinite(got.ppl)
    assert got.ppl == pytest.approx(ref.ppl, rel=0.05)


def test_unknown_cache_type_is_an_error(tiny128, short_text):
    r = run_tool("llama-perplexity", "-m", str(tiny128), "-f", str(short_text), "-ctk", "turboq5", check=False)
    assert r.returncode > 0
    assert "turboq5" in r.stderr + r.stdout


def test_flash_attention_off_with_turboq_v_is_an_error(tiny128, short_text):
    r = run_tool("llama-perplexity", "-m", str(tiny128), "-f", str(short_text), "-c", "128",
                 "-fa", "off", "-ctk", "f16", "-ctv", "turboq3", check=False)
    assert r.returncode > 0, "must fail cleanly, not abort"
    assert "requires flash_attn" in r.stderr + r.stdout


def test_flash_attention_off_with_turboq_k_is_an_error(tiny128, short_text):
    r = run_tool("llama-perplexity", "-m", str(tiny128), "-f", str(short_text), "-c", "128",
                 "-fa", "off", "-ctk", "turboq3", "-ctv", "f16", check=False)
    assert r.returncode > 0
    assert "requires flash_attn" in r.stderr + r.stdout


def test_head_dim_72_is_refused_with_its_head_dim(tiny72, short_text):
    """The refusal names the head size, the layer, why (128-, 64-, 32- or 16-value groups) and what works (issue 22)."""
    r = run_tool("llama-perplexity", "-m", str(tiny72), "-f", str(short_text), "-c", "128",
                 "-ctk", "turboq3", "-ctv", "turboq3", check=False)
    assert r.returncode > 0
    out = r.stderr + r.stdout
    assert "n_embd_head_k=72" in out
    assert "layer 0: K cache turboq3: turboq types rotate and store groups of 128 values, or of 64, 32 or 16" in out
    assert "this model's is 72; caches that work with it: f16" in out
    ok = run_tool("llama-perplexity", "-m", str(tiny72), "-f", str(short_text), "-c", "128", "--chunks", "1",
                  "-ctk", "f16", "-ctv", "f16", "-fa", "on")
    assert "Final estimate" in ok.stdout + ok.stderr  # what the message names does work


def test_help_lists_turboq_types():
    r = run_tool("llama-perplexity", "--help", check=False)
    for t in ("turboq2", "turboq3", "turboq4", "turboq8", "turboq3t", "turboq2t"):
        assert t in r.stdout + r.stderr


def test_llama_bench_accepts_turboq(tiny128):
    r = run_tool("llama-bench", "-m", str(tiny128), "-fa", "1", "-p", "64", "-n", "4", "-r", "1",
                 "-ctk", "f16,turboq3", "-ctv", "f16,turboq3", "-t", "2", "-o", "csv")
    assert "turboq3" in r.stdout


@pytest.mark.parametrize("how", ["flag", "env"])
def test_invalid_layer_adaptive_mode_is_an_error(tiny128, short_text, monkeypatch, how):
    """--layer-adaptive and its environment alias LLAMA_ARG_LAYER_ADAPTIVE are checked when the
    arguments are parsed, against libllama's table."""
    from pyturbo import layer_adaptive
    extra = ("--layer-adaptive", "8") if how == "flag" else ()
    if how == "env":
        monkeypatch.setenv("LLAMA_ARG_LAYER_ADAPTIVE", "8")
    r = run_tool("llama-perplexity", "-m", str(tiny128), "-f", str(short_text), "-c", "128",
                 "-ctk", "turboq3", "-ctv", "turboq3", *extra, check=False)
    assert r.returncode > 0
    out = r.stderr + r.stdout
    assert ("argument \"--layer-adaptive\"" if how == "flag" else "environment variable \"LLAMA_ARG_LAYER_ADAPTIVE\"") in out
    assert "'8' is not a layer-adaptive mode" in out
    # the C table is the truth; pyturbo reads its modes from the library, and they must be the ones it lists
    listed = re.search(r"valid modes are ([\d, ]+)", out).group(1)
    assert tuple(int(m) for m in listed.split(",")) == layer_adaptive.modes()


def test_layer_adaptive_is_the_models_key(tiny128, short_text, monkeypatch):
    """The mode is the model key turboq.layer_adaptive: a kv override (or the GGUF) sets it,
    libllama checks it when the model loads, and the argument beats its environment alias."""
    from pyturbo import layer_adaptive
    assert layer_adaptive.key() == "turboq.layer_adaptive"
    args = ("-m", str(tiny128), "-f", str(short_text), "-c", "128", "--chunks", "1", "-fa", "on", "-t", "2",
            "-ctk", "turboq3", "-ctv", "turboq3", "-lv", "4")
    r = run_tool("llama-perplexity", *args, "--override-kv", "turboq.layer_adaptive=int:8", check=False)
    assert r.returncode > 0
    assert "turboq.layer_adaptive=8 (set by" in r.stderr + r.stdout and "is not a layer-adaptive mode" in r.stderr + r.stdout
    r = run_tool("llama-perplexity", *args, "--override-kv", "turboq.layer_adaptive=int:7")
    assert "layer   0: layer-adaptive mode 7: K turboq3, V q8_0" in r.stderr + r.stdout
    monkeypatch.setenv("LLAMA_ARG_LAYER_ADAPTIVE", "1")
    r = run_tool("llama-perplexity", *args, "--layer-adaptive", "7")
    assert "layer   0: layer-adaptive mode 7: K turboq3, V q8_0" in r.stderr + r.stdout
    monkeypatch.setenv("LLAMA_ARG_LAYER_ADAPTIVE", "7")
    r = run_tool("llama-perplexity", *args, "--layer-adaptive", "0")
    assert "layer-adaptive mode" not in r.stderr + r.stdout
    # the environment is read before the arguments: a later --override-kv of the key still wins
    monkeypatch.setenv("LLAMA_ARG_LAYER_ADAPTIVE", "1")
    r = run_tool("llama-perplexity", *args, "--override-kv", "turboq.layer_adaptive=int:7")
    assert "layer   0: layer-adaptive mode 7: K turboq3, V q8_0" in r.stderr + r.stdout
    r = run_tool("llama-perplexity", *args, "--override-kv", "turboq.layer_adaptive=int:4294967297", check=False)
    assert r.returncode > 0 and "turboq.layer_adaptive=4294967297" in r.stderr + r.stdout


def test_layer_adaptive_from_the_gguf(short_text, monkeypatch):
    """A GGUF that holds the key gets its mode; an argument (or kv override) beats it."""
    monkeypatch.delenv("LLAMA_ARG_LAYER_ADAPTIVE", raising=False)
    keyed = data.tiny_model(head_dim=128, layer_adaptive=7)
    args = ("-m", str(keyed), "-f", str(short_text), "-c", "128", "--chunks", "1", "-fa", "on", "-t", "2",
            "-ctk", "turboq3", "-ctv", "turboq3", "-lv", "4")
    r = run_tool("llama-perplexity", *args)
    assert "layer   0: layer-adaptive mode 7: K turboq3, V q8_0" in r.stderr + r.stdout
    r = run_tool("llama-perplexity", *args, "--layer-adaptive", "0")
    assert "layer-adaptive mode" not in r.stderr + r.stdout
    bad = data.tiny_model(head_dim=128, layer_adaptive=8)
    r = run_tool("llama-perplexity", *args[:1], str(bad), *args[2:], check=False)
    assert r.returncode > 0 and "turboq.layer_adaptive=8 (from the GGUF) is not a layer-adaptive mode" in r.stderr + r.stdout


def test_llama_bench_reads_the_environment_alias(tiny128, monkeypatch):
    """llama-bench has no --layer-adaptive; it reads LLAMA_ARG_LAYER_ADAPTIVE, checked like the argument."""
    args = ("-m", str(tiny128), "-fa", "1", "-p", "16", "-n", "2", "-r", "1", "-ctk", "turboq3", "-ctv", "turboq3",
            "-t", "2", "-o", "csv", "-v")
    monkeypatch.setenv("LLAMA_ARG_LAYER_ADAPTIVE", "7")
    r = run_tool("llama-bench", *args)
    assert "layer   0: layer-adaptive mode 7: K turboq3, V q8_0" in r.stderr + r.stdout
    monkeypatch.setenv("LLAMA_ARG_LAYER_ADAPTIVE", "8")
    r = run_tool("llama-bench", *args, check=False)
    assert r.returncode == 1
    assert "LLAMA_ARG_LAYER_ADAPTIVE: '8' is not a layer-adaptive mode" in r.stderr


def test_layer_adaptive_modes_have_names(tiny128, short_text, monkeypatch):
    """Each mode has a name in libllama's table ("k4-global" for 4) that the flag, its alias,
    pyturbo and `python -m server` take beside the number; a wrong one is an error naming them all,
    and docs/usage.md's table lists the same names."""
    from pathlib import Path

    from pyturbo import layer_adaptive
    from pyturbo.server.cli import parser
    monkeypatch.delenv("LLAMA_ARG_LAYER_ADAPTIVE", raising=False)
    names = layer_adaptive.names()
    assert names[0] == "off" and names[4] == "k4-global" and len(set(names.values())) == len(names)
    args = ("-f", str(short_text), "-c", "128", "--chunks", "1", "-fa", "on", "-t", "2", "-ctk", "turboq3",
            "-ctv", "turboq3", "-lv", "4")

    def run(*extra):
        return perplexity(tiny128, short_text, "turboq3", "turboq3", ctx=128, chunks=1, extra=extra)

    by_number, by_name = run("--layer-adaptive", "7"), run("--layer-adaptive", names[7])
    assert "layer   0: layer-adaptive mode 7: K turboq3, V q8_0" in by_name.log and by_name.ppl == by_number.ppl
    assert "layer-adaptive mode" not in run("--layer-adaptive", "off").log
    monkeypatch.setenv("LLAMA_ARG_LAYER_ADAPTIVE", names[7])
    assert run().ppl == by_number.ppl
    monkeypatch.delenv("LLAMA_ARG_LAYER_ADAPTIVE")
    r = run_tool("llama-perplexity", "-m", str(tiny128), *args, "--layer-adaptive", "k9-nowhere", check=False)
    assert r.returncode > 0 and "(or their names: off, q8-edges, " in r.stderr + r.stdout
    assert layer_adaptive.check_mode("k4-global") == 4 and parser().parse_args(["--layer-adaptive", "k4-global"]).layer_adaptive == 4
    with pytest.raises(ValueError, match=r"4 \(k4-global\)"):
        layer_adaptive.check_mode("k4-everywhere")
    usage = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text()
    assert {int(m): n for m, n in re.findall(r"^\| (\d) \| `([\w-]+)` \|", usage, re.M)} == names


def test_k_centering_is_the_models_key(tiny128, short_text, monkeypatch):
    """K centering is the model key turboq.k_center: --kv-k-center on|off and its alias
    LLAMA_ARG_KV_K_CENTER in common's tools, the alias in llama-bench, the GGUF's own key; a bad
    value is an error while parsing, and the argument beats the alias."""
    monkeypatch.delenv("LLAMA_ARG_KV_K_CENTER", raising=False)

    def run(model, *extra):
        return perplexity(model, short_text, "turboq3", "turboq3", ctx=128, chunks=1, extra=extra)

    on = run(tiny128)
    assert "K means calibrated" in on.log and "turboq.k_center=false" not in on.log
    off = run(tiny128, "--kv-k-center", "off")
    assert "turboq.k_center=false (set by --kv-k-center" in off.log and "K means calibrated" not in off.log
    assert on.ppl != off.ppl  # centering changes what the cache stores
    keyed = data.tiny_model(head_dim=128, k_center=False)  # the same weights, the key in the GGUF
    r = run(keyed)
    assert "turboq.k_center=false (from the GGUF)" in r.log and r.ppl == off.ppl
    r = run(keyed, "--kv-k-center", "on")
    assert "K means calibrated" in r.log and r.ppl == on.ppl
    monkeypatch.setenv("LLAMA_ARG_KV_K_CENTER", "off")
    r = run(tiny128)
    assert "turboq.k_center=false" in r.log and r.ppl == off.ppl
    assert run(tiny128, "--kv-k-center", "on").ppl == on.ppl  # the argument wins
    alias_reaches_llama_bench_and_bad_values_are_errors(tiny128, short_text, monkeypatch, "LLAMA_ARG_KV_K_CENTER",
                                                        "--kv-k-center", "turboq.k_center=false", "maybe",
                                                        "'maybe' is not on or off")


def alias_reaches_llama_bench_and_bad_values_are_errors(model, text, monkeypatch, alias: str, flag: str, bench_says: str,
                                                        bad: str, error: str) -> None:
    """With `alias` already set by the caller: llama-bench's log says `bench_says`; a bad value in the
    alias is llama-bench's error (exit 1), and in the flag llama-perplexity's."""
    bench = ("-m", str(model), "-fa", "1", "-p", "16", "-n", "2", "-r", "1", "-ctk", "turboq3", "-ctv", "turboq3",
             "-t", "2", "-o", "csv", "-v")
    r = run_tool("llama-bench", *bench)
    assert bench_says in r.stderr + r.stdout
    monkeypatch.setenv(alias, bad)
    r = run_tool("llama-bench", *bench, check=False)
    assert r.returncode == 1 and f"{alias}: {error}" in r.stderr
    monkeypatch.delenv(alias)
    r = run_tool("llama-perplexity", "-m", str(model), "-f", str(text), "-c", "128", "-ctk", "turboq3",
                 "-ctv", "turboq3", flag, bad, check=False)
    assert r.returncode > 0 and error in r.stderr + r.stdout


def test_the_channel_scale_is_a_setting_and_auto_takes_the_trials_choice(tiny128, short_text, monkeypatch):
    """The channel scale is the model key turboq.k_scale: --kv-k-scale auto|on|off and its alias
    LLAMA_ARG_KV_K_SCALE in common's tools, the alias in llama-bench, a string in kv_overrides.
    auto (the default) logs the trial's figures and its choice, and computes what that choice
    computes; on and off differ; a bad value is an error while parsing."""
    monkeypatch.delenv("LLAMA_ARG_KV_K_SCALE", raising=False)

    def run(*extra):
        return perplexity(tiny128, short_text, "turboq3", "turboq3", ctx=128, chunks=1, extra=extra)

    auto, on, off = run(), run("--kv-k-scale", "on"), run("--kv-k-scale", "off")
    m = re.search(r"the channel scale is (on|off) \(turboq.k_scale=auto: the trial's attention error, summed over the "
                  r"layers, ([\d.]+) with it and ([\d.]+) without it", auto.log)
    assert m, auto.log[-3000:]
    with_it, without = float(m.group(2)), float(m.group(3))
    assert with_it > 0 and without > 0
    if abs(with_it - without) > 2e-4:  # the log's 4 decimals tell which is smaller
        assert m.group(1) == ("on" if with_it < without else "off")
    assert on.ppl != off.ppl and auto.ppl == (on if m.group(1) == "on" else off).ppl
    assert "the channel scale is on (turboq.k_scale)" in on.log and "the channel scale is off (turboq.k_scale)" in off.log
    assert run("--kv-k-scale", "auto").ppl == auto.ppl
    monkeypatch.setenv("LLAMA_ARG_KV_K_SCALE", "off")
    assert run().ppl == off.ppl and run("--kv-k-scale", "on").ppl == on.ppl  # the argument wins
    alias_reaches_llama_bench_and_bad_values_are_errors(tiny128, short_text, monkeypatch, "LLAMA_ARG_KV_K_SCALE",
                                                        "--kv-k-scale", "the channel scale is off (turboq.k_scale)",
                                                        "sometimes", "'sometimes' is not auto, on or off")
    r = run_tool("llama-perplexity", "-m", str(tiny128), "-f", str(short_text), "-c", "128", "-ctk", "turboq3",
                 "-ctv", "turboq3", "--override-kv", "turboq.k_scale=str:sometimes", check=False)
    assert r.returncode > 0 and "turboq.k_scale: 'sometimes' is not auto, on or off" in r.stderr + r.stdout


def test_the_deprecated_alias_still_sets_the_mode(tiny128, short_text, monkeypatch):
    """TURBO_LAYER_ADAPTIVE, the alias's name before LLAMA_ARG_LAYER_ADAPTIVE, still sets the mode
    for one release, in common's tools and in llama-bench, with a deprecation line; where both are
    set, the new name wins and the line says the old one is ignored."""
    monkeypatch.delenv("LLAMA_ARG_LAYER_ADAPTIVE", raising=False)
    monkeypatch.setenv("TURBO_LAYER_ADAPTIVE", "7")
    args = ("-m", str(tiny128), "-f", str(short_text), "-c", "128", "--chunks", "1", "-fa", "on", "-t", "2",
            "-ctk", "turboq3", "-ctv", "turboq3", "-lv", "4")
    r = run_tool("llama-perplexity", *args)
    out = r.stderr + r.stdout
    assert "TURBO_LAYER_ADAPTIVE is deprecated: set LLAMA_ARG_LAYER_ADAPTIVE instead" in out
    assert "layer   0: layer-adaptive mode 7: K turboq3, V q8_0" in out
    r = run_tool("llama-bench", "-m", str(tiny128), "-fa", "1", "-p", "16", "-n", "2", "-r", "1", "-ctk", "turboq3",
                 "-ctv", "turboq3", "-t", "2", "-o", "csv", "-v")
    out = r.stderr + r.stdout
    assert "TURBO_LAYER_ADAPTIVE is deprecated" in out and "layer   0: layer-adaptive mode 7: K turboq3, V q8_0" in out
    monkeypatch.setenv("LLAMA_ARG_LAYER_ADAPTIVE", "1")
    r = run_tool("llama-perplexity", *args)
    out = r.stderr + r.stdout
    assert "TURBO_LAYER_ADAPTIVE is deprecated and ignored: LLAMA_ARG_LAYER_ADAPTIVE is set" in out
    assert "layer   0: layer-adaptive mode 1: K q8_0, V q8_0" in out


@pytest.mark.slow
@pytest.mark.parametrize("mode,expect", [
    (5, {0: ("turboq3", "turboq4"), 1: ("turboq3", "turboq4"), 2: ("turboq3", "turboq2"), 17: ("turboq3", "turboq4")}),
    (6, {9: ("turboq3", "turboq2"), 10: ("turboq3", "turboq4")}),
    (1, {3: ("q8_0", "q8_0"), 4: ("turboq3", "turboq3"), 14: ("q8_0", "q8_0")}),
    (2, {9: ("turboq3", "turboq3"), 10: ("q8_0", "q8_0")}),
    # K gain from the weights (RMS of attn_k_norm): layers 11 and 5 on Gemma 3 270M, 18 // 9 = 2 of them
    (3, {11: ("q8_0", "turboq3"), 5: ("q8_0", "turboq3"), 10: ("turboq3", "turboq3"), 0: ("turboq3", "turboq3")}),
    # the layers that attend over the whole context: Gemma 3's every sixth
    (4, {5: ("turboq4", "turboq3"), 11: ("turboq4", "turboq3"), 17: ("turboq4", "turboq3"), 0: ("turboq3", "turboq3"),
         16: ("turboq3", "turboq3")}),
])
def test_layer_adaptive_modes_on_gemma_iswa(gemma, short_text, mode, expect):
    r = perplexity(gemma, short_text, "turboq3", "turboq3", ctx=256, chunks=1, extra=("--layer-adaptive", str(mode)))
    for il, (k, v) in expect.items():
        assert f"layer {il:3d}: layer-adaptive mode {mode}: K {k}, V {v}" in r.log
    assert math.isfinite(r.ppl)
    if mode != 3:  # pyturbo.layer_adaptive reads the C table; for the modes that do not rank by K gain it must say what the C code did
        from pyturbo.layer_adaptive import layer_cache_types, policies
        from pyturbo.memory import kv_geometry
        logged = dict(re.findall(rf"layer +(\d+): layer-adaptive mode {mode}: (K \w+, V \w+)", r.log))
        assert len(logged) == 18
        g = kv_geometry(gemma)
        gains = [1.0] * 18 if policies()[mode].k_gain_div else None  # mode 4 takes every candidate, whatever its gain
        for il, (k, v) in enumerate(layer_cache_types(mode, 18, "turboq3", "turboq3", gains, [g.is_swa(i) for i in range(18)])):
            assert logged[str(il)] == f"K {k}, V {v}", il
    if mode == 4:  # picks the same layers whatever their K gain, so pyturbo.memory counts its cache exactly
        from pyturbo.memory import kv_bytes
        assert r.kv_mib == pytest.approx(kv_bytes(gemma, 256, "turboq3", "turboq3", 4) / 2**20, abs=0.011)


def test_tiny_model_kld_follows_the_codebook_mse(tiny128, short_text, tmp_path):
    """On a random model (no common K component, so centering does nothing) the end-to-end KLD
    of each type scales like its quantization MSE. Bound: the type's expected MSE over q4_0's,
    times q4_0's KLD from the same run, with 50% slack (measured within 10%)."""
    from pyturbo.format.codebook import lloyd_max
    from pyturbo.lab.kvlab import q_mainline

    g = np.random.default_rng(0).standard_normal((4096, 128)).astype(np.float32)
    mse_q4_0 = float(np.mean((q_mainline(g, "q4_0") - g) ** 2) / np.mean(g ** 2))
    base = tmp_path / "f16.kld"
    perplexity(tiny128, short_text, "f16", "f16", ctx=256, chunks=3, kld_base=base, write_base=True)
    kld = {t: perplexity(tiny128, short_text, t, t, ctx=256, chunks=3, kld_base=base).kld
           for t in ("q8_0", "q4_0", "turboq8", "turboq4", "turboq3", "turboq2")}
    print(f"tiny128 KLD vs f16: {kld}; q4_0 MSE {mse_q4_0:.5f}")
    for b in (2, 3, 4):
        assert 0 < kld[f"turboq{b}"] <= 1.5 * kld["q4_0"] * lloyd_max(b).vector_mse / mse_q4_0
    assert kld["turboq8"] <= 2 * kld["q8_0"] + 2e-6



def test_trellis_types_beat_their_scalar_twins(tiny128, short_text, tmp_path):
    """turboq3t and turboq2t (issue 21's trellis), end to end
    on a random model (where KLD follows the codec's MSE): each has less KLD than the scalar type of
    its bits, and gives it twice; on heads of 64 too, where libllama stores their _g64 forms."""
    for head_dim, model in ((128, tiny128), (64, data.tiny_model(head_dim=64))):
        base = tmp_path / f"f16-{head_dim}.kld"
        perplexity(model, short_text, "f16", "f16", ctx=256, chunks=3, kld_base=base, write_base=True)
        kld = {t: perplexity(model, short_text, t, t, ctx=256, chunks=3, kld_base=base).kld
               for t in ("turboq3", "turboq3t", "turboq2", "turboq2t")}
        print(f"tiny, head {head_dim}, KLD vs f16: {kld}")
        assert 0 < kld["turboq3t"] < 0.9 * kld["turboq3"]
        assert 0 < kld["turboq2t"] < 0.9 * kld["turboq2"]
        assert perplexity(model, short_text, "turboq2t", "turboq2t", ctx=256, chunks=3, kld_base=base).kld == kld["turboq2t"]
    # no 32- or 16-value trellis: head size 96 is refused, naming the scalar type that takes it
    r = run_tool("llama-perplexity", "-m", str(data.tiny_model(head_dim=96)), "-f", str(short_text), "-c", "128",
                 "-fa", "on", "-ctk", "turboq2t", "-ctv", "turboq2t", check=False)
    assert r.returncode > 0
    assert "the trellis types store groups of 128 or 64 values, and this model's head size is 96; the scalar turboq2 of " \
           "the same bits takes it" in r.stderr + r.stdout

BAD_INPUT = [
    (("-fa", "off", "-ctk", "turboq3", "-ctv", "f16"), "requires flash_attn"),
    (("-ctk", "turboq5"), "turboq5"),
    (("-ctk", "turboq3", "-ctv", "turboq3", "--model-72"), "n_embd_head_k=72"),
]
# how each tool is run once its bad input is given: quickly, and never waiting for a terminal
TOOL_ARGS = {
    "llama-perplexity": lambda text: ("-f", str(text), "-c", "128"),
    "llama-server": lambda text: ("--port", "0", "--host", "127.0.0.1"),
    "llama-cli": lambda text: ("-p", "hi", "-n", "1", "-st"),
    "llama-bench": lambda text: ("-p", "8", "-n", "1", "-r", "1"),
}


@pytest.mark.parametrize("tool", list(TOOL_ARGS))
@pytest.mark.parametrize("args,message", BAD_INPUT)
def test_error_message_reaches_the_user_every_time(tiny128, tiny72, short_text, tool, args, message):
    """The log is written by a worker thread; an error exit used to lose its message about 1 run
    in 10 with piped output (patch 5 drains the log at exit), and llama-bench dropped llama.cpp's
    errors altogether (patch 7). Every tool we ship, 20 runs each, the message every time."""
    model = tiny72 if "--model-72" in args else tiny128
    args = tuple(a for a in args if a != "--model-72")
    if tool == "llama-bench":
        args = tuple("1" if a == "on" else "0" if a == "off" else a for a in args)
    missing = 0
    for _ in range(20):
        r = run_tool(tool, "-m", str(model), *TOOL_ARGS[tool](short_text), *args, check=False, timeout=120)
        assert r.returncode != 0, r.stdout[-1000:] + r.stderr[-1000:]
        missing += message not in r.stderr + r.stdout
    assert missing == 0, f"{tool}: the message was lost in {missing} of 20 runs"
