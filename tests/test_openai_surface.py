"""The OpenAI request fields that clients send, through `python -m server` (llama-server engine,
the recommended configuration's cache) and the official openai client: logprobs on both endpoints, response_format,
seed, tools and tool_choice on the template-less default model, embeddings behind --embeddings."""
from __future__ import annotations

import json
import math

import pytest

from helpers import RECOMMENDED, free_port, server_cmd, start, stop, wait_healthy

pytestmark = pytest.mark.slow  # a Gemma 3 270M server

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(build_info):
    port = free_port()
    proc = start(server_cmd("llama-server", port, *RECOMMENDED,
                            "--n-ctx", "1024", "--parallel", "2", "--embeddings"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server + "/v1", api_key="none", timeout=300, max_retries=0)


def test_completion_logprobs_have_the_completions_shape(client):
    """/v1/completions: parallel tokens / token_logprobs / top_logprobs ({token: logprob}), as the
    openai client's Logprobs and lm-eval read them (llama-server gave chat's shape there)."""
    r = client.completions.create(model="gemma", prompt="The sky is", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert isinstance(top, dict) and 1 <= len(top) <= 3
        assert logprob <= 0 and all(v <= 0 for v in top.values())
        assert math.isclose(max(top.values()), logprob, abs_tol=1e-6), "greedy picks the most likely token"
        assert top.get(token) == pytest.approx(logprob)
        assert math.fsum(math.exp(v) for v in top.values()) <= 1 + 1e-4


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert content and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)


def test_response_format_json_object_and_json_schema(client):
    # a base model fills an open object with keys until max_tokens: the grammar holds while it runs
    r = client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "A JSON object, please."}],
                                       max_tokens=48, temperature=0, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{") and '"' in text, text

    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    r = client.chat.completions.create(
        model="gemma", messages=[{"role": "user", "content": "Describe a person."}], max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    person = json.loads(r.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and 0 <= person["age"] <= 120
    assert isinstance(person["name"], str) and len(person["name"]) <= 12


def test_seed_makes_sampling_repeatable(client):
    def sample(seed: int) -> str:
        # cache_prompt off: a prompt found in the slot's cache is resumed from its last token, whose
        # logits then come from a one-token batch, not the prompt's, and sampling may follow them
        r = client.completions.create(model="gemma", prompt="Once upon a time", max_tokens=16, temperature=1.0,
                                      top_p=1.0, seed=seed, extra_body={"cache_prompt": False})
        return r.choices[0].text
    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1, "the seed does not reach the sampler"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tools_come_back_as_tool_calls(client, tool_choice):
    """The default GGUF has no chat template; pyturbo's Gemma fallback describes the tools, and a
    call comes back as tool_calls with JSON arguments, not as text."""
    r = client.chat.completions.create(model="gemma", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                       max_tokens=64, temperature=0)
    calls = r.choices[0].message.tool_calls
    # (a base model may go on after its call until max_tokens: finish_reason is then "length")
    assert calls, r.choices[0].message
    assert calls[0].type == "function" and calls[0].id
    # the reply is the calls (patch 14; a named function is "required" over one tool, patch 10): text
    # first could go on to max_tokens
    assert not r.choices[0].message.content, r.choices[0].message
    if isinstance(tool_choice, dict):
        assert {c.function.name for c in calls} == {"get_weather"}
    assert all(c.function.name in ("get_weather", "get_time") for c in calls)
    args = json.loads(calls[0].function.arguments)
    assert isinstance(args, dict) and set(args) <= {"city", "zone"} and args

    # the result goes back as a tool message, and the model answers in text (the first call only:
    # a base model's further calls may be cut off by max_tokens)
    call = calls[0].model_dump(exclude_none=True)
    r2 = client.chat.completions.create(model="gemma", max_tokens=16, temperature=0, tools=TOOLS, tool_choice="none",
                                        messages=ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                                        {"role": "tool", "tool_call_id": calls[0].id,
                                                         "content": "18 C, sunny"}])
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls


def test_a_tool_call_whose_arguments_are_not_json_is_a_400(client):
    import openai
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Par'}}
    with pytest.raises(openai.BadRequestError, match="not JSON|as JSON"):
        client.chat.completions.create(model="gemma", max_tokens=4, tools=TOOLS,
                                       messages=ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                                       {"role": "tool", "tool_call_id": "c1", "content": "18 C"}])


def test_tool_choice_naming_an_unknown_function_is_a_400(client):
    import openai
    with pytest.raises(openai.BadRequestError, match="get_news"):
        client.chat.completions.create(model="gemma", messages=ASK, tools=TOOLS, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "get_news"}})


def test_embeddings_beside_completions(client):
    """Inputs of different lengths in one request (decoded in one batch, two slots): each input's
    embedding is the one it gets alone. With a KV cache per slot, llama.cpp split that batch into
    ubatches of equal length per sequence and pooled only the last one (cosine 0.90 to itself);
    --embeddings therefore runs llama-server with --kv-unified."""
    cat, market = "The cat sat on the mat.", "Stock markets fell today."
    r = client.embeddings.create(model="gemma", input=[cat, market, cat])
    vecs = [d.embedding for d in r.data]
    alone = client.embeddings.create(model="gemma", input=cat).data[0].embedding
    assert len(vecs) == 3 and len(vecs[0]) == 640  # Gemma 3 270M's n_embd
    norm = [math.sqrt(sum(x * x for x in v)) for v in vecs]
    assert all(n == pytest.approx(1, abs=1e-3) for n in norm)  # llama-server normalizes (euclidean)
    cos = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    # (batched beside others, the sums run in another order: cosine 0.9999, not 1)
    assert cos(vecs[0], alone) == pytest.approx(1, abs=1e-3) and cos(vecs[2], alone) == pytest.approx(1, abs=1e-3)
    assert cos(vecs[0], vecs[1]) < 0.9
    assert r.usage.prompt_tokens > 0
    # the same server still generates
    assert client.completions.create(model="gemma", prompt="Hello", max_tokens=4, temperature=0).choices[0].text
