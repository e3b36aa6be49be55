"""Bad requests and client faults against `python -m server`, both engines, all on 127.0.0.1.

Every malformed request gets a 4xx with an OpenAI-style error body, never a 5xx, a hang or a
crash; the server keeps serving correct answers afterwards.
"""
from __future__ import annotations

import http.client
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import ENGINES, free_port, server_cmd, start, stop, wait_healthy

N_CTX = 128


@pytest.fixture(scope="module", params=ENGINES)
def srv(request, build_info):
    port = free_port()
    proc = start(server_cmd(request.param, port, "-ctk", "turboq3", "-ctv", "turboq3", "--n-ctx", str(N_CTX),
                            "--parallel", "2"))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        yield request.param, port, proc
    finally:
        stop(proc)


def request(port: int, path: str, body: bytes | None, method: str = "POST", timeout: float = 120) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body is not None else {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def assert_client_error(status: int, raw: bytes, what: str) -> None:
    assert 400 <= status < 500, f"{what}: {status} {raw[:300]!r}"
    body = json.loads(raw)
    assert isinstance(body.get("error"), dict) and body["error"].get("message"), f"{what}: {raw[:300]!r}"


def counting_answer_is_right(port: int) -> None:
    """A valid request after the abuse gets its own correct continuation."""
    status, raw = request(port, "/v1/completions", json.dumps(
        {"prompt": "41, 42, 43, 44, 45, 46,", "max_tokens": 4, "temperature": 0}).encode())
    assert status == 200, raw[:300]
    assert json.loads(raw)["choices"][0]["text"].strip().startswith("47"), raw[:300]


def j(obj) -> bytes:
    return json.dumps(obj).encode()


MALFORMED = {
    "not JSON": b"{not json",
    "truncated JSON": b'{"prompt": "hi", "max_tok',
    "a JSON array": b"[1, 2, 3]",
    "invalid UTF-8": b'{"prompt": "\xff\xfe", "max_tokens": 2}',
    "a lone surrogate": b'{"prompt": "\\ud800", "max_tokens": 2}',
    "deeply nested JSON": b"[" * 100000 + b"]" * 100000,
    "a 20 MB body": j({"prompt": "x " * 10_000_000, "max_tokens": 1}),
    "max_tokens of the wrong type": j({"prompt": "hi", "max_tokens": "many"}),
    "negative max_tokens": j({"prompt": "hi", "max_tokens": -5}),
    "negative top_k": None,  # engine-specific below
    "temperature of the wrong type": j({"prompt": "hi", "max_tokens": 2, "temperature": "hot"}),
    "logit_bias of the wrong type": j({"prompt": "hi", "max_tokens": 2, "logit_bias": "x"}),
    "a prompt of the wrong type": j({"prompt": {"a": 1}, "max_tokens": 2}),
    "no prompt": j({"max_tokens": 2}),
    "a prompt longer than the context": j({"prompt": "hello " * (N_CTX * 2), "max_tokens": 2}),
    "an unknown model": j({"model": "gpt-4", "prompt": "hi", "max_tokens": 2}),
    "a model that is a path": j({"model": "/etc/passwd", "prompt": "hi", "max_tokens": 2}),
}
MALFORMED_CHAT = {
    "messages not a list": j({"messages": "hi"}),
    "empty messages": j({"messages": [], "max_tokens": 2}),
    "no messages": j({"max_tokens": 2}),
    "a message without content": j({"messages": [{"role": "user"}], "max_tokens": 2}),
}


@pytest.mark.slow
@pytest.mark.parametrize("what", [k for k, v in MALFORMED.items() if v is not None])
def test_malformed_completion_gets_4xx(srv, what):
    _, port, _ = srv
    status, raw = request(port, "/v1/completions", MALFORMED[what])
    assert_client_error(status, raw, what)


@pytest.mark.slow
@pytest.mark.parametrize("what", list(MALFORMED_CHAT))
def test_malformed_chat_gets_4xx(srv, what):
    _, port, _ = srv
    status, raw = request(port, "/v1/chat/completions", MALFORMED_CHAT[what])
    assert_client_error(status, raw, what)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(srv, path):
    """The python engine refuses a prompt whose bytes over the vocabulary's longest token already
    exceed the context, without tokenizing it (20 MB took llama-cpp-python 20-35 s); a prompt
    with more bytes than the context has tokens, which fits, is still answered."""
    engine, port, _ = srv
    text = "x " * 1_000_000
    body = {"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
    status, raw = request(port, path, json.dumps({**body, "max_tokens": 1}).encode())
    assert_client_error(status, raw, "a 2 MB prompt")
    if engine == "python":
        error = json.loads(raw)["error"]
        assert error["code"] == "context_length_exceeded" and "at least" in error["message"], raw[:300]
    fits = "hello " * (N_CTX // 4)  # 3x N_CTX bytes, about N_CTX / 4 tokens
    body = {"prompt": fits} if path == "/v1/completions" else {"messages": [{"role": "user", "content": fits}]}
    status, raw = request(port, path, json.dumps({**body, "max_tokens": 1, "temperature": 0}).encode())
    assert status == 200, raw[:300]


@pytest.mark.slow
def test_still_serving_after_malformed_requests(srv):
    counting_answer_is_right(srv[1])


# values that clients get wrong: wrong types, out-of-range numbers, odd strings
ODD_STRINGS = st.sampled_from(["", "\x00", "a\x00b", "\ud800", "\U0001F600", "<start_of_turn>", "x" * 3000, "é"])
ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**63, max_value=2**63), st.sampled_from([-1, 0, 1, 2**31, 2**53]),
    st.floats(allow_nan=False, allow_infinity=False), ODD_STRINGS, st.lists(st.integers(-5, 300000), max_size=4),
    st.dictionaries(st.sampled_from(["1", "-1", "99999999", "a"]), st.integers(-200, 200), max_size=3),
)
FIELDS = ["prompt", "max_tokens", "n", "top_k", "top_p", "temperature", "logit_bias", "stream", "stop", "seed",
          "model", "n_probs", "min_p", "repeat_penalty", "logprobs"]


def small_budget(body: dict) -> dict:
    # a valid request generates at most a few tokens, so that the fuzz stays bounded in time
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] > 4 or body["max_tokens"] < 0:
        body.setdefault("max_tokens", 4)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
        body["max_tokens"] = 4
    return body


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_requests_never_get_5xx(srv, data):
    _, port, _ = srv
    chat = data.draw(st.booleans(), label="chat")
    body = data.draw(st.dictionaries(st.sampled_from(FIELDS), ODD_VALUES, max_size=5), label="fields")
    if chat:
        msgs = data.draw(st.one_of(
            st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "wizard", ""]),
                                            "content": st.one_of(ODD_STRINGS, st.integers(), st.none())}), max_size=3),
            ODD_VALUES), label="messages")
        body["messages"] = msgs
        body.pop("prompt", None)
    small_budget(body)
    if body.get("stream") is True:
        body["stream"] = False  # streams are covered below; here every answer is one JSON body
    raw_body = json.dumps(body).encode()
    status, raw = request(port, "/v1/chat/completions" if chat else "/v1/completions", raw_body)
    assert status < 500, f"{status} for {raw_body[:300]!r}: {raw[:300]!r}"
    if status >= 400:
        assert_client_error(status, raw, raw_body[:200].decode(errors="replace"))


@pytest.mark.slow
def test_still_serving_after_the_fuzz(srv):
    counting_answer_is_right(srv[1])


@pytest.mark.slow
def test_client_disconnecting_mid_stream_frees_its_slot(srv):
    _, port, _ = srv
    for _ in range(5):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", body=j({"prompt": "Once upon a time", "max_tokens": 64, "stream": True,
                                                          "temperature": 0.8}),
                      headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        r.fp.readline()  # the first event, then hang up
        conn.sock.close()
        conn.close()
    time.sleep(1.0)
    # both slots serve again, with correct answers
    for _ in range(2):
        counting_answer_is_right(port)


def counting(port: int, n: int) -> str:
    status, raw = request(port, "/v1/completions", j({"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": n,
                                                      "temperature": 0, "ignore_eos": True}), timeout=300)
    assert status == 200, raw[:300]
    return json.loads(raw)["choices"][0]["text"]


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["-ctk", "turboq3", "-ctv", "turboq4", "--layer-adaptive", "3"],
                                   ["-ctk", "turboq4", "-ctv", "turboq4"]], ids=["recommended", "turboq4"])
def test_context_overflow_with_context_shift_stays_coherent(build_info, flags):
    """300 tokens through a 128-token context with llama-server's context shift (K rows re-roped,
    the K-centering mean added back around RoPE): no crash, the count goes on through every shift
    (to 85, each step right, as with f16), and the first tokens are f16's. (turboq3 K/V without
    a layer mode loses the count after ~50 with or without a shift: that is its quality, not the shift.)"""
    import re
    texts = {}
    for name, types in (("f16", ["-ctk", "f16", "-ctv", "f16"]), ("turboq", flags)):
        port = free_port()
        proc = start(server_cmd("llama-server", port, *types, "--n-ctx", "128", "--parallel", "1", "--",
                                "--context-shift"))
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc)
            texts[name] = counting(port, 300)
        finally:
            stop(proc)
    assert texts["turboq"][:40] == texts["f16"][:40]
    numbers = [int(x) for x in re.findall(r"\d+", texts["turboq"])]
    steps = sum(1 for a, b in zip(numbers, numbers[1:]) if b == a + 1)
    assert len(numbers) > 60 and steps >= 0.9 * (len(numbers) - 1), texts["turboq"]


@pytest.mark.parametrize("engine", ["llama-server", "python"])
def test_a_context_that_cannot_fit_is_refused_at_startup(build_info, engine):
    """Twice the machine's available memory of f16 KV: a message with the sizes, before any
    allocation (llama.cpp would clear the buffer and be killed by the kernel)."""
    import subprocess

    from pyturbo import data
    from pyturbo.memory import kv_bytes
    from pyturbo.server.cli import mem_available

    avail = mem_available()
    if avail is None:
        pytest.skip("no /proc/meminfo")
    # llama-server keeps a window of cells for sliding-window layers; llama-cpp-python keeps them all
    per_token = kv_bytes(data.default_model(), 1 << 16, swa_full=engine == "python") / (1 << 16)
    n_ctx = int(2 * avail / per_token)
    t0 = time.time()
    r = subprocess.run(server_cmd(engine, free_port(), "--n-ctx", str(n_ctx), "--parallel", "1"), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    assert f"--n-ctx {n_ctx}" in r.stderr and "GiB available" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert time.time() - t0 < 60
