"""K centering and saved state: a turboq K cache stores k - mu (llama-turboq-center.h), mu being the
model's calibrated K mean, so a saved sequence carries mu and is restored only into a cache with
the same mean: bit for bit, into an empty cache or beside other sequences. A state without the
mean, with a corrupt one, with another one, or from the build whose mean came from the first
request, is refused with a message; it is never read as if it were centered on this cache's mean.

Runs on the low-level API with two sequences in one unified cache (tiny head_dim-128 model, Gemma).
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from helpers import K_RECORD, k_records
from pyturbo import data

N_CTX = 256


@pytest.fixture(scope="module")
def lc(build_info):
    from pyturbo.llama import llama_cpp  # points llama_cpp at the patched library first
    llama_cpp.llama_backend_init()
    return llama_cpp


def load(lc, path, k_scale: str | None = None):
    """The model, with the channel scale's setting (turboq.k_scale) as a string kv override when given."""
    import ctypes as C
    mp = lc.llama_model_default_params()
    if k_scale is not None:
        from pyturbo.k_centering import scale_key
        arr = (lc.llama_model_kv_override * 2)()
        arr[0].key = scale_key().encode()
        arr[0].tag = lc.LLAMA_KV_OVERRIDE_TYPE_STR
        C.memmove(C.addressof(arr[0].value) + lc.llama_model_kv_override_value.val_str.offset, k_scale.encode().ljust(128, b"\0"), 128)
        mp.kv_overrides = arr
    m = lc.llama_model_load_from_file(str(path).encode(), mp)
    assert m
    return m


@pytest.fixture(scope="module")
def model(lc):
    m = load(lc, data.tiny_model(head_dim=128))
    yield m
    lc.llama_model_free(m)


@pytest.fixture(scope="module")
def gemma(lc):
    m = load(lc, data.default_model())
    yield m
    lc.llama_model_free(m)


class Ctx:
    def __init__(self, lc, model, t: str, n_ctx: int = N_CTX):
        from pyturbo.types import cache_type
        self.lc = lc
        p = lc.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, N_CTX, N_CTX, 2
        p.kv_unified = True
        p.type_k = p.type_v = cache_type(t).ggml_id
        p.flash_attn_type = 1
        p.n_threads = p.n_threads_batch = 2
        self.ctx = lc.llama_init_from_model(model, p)
        assert self.ctx
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
        self.pos = {0: 0, 1: 0}

    def eval(self, seq: int, tokens: list[int]) -> np.ndarray:
        lc = self.lc
        b = lc.llama_batch_init(len(tokens), 0, 1)
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = self.pos[seq] + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = i == len(tokens) - 1
        b.n_tokens = len(tokens)
        assert lc.llama_decode(self.ctx, b) == 0
        lc.llama_batch_free(b)
        self.pos[seq] += len(tokens)
        out = lc.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(out, shape=(self.n_vocab,)).copy()

    def save(self, seq: int) -> bytes:
        n = self.lc.llama_state_seq_get_size(self.ctx, seq)
        buf = (ctypes.c_uint8 * n)()
        assert self.lc.llama_state_seq_get_data(self.ctx, buf, n, seq) == n
        return bytes(buf)

    def restore(self, seq: int, state: bytes, n_pos: int) -> bool:
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        ok = self.lc.llama_state_seq_set_data(self.ctx, buf, len(state), seq) == len(state)
        if ok:
            self.pos[seq] = n_pos
        return ok

    def __del__(self):
        self.lc.llama_free(self.ctx)


def tokens(lc, model, offset: int, n: int) -> list[int]:
    """n tokens of botchan.txt from character `offset`, the first replaced by BOS."""
    vocab = lc.llama_model_get_vocab(model)
    text = data.corpus().read_text(encoding="utf-8")[offset:offset + 8 * n].encode()
    buf = (lc.llama_token * (2 * len(text) + 16))()
    got = lc.llama_tokenize(vocab, text, len(text), buf, len(buf), False, False)
    assert got >= n
    return [lc.llama_vocab_bos(vocab)] + list(buf[1:n])


def prompts(lc, m):
    """A prompt, another sequence's prompt (other text), and the tokens that continue the first."""
    return tokens(lc, m, 2000, 96), tokens(lc, m, 60000, 80), tokens(lc, m, 2600, 5)[1:]


@pytest.mark.parametrize("t", ["turboq3", "turboq8"])
def test_restore_into_empty_cache_is_bit_identical(lc, model, t):
    prompt, _, nxt = prompts(lc, model)
    a = Ctx(lc, model, t)
    a.eval(0, prompt)
    state = a.save(0)
    want = a.eval(0, nxt)
    b = Ctx(lc, model, t)
    assert b.restore(0, state, len(prompt))
    np.testing.assert_array_equal(b.eval(0, nxt), want)


@pytest.mark.slow
@pytest.mark.parametrize("t", ["turboq8", "turboq3"])
def test_restore_beside_another_sequence_is_bit_identical(lc, gemma, t):
    """Every sequence shares the model's mean, so a sequence restored beside another one reads
    as it did when it was saved; and the other sequence's cells are untouched."""
    prompt, other, nxt = prompts(lc, gemma)

    def continuation(c: Ctx) -> list[np.ndarray]:
        return [c.eval(0, [tok]) for tok in nxt]

    a = Ctx(lc, gemma, t)
    a.eval(0, prompt)
    state = a.save(0)
    want = continuation(a)
    b = Ctx(lc, gemma, t)
    b.eval(1, other)
    other_state = b.save(1)
    assert b.restore(0, state, len(prompt))
    assert b.save(1) == other_state
    for w, g in zip(want, continuation(b)):
        np.testing.assert_array_equal(g, w)


def restore_log(ctx: Ctx, state: bytes, n_pos: int) -> tuple[bool, str]:
    """Restore into seq 0 and return llama.cpp's log of it (captured by callback: whether it
    also reaches stderr depends on the log callback other tests left installed)."""
    from pyturbo.llama import captured_log
    with captured_log(verbose=False) as lines:
        ok = ctx.restore(0, state, n_pos)
    return ok, "".join(text for _, text in lines)


def test_state_without_the_mean_is_refused(lc, model):
    """A state saved from the same weights with K centering off (the GGUF's turboq.k_center=false)
    has no mean records: a centered cache refuses it."""
    prompt, _, _ = prompts(lc, model)
    uncentered = load(lc, data.tiny_model(head_dim=128, k_center=False))
    try:
        a = Ctx(lc, uncentered, "turboq3")
        a.eval(0, prompt)
        state = a.save(0)
        del a
    finally:
        lc.llama_model_free(uncentered)
    b = Ctx(lc, model, "turboq3")
    ok, log = restore_log(b, state, len(prompt))
    assert not ok
    assert "no K-centering mean" in log
    assert np.isfinite(b.eval(0, prompt)).all()  # the cache still works afterwards


def saved_with_mean(lc, model) -> tuple[bytearray, int, int]:
    """A turboq3 state of seq 0, the offset of its first mean record and the prompt length."""
    prompt, _, _ = prompts(lc, model)
    a = Ctx(lc, model, "turboq3")
    a.eval(0, prompt)
    state = bytearray(a.save(0))
    magic = state.find(K_RECORD)
    assert magic > 0
    return state, magic, len(prompt)


def _bump(st: bytearray, at: int) -> None:
    st[at:at + 4] = (np.frombuffer(bytes(st[at:at + 4]), np.float32) + np.float32(1e-3)).tobytes()


def _scale_at(st: bytearray, at: int) -> int:
    """The offset of the record's first channel scale (the second half of its floats)."""
    return at + 8 + 4 * (int.from_bytes(st[at + 4:at + 8], "little") // 2)


@pytest.mark.parametrize("change,message", [
    (lambda st, at: st.__setitem__(slice(at + 8, at + 12), np.array([np.nan], np.float32).tobytes()), "not finite"),
    (lambda st, at: _bump(st, at + 8), "not this cache's"),
    (lambda st, at: _bump(st, _scale_at(st, at)), "not this cache's"),
    (lambda st, at: st.__setitem__(slice(at, at + 4), b"TQKC"), "earlier build"),
    (lambda st, at: st.__setitem__(slice(at, at + 4), b"TQKM"), "earlier build"),
], ids=["not-finite", "another-mean", "another-scale", "mean-only-record", "first-request-mean"])
def test_state_with_another_mean_is_refused(lc, model, change, message):
    """A corrupt mean, another model's or build's mean or channel scale, and the records of earlier
    builds (a mean only; a mean from the first request) are refused with a message: their rows
    cannot be re-encoded exactly."""
    state, magic, n_pos = saved_with_mean(lc, model)
    change(state, magic)
    b = Ctx(lc, model, "turboq3")
    ok, log = restore_log(b, bytes(state), n_pos)
    assert not ok
    assert message in log, log
    assert np.isfinite(b.eval(0, prompts(lc, model)[0])).all()  # the cache still works afterwards


def test_the_mean_is_the_models_not_the_requests(lc, model):
    """Contexts that processed different texts first save the same mean records."""
    prompt, other, _ = prompts(lc, model)
    states = []
    for first in (prompt, other):
        c = Ctx(lc, model, "turboq3")
        c.eval(1, first)
        c.eval(0, prompt)
        states.append([rec.tobytes() for _, rec in k_records(c.save(0))])
    assert states[0] and states[0] == states[1]


@pytest.mark.slow
def test_channel_scale_is_per_rope_pair_and_off_with_its_setting(lc, gemma):
    """Gemma 3 (NEOX RoPE over all 256 channels, one KV head): each record is the mean, then a
    channel scale that is equal on the two channels of a RoPE pair and has a geometric mean of 1
    (auto takes the scale on Gemma: the calibration's trial finds it helps). With turboq.k_scale=off
    the scale is all ones and the mean is unchanged."""
    def records(m) -> list[np.ndarray]:
        c = Ctx(lc, m, "turboq3")
        c.eval(0, prompts(lc, m)[0])
        recs = [rec for _, rec in k_records(c.save(0))]
        del c
        return recs

    on = records(gemma)
    assert len(on) == 18
    for rec in on:
        mu, s = rec[:256], rec[256:]
        assert len(rec) == 512 and np.isfinite(rec).all() and (s > 0).all()
        np.testing.assert_array_equal(s[:128], s[128:])
        assert abs(np.log(s.astype(np.float64)).mean()) < 1e-5
        assert s.max() / s.min() > 1.5  # Q and K energies differ across channels: the scale does something
    m = load(lc, data.default_model(), k_scale="off")
    try:
        off = records(m)
    finally:
        lc.llama_model_free(m)
    for a, b in zip(on, off):
        np.testing.assert_array_equal(b[256:], np.ones(256, np.float32))
        np.testing.assert_array_equal(b[:256], a[:256])


def rope_mean_factor(theta: np.ndarray, span: int) -> np.ndarray:
    """A = (1/span) sum_{p < span} e^(i p theta): the mean of a unit pair spread over span positions."""
    p = np.arange(span, dtype=np.float64)
    return np.exp(1j * np.outer(theta, p)).mean(axis=1)


@pytest.mark.slow
def test_the_mean_fits_the_contexts_positions_not_the_calibrations(lc, gemma):
    """The calibration sees positions 0..511, but a key is centered at any position of the context.
    Each RoPE pair's calibrated mean is turned back to position 0 and spread over the positions a
    sequence of the context spans (n_ctx_seq; unified here, so n_ctx): mu_pair = A(theta, n) * m,
    m being the model's. So a context of 1024 and one of 256 have mu_1024 * A(256) = mu_256 *
    A(1024) on every pair (as complex numbers), from Gemma's RoPE (NEOX over 256 channels; base 1e6
    on layers 5, 11, 17, 1e4 on the sliding-window layers): the pairs that turn a lot over 1024
    positions lose their mean there, and the slowest pairs keep it."""
    def records(n_ctx: int) -> list[np.ndarray]:
        c = Ctx(lc, gemma, "turboq3", n_ctx=n_ctx)
        assert lc.llama_n_ctx_seq(c.ctx) == n_ctx
        c.eval(0, prompts(lc, gemma)[0])
        recs = [rec[:256].astype(np.float64) for _, rec in k_records(c.save(0))]
        del c
        return recs

    long, short = records(1024), records(256)
    assert len(long) == len(short) == 18
    i = np.arange(128)
    shrunk = kept = 0
    # a saved state holds the full-context cache (layers 5, 11, 17: base 1e6) before the
    # sliding-window one (base 1e4)
    bases = [1e6] * 3 + [1e4] * 15
    for il, (a, b, base) in enumerate(zip(long, short, bases)):
        theta = base ** (-2.0 * i / 256)
        got, short_mu = a[:128] + 1j * a[128:], b[:128] + 1j * b[128:]
        scale = np.abs(short_mu).max()
        np.testing.assert_allclose(got * rope_mean_factor(theta, 256), short_mu * rope_mean_factor(theta, 1024),
                                   rtol=0, atol=1e-5 * scale, err_msg=f"record {il}")
        big = np.abs(short_mu) > 0.05 * scale
        shrunk += int(np.sum(big & (np.abs(got) < 0.2 * np.abs(short_mu))))
        kept += int(np.sum(big & (np.abs(got) > 0.95 * np.abs(short_mu))))
    assert shrunk > 0 and kept > 0, (shrunk, kept)
