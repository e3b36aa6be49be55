"""pyturbo.Llama: llama-cpp-python on the patched libllama, cache types by name."""
from __future__ import annotations

import numpy as np
import pytest

from pyturbo import data
from helpers import kl, last_logits

PROMPT = "The old man looked at the sea and said"


@pytest.fixture(scope="session")
def gemma(build_info):
    return str(data.default_model())


@pytest.fixture(scope="session")
def tiny128(build_info):
    return str(data.tiny_model(head_dim=128))


def make(Llama, path, **kw):
    kw.setdefault("n_ctx", 512)
    kw.setdefault("n_threads", 2)
    kw.setdefault("verbose", False)
    kw.setdefault("seed", 1)
    return Llama(path, **kw)


def test_unknown_type_name_lists_valid_ones(Llama, tiny128):
    with pytest.raises(ValueError, match="turboq3"):
        make(Llama, tiny128, cache_type_k="turboq5")


def test_names_are_case_insensitive(Llama, tiny128):
    llm = make(Llama, tiny128, cache_type_k="TurboQ3", cache_type_v="Q8_0")
    assert llm.context_params.type_k == 61 and llm.context_params.type_v == 8


def test_turboq_by_raw_id_turns_flash_attention_on(Llama, tiny128):
    llm = make(Llama, tiny128, type_k=61, type_v=61)
    assert llm.context_params.type_k == 61


def test_unknown_type_id_is_refused_before_llama_cpp(Llama, tiny128):
    with pytest.raises(ValueError, match="not a llama.cpp cache type"):
        make(Llama, tiny128, type_k=55)


def test_flash_attention_off_gives_llama_cpp_reason(Llama, tiny128):
    from pyturbo.llama import ContextError
    with pytest.raises(ContextError, match="requires flash_attn"):
        make(Llama, tiny128, cache_type_k="f16", cache_type_v="turboq3", flash_attn=False)


def test_head_dim_72_gives_llama_cpp_reason(Llama):
    # not a multiple of 16, so no turboq twin fits (80 takes the _g16 twins)
    from pyturbo.llama import ContextError
    with pytest.raises(ContextError, match=r"n_embd_head_k=72(.|\n)*or of 64, 32 or 16(.|\n)*this model's is 72(.|\n)*f16"):
        make(Llama, str(data.tiny_model(head_dim=72)), cache_type_k="turboq3", cache_type_v="turboq3")


def test_invalid_layer_adaptive_mode(Llama, tiny128):
    with pytest.raises(ValueError, match="valid modes"):
        make(Llama, tiny128, cache_type_k="turboq3", cache_type_v="turboq3", layer_adaptive=8)


def test_layer_adaptive_on_repacked_k_weights(Llama):
    """K projections that the CPU backend repacks (Q4_0 here, Q4_K in most Llama files) cannot be
    read back: k4-global, which picks every layer whatever their K gain, reads none and runs (it
    crashed on a null get_tensor before); k8-gain, which ranks the layers, says why it cannot."""
    from pyturbo.llama import ContextError
    path = str(data.tiny_model(head_dim=128, n_layer=4, k_type="q4_0"))
    llm = make(Llama, path, cache_type_k="turboq3", cache_type_v="turboq3", layer_adaptive="k4-global")
    llm.eval([1, 2, 3])
    assert np.isfinite(last_logits(llm)).all()
    import llama_cpp
    info = llama_cpp.llama_print_system_info().decode()
    if "REPACK = 1" in info and ("AVX2 = 1" in info or "DOTPROD = 1" in info):  # where ggml-cpu repacks Q4_0
        with pytest.raises(ContextError, match=r"layer-adaptive mode 3 ranks(.|\n)*repacked(.|\n)*--no-repack"):
            make(Llama, path, cache_type_k="turboq3", cache_type_v="turboq3", layer_adaptive="k8-gain")


def test_k_scale_is_the_models_setting(Llama, tiny128):
    """k_scale= reaches libllama as the string kv override turboq.k_scale: on and off give other
    logits, auto gives one of the two; a value that is not auto, on or off is refused first."""
    with pytest.raises(ValueError, match="k_scale must be one of auto, on, off, not 'yes'"):
        make(Llama, tiny128, cache_type_k="turboq3", cache_type_v="turboq3", k_scale="yes")
    out = {}
    for s in ("auto", "on", "off"):
        llm = make(Llama, tiny128, cache_type_k="turboq3", cache_type_v="turboq3", k_scale=s, logits_all=True)
        llm.eval(list(range(1, 40)))
        out[s] = np.array(llm.scores[:39]).copy()
        del llm
    assert not np.array_equal(out["on"], out["off"])
    assert np.array_equal(out["auto"], out["on"]) or np.array_equal(out["auto"], out["off"])


def decode_logits(Llama, path: str, k: str, v: str, tokens: list[int], n_prompt: int,
                  k_center: bool | None = None) -> np.ndarray:
    """Logits of the decode steps: the prompt in one batch, then one token per eval (teacher-forced).
    Each eval's last row only (logits_all would also run the output layer over the whole prompt,
    262k columns a row on Gemma, and the same rows come back: last_logits reads llama.cpp's)."""
    llm = make(Llama, path, cache_type_k=k, cache_type_v=v, flash_attn=True, k_center=k_center)
    llm.eval(tokens[:n_prompt])
    rows = [last_logits(llm)]
    for t in tokens[n_prompt:-1]:
        llm.eval([t])
        rows.append(last_logits(llm))
    return np.array(rows)


def mean_kld(ref: np.ndarray, x: np.ndarray) -> float:
    """Row by row (helpers.kl, float64): whole-array temporaries at Gemma's 262k vocabulary cost
    seconds of page faults a call."""
    return float(np.mean([kl(a, b) for a, b in zip(ref, x)]))


@pytest.fixture(scope="module")
def decode_klds(Llama, gemma):
    """Mean KLD vs f16 of 64 teacher-forced decode steps after a 256-token prompt (botchan.txt)."""
    llm = make(Llama, gemma, vocab_only=True)
    tokens = llm.tokenize(data.corpus().read_text(encoding="utf-8")[:8000].encode())[:256 + 64]
    del llm
    ref = decode_logits(Llama, gemma, "f16", "f16", tokens, 256)
    out = {}
    for name, k, v, center in (("q8_0", "q8_0", "q8_0", True), ("q4_0", "q4_0", "q4_0", True),
                               ("turboq8", "turboq8", "turboq8", True), ("turboq4", "turboq4", "turboq4", True),
                               ("turboq3", "turboq3", "turboq3", True), ("turboq3 uncentered", "turboq3", "turboq3", False)):
        out[name] = mean_kld(ref, decode_logits(Llama, gemma, k, v, tokens, 256, k_center=center))
        print(f"decode KLD vs f16, {name}: {out[name]:.5f}")
    return out


@pytest.mark.slow
def test_turboq8_decode_is_as_close_to_f16_as_q8_0(decode_klds):
    # teacher-forced, so a near-tie cannot fork the text; bound: q8_0's KLD with 50% margin
    assert decode_klds["turboq8"] <= 1.5 * decode_klds["q8_0"] + 1e-3


@pytest.mark.slow
def test_turboq4_decode_beats_q4_0(decode_klds):
    assert decode_klds["turboq4"] < decode_klds["q4_0"]


@pytest.mark.slow
def test_k_centering_cuts_turboq3_error(decode_klds):
    # measured about 2x on this model; fails if centering is lost on the decode path
    assert decode_klds["turboq3"] < 0.7 * decode_klds["turboq3 uncentered"]


@pytest.mark.slow
@pytest.mark.parametrize("t", ["turboq3", "turboq4"])
def test_save_load_state_roundtrips(Llama, gemma, t):
    llm = make(Llama, gemma, cache_type_k=t, cache_type_v=t)
    llm.eval(llm.tokenize(PROMPT.encode()))
    state = llm.save_state()
    tokens, logits = [llm.sample(top_k=1, temp=0.0)], []
    for _ in range(8):
        llm.eval([tokens[-1]])
        logits.append(last_logits(llm))
        tokens.append(llm.sample(top_k=1, temp=0.0))
    llm.load_state(state)
    assert bytes(llm.save_state().llama_state) == bytes(state.llama_state)
    # llama-cpp-python's sample() right after load_state reads stale logits (f16 too), so the
    # continuation is compared by feeding the same tokens: logits must be identical bit for bit
    for i in range(8):
        llm.eval([tokens[i]])
        np.testing.assert_array_equal(last_logits(llm), logits[i])
        assert llm.sample(top_k=1, temp=0.0) == tokens[i + 1]


@pytest.mark.slow
def test_layer_adaptive_sets_per_layer_types_and_does_not_leak(Llama, gemma, capfd):
    llm = make(Llama, gemma, cache_type_k="turboq3", cache_type_v="turboq3", layer_adaptive=7, verbose=True)
    err = capfd.readouterr().err
    assert "layer   0: layer-adaptive mode 7: K turboq3, V q8_0" in err
    assert "layer   5: layer-adaptive mode 7: K turboq3, V turboq2" in err
    assert "layer  17: layer-adaptive mode 7: K turboq3, V q8_0" in err
    other = make(Llama, gemma, cache_type_k="turboq3", cache_type_v="turboq3", verbose=True)
    assert "layer-adaptive mode" not in capfd.readouterr().err
    # the key given as llama-cpp-python users give it: flash attention on for mode 7's turboq2 V
    third = make(Llama, gemma, cache_type_k="f16", cache_type_v="f16", verbose=True,
                 kv_overrides={"turboq.layer_adaptive": 7})
    assert third.layer_adaptive == 7
    assert "layer   5: layer-adaptive mode 7: K f16, V turboq2" in capfd.readouterr().err
    del llm, other, third


@pytest.mark.slow
def test_layer_adaptive_is_a_kv_override(Llama, gemma, capfd, monkeypatch):
    """layer_adaptive= is the model key turboq.layer_adaptive; plain llama-cpp-python reaches it
    with kv_overrides, and libllama never reads LLAMA_ARG_LAYER_ADAPTIVE (an alias of the tools'
    --layer-adaptive only)."""
    import llama_cpp
    monkeypatch.setenv("LLAMA_ARG_LAYER_ADAPTIVE", "1")
    llm = llama_cpp.Llama(str(gemma), n_ctx=256, flash_attn=True, type_k=61, type_v=61, verbose=True,
                          kv_overrides={"turboq.layer_adaptive": 7})  # turboq3 = ggml type 61
    err = capfd.readouterr().err
    assert "layer   5: layer-adaptive mode 7: K turboq3, V turboq2" in err
    other = make(Llama, gemma, cache_type_k="turboq3", cache_type_v="turboq3", verbose=True)
    assert "layer-adaptive mode" not in capfd.readouterr().err
    del llm, other
