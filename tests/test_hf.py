"""pyturbo.hf: the transformers TurboQuantCache against the NumPy reference, the C codec and llama.cpp.

torch and transformers come with the [hf] extra (scripts/setup.sh installs every extra). Without them
these tests skip, except under CI (CI=true), where a missing extra is a failure.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from pyturbo import codec, data, layer_adaptive
from pyturbo.format import reference
from pyturbo.types import TURBOQ_STORED_TYPES, cache_type

from helpers import special_groups  # tests/ is on sys.path (pytest prepend mode)

if os.environ.get("CI") == "true":
    import torch
    import transformers  # noqa: F401
else:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")

from pyturbo.hf import TurboQuantCache, TurboQuantLayer, k_gains_from_gguf, layer_cache_types, load  # noqa: E402
from pyturbo.hf import torch_codec as tc  # noqa: E402
from pyturbo.hf.cache import dynamic_cache_nbytes  # noqa: E402
from pyturbo.perplexity.hf import hf_perplexity, make_cache  # noqa: E402

D = 128


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the suite shares 2 cores with llama.cpp tools that some tests start
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def groups(rng) -> np.ndarray:
    return np.concatenate(list(special_groups(rng).values()))


@pytest.mark.parametrize("type_name", TURBOQ_STORED_TYPES)
def test_torch_blocks_equal_reference_and_c_bit_for_bit(lib, rng, type_name):
    x = groups(rng)
    blocks = tc.encode(torch.from_numpy(x), type_name).numpy()
    t = cache_type(type_name)
    assert blocks.shape == (x.shape[0], D // t.block_size * t.block_bytes)  # rows of 128 values
    np.testing.assert_array_equal(blocks.ravel(), reference.quantize(x, type_name))
    np.testing.assert_array_equal(blocks.ravel(), codec.quantize(x, type_name))
    # rows of several blocks: [tokens, 3 blocks] is the same bytes as the 3*tokens groups
    rows = (rng.standard_normal((7, 3 * D)) * 4).astype(np.float32)
    np.testing.assert_array_equal(tc.encode(torch.from_numpy(rows), type_name).numpy().ravel(),
                                  codec.quantize(rows, type_name))


def test_q8_0_equals_ggml_reference_quantizer(lib, rng):
    x = np.concatenate([g for k, g in special_groups(rng).items() if k != "nan_inf"])  # C's MAX() drops NaNs by position
    np.testing.assert_array_equal(tc.encode(torch.from_numpy(x), "q8_0").numpy().ravel(), codec.quantize(x, "q8_0"))
    blocks = codec.quantize(x, "q8_0")
    np.testing.assert_array_equal(tc.decode(torch.from_numpy(blocks.reshape(x.shape[0], -1)), "q8_0", D).numpy().ravel(),
                                  codec.dequantize(blocks, "q8_0"))


@pytest.mark.parametrize("type_name", TURBOQ_STORED_TYPES)
def test_decode_matches_reference(lib, rng, type_name):
    x = groups(rng)
    blocks = codec.quantize(x, type_name)
    b = torch.from_numpy(blocks.reshape(x.shape[0], -1))
    exact = tc.decode(b, type_name, D).numpy().ravel()
    ref = reference.dequantize(blocks, type_name)
    np.testing.assert_array_equal(exact.view(np.uint32), ref.view(np.uint32))
    np.testing.assert_array_equal(exact.view(np.uint32), codec.dequantize(blocks, type_name).view(np.uint32))
    # the cache's fast read (a matmul) differs only in summation order
    fast = tc.decode(b, type_name, D, exact=False).numpy().reshape(-1, D)
    scale = np.abs(ref.reshape(-1, D)).max(axis=1, keepdims=True) + 1e-30
    assert np.all(np.abs(fast - ref.reshape(-1, D)) <= 1e-5 * scale)


@pytest.mark.parametrize("k_center", [False, True])
@pytest.mark.parametrize("d,g,k_bytes,v_bytes", [(64, 64, 26, 34), (96, 32, 14, 18), (80, 16, 8, 10)])
def test_head_dims_store_their_twins(rng, k_center, d, g, k_bytes, v_bytes):
    """SmolLM2's geometry, 3 KV heads of 64 -> rows of 192 values, three 64-value groups (the _g64
    twins, as llama.cpp stores them); Phi-3's head size 96 -> rows of 288 values, nine 32-value
    groups (the _g32 twins); Phi-2's 80 -> rows of 240 values, fifteen 16-value groups (the _g16
    twins); no padding."""
    b, h, t = 2, 3, 5
    n = h * d
    k = torch.from_numpy((rng.standard_normal((b, h, t, d)) * 3 + 1).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((b, h, t, d)).astype(np.float32))
    layer = TurboQuantLayer("turboq3", "turboq4", k_center=k_center)
    k_out, v_out = layer.update(k, v)
    assert (layer.k.type, layer.v.type) == (f"turboq3_g{g}", f"turboq4_g{g}")
    assert k_out.shape == k.shape and v_out.shape == v.shape
    assert layer.keys.shape == (b, t, n // g * k_bytes) and layer.values.shape == (b, t, n // g * v_bytes)
    rows_k = k.transpose(1, 2).reshape(b, t, n).numpy()
    mu = rows_k.sum(axis=1, keepdims=True) * np.float32(1.0 / t) if k_center else np.zeros((b, 1, n), np.float32)
    np.testing.assert_array_equal(layer.keys.numpy().ravel(), reference.quantize(rows_k - mu, f"turboq3_g{g}"))
    back = reference.dequantize(layer.keys.numpy().ravel(), f"turboq3_g{g}").reshape(b, t, n) + mu
    np.testing.assert_allclose(k_out.transpose(1, 2).reshape(b, t, n).numpy(), back, rtol=0, atol=1e-5)
    rows_v = v.transpose(1, 2).reshape(b, t, n).numpy()
    np.testing.assert_array_equal(layer.values.numpy().ravel(), reference.quantize(rows_v, f"turboq4_g{g}"))
    # a second update appends rows and returns all tokens
    k2, v2 = layer.update(k[:, :, :1], v[:, :, :1])
    assert k2.shape == (b, h, t + 1, d) and layer.get_seq_length() == t + 1
    rel = float(((k2 - torch.cat([k, k[:, :, :1]], dim=2)).norm() / k.norm()))
    assert rel < 0.25


@pytest.mark.parametrize("d,want", [(80, "turboq8_g16"), (64, "q8_0")])
def test_a_modes_q8_0_at_head_size_80_is_turboq8(rng, d, want):
    """A layer-adaptive mode's q8_0 K (turboq3 asked for) stores what llama.cpp stores: q8_0 where
    its 32-value blocks divide the head size, turboq8 in 16-value groups at 80 (K-centered, as a
    turboq K is); a q8_0 that the user asked for keeps its padding (llama.cpp refuses it at 80)."""
    b, h, t = 1, 3, 4
    k = torch.from_numpy((rng.standard_normal((b, h, t, d)) * 3 + 1).astype(np.float32))
    layer = TurboQuantLayer("q8_0", "turboq3", requested=("turboq3", "turboq3"))
    layer.update(k, k)
    assert layer.k.type == want
    assert layer.k_center == want.startswith("turboq")
    if layer.k_center:
        rows = k.transpose(1, 2).reshape(b, t, h * d).numpy()
        rows = rows - rows.sum(axis=1, keepdims=True) * np.float32(1.0 / t)
        np.testing.assert_array_equal(layer.keys.numpy().ravel(), reference.quantize(rows, want))
    asked = TurboQuantLayer("q8_0", "turboq3")
    asked.update(k, k)
    assert asked.k.type == "q8_0"


def test_other_head_sizes_pad_the_row_to_whole_blocks(rng):
    """Head size 72 (not a multiple of 16, which llama.cpp refuses for turboq): 2 KV heads -> rows
    of 144 values, padded with zeros to 256 (two 128-value blocks), the padding dropped on decoding."""
    b, h, t, d = 1, 2, 4, 72
    k = torch.from_numpy(rng.standard_normal((b, h, t, d)).astype(np.float32))
    layer = TurboQuantLayer("turboq3", "turboq3", k_center=False)
    k_out, _ = layer.update(k, k)
    assert layer.keys.shape == (b, t, 2 * 50)
    padded = np.zeros((b, t, 256), np.float32)
    padded[..., :144] = k.transpose(1, 2).reshape(b, t, h * d).numpy()
    np.testing.assert_array_equal(layer.keys.numpy().ravel(), reference.quantize(padded, "turboq3"))
    back = reference.dequantize(layer.keys.numpy().ravel(), "turboq3").reshape(b, t, 256)[..., :144]
    np.testing.assert_allclose(k_out.transpose(1, 2).reshape(b, t, h * d).numpy(), back, rtol=0, atol=1e-5)


def test_trellis_types_are_llama_cpps_bytes_and_refused_where_llama_cpp_refuses_them(rng):
    """turboq3t K / turboq2t V on 2 heads of 128, and on 2 heads of 64 (their _g64 forms, as libllama
    stores them there): the stored rows are the reference's (and so the C codec's) bytes; like libllama,
    the cache refuses them at a head size that is not a multiple of 64, naming the scalar type of the
    same bits."""
    for d, sizes, names in ((128, (50, 34), ("turboq3t", "turboq2t")), (64, (26, 18), ("turboq3t_g64", "turboq2t_g64"))):
        b, h, t = 1, 2, 5
        k = torch.from_numpy((rng.standard_normal((b, h, t, d)) * 3).astype(np.float32))
        v = torch.from_numpy(rng.standard_normal((b, h, t, d)).astype(np.float32))
        layer = TurboQuantLayer("turboq3t", "turboq2t", k_center=False)
        k_out, v_out = layer.update(k, v)
        assert layer.keys.shape == (b, t, h * sizes[0]) and layer.values.shape == (b, t, h * sizes[1])
        for x, stored, out, name in ((k, layer.keys, k_out, names[0]), (v, layer.values, v_out, names[1])):
            rows = x.transpose(1, 2).reshape(b, t, h * d).numpy()
            np.testing.assert_array_equal(stored.numpy().ravel(), reference.quantize(rows, name))
            back = reference.dequantize(stored.numpy().ravel(), name).reshape(b, t, h * d)
            np.testing.assert_allclose(out.transpose(1, 2).reshape(b, t, h * d).numpy(), back, rtol=0, atol=1e-5)
    for d_bad, scalar in ((96, "turboq3"), (80, "turboq3")):
        with pytest.raises(ValueError, match=f"head_dim is {d_bad}; the scalar {scalar} of the same bits takes it"):
            TurboQuantLayer("turboq3t", "turboq3").update(torch.randn(1, 2, 1, d_bad), torch.randn(1, 2, 1, d_bad))
    with pytest.raises(ValueError, match="head_dim is 96; the scalar turboq2 of the same bits takes it"):
        TurboQuantLayer("turboq3", "turboq2t").update(torch.randn(1, 2, 1, 96), torch.randn(1, 2, 1, 96))


def test_bad_input_is_a_clear_error(rng):
    with pytest.raises(ValueError, match="unknown KV cache type 'turboq5'"):
        TurboQuantLayer("turboq5", "turboq3")
    with pytest.raises(ValueError, match="not supported by pyturbo.hf"):
        TurboQuantLayer("q4_0", "turboq3")
    with pytest.raises(ValueError, match="ask for 'turboq3'"):  # a twin is picked per head size, not asked for
        TurboQuantLayer("turboq3", "turboq3_g64")
    with pytest.raises(ValueError, match="ask for 'turboq2'"):
        TurboQuantLayer("turboq2_G32", "turboq3")
    layer = TurboQuantLayer("turboq3", "turboq3")
    with pytest.raises(ValueError, match=r"\[batch, kv_heads, tokens, head_dim\]"):
        layer.update(torch.zeros(1, 4, 64), torch.zeros(1, 4, 64))
    layer.update(torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64))
    with pytest.raises(ValueError, match="head_dim 64"):
        layer.update(torch.randn(1, 2, 1, 80), torch.randn(1, 2, 1, 80))
    with pytest.raises(ValueError, match="layer-adaptive mode 8"):
        layer_cache_types(18, "turboq3", "turboq3", 8)


@pytest.mark.parametrize("mode", [m for m in layer_adaptive.modes() if m])
def test_layer_adaptive_types_are_libllama_table(mode):
    p = layer_adaptive.policies()[mode]
    n_layer = 18
    if p.k_gain_div:
        gains = list(np.random.default_rng(mode).random(n_layer))
        sliding = [(il + 1) % 6 != 0 for il in range(n_layer)]  # Gemma 3's pattern
        got = layer_cache_types(n_layer, "turboq3", "turboq4", mode, gains, sliding)
        candidates = [il for il in range(n_layer) if not (p.full_context and sliding[il])]
        ranked = sorted(candidates, key=lambda il: -gains[il])
        picked = set(ranked[:max(1, n_layer // p.k_gain_div)])
        assert got == [p.types(il in picked, "turboq3", "turboq4") for il in range(n_layer)]
        if p.full_context:
            assert picked == {5, 11, 17}
            with pytest.raises(ValueError, match="sliding"):
                layer_cache_types(n_layer, "turboq3", "turboq4", mode, gains)
        if layer_adaptive.needs_gains(mode):
            with pytest.raises(ValueError, match="k_gains"):
                layer_cache_types(n_layer, "turboq3", "turboq4", mode, sliding=sliding)
        else:  # every candidate is picked: the gains change nothing, and none are needed
            assert layer_cache_types(n_layer, "turboq3", "turboq4", mode, sliding=sliding) == got
    else:
        ends = [il < p.n_first or il + p.n_last >= n_layer for il in range(n_layer)]
        assert layer_cache_types(n_layer, "turboq3", "turboq4", mode) == [p.types(b, "turboq3", "turboq4") for b in ends]


@pytest.mark.slow
def test_layer_adaptive_3_on_gemma_picks_llama_cpp_layers(gemma_lm):
    # docs/usage.md: on Gemma 3 270M mode 3 puts q8_0 K on layers 11 and 5, mode 4 turboq4 K on the
    # layers without a sliding window (5, 11, 17), as test_llama_tools reads llama.cpp's log
    gains = k_gains_from_gguf(gemma_lm.gguf)
    cache = TurboQuantCache(gemma_lm.model.config, "turboq3", "turboq4", 3, gains)
    assert [il for il, (tk, _) in enumerate(cache.layer_types_kv) if tk == "q8_0"] == [5, 11]
    assert all(tv == "turboq4" for _, tv in cache.layer_types_kv)
    cache = TurboQuantCache(gemma_lm.model.config, "turboq3", "turboq3", 4)  # mode 4 needs no gains
    assert [il for il, (tk, _) in enumerate(cache.layer_types_kv) if tk == "turboq4"] == [5, 11, 17]
    assert all(tv == "turboq3" for _, tv in cache.layer_types_kv)


@pytest.fixture(scope="module")
def gemma_lm(build_info):
    return load("gemma3-270m")


@pytest.fixture(scope="module")
def smollm2_lm(build_info):
    return load("smollm2-135m")


def prompt_ids(lm, n: int) -> torch.Tensor:
    text = data.corpus_slice(12000).read_text(encoding="utf-8")
    return torch.tensor([lm.tokenize(text)[:n]])


@pytest.mark.slow
def test_memory_drops(gemma_lm):
    from transformers import DynamicCache

    n = 1024
    ids = prompt_ids(gemma_lm, n)
    m = gemma_lm.model
    held = {}
    with torch.inference_mode():
        for name in ("dynamic", "turboq3", "turboq8"):
            cache = DynamicCache(config=m.config) if name == "dynamic" else make_cache(gemma_lm, name, name)
            m(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            held[name] = dynamic_cache_nbytes(cache) if name == "dynamic" else cache.nbytes()
    cfg = m.config
    sliding = sum(t == "sliding_attention" for t in cfg.layer_types)
    full = cfg.num_hidden_layers - sliding
    cells = full * n + sliding * (cfg.sliding_window - 1)
    row = cfg.num_key_value_heads * cfg.head_dim
    assert held["dynamic"] == cells * row * 4 * 2
    mean_bytes = cfg.num_hidden_layers * row * 4  # the K-centering mean, one row per layer
    for t in ("turboq3", "turboq8"):
        assert held[t] == cells * row // D * cache_type(t).block_bytes * 2 + mean_bytes
    assert held["turboq3"] / held["dynamic"] < 0.1


# Measured over these 95 positions: turboq8 mean KLD 0.0026 / 0.0020 and top-1 0.989 with torch's
# AVX-512 / AVX2 kernels (ATEN_CPU_CAPABILITY), turboq4 0.584 / 0.579 and 0.747 / 0.737 (per position
# up to 4 in the first 64 positions: a short context's attention leans on few keys), turboq3 1.861 and 0.537 with both
# (the bounds are loose there, so the test also asks that fewer bits never give a smaller error)
SKIP = 8
LOGITS_TOLERANCES = (("turboq8", 0.01, 0.95), ("turboq4", 0.8, 0.6), ("turboq3", 3.0, 0.4))


@pytest.mark.slow
def test_generation_with_the_cache_and_logits_close_to_f32(gemma_lm):
    """Greedy decoding through TurboQuantCache, then the logits of that text, teacher-forced through
    the cache, against a DynamicCache (f32 K/V) at every position past the first SKIP. KLD is averaged
    over all those positions: over the 8 generated ones alone, one near-tie decided the mean, which
    then moved by 35% between torch's AVX2 and AVX-512 kernels. Tolerances: the measured errors
    (above LOGITS_TOLERANCES) with headroom."""
    from transformers import DynamicCache

    m = gemma_lm.model
    ids = prompt_ids(gemma_lm, 96)
    with torch.inference_mode():
        ref = m.generate(ids, past_key_values=DynamicCache(config=m.config), max_new_tokens=8, do_sample=False)
        text = ref[:, :-1]
        ref_logits = m(input_ids=text, past_key_values=DynamicCache(config=m.config), use_cache=True).logits
        ref_logits = ref_logits[0, SKIP:].float()
        p = torch.log_softmax(ref_logits, -1)
        klds = []
        for t, max_kld, min_top1 in LOGITS_TOLERANCES:
            out = m(input_ids=text, past_key_values=make_cache(gemma_lm, t, t), use_cache=True)
            logits = out.logits[0, SKIP:].float()
            q = torch.log_softmax(logits, -1)
            kld = float((p.exp() * (p - q)).sum(-1).mean())
            top1 = float((ref_logits.argmax(-1) == logits.argmax(-1)).float().mean())
            print(f"{t}: mean KLD vs f32 cache {kld:.5f}, top-1 agreement {top1:.3f} over {len(logits)} positions")
            assert kld < max_kld and top1 >= min_top1, (t, kld, top1)
            klds.append(kld)
        assert klds == sorted(klds), klds
        gen = m.generate(ids, past_key_values=make_cache(gemma_lm, "turboq3", "turboq3"), max_new_tokens=8,
                         do_sample=False)
        assert gen.shape == (1, ids.shape[1] + 8)


@pytest.mark.slow
def test_smollm2_head_dim_64(smollm2_lm):
    lm = smollm2_lm
    cfg = lm.model.config
    assert cfg.head_dim == 64 and cfg.num_key_value_heads == 3
    ids = prompt_ids(lm, 64)
    with torch.inference_mode():
        ref = lm.model(input_ids=ids).logits[0].float()
        cache = make_cache(lm, "turboq4", "turboq4")
        got = lm.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0].float()
    assert cache.layers[0].keys.shape == (1, 64, 3 * 34)  # 192 values: three turboq4_g64 blocks
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kld = float((p.exp() * (p - q)).sum(-1).mean())
    # measured 0.150 in 64-value groups (0.109 when this cache put two heads in one 128-value block,
    # which llama.cpp's rotated-domain attention cannot read per head)
    print(f"SmolLM2 turboq4: mean KLD vs f32 {kld:.5f}")
    assert kld < 0.2


# The cross-check: the same 4 chunks of 512 tokens, llama-perplexity's scheme (the second half of
# each chunk scored), f16 and turboq3 K/V in both implementations (llama.cpp without its K channel
# scale, which the transformers cache does not have).
# - f16: transformers runs the dequantized weights in f32, llama.cpp the Q4_K_M matmuls: within 2%.
# - the relative PPL increase of turboq3 over f16 differs between the two by at most
#   INCREASE_TOL. Both run the same codec on slightly different K/V (the weights differ), so their
#   quantization errors are two draws of the same noise. Over 5 rotation seeds on 8 chunks the
#   transformers increase had a standard deviation of SEED_SD (docs/transformers.md); 4 chunks hold half the
#   tokens, so about sqrt(2) times that. llama.cpp's draw spreads more: with centering alone
#   (--kv-k-scale off, the scheme both sides share) its turboq3 increase on Gemma's 4 chunks was
#   +34.2% with the shipped signs and +26.1% with seed 7's (scripts/build_seeded.sh) on an AVX-512
#   FP16/AMX machine, where the shipped draw alone left the old bound (3 sigma of two transformers-like
#   draws, 0.096); CPP_DRAW_SD is that pair's estimate, |a - b| / sqrt(2). The tolerance is 3 sigma
#   of the difference. It still fails where the codecs differ in kind: K stored uncentered in one of
#   them moves llama.cpp's increase to +63%.
SEED_SD = 0.016
CPP_DRAW_SD = 0.057
INCREASE_TOL = 3 * math.sqrt((math.sqrt(2) * SEED_SD) ** 2 + CPP_DRAW_SD ** 2)


@pytest.fixture(scope="module")
def cross_check_ppl():
    """(model fixture, type) -> (transformers PPL, llama.cpp PPL), each computed once: the f16
    baseline serves every type of a model."""
    from pyturbo.tools import llama_perplexity

    # the same scheme on both sides: the transformers cache centers K but has no channel scale, no
    # sink row and no exact window (llama.cpp keeps both by default beside a turboq cache)
    env = {"LLAMA_ARG_KV_K_SCALE": "off", "LLAMA_ARG_KV_EXACT_SINK": "0", "LLAMA_ARG_KV_EXACT_WINDOW": "0"}
    chunks = 4
    text = data.corpus_slice(12000)
    done: dict[tuple[str, str], tuple[float, float]] = {}

    def ppl(model: str, lm, t: str) -> tuple[float, float]:
        if (model, t) not in done:
            hf = hf_perplexity(lm, text.read_text(encoding="utf-8"), t, t, max_length=512, stride=512,
                               score_from=257, max_tokens=chunks * 512, show_progress=False).ppl
            cpp = llama_perplexity(lm.gguf, text, t, t, ctx=512, chunks=chunks, threads=2, env=env).ppl
            done[model, t] = (hf, cpp)
        return done[model, t]
    return ppl


@pytest.mark.slow
@pytest.mark.parametrize("model,type_name", [("gemma_lm", "turboq3"), ("smollm2_lm", "turboq3"), ("gemma_lm", "turboq3t")])
def test_ppl_cross_check_with_llama_cpp(model, type_name, request, cross_check_ppl):
    """Gemma 3 (head_dim 256, 128-value groups) and SmolLM2 (head_dim 64: the _g64 twins on both sides);
    the trellis type turboq3t on Gemma."""
    lm = request.getfixturevalue(model)
    types = ("f16", type_name)
    runs = {t: cross_check_ppl(model, lm, t) for t in types}
    hf = {t: runs[t][0] for t in types}
    cpp = {t: runs[t][1] for t in types}
    inc_hf, inc_cpp = hf[type_name] / hf["f16"] - 1, cpp[type_name] / cpp["f16"] - 1
    print(f"{model} f16 PPL: transformers {hf['f16']:.3f}, llama.cpp {cpp['f16']:.3f}; {type_name}: {hf[type_name]:.3f}, "
          f"{cpp[type_name]:.3f}; increase {inc_hf:+.2%} vs {inc_cpp:+.2%} (tolerance {INCREASE_TOL:.3f})")
    assert abs(hf["f16"] / cpp["f16"] - 1) < 0.02
    assert abs(inc_hf - inc_cpp) < INCREASE_TOL
    assert inc_hf > 0.05 and inc_cpp > 0.05  # the type does cost something: the check is not vacuous


@pytest.mark.slow
def test_the_labs_channel_scales_land_on_transformers_channels(smollm2_lm):
    """pyturbo.lab.trellis e2e scales K in transformers with scales computed from llama.cpp's dump.
    SmolLM2's GGUF (llama) interleaves RoPE pairs and transformers' loader permutes Q and K back, so
    the scales must be reordered (kvlab.transformers_order): layer 3's per-channel K RMS from the dump,
    reordered, is transformers' (correlation > 0.99; in the dump's own order it is unrelated, 0.04)."""
    from transformers import DynamicCache

    from pyturbo.lab import kvlab

    k_dump = kvlab.load(kvlab.dumped(smollm2_lm.gguf))[0]["k3"]  # [tokens, KV heads, head_dim]
    seen = {}

    class Capture(DynamicCache):
        def update(self, k, v, il, *args, **kwargs):
            if il == 3:
                seen["k"] = k[0].permute(1, 0, 2).float().numpy()
            return super().update(k, v, il, *args, **kwargs)

    text = data.corpus().read_text(encoding="utf-8")[:20000]
    ids = [smollm2_lm.bos_id, *smollm2_lm.tokenize(text, add_bos=False)][:512]
    with torch.inference_mode():
        smollm2_lm.model.model(input_ids=torch.tensor([ids]), past_key_values=Capture(config=smollm2_lm.model.config),
                               use_cache=True)
    dumped = {3: np.sqrt((k_dump ** 2).mean(0))}
    ours = np.sqrt((seen["k"] ** 2).mean(0)).ravel()
    same = np.corrcoef(kvlab.transformers_order(dumped)[3].ravel(), ours)[0, 1]
    other = np.corrcoef(dumped[3].ravel(), ours)[0, 1]
    print(f"per-channel K RMS, dump vs transformers: reordered {same:.4f}, as dumped {other:.4f}")
    assert same > 0.99 and abs(other) < 0.5
