"""Speculative decoding with turboq caches (`python -m server --draft-model`): at temperature 0
the text is the one the same server gives without a draft, and the draft model really drafts.

Both servers run with -ub 1, so that every token's logits are computed alone, as plain decoding
computes them: with llama-server's default ubatch, the verification batch's matmuls and flash
attention sum in another order than single-token decoding, and greedy text differs at near-ties
with an f16 cache too (`pyturbo bench speculative`: 1 of 4 completions identical with f16). What
this test guards is the speculative machinery on a turboq cache: drafted rows written, rejected
ones removed (the draft's turboq2 cache makes it guess wrong), the rest kept."""
from __future__ import annotations

import pytest

from pyturbo import data

from helpers import RECOMMENDED, free_port, post, server_cmd, start, stop, wait_healthy

pytestmark = pytest.mark.slow  # Gemma 3 270M servers, drafting for themselves

# the last one is long enough that a draft with an exact window (the recommended configuration's) still reads most
# of it from its coarse cache, and guesses wrong at times
PROMPTS = ["Ever since I was a child,", "The history of the Roman Empire", "def fibonacci(n):",
           data.corpus().read_text(encoding="utf-8")[20000:21200]]


def _generate(build_info, flags: list[str]) -> list[dict]:
    port = free_port()
    proc = start(server_cmd("llama-server", port, "--n-ctx", "512", "--parallel", "1", *flags, "--", "-ub", "1"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        outs = []
        for prompt in PROMPTS:
            status, out = post(url + "/v1/completions", {"prompt": prompt, "max_tokens": 48, "temperature": 0})
            assert status == 200, out
            outs.append(out)
        return outs
    finally:
        stop(proc)


@pytest.mark.parametrize("cache", [["-ctk", "turboq3", "-ctv", "turboq3"],
                                   list(RECOMMENDED)],
                         ids=["turboq3", "recommended"])
def test_a_draft_model_leaves_greedy_text_unchanged(build_info, cache):
    plain = _generate(build_info, cache)
    # the bundled model drafts for itself, from a turboq2 cache: close enough to be accepted
    # often, coarse enough to be rejected sometimes; drafts of up to 8 tokens, so that some go
    # wrong beside the recommended configuration's exact window too (with 4, after patch 40's
    # change of the decode's sums, every drafted token of the four prompts was accepted)
    drafted = _generate(build_info, cache + ["--draft-model", str(data.default_model()), "--draft-max", "8",
                                             "-ctkd", "turboq2", "-ctvd", "turboq2"])
    for prompt, a, b in zip(PROMPTS, plain, drafted):
        assert a["choices"][0]["text"] == b["choices"][0]["text"], prompt
        assert "draft_n" not in a["timings"]
        assert b["timings"]["draft_n"] > 0 and 0 < b["timings"]["draft_n_accepted"] <= b["timings"]["draft_n"]
    print("drafted, accepted:", [(b["timings"]["draft_n"], b["timings"]["draft_n_accepted"]) for b in drafted])
    assert sum(b["timings"]["draft_n_accepted"] for b in drafted) < sum(b["timings"]["draft_n"] for b in drafted), \
        "no draft token was rejected: the rollback went untested"
