"""Same input, same output: a request's answer does not depend on other requests.

A turboq K cache is centered on the model's calibrated K mean (llama-turboq-center.h), which no request
can change. Before, the mean came from whichever ubatch first reached the empty cache, so the
recommended configuration's server gave 5 distinct greedy answers to 6 identical requests. Each case here is run
with an f16 cache too: where f16 gives one answer (or bit-identical logits), so must turboq.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from pyturbo import data
from helpers import RECOMMENDED, free_port, k_records, last_logits, post, server_cmd, start, stop, wait_healthy

pytestmark = pytest.mark.slow  # Gemma 3 270M: its servers and contexts

QUESTION = "The capital of France is"
OTHERS = ["Ever since I was a child,", "1, 2, 3, 4, 5,", "The recipe calls for"]
CACHES = {"f16": ("-ctk", "f16", "-ctv", "f16"), "q8_0": ("-ctk", "q8_0", "-ctv", "q8_0"),
          "turboq3": ("-ctk", "turboq3", "-ctv", "turboq3"), "recommended": RECOMMENDED}


def long_prompt() -> str:
    return data.corpus().read_text(encoding="utf-8")[30000:36000]


def serve(cache: str):
    """The recommended configuration's server shape: 4 slots sharing one cache (llama-server's defaults otherwise)."""
    port = free_port()
    proc = start(server_cmd("llama-server", port, *CACHES[cache], "--n-ctx", "2048", "--parallel", "4"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
    except BaseException:
        stop(proc)
        raise
    return proc, url


@pytest.fixture(scope="module", params=list(CACHES))
def server(request, build_info):
    proc, url = serve(request.param)
    try:
        yield request.param, url
    finally:
        stop(proc)


def complete(url: str, prompt: str | list[str], n: int = 24, **fields) -> list[str]:
    status, body = post(url + "/v1/completions", json.dumps(
        {"prompt": prompt, "max_tokens": n, "temperature": 0, **fields}).encode())
    assert status == 200, body
    return [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]


def test_the_same_request_gets_the_same_answer(server):
    """Six times in a row, then after an unrelated long prompt; and on a second server whose
    first request was a chat turn (the old mean came from a server's first request, and this
    one changed the recommended configuration's answer)."""
    name, url = server
    answers = [complete(url, QUESTION)[0] for _ in range(6)]
    complete(url, long_prompt(), 8)
    answers += [complete(url, QUESTION)[0] for _ in range(2)]
    other, other_url = serve(name)
    try:
        status, body = post(other_url + "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0}).encode())
        assert status == 200, body
        answers += [complete(other_url, QUESTION)[0] for _ in range(2)]
    finally:
        stop(other)
    print(f"{name}: {len(set(answers))} distinct of {len(answers)}: {sorted(set(answers))}")
    assert answers[0].strip()
    assert len(set(answers)) == 1, answers


def test_the_same_request_beside_the_same_others_gets_the_same_answer(server):
    """Four prompts in one request reach the server together, and none reuses a cached prompt,
    so each round batches them alike. As with f16 the answers may differ from the sequential
    ones, and from rounds that reuse cached prompts: llama.cpp is not batch-invariant (a
    different ubatch shape changes the float order of the matmuls)."""
    name, url = server
    rounds = [complete(url, [QUESTION, *OTHERS], cache_prompt=False) for _ in range(3)]
    for r in rounds:
        print(f"{name}: {r}")
    assert all(r == rounds[0] for r in rounds), rounds


# ---- Python: contexts and sequences ----

def make(Llama, k: str, v: str, **kw):
    kw = {"n_ctx": 1024, "n_batch": 512, **kw}
    return Llama(str(data.default_model()), cache_type_k=k, cache_type_v=v, flash_attn=True, verbose=False, seed=1, **kw)


def logits_of(llm, text: str) -> np.ndarray:
    """The logits at the prompt's last token, evaluated as llama-cpp-python's generate() does:
    the prefix it shares with what the context last processed stays in the cache."""
    tokens = llm.tokenize(text.encode())
    n = 0
    while n < min(llm.n_tokens, len(tokens) - 1) and llm._input_ids[n] == tokens[n]:
        n += 1
    llm.n_tokens = n
    llm.eval(tokens[n:])
    return last_logits(llm)


@pytest.mark.parametrize("k,v", [("f16", "f16"), ("turboq3", "turboq3"), ("turboq3", "turboq4"), ("turboq2", "q8_0")])
def test_two_contexts_agree_whatever_each_processed_first(Llama, k, v):
    """Each context answered another question first and keeps the shared prefix "<bos>The capital
    of" in its cache. The two earlier prompts have the same length, so the prefix was computed
    in batches of the same shape (llama.cpp is not batch-invariant: with f16 a prefix computed
    in a batch of another size differs by up to 1.3 in the logits on Gemma)."""
    first = ["The capital of Germany is Berlin.", "The capital of Italy is Rome."]
    answers = []
    for earlier in first:
        llm = make(Llama, k, v)
        logits_of(llm, earlier)
        answers.append(logits_of(llm, QUESTION))
    assert len(llm.tokenize(first[0].encode())) == len(llm.tokenize(first[1].encode()))
    np.testing.assert_array_equal(answers[0], answers[1])
    assert logits_of(llm, "1, 2, 3, 4, 5,").argmax() != answers[0].argmax()  # the context still works


def test_layer_mode_and_batch_size_do_not_change_the_mean(Llama):
    """The saved state carries the mean: the same bytes from contexts of other batch sizes and
    threads. The context size does change it: the mean fits the positions a sequence spans
    (test_k_centering_state checks how)."""
    def mean_records(**kw) -> list[bytes]:
        llm = make(Llama, "turboq3", "turboq3", **kw)
        llm.eval(llm.tokenize(QUESTION.encode()))
        raw = bytes(llm.save_state().llama_state)
        return [rec.tobytes() for _, rec in k_records(raw)]

    base = mean_records()
    assert len(base) == 18 and all(np.any(np.frombuffer(m, np.float32)) for m in base)  # Gemma 3 270M: 18 layers
    assert mean_records(n_ubatch=64) == base
    assert mean_records(n_batch=256, n_threads=1) == base
    assert mean_records(n_ctx=2048) != base
    moded = mean_records(layer_adaptive=3)  # layers 5 and 11 become q8_0 K, the others keep their mean
    assert len(moded) == 16 and all(m in base for m in moded)


@pytest.mark.parametrize("k,v,window", [("f16", "f16", 0), ("turboq3", "turboq3", 0), ("turboq3", "turboq4", 32),
                                         ("turboq3", "turboq2", None)])  # None: the default window (auto's)
def test_decode_gives_the_same_logits_on_any_number_of_threads(Llama, tiny128, k, v, window):
    """The CPU backend runs a graph on fewer threads than asked while the machine does not give
    them cores (patch 3), so no step may depend on the thread count. Both flash-attention decode
    paths split the KV range by it: f16's into one chunk per thread (from 512 cached rows; patch
    2), turboq's into items that divided among the threads (patch 40). 700 cached rows, then
    three decode steps, on 1, 2 and 3 threads: the same bits."""
    prompt = [1 + (i * 37) % 250 for i in range(700)]
    seen = []
    for n_threads in (1, 2, 3):
        llm = Llama(str(tiny128), n_ctx=1024, n_batch=512, n_threads=n_threads, n_threads_batch=n_threads,
                    cache_type_k=k, cache_type_v=v, kv_exact_window=window, flash_attn=True,
                    verbose=False, seed=1)
        llm.eval(prompt)
        steps = [last_logits(llm)]
        for _ in range(3):
            llm.eval([int(steps[-1].argmax())])
            steps.append(last_logits(llm))
        seen.append(np.stack(steps))
        del llm
    for n_threads, logits in zip((2, 3), seen[1:]):
        np.testing.assert_array_equal(logits, seen[0], err_msg=f"{n_threads} threads against 1")


@pytest.fixture(scope="module")
def lc(build_info):
    from pyturbo.llama import llama_cpp  # points llama_cpp at the patched library first
    llama_cpp.llama_backend_init()
    return llama_cpp


class Sequences:
    """One context, two sequences in a unified cache (low-level API)."""

    def __init__(self, lc, model, t: str) -> None:
        from pyturbo.types import cache_type
        self.lc = lc
        p = lc.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max, p.kv_unified = 2048, 512, 512, 2, True
        p.type_k = p.type_v = cache_type(t).ggml_id
        p.flash_attn_type = 1
        p.n_threads = p.n_threads_batch = 2
        self.ctx = lc.llama_init_from_model(model, p)
        assert self.ctx
        self.vocab = lc.llama_model_get_vocab(model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)

    def tokens(self, text: str) -> list[int]:
        raw = text.encode()
        buf = (self.lc.llama_token * (len(raw) + 16))()
        n = self.lc.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), True, False)
        return list(buf[:n])

    def eval(self, seq: int, tokens: list[int]) -> np.ndarray:
        lc = self.lc
        out = []
        for s in range(0, len(tokens), 512):
            part = tokens[s:s + 512]
            b = lc.llama_batch_init(len(part), 0, 1)
            for i, t in enumerate(part):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, s + i, 1, True
                b.seq_id[i][0] = seq
            b.n_tokens = len(part)
            assert lc.llama_decode(self.ctx, b) == 0
            lc.llama_batch_free(b)
            out.append(np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(len(part), self.n_vocab)).copy())
        return np.concatenate(out)

    def __del__(self):
        self.lc.llama_free(self.ctx)


@pytest.fixture(scope="module")
def gemma(lc):
    m = lc.llama_model_load_from_file(str(data.default_model()).encode(), lc.llama_model_default_params())
    assert m
    yield m
    lc.llama_model_free(m)


@pytest.mark.parametrize("t", ["f16", "turboq3", "turboq8"])
def test_two_sequences_of_one_context_agree(lc, gemma, t):
    """Sequence 1 holds another text; sequence 0 then gets the prompt a fresh context got."""
    fresh = Sequences(lc, gemma, t)
    prompt = fresh.tokens(QUESTION)
    want = fresh.eval(0, prompt)
    both = Sequences(lc, gemma, t)
    both.eval(1, both.tokens(long_prompt()[:1500]))
    np.testing.assert_array_equal(both.eval(0, prompt), want)
