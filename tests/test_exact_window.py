"""The exact window (--kv-exact-window W, llama-turboq-window.h): each sequence's last W positions
read exact from F16 rows kept beside a quantized cache, in llama.cpp's tools, pyturbo.Llama and
the server; the same answer however the tokens arrive, and a clear error where it cannot run."""
from __future__ import annotations

import pytest

from pyturbo import data
from pyturbo.tools import binary, llama_perplexity as perplexity, run_tool, tool_env
from helpers import (assert_reads_beside, assert_state_refused, decode_step_ops, fa_packed, free_port, post, server_cmd,
                     start, stop, wait_healthy)


def window(w: int) -> tuple[str, ...]:
    return ("--kv-exact-window", str(w))


@pytest.mark.slow
def test_one_ubatch_reads_what_the_debug_tail_reads(build_info, short_text, tmp_path):
    """With each chunk in one ubatch, every window lies in the ubatch at hand, so the window reads
    the rows that TURBOQ_EXACT_TAIL reads, in the same order: the same bits. The window must also
    earn what the tail measured (issue 21): turboq3's KLD well down."""
    gemma = data.default_model()
    base = tmp_path / "f16.kld"
    perplexity(gemma, short_text, "f16", "f16", ctx=256, chunks=3, kld_base=base, write_base=True)
    plain = perplexity(gemma, short_text, "turboq3", "turboq3", ctx=256, chunks=3, kld_base=base, extra=window(0))
    tail = perplexity(gemma, short_text, "turboq3", "turboq3", ctx=256, chunks=3, kld_base=base, env={"TURBOQ_EXACT_TAIL": "16"})
    # the tail has no sink row (auto keeps none beside it): neither has the window here
    win = perplexity(gemma, short_text, "turboq3", "turboq3", ctx=256, chunks=3, kld_base=base, extra=(*window(16), *sink(0)))
    assert (win.ppl, win.kld, win.kld_p999) == (tail.ppl, tail.kld, tail.kld_p999)
    assert win.kld <= 0.5 * plain.kld, (win.kld, plain.kld)


# Ubatch splits against one ubatch per chunk at float precision: the split's small ubatches must
# take the float attention that one ubatch takes. A turboq cache's decode steps (fewer than 16
# query rows a tile: 7 tokens or 1 of the tiny llama's GQA pairs, or a chunk's short last ubatch)
# read the packed rows in 8-bit integers where the CPU has them (patch 46), which moves the tiny
# llama's perplexity by 6e-4: more than some bugs these tests look for would. So the small splits
# run a q4_0 cache, whose window and sink rows are the same code; turboq3/turboq2 runs in ubatches
# of 64 (whole tiles) and, through the packed path, in test_packed_decode_steps_read_the_window.
SPLITS = [("turboq3", "turboq2", "64"), ("q4_0", "q4_0", "7"), ("q4_0", "q4_0", "1")]


@pytest.mark.parametrize("type_k,type_v,ubatch", SPLITS)
def test_the_window_crosses_ubatches(tiny128, short_text, type_k, type_v, ubatch):
    """Tokens in ubatches of 64 (more than the ring's 32 slots: each layer must read the ring
    before its ubatch's rows overwrite it), of 7, or one at a time, read the rows of earlier
    ubatches from the ring:
    the tiny llama (unquantized weights, so no 8-bit activations amplify the rounding) gives the
    perplexity of one ubatch per chunk to 6 digits, and not that of the cache without a window.
    Measured (turboq3/turboq2): 395.3971 for every ubatch size, 397.1750 without the window; q4_0:
    368.6504 in one ubatch, 368.6507 one token at a time, 368.2191 without the window. Without the
    default sink row, whose ubatch splits test_sink_rows_cross_ubatches checks (with it the
    one-token split moved by 1.3e-6)."""
    one = perplexity(tiny128, short_text, type_k, type_v, ctx=256, chunks=3, extra=(*window(16), *sink(0)))
    split = perplexity(tiny128, short_text, type_k, type_v, ctx=256, chunks=3,
                       extra=(*window(16), *sink(0), "-ub", ubatch))
    plain = perplexity(tiny128, short_text, type_k, type_v, ctx=256, chunks=3, extra=(*window(0), *sink(0), "-ub", ubatch))
    assert split.ppl == pytest.approx(one.ppl, rel=1e-6)
    assert abs(plain.ppl - one.ppl) > 1e-3 * one.ppl


def test_packed_decode_steps_read_the_window(lib, tiny128, short_text):
    """turboq3/turboq2 one token at a time, where the decode steps take the packed path: the
    window's rows (F16, read beside the cache on the float path) still count, by more than the
    packed path's own rounding moves the perplexity. Measured: 377.4902 in one ubatch, 377.2661
    one token at a time (the packed path: 5.9e-4), 378.7788 one token at a time without the
    window (3.4e-3)."""
    if not fa_packed(lib, "turboq3"):
        pytest.skip("this CPU build has no packed path (x86: AVX-512 BW + VNNI, or AVX2; AArch64 NEON)")
    one = perplexity(tiny128, short_text, "turboq3", "turboq2", ctx=256, chunks=3, extra=(*window(16), *sink(0)))
    split = perplexity(tiny128, short_text, "turboq3", "turboq2", ctx=256, chunks=3,
                       extra=(*window(16), *sink(0), "-ub", "1"))
    plain = perplexity(tiny128, short_text, "turboq3", "turboq2", ctx=256, chunks=3, extra=(*window(0), *sink(0), "-ub", "1"))
    assert split.ppl == pytest.approx(one.ppl, rel=1.5e-3)
    assert abs(split.ppl - one.ppl) > 1e-5 * one.ppl, "the packed path did not run"
    assert abs(plain.ppl - one.ppl) > 2.5e-3 * one.ppl


def test_a_window_over_the_whole_chunk_is_the_f16_cache(tiny128, short_text, tmp_path):
    """W = ctx in ubatches of 64: every row any query reads is exact, from the ring or its ubatch,
    so the tiny llama's logits are the f16 cache's: a ring row lost, read twice, or its stored copy
    left visible moves them by far more."""
    base = tmp_path / "f16.kld"
    ref = perplexity(tiny128, short_text, "f16", "f16", ctx=256, chunks=3, kld_base=base, write_base=True)
    got = perplexity(tiny128, short_text, "turboq3", "turboq2", ctx=256, chunks=3, kld_base=base,
                     env={"LLAMA_ARG_KV_K_CENTER": "off"}, extra=(*window(256), "-ub", "64"))
    assert got.ppl == pytest.approx(ref.ppl, rel=1e-5)
    assert got.kld is not None and abs(got.kld) < 1e-6 and got.same_top == 100.0


COPY = {"TURBOQ_WINDOW_COPY": "1"}  # the debug switch: the CPU reads the window as a GPU's cache does


@pytest.mark.parametrize("ubatch", ["7", "64"])
def test_through_the_copy_a_window_over_the_whole_chunk_is_the_f16_cache(tiny128, short_text, tmp_path, ubatch):
    """A cache on a device reads its window after an F16 copy of its rows, padded to 256 rows with
    hidden zeros. With W = ctx every row a query reads is exact, so the attention is the f16
    cache's over the same rows in another order: at the same ubatch size the same perplexity to 6
    digits and a KLD of 0 but for summation order (measured: mean below 5e-7, p99.9 9e-6). A ring
    row lost, the padding shown, or a stored copy left visible moves them by far more."""
    base = tmp_path / "f16.kld"
    ref = perplexity(tiny128, short_text, "f16", "f16", ctx=256, chunks=3, kld_base=base, write_base=True,
                     extra=("-ub", ubatch))
    got = perplexity(tiny128, short_text, "turboq3", "turboq2", ctx=256, chunks=3, kld_base=base,
                     env={**COPY, "LLAMA_ARG_KV_K_CENTER": "off"}, extra=(*window(256), "-ub", ubatch))
    assert "read exact (F16 rows after an F16 copy of the cache, a margin of 16)" in got.log
    assert got.ppl == pytest.approx(ref.ppl, rel=1e-6)
    assert got.kld is not None and abs(got.kld) < 1e-6 and got.kld_p999 < 1e-4 and got.same_top == 100.0


def test_a_decode_step_reads_the_window_without_copying_the_cache(tiny128, short_text):
    """The graph of a decode step whose window is read beside the cache, as the CPU reads it and a
    device whose flash attention takes the rows does (CUDA beside a turboq cache, patch 43): no
    CPY, PAD or CONCAT of the cache, only the small CONCATs of the ring's rows with the step's
    (measured on the tiny llama, 2 layers: 70 nodes; 86 through the copy, which converts each
    layer's K and V cache to F16, appends the rows and pads them)."""
    exe = binary("llama-perplexity")
    beside = decode_step_ops(exe, tiny128, short_text, tool_env())
    copy = decode_step_ops(exe, tiny128, short_text, tool_env(COPY))
    assert_reads_beside(beside, copy, "CPU")
    print(f"\ndecode step nodes: {len(beside)} beside the cache, {len(copy)} through the copy")


def test_the_copy_reads_what_the_rows_beside_read(tiny128, short_text, tmp_path):
    """The same window of 16 in ubatches of 64 (so rows come from the ring too), read beside the
    cache and through the copy: the same logits but for F16 rounding of the cache's rows (measured:
    KLD below 5e-7, p99.9 8e-6), where dropping the window costs 5.9e-4."""
    base = tmp_path / "beside.kld"
    run = dict(ctx=256, chunks=3, kld_base=base)
    perplexity(tiny128, short_text, "turboq3", "turboq2", write_base=True, extra=(*window(16), "-ub", "64"), **run)
    copy = perplexity(tiny128, short_text, "turboq3", "turboq2", env=COPY, extra=(*window(16), "-ub", "64"), **run)
    plain = perplexity(tiny128, short_text, "turboq3", "turboq2", extra=(*window(0), "-ub", "64"), **run)
    assert copy.kld is not None and copy.kld_p999 is not None and plain.kld is not None
    assert copy.kld_p999 < 1e-4 and copy.kld < 1e-5
    assert plain.kld > 50 * max(copy.kld, 1e-6)


def test_the_window_needs_flash_attention_and_says_so(tiny128, short_text):
    r = run_tool("llama-perplexity", "-m", str(tiny128), "-f", str(short_text), "-c", "256", "-ctk", "q8_0", "-fa", "off",
                 *window(16), check=False)
    assert r.returncode != 0
    assert "turboq.exact_window=16: the exact window needs flash attention (-fa on)" in r.stdout + r.stderr


@pytest.mark.parametrize("bad", ["-2", "4097", "x"])
def test_a_bad_window_is_refused_by_the_tools_and_python(Llama, tiny128, short_text, bad):
    r = run_tool("llama-perplexity", "-m", str(tiny128), "-f", str(short_text), "-c", "256", *window(0)[:1], bad,
                 check=False)
    assert r.returncode != 0 and "is not an exact window" in r.stdout + r.stderr
    with pytest.raises(ValueError, match="exact window"):
        Llama(str(tiny128), cache_type_k="turboq3", cache_type_v="turboq3", kv_exact_window=int(bad) if bad != "x" else bad,
              verbose=False)


@pytest.mark.slow
def test_the_server_answers_the_same_with_a_window(build_info):
    """Two slots, a window of 16, greedy answers longer than the window's 16-row margin: a re-asked
    prompt finds its window gone from the slot (the answer pushed it out), so the server processes
    it again (and says so) rather than read those rows as stored, and every answer to the same
    prompt is the same."""
    port = free_port()
    proc = start(server_cmd("llama-server", port, "-ctk", "turboq3", "-ctv", "turboq3", "--n-ctx", "512",
                            "--parallel", "2", "--kv-exact-window", "16"))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        prompts = ["The old man and the sea: once upon a time", "Counting: 1, 2, 3,"] * 3
        answers: dict[str, set[str]] = {}
        for p in prompts:
            status, body = post(f"http://127.0.0.1:{port}/v1/completions", {"prompt": p, "max_tokens": 40, "temperature": 0})
            assert status == 200, body
            answers.setdefault(p, set()).add(body["choices"][0]["text"])
    finally:
        log = stop(proc)
    assert all(len(a) == 1 and next(iter(a)).strip() for a in answers.values()), answers
    assert "the exact window does not hold the 16 positions before" in log


def test_server_flag_is_checked(build_info):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "server", "--kv-exact-window", "-2"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "--kv-exact-window: exact window -2" in r.stderr


def test_sequence_operations_keep_the_window_right(Llama, tiny128, short_text):
    """Rolling back up to 16 positions (the margin) and processing them again gives the first
    pass's bits (also where the window's rows wrap around the ring), and the cache says it can
    continue; rolling back more cannot be continued as if
    fresh (the rows before it are gone from the ring), and says so. A context shift, a copied
    sequence and a kept one still give finite logits. Without the default sink row: these cut points
    are ones where the two passes' batches take the same kernel paths; with one more exact row the
    tiles group the rows differently and the second cut moved by 4.8e-7 (re-processing in another
    batch shape is not bit-identical in the tiled turboq path, with or without exact rows)."""
    import ctypes

    import numpy as np

    from pyturbo._paths import library

    can_continue = library("llama").llama_turboq_window_can_continue
    can_continue.restype = ctypes.c_bool
    can_continue.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]

    llm = Llama(str(tiny128), cache_type_k="turboq3", cache_type_v="turboq2", kv_exact_window=8, kv_exact_sink=0,
                n_ctx=256, n_batch=256, n_seq_max=2, flash_attn=True, verbose=False, logits_all=True)
    toks = llm.tokenize(short_text.read_text()[:2000].encode())[:60]
    llm.eval(toks)
    first = llm.scores[59].copy()
    assert can_continue(llm._ctx.ctx, 0, 44) and not can_continue(llm._ctx.ctx, 0, 40)
    llm.n_tokens = 44  # eval removes positions 44.. first
    llm.eval(toks[44:])
    np.testing.assert_array_equal(llm.scores[59], first)
    # positions 42..49 lie across the ring's wrap (slot 48 % 24 = 0): read in position order, as
    # the one-ubatch pass read them, they give the same bits
    llm.n_tokens = 50
    llm.eval(toks[50:])
    np.testing.assert_array_equal(llm.scores[59], first)

    llm._ctx.kv_cache_seq_cp(0, 1, -1, -1)
    llm._ctx.kv_cache_seq_rm(0, 10, 30)
    llm._ctx.kv_cache_seq_shift(0, 30, -1, -20)
    llm._ctx.kv_cache_seq_keep(0)
    llm.n_tokens = 40
    llm.eval(toks[:8])
    assert np.isfinite(llm.scores[47]).all()


@pytest.mark.parametrize("layout", [("-b", "512"), ("-b", "512", "--kv-unified")])
def test_several_sequences_keep_their_own_windows(tiny128, short_text, layout):
    """Two chunks decoded side by side, in a cache per sequence or in one shared cache: each
    sequence reads its own window, so the perplexity is that of one chunk at a time. K centering
    is off: a shared cache's sequences span its 512 cells, which its K mean is fitted to."""
    uncentered = {"LLAMA_ARG_KV_K_CENTER": "off"}
    one = perplexity(tiny128, short_text, "turboq3", "turboq2", ctx=256, chunks=4, env=uncentered,
                     extra=(*window(16), "-ub", "64"))
    two = perplexity(tiny128, short_text, "turboq3", "turboq2", ctx=256, chunks=4, env=uncentered,
                     extra=(*window(16), "-ub", "64", *layout))
    assert two.ppl == pytest.approx(one.ppl, rel=1e-6)


@pytest.mark.parametrize("margin", [None, 0])
def test_python_reprocesses_a_prefix_whose_window_is_gone(Llama, tiny128, monkeypatch, margin):
    """llama-cpp-python reuses the prompt a second completion shares with the first; with the
    window pushed past it by the first answer (or, with a margin of 0, by the one position that
    llama-cpp-python evaluates again), pyturbo.Llama evaluates the whole prompt again (a fresh
    pass's rows), and both completions are the same."""
    import llama_cpp

    llm = Llama(str(tiny128), cache_type_k="turboq3", cache_type_v="turboq2", kv_exact_window=8, n_ctx=256,
                kv_exact_window_margin=margin, verbose=False, seed=1)
    prompt = "The old man looked at the sea and said"
    first = llm.create_completion(prompt, max_tokens=32, temperature=0)["choices"][0]["text"]
    calls: list[int] = []
    upstream = llama_cpp.Llama.eval
    monkeypatch.setattr(llama_cpp.Llama, "eval", lambda self, tokens: (calls.append(len(tokens)), upstream(self, tokens))[1])
    again = llm.create_completion(prompt, max_tokens=32, temperature=0)["choices"][0]["text"]
    assert again == first
    assert calls[0] >= len(llm.tokenize(prompt.encode())), calls[:3]


def test_the_window_counts_its_bytes(build_info):
    from pyturbo import exact_window
    from pyturbo.bench.cpu import config_bpw, parse_config
    from pyturbo.memory import kv_bytes

    assert exact_window.rows_per_sequence(16) == 32 and exact_window.rows_per_sequence(0) == 0
    env = parse_config("turboq3:win16")[3]  # and auto's sink row: 16 + 16 + 1 rows
    assert config_bpw(18, "turboq3", "turboq3", env, 8192) == pytest.approx(3.125 + 16 * 33 / 8192)
    env = parse_config("turboq3:win16m0")[3]
    assert env == {exact_window.ENV: "16", exact_window.MARGIN_ENV: "0"}
    assert config_bpw(18, "turboq3", "turboq3", env, 8192) == pytest.approx(3.125 + 16 * 17 / 8192)
    assert config_bpw(18, "turboq3", "turboq3", parse_config("turboq3:win16m0:sink0")[3], 8192) == \
        pytest.approx(3.125 + 16 * 16 / 8192)
    for bad in ("turboq3:win16m", "turboq3:winm4", "turboq3:win16m4097"):
        with pytest.raises(SystemExit, match="unknown option"):
            parse_config(bad)
    assert config_bpw(18, "f16", "f16", env, 8192) == 16  # nothing quantized: no window
    gemma = data.default_model()
    extra = kv_bytes(gemma, 4096, "turboq3", "turboq3", exact_window=16) - kv_bytes(gemma, 4096, "turboq3", "turboq3")
    assert extra == 18 * (32 + 1) * 1 * (256 + 256) * 2  # 18 layers, 1 KV head of 256, K and V in F16


def test_a_margin_of_0_keeps_the_logits_and_saves_its_rows(build_info, tiny128, short_text):
    """--kv-exact-window-margin 0 keeps W rows per sequence instead of W + 16: in ubatches of 7
    (each layer reads the ring's last rows before its ubatch overwrites them, the margin no
    longer between them) the perplexity is the default margin's to the digit, the log states the
    margin, and the bytes are 16 rows fewer per layer, as pyturbo.memory counts them."""
    from pyturbo import exact_window
    from pyturbo.memory import kv_bytes

    runs = {m: perplexity(tiny128, short_text, "turboq3", "turboq2", ctx=256, chunks=3,
                          extra=(*window(16), "-ub", "7", *(("--kv-exact-window-margin", m) if m else ())))
            for m in ("", "0")}
    assert runs["0"].ppl == runs[""].ppl
    r = run_tool("llama-perplexity", "-m", str(tiny128), "-f", str(short_text), "-c", "256", "--chunks", "1",
                 "-ctk", "turboq3", "-ctv", "turboq3", "-fa", "on", *window(16), "-lv", "4",
                 env={exact_window.MARGIN_ENV: "0"})
    assert "read exact (F16 rows beside the cache, a margin of 0)" in r.stdout + r.stderr
    assert exact_window.rows_per_sequence(16, 0) == 16 and exact_window.rows_per_sequence(16) == 32
    gemma = data.default_model()
    saved = (kv_bytes(gemma, 4096, "turboq3", "turboq3", n_seq=2, exact_window=16) -
             kv_bytes(gemma, 4096, "turboq3", "turboq3", n_seq=2, exact_window=16, exact_window_margin=0))
    assert saved == 18 * 2 * 16 * (256 + 256) * 2  # 18 layers, 2 sequences, 16 rows of K and V, F16


def test_a_margin_of_0_reads_the_window_exact_until_a_rollback(Llama, tiny128, short_text):
    """With no margin the ring holds exactly the window: the cache can continue after its last
    position and not one before it; the logits are those of the default margin's cache."""
    import numpy as np

    from pyturbo import exact_window

    def logits(margin):
        llm = Llama(str(tiny128), cache_type_k="turboq3", cache_type_v="turboq2", kv_exact_window=8, n_ctx=256,
                    n_batch=16, kv_exact_window_margin=margin, flash_attn=True, verbose=False, logits_all=True)
        toks = llm.tokenize(short_text.read_text()[:2000].encode())[:60]
        llm.eval(toks)
        return llm, llm.scores[:60].copy()

    llm, zero = logits(0)
    assert exact_window.can_continue(llm._ctx.ctx, 0, 60) and not exact_window.can_continue(llm._ctx.ctx, 0, 59)
    np.testing.assert_array_equal(zero, logits(None)[1])


@pytest.mark.parametrize("bad", ["-1", "4097", "x"])
def test_a_bad_margin_is_refused_by_the_tools_python_and_the_server(Llama, tiny128, short_text, bad):
    import subprocess
    import sys

    r = run_tool("llama-perplexity", "-m", str(tiny128), "-f", str(short_text), "-c", "256", *window(8),
                 "--kv-exact-window-margin", bad, check=False)
    assert r.returncode != 0 and "is not an exact window's margin" in r.stdout + r.stderr
    with pytest.raises(ValueError, match="exact window margin"):
        Llama(str(tiny128), cache_type_k="turboq3", cache_type_v="turboq3", kv_exact_window=8,
              kv_exact_window_margin=int(bad) if bad != "x" else bad, verbose=False)
    if bad == "-1":
        r = subprocess.run([sys.executable, "-m", "server", "--kv-exact-window", "8", "--kv-exact-window-margin", bad],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "--kv-exact-window-margin: exact window margin -1" in r.stderr


def test_the_server_keeps_a_margin_that_drafts_fit(build_info):
    """A margin below what a draft model may roll back would let rejected drafts cut into the
    window: refused, naming the flag to lower; and a margin needs a window."""
    import subprocess
    import sys

    def run(*flags):
        return subprocess.run([sys.executable, "-m", "server", *flags], capture_output=True, text=True, timeout=120)

    gemma = str(data.default_model())
    r = run("--kv-exact-window", "16", "--kv-exact-window-margin", "2", "--draft-model", gemma)
    assert r.returncode != 0 and "give --draft-max at most 2" in r.stderr
    r = run("--kv-exact-window", "0", "--kv-exact-window-margin", "2")
    assert r.returncode != 0 and "--kv-exact-window-margin needs a window (--kv-exact-window 0 keeps none)" in r.stderr


def test_a_state_saved_with_another_margin_is_refused(Llama, tiny128):
    """The ring's slots depend on the margin, so a state saved with another one is refused, naming
    the margin, and the context keeps what it held."""
    def make(margin):
        return Llama(str(tiny128), cache_type_k="turboq3", cache_type_v="turboq2", kv_exact_window=8, n_ctx=256,
                     kv_exact_window_margin=margin, flash_attn=True, verbose=False)

    a = make(None)
    a.eval(a.tokenize(b"The old man looked at the sea and said nothing for a long while."))
    state = a.save_state()
    b = make(0)
    b.eval(b.tokenize(b"Another text, another cache."))
    assert_state_refused(b, state, r"window is 8 positions and a margin of 16 over \d+ layers, this cache's 8 "
                                   r"and 0 over \d+ \(turboq.exact_window_margin\)")


def test_each_engine_gives_the_model_its_margin(tiny128, capfd):
    """--kv-exact-window-margin reaches llama-server as its argument (only when given: the model's
    own setting stands otherwise) and the python engine as the model's kv override."""
    from pyturbo.server import python_engine
    from pyturbo.server.llama_server import LaunchSpec

    spec = LaunchSpec("m.gguf", "turboq3", "turboq3", 0, 4096, 1, "127.0.0.1", 8080, "m", kv_exact_window=8)
    assert "--kv-exact-window-margin" not in spec.argv()
    spec.kv_exact_window_margin = 0
    argv = spec.argv()
    assert argv[argv.index("--kv-exact-window-margin") + 1] == "0"
    settings = python_engine.TurboModelSettings(model=str(tiny128), n_ctx=256, type_k=61, type_v=61, flash_attn=True,
                                                kv_exact_window=8, kv_exact_window_margin=0, verbose=True)
    llm = python_engine._load_model(settings)
    assert "read exact (F16 rows beside the cache, a margin of 0)" in capfd.readouterr().err
    del llm


def test_llama_bench_reads_the_window_and_margin_aliases(tiny128):
    """llama-bench has no --kv-exact-window; it reads the two aliases, checked like the arguments."""
    from pyturbo import exact_window

    args = ("-m", str(tiny128), "-fa", "1", "-p", "16", "-n", "2", "-r", "1", "-ctk", "turboq3", "-ctv", "turboq3",
            "-t", "2", "-o", "csv", "-v")
    r = run_tool("llama-bench", *args, env={exact_window.ENV: "8", exact_window.MARGIN_ENV: "0"})
    assert "the last 8 positions of each sequence read exact (F16 rows beside the cache, a margin of 0)" in r.stderr + r.stdout
    r = run_tool("llama-bench", *args, env={exact_window.ENV: "8", exact_window.MARGIN_ENV: "-3"}, check=False)
    assert r.returncode == 1 and "LLAMA_ARG_KV_EXACT_WINDOW_MARGIN: '-3' is not an exact window's margin" in r.stderr


# ---- auto (--kv-exact-window auto): the window and its margin sized by the context ----

def test_auto_sizes_the_window_by_the_cells_per_sequence(build_info):
    """libllama's rule (llama_turboq_exact_window_auto): min(48, cells / 96) rows per sequence, a
    third of them the margin (up to 16, at least 1 where cap > 1), the rest the window; none below 96 cells; a
    margin given replaces auto's, on top of the window as sized."""
    from pyturbo import exact_window

    assert [exact_window.auto_window(c) for c in (64, 95, 96, 192, 512, 1024, 4096, 4608, 1 << 20)] == \
        [(0, 0), (0, 0), (1, 0), (1, 1), (4, 1), (7, 3), (28, 14), (32, 16), (32, 16)]
    assert exact_window.auto_window(512, 0) == (4, 0) and exact_window.auto_window(8192, 16) == (32, 16)
    # a draft model's margin (python -m server gives --draft-max) must not change the window its target reads
    assert exact_window.auto_window(512, 16) == (4, 16) and exact_window.auto_window(64, 16) == (0, 0)
    # so its rows weigh at most 1/6 bit per value, where a window of 32 and the default margin weigh 1.5 at 512 positions
    for cells in (96, 100, 512, 2048, 8192, 65536):
        assert 16 * exact_window.rows_per_sequence(exact_window.AUTO, None, 0, cells) / cells <= 1 / 6
    assert 16 * exact_window.rows_per_sequence(32, None, 0) / 512 == 1.5
    with pytest.raises(ValueError, match="cells per sequence"):
        exact_window.rows_per_sequence(exact_window.AUTO)
    assert exact_window.check("auto") == exact_window.check(-1) == exact_window.AUTO


def test_auto_is_the_window_it_logs(Llama, tiny128, short_text):
    """--kv-exact-window auto at 512 positions keeps a window of 4 and a margin of 1, says so, and
    gives the bits of that window given by hand; at 256 positions per sequence (two sequences
    unified in 512 cells) a window of 1 and a margin of 1. The same through pyturbo.Llama."""
    auto = run_tool("llama-perplexity", "-m", str(tiny128), "-f", str(short_text), "-c", "512", "--chunks", "2",
                    "-ctk", "turboq3", "-ctv", "turboq2", "-fa", "on", "-ub", "7", "--kv-exact-window", "auto",
                    "-lv", "4")
    log = auto.stdout + auto.stderr
    assert "turboq.exact_window=auto: a window of 4 positions and a margin of 1 for 512 cells per sequence" in log
    assert "the last 4 positions of each sequence read exact (F16 rows beside the cache, a margin of 1)" in log
    by_hand = perplexity(tiny128, short_text, "turboq3", "turboq2", ctx=512, chunks=2,
                         extra=(*window(4), "--kv-exact-window-margin", "1", "-ub", "7"))
    none = perplexity(tiny128, short_text, "turboq3", "turboq2", ctx=512, chunks=2, extra=(*window(0), "-ub", "7"))
    got = perplexity(tiny128, short_text, "turboq3", "turboq2", ctx=512, chunks=2,
                     extra=("--kv-exact-window", "auto", "-ub", "7"))
    assert got.ppl == by_hand.ppl and got.ppl != none.ppl
    # unset, the window is auto's beside a turboq cache, and says so
    default = run_tool("llama-perplexity", "-m", str(tiny128), "-f", str(short_text), "-c", "512", "--chunks", "2",
                       "-ctk", "turboq3", "-ctv", "turboq2", "-fa", "on", "-ub", "7", "-lv", "4")
    assert "turboq.exact_window=auto (unset: the default beside a turboq cache; --kv-exact-window 0 keeps none): " \
           "a window of 4 positions and a margin of 1 for 512 cells per sequence" in default.stdout + default.stderr
    assert perplexity(tiny128, short_text, "turboq3", "turboq2", ctx=512, chunks=2, extra=("-ub", "7")).ppl == got.ppl
    two = run_tool("llama-perplexity", "-m", str(tiny128), "-f", str(short_text), "-c", "256", "-b", "512",
                   "--kv-unified", "--chunks", "2", "-ctk", "turboq3", "-ctv", "turboq3", "-fa", "on",
                   "--kv-exact-window", "auto", "-lv", "4")
    assert "a window of 1 positions and a margin of 1 for 256 cells per sequence" in two.stdout + two.stderr
    # Gemma's sliding-window cache (1024 cells at 2048 positions) takes its sibling's window: sized by
    # its own cells it read 7 positions where the global layers read 14 (and doubled the KLD at 8192)
    gemma = run_tool("llama-perplexity", "-m", str(data.default_model()), "-f", str(short_text), "-c", "2048",
                     "--chunks", "1", "-ctk", "turboq3", "-ctv", "turboq3", "-fa", "on", "--kv-exact-window", "auto",
                     "-lv", "4")
    log = gemma.stdout + gemma.stderr
    assert "creating     SWA KV cache, size = 1024 cells" in log
    assert log.count("a window of 14 positions and a margin of 7 for 2048 cells per sequence") == 2, log
    llm = Llama(str(tiny128), n_ctx=512, cache_type_k="turboq3", cache_type_v="turboq3", kv_exact_window="auto",
                verbose=False)
    assert llm.kv_exact_window == -1
    from pyturbo import exact_window
    assert exact_window.context_window(llm._ctx.ctx) == 4
    del llm


def test_auto_reaches_every_engine_and_counts_its_bytes(tiny128, capfd):
    """python -m server's --kv-exact-window auto reaches llama-server as "auto" and the python
    engine as the key's -1; pyturbo.memory counts auto's rows by the context's cells per sequence, on
    Gemma's sliding-window layers too; with a draft model auto keeps a margin the drafts fit in."""
    from pyturbo import exact_window
    from pyturbo.memory import kv_bytes
    from pyturbo.server import cli, python_engine
    from pyturbo.server.llama_server import LaunchSpec

    spec = LaunchSpec("m.gguf", "turboq3", "turboq3", 0, 4096, 1, "127.0.0.1", 8080, "m", kv_exact_window=exact_window.AUTO)
    argv = spec.argv()
    assert argv[argv.index("--kv-exact-window") + 1] == "auto"
    args = cli.parser().parse_args(["--kv-exact-window", "auto", "--model", str(tiny128), "--draft-model", str(tiny128)])
    cli._check(args)
    assert args.kv_exact_window == exact_window.AUTO and args.kv_exact_window_margin == 16
    with pytest.raises(ValueError, match="--kv-exact-window: exact window 'autox'"):
        cli._check(cli.parser().parse_args(["--kv-exact-window", "autox"]))
    settings = python_engine.TurboModelSettings(model=str(tiny128), n_ctx=1024, type_k=61, type_v=61, flash_attn=True,
                                                kv_exact_window=exact_window.AUTO, verbose=True)
    llm = python_engine._load_model(settings)
    assert "a window of 7 positions and a margin of 3 for 1024 cells per sequence" in capfd.readouterr().err
    del llm
    gemma = data.default_model()
    extra = kv_bytes(gemma, 8192, "turboq3", "turboq3", exact_window=exact_window.AUTO, exact_sink=0) - \
        kv_bytes(gemma, 8192, "turboq3", "turboq3")
    # 18 layers of 48 rows and the spare slot: the 15 sliding-window layers' 1024 cells take the context's window too
    row = 1 * (256 + 256) * 2  # a position's F16 K and V: 1 KV head of 256
    assert extra == 18 * (48 + 1) * row
    # 4 sequences of 2048 positions, in one unified cache or a stream each: 21 rows per sequence
    for n_stream in (1, 4):
        extra = kv_bytes(gemma, 8192, "turboq3", "turboq3", n_seq=4, n_stream=n_stream, exact_window=exact_window.AUTO,
                         exact_sink=0) - kv_bytes(gemma, 8192, "turboq3", "turboq3", n_seq=4, n_stream=n_stream)
        assert extra == 18 * (4 * 21 + 1) * row, n_stream
    # the bench's bits per layer weigh each layer's rows against its own cells
    from pyturbo.bench.cpu import config_bpw, parse_config
    env = parse_config("turboq3:winauto:sink0")[3]
    assert config_bpw(2, "turboq3", "turboq3", env, 8192, 256, 256, cells=[8192, 1024]) == \
        pytest.approx(3.125 + (16 * 48 / 8192 + 16 * 48 / 1024) / 2)


def test_the_window_is_auto_by_default_beside_a_turboq_cache(Llama, tiny128, short_text, capfd):
    """Unset, the window is auto's wherever the default sink row is kept (beside a turboq K or V),
    none beside other caches or beside the debug tail; every engine and byte count says the same,
    and a draft model gives it a margin of the longest draft, at least 16 (llama-server's
    --spec-draft-n-max, python -m server's --draft-max)."""
    from pyturbo import exact_window
    from pyturbo.bench.cpu import config_bpw, parse_config
    from pyturbo.memory import kv_bytes
    from pyturbo.server import cli
    from pyturbo.server.llama_server import LaunchSpec

    def logged(type_k, type_v, *extra, env=None):
        r = run_tool("llama-perplexity", "-m", str(tiny128), "-f", str(short_text), "-c", "512", "--chunks", "1",
                     "-ctk", type_k, "-ctv", type_v, "-fa", "on", "-lv", "4", *extra, env=env)
        return r.stdout + r.stderr

    assert "the last 4 positions of each sequence read exact" in logged("q8_0", "turboq3")
    for log in (logged("q8_0", "q8_0"), logged("turboq3", "turboq3", *window(0)),
                logged("turboq3", "turboq3", env={"TURBOQ_EXACT_TAIL": "8"})):
        assert "exact window:" not in log and "exact_window=auto" not in log, log[-2000:]
    assert exact_window.window_default("turboq3", "q8_0") == exact_window.AUTO
    assert exact_window.window_default("q8_0", "q4_0") == 0
    llm = Llama(str(tiny128), n_ctx=512, cache_type_k="turboq3", cache_type_v="turboq3", verbose=False)
    assert llm.kv_exact_window is None and exact_window.context_window(llm._ctx.ctx) == 4
    del llm
    gemma = data.default_model()
    assert kv_bytes(gemma, 8192, "turboq3", "turboq3", exact_window=None) == \
        kv_bytes(gemma, 8192, "turboq3", "turboq3", exact_window=exact_window.AUTO)
    assert kv_bytes(gemma, 8192, "q8_0", "q8_0", exact_window=None) == kv_bytes(gemma, 8192, "q8_0", "q8_0")
    assert config_bpw(18, "turboq3", "turboq3", parse_config("turboq3")[3], 8192) == \
        config_bpw(18, "turboq3", "turboq3", parse_config("turboq3:winauto")[3], 8192) > \
        config_bpw(18, "turboq3", "turboq3", parse_config("turboq3:win0")[3], 8192)
    # python -m server passes the window only when given (0 too), and keeps a margin that drafts fit
    spec = LaunchSpec("m.gguf", "turboq3", "turboq3", 0, 4096, 1, "127.0.0.1", 8080, "m")
    assert "--kv-exact-window" not in spec.argv()
    spec.kv_exact_window = 0
    assert spec.argv()[spec.argv().index("--kv-exact-window") + 1] == "0"
    for draft_max, margin in (("5", 16), ("24", 24)):
        args = cli.parser().parse_args(["--model", str(tiny128), "--draft-model", str(tiny128), "--draft-max", draft_max])
        cli._check(args)
        assert args.kv_exact_window is None and args.kv_exact_window_margin == margin
    # llama-server with a draft model: common gives the window a margin of --spec-draft-n-max (at least 16)
    port = free_port()
    proc = start([str(binary("llama-server")), "-m", str(tiny128), "-md", str(tiny128), "-c", "1024",
                  "-ctk", "turboq3", "-ctv", "turboq3", "-fa", "on", "--spec-draft-n-max", "20", "-np", "1",
                  "--port", str(port), "-lv", "4"])
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
    finally:
        log = stop(proc)
    assert "a window of 7 positions and a margin of 20 for 1024 cells per sequence" in log, log[-3000:]


# ---- sink rows (--kv-exact-sink S): each sequence's first S positions read exact by every query ----

def sink(s: int) -> tuple[str, ...]:
    return ("--kv-exact-sink", str(s))


@pytest.mark.parametrize("type_k,type_v,ubatch", [("q4_0", "q4_0", "7"), ("turboq3", "turboq2", "64")])
def test_sink_rows_cross_ubatches(tiny128, short_text, type_k, type_v, ubatch):
    """Sink rows alone (no window) and beside a window: a chunk in ubatches of 7 or 64 reads its
    first positions from the sink slots and gives the perplexity of one ubatch per chunk (where
    they come from the ubatch itself) to 6 digits, and not that of the cache without them. A sink
    row lost after its ubatch, or read from a slot that another position overwrote, moves it
    (by more than 1e-4 below). Tolerance 2e-5: a float decode step (ubatches of 7 tokens on a q4_0
    cache) sums its scores in another order than the prefill's GEMM (measured 5e-6 with patch 40's
    16-row sums on turboq3/turboq2). The small split runs q4_0 for the reason SPLITS gives."""
    for extra in (sink(4), (*window(16), *sink(4))):
        one = perplexity(tiny128, short_text, type_k, type_v, ctx=256, chunks=3, extra=extra)
        split = perplexity(tiny128, short_text, type_k, type_v, ctx=256, chunks=3, extra=(*extra, "-ub", ubatch))
        assert split.ppl == pytest.approx(one.ppl, rel=2e-5), extra
    plain = perplexity(tiny128, short_text, type_k, type_v, ctx=256, chunks=3, extra=(*window(0), *sink(0), "-ub", ubatch))
    alone = perplexity(tiny128, short_text, type_k, type_v, ctx=256, chunks=3, extra=sink(4))
    assert abs(plain.ppl - alone.ppl) > 1e-4 * alone.ppl, (plain.ppl, alone.ppl)


def test_sink_rows_over_the_whole_chunk_in_small_ubatches_are_the_f16_cache(tiny128, short_text, tmp_path):
    """S = ctx in ubatches of 64, K as it comes: every row any query reads is a sink row, from the
    sink slots or its ubatch, so the tiny llama's logits are the f16 cache's."""
    base = tmp_path / "f16.kld"
    ref = perplexity(tiny128, short_text, "f16", "f16", ctx=256, chunks=3, kld_base=base, write_base=True)
    got = perplexity(tiny128, short_text, "turboq3", "turboq2", ctx=256, chunks=3, kld_base=base,
                     env={"LLAMA_ARG_KV_K_CENTER": "off"}, extra=(*sink(256), "-ub", "64"))
    assert got.ppl == pytest.approx(ref.ppl, rel=1e-5)
    assert got.kld is not None and abs(got.kld) < 1e-6 and got.same_top == 100.0


def test_sink_rows_keep_decode_state_and_sequences_right(Llama, tiny128, short_text):
    """pyturbo.Llama's kv_exact_sink: token by token after a prompt, the logits are those of the
    prompt and the tokens in one pass (sinks read from their slots); a saved state restores into a
    context with the same sinks and continues with the same bits, and is refused, naming the
    setting, by one with other sinks, none, or a window beside them; removing a sink position means
    the cache cannot continue as if fresh."""
    import ctypes

    import numpy as np

    from pyturbo._paths import library

    can_continue = library("llama").llama_turboq_window_can_continue
    can_continue.restype = ctypes.c_bool
    can_continue.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]

    def make(s, types=("turboq3", "turboq2"), **kw):
        kw.setdefault("kv_exact_window", 0)  # sink rows alone (a turboq cache keeps a window by default)
        return Llama(str(tiny128), cache_type_k=types[0], cache_type_v=types[1], n_ctx=256, n_batch=256,
                     flash_attn=True, verbose=False, logits_all=True, **({"kv_exact_sink": s} if s is not None else {}),
                     **kw)

    # steps against one pass at float precision: a q4_0 cache, whose decode steps stay on the
    # float path (SPLITS says why); the rest on turboq3/turboq2
    toks = make(None).tokenize(short_text.read_text()[:2000].encode())[:48]
    one = make(2, ("q4_0", "q4_0"))
    one.eval(toks)
    want = one.scores[47].copy()
    steps = make(2, ("q4_0", "q4_0"))
    steps.eval(toks[:20])
    for t in toks[20:]:
        steps.eval([t])
    np.testing.assert_allclose(steps.scores[47], want, rtol=0, atol=1e-4)  # other batch shapes, other sums
    plain = make(0, ("q4_0", "q4_0"))
    plain.eval(toks)
    assert float(np.abs(plain.scores[47] - want).max()) > 1e-3  # the sinks are read exact

    a = make(2)
    a.eval(toks[:40])
    state = a.save_state()
    a.eval(toks[40:])
    b = make(2)
    b.eval(b.tokenize(b"Another text, another cache."))
    b.load_state(state)
    b.eval(toks[40:])
    np.testing.assert_array_equal(b.scores[47], a.scores[47])
    assert_state_refused(make(4), state, r"the state keeps 2 sink rows per sequence, this cache 4 \(turboq.exact_sink\)")
    assert_state_refused(make(0), state, r"saved with exact sink rows \(turboq.exact_sink\)")
    # a window beside the same sinks: the refusal names the window, not its margin
    assert_state_refused(make(2, kv_exact_window=8), state,
                         r"the state's window is 0 positions .* this cache's 8 and 16 over \d+ \(turboq.exact_window\)")

    assert can_continue(a._ctx.ctx, 0, 48)
    a._ctx.kv_cache_seq_rm(0, 1, 2)
    assert not can_continue(a._ctx.ctx, 0, 48)


@pytest.mark.parametrize("bad", ["-2", "4097", "x"])
def test_bad_sink_rows_are_refused_by_the_tools_python_and_the_server(Llama, tiny128, short_text, bad):
    import subprocess
    import sys

    r = run_tool("llama-perplexity", "-m", str(tiny128), "-f", str(short_text), "-c", "256", "--kv-exact-sink", bad,
                 check=False)
    assert r.returncode != 0 and "is not a count of exact sink rows" in r.stdout + r.stderr
    with pytest.raises(ValueError, match="exact sink rows"):
        Llama(str(tiny128), cache_type_k="turboq3", cache_type_v="turboq3", kv_exact_sink=int(bad) if bad != "x" else bad,
              verbose=False)
    if bad != "x":
        r = subprocess.run([sys.executable, "-m", "server", "--kv-exact-sink", bad], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode != 0 and "--kv-exact-sink: exact sink rows" in r.stderr


def test_sink_rows_reach_every_engine_and_count_their_bytes(tiny128, capfd):
    """--kv-exact-sink reaches llama-server as its argument (also 0, which beats the GGUF's; not at
    all when unset, so that libllama's auto stands) and the python engine as the model's kv
    override; llama-bench reads its alias; the rows count S per sequence in pyturbo.memory and the
    benches' bits per value, and auto's one beside a turboq cache (none beside q8_0) when asked."""
    from pyturbo import exact_window
    from pyturbo.bench.cpu import config_bpw, parse_config
    from pyturbo.memory import kv_bytes
    from pyturbo.server import python_engine
    from pyturbo.server.llama_server import LaunchSpec

    assert "--kv-exact-sink" not in LaunchSpec("m.gguf", "turboq3", "turboq3", 0, 4096, 1, "127.0.0.1", 8080, "m").argv()
    argv = LaunchSpec("m.gguf", "turboq3", "turboq3", 0, 4096, 1, "127.0.0.1", 8080, "m", kv_exact_sink=0).argv()
    assert argv[argv.index("--kv-exact-sink") + 1] == "0"
    argv = LaunchSpec("m.gguf", "turboq3", "turboq3", 0, 4096, 1, "127.0.0.1", 8080, "m", kv_exact_sink=4).argv()
    assert argv[argv.index("--kv-exact-sink") + 1] == "4"
    settings = python_engine.TurboModelSettings(model=str(tiny128), n_ctx=256, type_k=61, type_v=61, flash_attn=True,
                                                kv_exact_sink=4, verbose=True)
    llm = python_engine._load_model(settings)
    assert "sink rows: the first 4 positions of each sequence read exact" in capfd.readouterr().err
    del llm

    args = ("-m", str(tiny128), "-fa", "1", "-p", "16", "-n", "2", "-r", "1", "-ctk", "turboq3", "-ctv", "turboq3",
            "-t", "2", "-o", "csv", "-v")
    r = run_tool("llama-bench", *args, env={exact_window.SINK_ENV: "4"})
    assert "sink rows: the first 4 positions of each sequence read exact" in r.stderr + r.stdout
    r = run_tool("llama-bench", *args, env={exact_window.SINK_ENV: "-3"}, check=False)
    assert r.returncode == 1 and "LLAMA_ARG_KV_EXACT_SINK: '-3' is not a count of exact sink rows" in r.stderr

    assert exact_window.rows_per_sequence(0, None, 4) == 4 and exact_window.rows_per_sequence(16, 0, 4) == 20
    assert exact_window.rows_per_sequence(16, None, 1) == 33
    env = parse_config("turboq3:sink1")[3]
    assert env == {exact_window.SINK_ENV: "1"}
    assert config_bpw(18, "turboq3", "turboq3", {**env, exact_window.ENV: "0"}, 512) == pytest.approx(3.125 + 16 * 1 / 512)
    # auto's row, beside the default window (auto's 4 and a margin of 1 at 512 cells)
    assert config_bpw(18, "turboq3", "turboq3", {}, 512) == pytest.approx(3.125 + 16 * (1 + 4 + 1) / 512)
    assert config_bpw(18, "turboq3", "turboq3", parse_config("turboq3:sink0:win0")[3], 512) == pytest.approx(3.125)
    assert config_bpw(18, "q8_0", "q8_0", {}, 512) == pytest.approx(8.5)
    gemma = data.default_model()
    extra = kv_bytes(gemma, 4096, "turboq3", "turboq3", n_seq=2, exact_sink=4) - kv_bytes(gemma, 4096, "turboq3", "turboq3", n_seq=2)
    assert extra == 18 * (2 * 4 + 1) * (256 + 256) * 2  # 18 layers, 2 sequences of 4 rows and the spare, F16 K and V
    auto = kv_bytes(gemma, 4096, "turboq3", "turboq3", n_seq=2, exact_sink="auto") - kv_bytes(gemma, 4096, "turboq3", "turboq3", n_seq=2)
    assert auto == 18 * (2 * 1 + 1) * (256 + 256) * 2
    assert kv_bytes(gemma, 4096, "q8_0", "q8_0", exact_sink="auto") == kv_bytes(gemma, 4096, "q8_0", "q8_0")
