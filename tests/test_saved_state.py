"""Saved state with turboq caches: restored exactly, or refused with a reason; never misread.

- llama-cpp-python (pyturbo.Llama.save_state / load_state);
- llama-server slot files (`--slot-save-path`, POST /slots/0?action=save|restore|erase).
"""
from __future__ import annotations

import copy
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyturbo import data
from helpers import assert_state_refused, continuation, free_port, post, server_cmd, start, stop, wait_healthy

PROMPT = "The old man looked at the sea and said"


@pytest.fixture(scope="module")
def tiny(build_info):
    return str(data.tiny_model())


def make(Llama, path, k, v, la=None, window=None, sink=None):
    # logits_all: llama-cpp-python keeps no logits in `scores` otherwise, and the continuations
    # below would compare rows of zeros
    return Llama(path, cache_type_k=k, cache_type_v=v, layer_adaptive=la, kv_exact_window=window, kv_exact_sink=sink,
                 n_ctx=256, n_batch=256, flash_attn=True, verbose=False, seed=1, logits_all=True)


@pytest.mark.slow
@pytest.mark.parametrize("k,v", [("turboq2", "turboq2"), ("turboq8", "turboq8"), ("q8_0", "turboq4"),
                                 ("turboq4", "turboq3"), ("turboq3", "f16")])
def test_python_state_restores_bit_identically(Llama, k, v):
    llm = make(Llama, str(data.default_model()), k, v)
    llm.eval(llm.tokenize(PROMPT.encode()))
    state = llm.save_state()
    first = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    tokens, logits = continuation(llm, first)
    llm.load_state(state)
    assert bytes(llm.save_state().llama_state) == bytes(state.llama_state)
    again, logits2 = continuation(llm, first)
    assert again == tokens
    for a, b in zip(logits, logits2):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_python_state_with_an_exact_window_restores_bit_identically(Llama):
    """The exact window's rows travel with the state: a fresh context whose window held other
    rows continues as the saved one did, bit for bit, although the window changes the logits
    (compared with the same cache without it); a state without the window, or with another one,
    is refused with the reason."""
    from pyturbo.llama import StateError
    gemma = str(data.default_model())
    text = PROMPT + " that the fish would come back when the wind turned"
    a = make(Llama, gemma, "turboq3", "turboq3", window=8)
    a.eval(a.tokenize(text.encode()))
    state = a.save_state()
    first = int(np.argmax(a.scores[a.n_tokens - 1]))
    tokens, logits = continuation(a, first)
    b = make(Llama, gemma, "turboq3", "turboq3", window=8)
    b.eval(b.tokenize(b"Another text, another cache, with other rows in its window than the first had."))
    b.load_state(state)
    again, logits2 = continuation(b, first)
    assert again == tokens
    for x, y in zip(logits, logits2):
        np.testing.assert_array_equal(x, y)
    plain = make(Llama, gemma, "turboq3", "turboq3", window=0, sink=0)  # no exact rows (by default a sink row and a window)
    plain.eval(plain.tokenize(text.encode()))
    _, logits3 = continuation(plain, first)
    assert max(float(np.abs(x - y).max()) for x, y in zip(logits, logits3)) > 0.1
    with pytest.raises(StateError, match="the state was saved without an exact window"):
        b.load_state(plain.save_state())
    with pytest.raises(StateError, match="the state's window is 8 positions"):
        make(Llama, gemma, "turboq3", "turboq3", window=16).load_state(state)


@pytest.mark.parametrize("model", ["tiny", pytest.param("gemma", marks=pytest.mark.slow)])
def test_python_state_with_an_exact_window_into_a_context_without_one_is_refused(Llama, tiny, tmp_path, model):
    """The window's rows follow the cache's own state, so a context without a window used to stop
    short of them: a bare size mismatch (one cache) or "n_stream mismatch" (Gemma's pair of
    caches). It names the window now, in memory and from a state file (llama_state_load_file,
    llama-cli's prompt cache), and nothing is lost."""
    import ctypes
    import llama_cpp
    from pyturbo.llama import captured_log
    path = tiny if model == "tiny" else str(data.default_model())
    # without the default sink row, whose refusal names both settings (test_exact_window.py)
    a = make(Llama, path, "turboq3", "turboq3", window=8, sink=0)
    a.eval(a.tokenize(PROMPT.encode()))
    state = a.save_state()
    b = make(Llama, path, "turboq3", "turboq3", window=0, sink=0)  # no exact rows at all (by default a window)
    b.eval(b.tokenize(b"Another text, another cache."))
    assert_state_refused(b, state, r"saved with an exact window of 8 positions \(turboq.exact_window=8\), "
                                   r"and this context has none")
    file = str(tmp_path / "state.bin").encode()
    tokens = (llama_cpp.llama_token * a.n_tokens)(*a.input_ids[: a.n_tokens].tolist())
    assert llama_cpp.llama_state_save_file(a._ctx.ctx, file, tokens, a.n_tokens)
    out, n_out = (llama_cpp.llama_token * 256)(), ctypes.c_size_t(0)
    with captured_log(False) as log:
        assert not llama_cpp.llama_state_load_file(b._ctx.ctx, file, out, 256, ctypes.byref(n_out))
    assert "saved with an exact window of 8 positions" in "".join(msg for _, msg in log)


@pytest.mark.parametrize("k,v,la,reason", [
    ("q8_0", "q8_0", None, "mismatched key type (q8_0 in this context, turboq3 in the saved state"),
    ("turboq4", "turboq3", None, "mismatched key type (turboq4 in this context, turboq3 in the saved state"),
    ("turboq3", "turboq3", 1, "mismatched key type (q8_0 in this context, turboq3 in the saved state"),
    ("turboq3", "turboq4", None, "mismatched value type (turboq4 in this context, turboq3 in the saved state"),
])
def test_python_state_of_another_cache_type_is_refused_and_nothing_is_lost(Llama, tiny, k, v, la, reason):
    a = make(Llama, tiny, "turboq3", "turboq3")
    a.eval(a.tokenize(PROMPT.encode()))
    state = a.save_state()
    b = make(Llama, tiny, k, v, la)
    b.eval(b.tokenize(b"Another text, another cache."))
    assert_state_refused(b, state, re.escape(reason))


def test_python_truncated_state_is_refused(Llama, tiny):
    from pyturbo.llama import StateError
    a = make(Llama, tiny, "turboq3", "turboq3")
    a.eval(a.tokenize(PROMPT.encode()))
    state = a.save_state()
    b = make(Llama, tiny, "turboq3", "turboq3")
    for cut in (0, 4, 64, len(state.llama_state) // 2, len(state.llama_state) - 1):
        bad = copy.copy(state)
        bad.llama_state = state.llama_state[:cut]
        bad.llama_state_size = cut
        with pytest.raises(StateError):
            b.load_state(bad)
    b.load_state(state)  # and the real one still loads
    assert bytes(b.save_state().llama_state) == bytes(state.llama_state)


@pytest.fixture(scope="module")
def tiny_state(Llama, tiny):
    a = make(Llama, tiny, "turboq3", "turboq3")
    a.eval(a.tokenize(PROMPT.encode()))
    b = make(Llama, tiny, "turboq3", "turboq3")
    b.eval(b.tokenize(b"Something else."))
    return a.save_state(), b


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4))
def test_python_corrupted_state_is_refused_and_nothing_is_lost(tiny_state, flips):
    """Flipped bytes anywhere in a saved state: refused (the SHA-256 pyturbo's save_state adds),
    and the context keeps what it held. llama.cpp alone loads some of these: a flipped output
    count (byte 0) restores, and the next decode returns non-finite logits."""
    from pyturbo.llama import StateError
    state, b = tiny_state
    raw = bytearray(state.llama_state)
    for pos, xor in {pos % len(raw): xor for pos, xor in flips}.items():  # one flip per byte: none cancels
        raw[pos] ^= xor
    bad = copy.copy(state)
    bad.llama_state = bytes(raw)
    before = bytes(b.save_state().llama_state)
    with pytest.raises(StateError, match="corrupt"):
        b.load_state(bad)
    assert bytes(b.save_state().llama_state) == before


# ---- llama-server slot files ----

def complete(url: str, prompt: str, n: int = 8, probs: bool = False, **fields) -> str | tuple[str, list]:
    """The greedy text (and, with probs, the top-3 probabilities of every token: floats that
    differ when the logits differ in any bit that matters after softmax)."""
    status, body = post(url + "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0, "id_slot": 0,
                                                  **({"n_probs": 3} if probs else {}), **fields})
    assert status == 200, body
    c = body["choices"][0]
    return (c["text"], c["logprobs"]) if probs else c["text"]


class SlotServer:
    def __init__(self, k: str, v: str, slots, la: int = 0, model: str | None = None, *extra: str,
                 window: int = 0, sink: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = start(server_cmd("llama-server", self.port, "-ctk", k, "-ctv", v, "--layer-adaptive", str(la),
                                     *(["--model", model] if model else []), "--kv-exact-window", str(window),
                                     *(["--kv-exact-sink", str(sink)] if sink is not None else []),
                                     "--n-ctx", "512", "--parallel", "1", "--", "--slot-save-path", str(slots), *extra))
        try:
            wait_healthy(self.url, self.proc)
        except BaseException:
            stop(self.proc)
            raise

    def slot(self, action: str, filename: str | None = None) -> tuple[int, dict]:
        return post(f"{self.url}/slots/0?action={action}", {"filename": filename} if filename else {})

    def close(self) -> str:
        return stop(self.proc)


@pytest.mark.parametrize("k,v,la,gemma", [pytest.param(*c, marks=[pytest.mark.slow] if c[-1] else []) for c in [
    ("turboq3", "turboq3", 0, False), ("turboq8", "turboq2", 0, False), ("turboq4", "turboq4", 0, False),
    ("q8_0", "turboq4", 0, False), ("f16", "f16", 0, True), ("turboq3", "turboq4", 3, True), ("turboq3", "turboq3", 0, True)]])
def test_slot_restore_continues_bit_identically(tiny, tmp_path, k, v, la, gemma):
    """Save, erase, restore, continue: the same text and top-token probabilities as without the
    restore. Gemma (sliding-window layers) runs with --swa-full: without it llama-server keeps no
    SWA state in slot files and re-processes the whole prompt after a restore, in batches of
    another shape, and then not even f16 continues bit for bit (measured: same text, other
    probabilities)."""
    srv = SlotServer(k, v, tmp_path, la, None if gemma else tiny, *(["--swa-full"] if gemma else []))
    try:
        first = complete(srv.url, PROMPT)
        assert srv.slot("save", "s.bin")[0] == 200
        follow = PROMPT + first + " Then"
        uninterrupted = complete(srv.url, follow, 12, probs=True)
        assert srv.slot("erase")[0] == 200
        status, body = srv.slot("restore", "s.bin")
        assert status == 200 and body["n_restored"] > 0, body
        assert complete(srv.url, follow, 12, probs=True) == uninterrupted
    finally:
        srv.close()


@pytest.mark.slow
def test_slot_files_are_refused_when_they_do_not_fit(build_info, tmp_path):
    """Path traversal, truncation (patch 8), flipped bytes (patch 9's CRC-32) and another cache
    type or layer mode: 400, and the server goes on serving."""
    a = SlotServer("turboq3", "turboq3", tmp_path)
    try:
        counting = complete(a.url, "1, 2, 3, 4, 5,", 3, cache_prompt=False)  # a whole prompt, each time alike
        complete(a.url, PROMPT)
        assert a.slot("save", "s.bin")[0] == 200
        for name in ("../x.bin", "/tmp/x.bin", "a/../../x.bin", "..", ""):
            status, body = a.slot("save", name)
            assert status == 400 and body["error"]["message"], (name, body)
            status, body = a.slot("restore", name)
            assert status == 400, (name, body)
        raw = (tmp_path / "s.bin").read_bytes()
        for cut in (0, 10, len(raw) // 2, len(raw) - 1):
            (tmp_path / f"cut{cut}.bin").write_bytes(raw[:cut])
            status, body = a.slot("restore", f"cut{cut}.bin")
            assert status == 400 and "slot" in body["error"]["message"].lower(), (cut, body)
        for pos in (13, 40, len(raw) // 2, len(raw) - 20):  # a count, a layer header, K/V data, the tail
            flipped = bytearray(raw)
            flipped[pos] ^= 0x10
            (tmp_path / f"flip{pos}.bin").write_bytes(bytes(flipped))
            status, body = a.slot("restore", f"flip{pos}.bin")
            assert status == 400, (pos, body)
        # still serving, and nothing was lost: the same answer as before the refused restores
        assert complete(a.url, "1, 2, 3, 4, 5,", 3, cache_prompt=False) == counting
    finally:
        log = a.close()
    assert log.count("is corrupt: its CRC-32 is") == 4, log[-3000:]
    for k, v, la in (("q8_0", "q8_0", 0), ("turboq4", "turboq3", 0), ("turboq3", "turboq3", 3)):
        b = SlotServer(k, v, tmp_path, la)
        try:
            status, body = b.slot("restore", "s.bin")
            assert status == 400, (k, v, la, body)
            assert complete(b.url, "1, 2, 3, 4, 5,", 3).strip().startswith("6")
        finally:
            log = b.close()
        assert "mismatched key type" in log or "mismatched value type" in log, log[-2000:]


def test_slot_file_with_an_exact_window_into_a_server_without_one_is_refused(tiny, tmp_path):
    """A slot saved by a server with --kv-exact-window, restored by one without: 400, the log
    names the window (it said the file was truncated or corrupt), and the server goes on."""
    a = SlotServer("turboq3", "turboq3", tmp_path, 0, tiny, window=8, sink=0)  # the window alone
    try:
        complete(a.url, PROMPT)
        assert a.slot("save", "w.bin")[0] == 200
    finally:
        a.close()
    b = SlotServer("turboq3", "turboq3", tmp_path, 0, tiny, sink=0)  # no exact rows at all
    try:
        counting = complete(b.url, "1, 2, 3, 4, 5,", 3, cache_prompt=False)
        status, body = b.slot("restore", "w.bin")
        assert status == 400, body
        assert complete(b.url, "1, 2, 3, 4, 5,", 3, cache_prompt=False) == counting
    finally:
        log = b.close()
    assert "saved with an exact window of 8 positions" in log, log[-2000:]


_SEEDED = r"""
import pickle, sys
from pyturbo import data
from pyturbo.llama import Llama, StateError
k, v = sys.argv[3], sys.argv[4]
llm = Llama(str(data.tiny_model()), cache_type_k=k, cache_type_v=v, n_ctx=256, n_batch=256, flash_attn=True,
            verbose=False, seed=1)
llm.eval(llm.tokenize(b"The old man looked at the sea"))
own = llm.save_state()
llm.eval([1, 2, 3])
llm.load_state(own)
print("own state", "RESTORED" if bytes(llm.save_state().llama_state) == bytes(own.llama_state) else "DIFFERS")
with open(sys.argv[1], "rb") as f:
    shipped = pickle.load(f)
try:
    llm.load_state(shipped)
    print("shipped state DONE")
except StateError as e:
    print("shipped state REFUSED", str(e).replace("\n", " | "))
with open(sys.argv[2], "wb") as f:
    pickle.dump(own, f)
"""


@pytest.mark.seeded
@pytest.mark.parametrize("k,v", [("turboq3", "turboq3"), ("f16", "turboq3")])
def test_a_seeded_builds_state_stays_its_own(Llama, tiny, tmp_path, seeded_build, k, v):
    """A build with other rotation signs (cmake -DPYTURBO_SIGN_SEED, a debug option) marks its
    states where each turboq layer's type goes, so a state is refused across signs, both ways,
    also for a turboq V without K centering (no K record to carry it), while each build restores
    its own state bit-identically (llama-server's prompt cache and checkpoints do that). The
    shipped build writes no mark: its format is unchanged."""
    from pyturbo.llama import StateError
    bin_dir, seed = seeded_build
    llm = make(Llama, tiny, k, v)
    llm.eval(llm.tokenize(PROMPT.encode()))
    mine = llm.save_state()
    (tmp_path / "shipped.pkl").write_bytes(pickle.dumps(mine))
    env = {**os.environ, "PYTURBO_BUILD_DIR": str(bin_dir.parent)}
    env.pop("LLAMA_CPP_LIB_PATH", None)
    r = subprocess.run([sys.executable, "-c", _SEEDED, str(tmp_path / "shipped.pkl"), str(tmp_path / "seeded.pkl"), k, v],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "own state RESTORED", r.stdout
    assert lines[1].startswith("shipped state REFUSED") and "written with the shipped rotation signs, and this " \
        f"build has rotation signs from PYTURBO_SIGN_SEED={seed}" in lines[1], lines[1]
    seeded = pickle.loads((tmp_path / "seeded.pkl").read_bytes())
    mark = b"TTQS" + int(seed).to_bytes(8, "little")  # where each turboq layer's type goes (tiny: 2 layers)
    assert bytes(seeded.llama_state).count(mark) == 2 * ((k != "f16") + 1) and b"TTQS" not in bytes(mine.llama_state)
    before = bytes(llm.save_state().llama_state)
    with pytest.raises(StateError, match=f"written with rotation signs from PYTURBO_SIGN_SEED={seed}, and this build "
                                         "has the shipped rotation signs"):
        llm.load_state(seeded)
    assert bytes(llm.save_state().llama_state) == before
