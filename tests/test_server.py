"""`python -m server`, both engines, on 127.0.0.1, driven with the official openai client."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import ENGINES, RECOMMENDED, free_port, output, post, server_cmd, start, stop, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE_TOKENS = ("<start_of_turn>", "<end_of_turn>", "<im_start>", "<|im_start|>", "<im_end>", "<|im_end|>")
N_CTX = 1024


@pytest.fixture(scope="module", params=ENGINES)
def server(request, build_info):
    port = free_port()
    proc = start(server_cmd(request.param, port, *RECOMMENDED,
                            "--n-ctx", str(N_CTX), "--parallel", "8"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield request.param, url, proc
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server[1] + "/v1", api_key="none", timeout=300, max_retries=0)


@pytest.mark.slow
def test_models(client):
    assert "gemma" in [m.id for m in client.models.list().data]


@pytest.mark.slow
def test_completion(client):
    r = client.completions.create(model="gemma", prompt="Ever since I was a child,", max_tokens=12, temperature=0)
    assert r.choices[0].text.strip()


@pytest.mark.slow
def test_chat_answers_on_the_template_less_default_model(server, client):
    """The bundled Gemma GGUF has no chat template: the Gemma turn format is used, and said so in the log."""
    for question in ("Say hello.", "What is the capital of France?"):
        r = client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": question}],
                                           max_tokens=24, temperature=0)
        text = r.choices[0].message.content
        assert text and text.strip(), f"empty chat answer to {question!r}: {r}"
        assert not any(t in text for t in TEMPLATE_TOKENS), text
        assert r.usage.completion_tokens > 0


@pytest.mark.slow
def test_chat_stream_yields_content(client):
    chunks = [c for c in client.chat.completions.create(
        model="gemma", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to five."}],
        max_tokens=16, temperature=0, stream=True) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert sum(1 for c in chunks if c.choices[0].delta.content) >= 2
    assert text.strip() and not any(t in text for t in TEMPLATE_TOKENS)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_completion_stream(client):
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="gemma", prompt="The sea was", max_tokens=8, stream=True, temperature=0))
    assert text.strip()


@pytest.mark.slow
def test_eight_concurrent_clients(client):
    """8 clients at once, streaming and not, chat and completions; each gets its own answer:
    counting prompts that start at different numbers must continue with their own next number."""
    def one(i: int) -> tuple[int, str]:
        start_n = 10 * i + 3
        prompt = ", ".join(str(start_n + j) for j in range(6)) + ","
        if i % 4 == 3:
            r = client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": f"Say {i}."}],
                                               max_tokens=8, temperature=0, stream=bool(i % 2))
            text = ("".join(c.choices[0].delta.content or "" for c in r if c.choices) if i % 2
                    else r.choices[0].message.content)
            return i, text
        if i % 2:
            text = "".join(c.choices[0].text for c in client.completions.create(
                model="gemma", prompt=prompt, max_tokens=6, temperature=0, stream=True))
        else:
            text = client.completions.create(model="gemma", prompt=prompt, max_tokens=6, temperature=0).choices[0].text
        return i, text

    with ThreadPoolExecutor(8) as pool:
        out = dict(pool.map(one, range(8)))
    for i, text in out.items():
        assert text and text.strip(), f"client {i}: empty answer"
        if i % 4 != 3:
            assert text.strip().startswith(str(10 * i + 3 + 6)), f"client {i}: {text!r}"


def error_message(body: dict) -> str:
    err = body.get("error") or body.get("detail") or body
    return (err.get("message") if isinstance(err, dict) else str(err)) or ""


@pytest.mark.slow
def test_bad_requests_get_4xx_with_a_reason_and_server_survives(server, client):
    _, url, _ = server
    status, body = post(url + "/v1/completions", b"{not json")
    assert status == 400, body
    status, body = post(url + "/v1/chat/completions", json.dumps(
        {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode())
    assert status == 404 and "no-such-model" in error_message(body), body
    status, body = post(url + "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": "many"}).encode())
    assert status == 400 and "max_tokens" in error_message(body), body
    status, body = post(url + "/v1/chat/completions", json.dumps({"messages": "not a list"}).encode())
    assert status == 400 and error_message(body), body
    long_prompt = "hello " * (N_CTX + 200)
    status, body = post(url + "/v1/completions", json.dumps({"prompt": long_prompt, "max_tokens": 4}).encode())
    assert status == 400 and "context" in error_message(body).lower(), body
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        assert r.status == 200
    r = client.completions.create(model="gemma", prompt="Still alive?", max_tokens=4)
    assert r.choices[0].text is not None


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_api_key_guards_everything_but_health(engine, build_info):
    port = free_port()
    proc = start(server_cmd(engine, port, "--n-ctx", "256", "--parallel", "1", "--api-key", "s3cret"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        assert post(url + "/v1/completions", body)[0] == 401
        assert post(url + "/v1/completions", body, {"Authorization": "Bearer wrong"})[0] == 401
        assert post(url + "/v1/completions", body, {"Authorization": "Bearer s3cret"})[0] == 200
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/v1/models", timeout=5)
        assert e.value.code == 401
    finally:
        stop(proc)


@pytest.mark.parametrize("flags, message", [
    (["-ctk", "turboq9"], "unknown KV cache type 'turboq9'"),
    (["-ctv", "turboq4_g64"], "ask for 'turboq4'"),
    (["-ctk", "turboq2_g32"], "ask for 'turboq2'"),
    (["--layer-adaptive", "8"], "valid modes are 0 (off), 1 (q8-edges), 2 (q8-last8), 3 (k8-gain), 4 (k4-global), 5"),
    (["--parallel", "0"], "--parallel 0"),
    (["--model", "/no/such.gguf"], "/no/such.gguf: no such file"),
    (["--engine", "python", "--", "-t", "2"], "llama-server flags"),
    (["--layer-adaptive", "3", "--", "--layer-adaptive", "7"], "--layer-adaptive after '--'"),
    (["--model", str(ROOT / "README.md")], "not a readable GGUF file"),
    (["--draft-model", "/no/draft.gguf"], "--draft-model /no/draft.gguf: no such file"),
    (["-ctkd", "turboq3"], "need --draft-model"),
    (["--draft-model", str(ROOT / "README.md"), "-ctkd", "turboq9"], "unknown KV cache type 'turboq9'"),
    (["--draft-model", str(ROOT / "README.md")], "not a readable GGUF file"),
    (["--engine", "python", "--embeddings"], "--embeddings needs the llama-server engine"),
    (["--embeddings", "sum"], "invalid choice: 'sum'"),
])
def test_bad_flags_end_with_a_message_not_a_traceback(flags, message):
    r = subprocess.run([sys.executable, "-m", "server", *flags], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode != 0
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_engine_killed_during_generation_is_reported_and_the_supervisor_exits(build_info):
    import threading
    port = free_port()
    proc = start(server_cmd("llama-server", port, "--n-ctx", "512", "--parallel", "1"))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        child = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(child) == 1
        got: dict = {}

        def stream() -> None:
            try:
                got["status"], _ = post(f"http://127.0.0.1:{port}/v1/completions", json.dumps(
                    {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}).encode())
            except (OSError, ValueError, http.client.HTTPException) as e:
                got["error"] = e

        client = threading.Thread(target=stream)
        client.start()
        time.sleep(1.5)  # generating
        os.kill(int(child[0]), signal.SIGKILL)
        proc.wait(timeout=30)
        client.join(timeout=30)
        assert not client.is_alive(), "the client hangs on a dead server"
        out = output(proc)
        assert proc.returncode != 0
        assert "llama-server killed by SIGKILL" in out
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing left listening
    finally:
        stop(proc)


def test_binds_this_machine_only_by_default(build_info):
    from pyturbo.server.cli import parser
    from pyturbo.server.llama_server import LaunchSpec
    args = parser().parse_args([])
    assert args.host == "127.0.0.1"
    spec = LaunchSpec("m.gguf", "f16", "f16", 0, 4096, 4, args.host, args.port, "m", api_key="k")
    argv = spec.argv()
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "k" not in argv and spec.env()["LLAMA_API_KEY"] == "k"  # the key is not on the command line


@pytest.mark.parametrize("host", ["llama-cpp-python", "jinja2"])
def test_the_gemma_fallback_renders_tools_without_escaping(build_info, host):
    """Python hosts render the fallback with Jinja2. llama-cpp-python's formatter has its own tojson;
    Jinja2's returns Markup, and joined with `+` the whole prompt around it came out HTML-escaped
    (&lt;start_of_turn&gt;), as a host that keeps Jinja2's filter would render it."""
    from pyturbo._paths import use_patched_llama_cpp
    from pyturbo.server.chat_template import TEMPLATES

    source = (TEMPLATES / "gemma.jinja").read_text()
    if host == "llama-cpp-python":
        use_patched_llama_cpp()
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter
        fmt = Jinja2ChatFormatter(source, eos_token="<end_of_turn>", bos_token="<bos>")
    else:
        from types import SimpleNamespace
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
        fmt = lambda **kw: SimpleNamespace(prompt=template.render(bos_token="<bos>", add_generation_prompt=True, **kw))  # noqa: E731
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris & <Rome>?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    prompt = fmt(messages=messages, tools=tools).prompt
    assert "&lt;" not in prompt and "&#34;" not in prompt and "&amp;" not in prompt, prompt
    assert prompt.startswith("<bos><start_of_turn>user\nYou may call") and '"name": "get_weather"' in prompt
    assert 'Be brief.\n\nWeather in Paris & <Rome>?<end_of_turn>\n' in prompt
    assert '<start_of_turn>model\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><end_of_turn>\n' in prompt
    assert prompt.endswith("<start_of_turn>user\n<tool_response>\n18 C\n</tool_response><end_of_turn>\n<start_of_turn>model\n")
    # without tools, a plain chat is what it was before tools were added
    plain = fmt(messages=messages[:2]).prompt
    assert plain == "<bos><start_of_turn>user\nBe brief.\n\nWeather in Paris & <Rome>?<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.slow
def test_each_engine_gives_the_model_its_layer_adaptive_mode(build_info, capfd):
    """--layer-adaptive reaches llama-server as its argument (0 too: it beats a LLAMA_ARG_LAYER_ADAPTIVE
    that the caller's environment holds) and the python engine as the model's kv override."""
    from pyturbo import data
    from pyturbo.server import python_engine
    from pyturbo.server.llama_server import LaunchSpec
    argv = LaunchSpec("m.gguf", "turboq3", "turboq4", 0, 4096, 1, "127.0.0.1", 8080, "m").argv()
    assert argv[argv.index("--layer-adaptive") + 1] == "0"
    settings = python_engine.TurboModelSettings(model=str(data.default_model()), n_ctx=256, type_k=61, type_v=62,
                                                flash_attn=True, layer_adaptive=7, verbose=True)
    llm = python_engine._load_model(settings)
    err = capfd.readouterr().err
    assert "layer   5: layer-adaptive mode 7: K turboq3, V turboq2" in err
    assert settings.kv_overrides is None  # the caller's settings are not changed
    del llm


def test_each_engine_gives_the_model_its_k_centering(build_info, capfd):
    """--kv-k-center reaches llama-server as its argument (only when given: the model's own key
    stands otherwise) and the python engine as the model's bool kv override."""
    from pyturbo import data
    from pyturbo.server import python_engine
    from pyturbo.server.cli import parser
    from pyturbo.server.llama_server import LaunchSpec
    argv = LaunchSpec("m.gguf", "turboq3", "turboq3", 0, 4096, 1, "127.0.0.1", 8080, "m", kv_k_center="off").argv()
    assert argv[argv.index("--kv-k-center") + 1] == "off"
    assert "--kv-k-center" not in LaunchSpec("m.gguf", "turboq3", "turboq3", 0, 4096, 1, "127.0.0.1", 8080, "m").argv()
    assert parser().parse_args(["--kv-k-center", "off"]).kv_k_center == "off"
    settings = python_engine.TurboModelSettings(model=str(data.tiny_model(head_dim=128)), n_ctx=128, type_k=61,
                                                type_v=61, flash_attn=True, k_center=False, verbose=True)
    llm = python_engine._load_model(settings)
    assert "turboq.k_center=false (set by" in capfd.readouterr().err
    del llm


def test_each_engine_gives_the_model_its_channel_scale(build_info, capfd):
    """--kv-k-scale reaches llama-server as its argument (only when given) and the python engine as
    the model's string kv override, which the calibration's log line names; a value that is not
    auto, on or off is refused before a model loads."""
    from pyturbo import data
    from pyturbo.server import python_engine
    from pyturbo.server.cli import parser
    from pyturbo.server.llama_server import LaunchSpec
    argv = LaunchSpec("m.gguf", "turboq3", "turboq3", 0, 4096, 1, "127.0.0.1", 8080, "m", kv_k_scale="off").argv()
    assert argv[argv.index("--kv-k-scale") + 1] == "off"
    assert "--kv-k-scale" not in LaunchSpec("m.gguf", "turboq3", "turboq3", 0, 4096, 1, "127.0.0.1", 8080, "m").argv()
    assert parser().parse_args(["--kv-k-scale", "on"]).kv_k_scale == "on"
    with pytest.raises(SystemExit):
        parser().parse_args(["--kv-k-scale", "sometimes"])
    settings = python_engine.TurboModelSettings(model=str(data.tiny_model(head_dim=128)), n_ctx=128, type_k=61,
                                                type_v=61, flash_attn=True, k_scale="off", verbose=True)
    llm = python_engine._load_model(settings)
    assert "the channel scale is off (turboq.k_scale)" in capfd.readouterr().err
    del llm
    with pytest.raises(ValueError, match="k_scale must be one of auto, on, off, not 'sometimes'"):
        python_engine._load_model(settings.model_copy(update={"k_scale": "sometimes"}))


@pytest.mark.slow
def test_llama_server_waits_passively_between_tokens(server):
    """The OpenMP threads of the server's engine wait passively (OMP_WAIT_POLICY), which keeps
    decode beside another busy process at about 0.45x of idle instead of 0.38x (docs/server.md)."""
    engine, _, proc = server
    if engine != "llama-server":
        pytest.skip("the python engine loads libgomp in the server's own process, whose /proc environ is its start's")
    (child,) = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    env = dict(e.split("=", 1) for e in Path(f"/proc/{child}/environ").read_text().split("\0") if "=" in e)
    assert env.get("OMP_WAIT_POLICY") == "passive"


def test_a_wait_policy_the_user_set_is_kept(monkeypatch):
    from pyturbo.server.cli import wait_passively
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert wait_passively() == "active"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert wait_passively() == "passive"
