"""Trellis-coded quantization (issue 21's lever), measured in the lab: a bit-shift trellis over the
rotated coordinates of a group, as QTIP and the turbo*_tcq forks use it.

Each value still costs `bits` bits, but the value it decodes to is read from a codebook of 2^L
entries by the state, the last L bits of the code stream: s_t = ((s_{t-1} << bits) | c_t) mod 2^L,
s_{-1} = 0. The encoder picks the whole path at once (Viterbi), so a group of 128 values is
quantized as one vector from a code of 2^(128*bits) paths, which is where the gain over the
scalar Lloyd-Max codebook comes from. The decoder stays a table lookup per value; the encoder
costs 2^L states per value, which is what a shipped type would pay on every token written.

    python -m pyturbo.lab.trellis                 # Gaussian MSE of the trellises against Lloyd-Max
    python -m pyturbo.lab.trellis e2e --chunks 20 # KLD vs the exact cache, the model in transformers
    python -m pyturbo.lab.trellis e2e --chunks 10 --states 6 8 --seeds 2   # 64 and 256 states, 2 draws
    python -m pyturbo.lab.trellis e2e --chunks 1 --ctx 8192 --text pydoc --states 6   # at c=8192
    python -m pyturbo.lab.trellis e2e --model smollm2-135m --sink 1 --states 6   # head 64: 64-value groups

`e2e` is end to end without a C encoder: the bundled model runs in transformers on chunks of
botchan.txt (or `--text`) as llama-perplexity takes them (BOS first, 512 tokens or `--ctx`, one
forward each), with a
cache that hands attention every K and V row encoded and decoded by a pyturbo.lab.kvlab codec
(K centered on the chunk's own mean, where the product uses a calibrated one, and
channel-scaled), and the mean KLD of the positions llama-perplexity scores against the same
model with the exact cache.
"""
from __future__ import annotations

import numpy as np

from ..format.codebook import lloyd_max
from ..format.trellis import quantize


def main() -> None:
    rng = np.random.default_rng(1)
    g = rng.standard_normal((2048, 128))
    y = g / np.linalg.norm(g, axis=1, keepdims=True) * np.sqrt(128)  # a rotated unit vector's coordinates, scaled
    print("| bits | quantizer | MSE per value (unit variance) | vs Lloyd-Max |")
    print("|---|---|---|---|")
    for bits in (2, 3):
        lm = lloyd_max(bits)  # the shipped scalar codebook
        c, t = lm.centroids * np.sqrt(128), lm.thresholds * np.sqrt(128)
        base = float(np.mean((y - c[np.searchsorted(t, y)]) ** 2))
        print(f"| {bits} | Lloyd-Max (scalar) | {base:.5f} | 1.00x |", flush=True)
        for L in (6, 8, 10, 12):
            if L <= bits:
                continue
            e = float(np.mean((y - quantize(y, bits, L)) ** 2))
            print(f"| {bits} | trellis, 2^{L} states | {e:.5f} | {e / base:.2f}x |", flush=True)


def e2e(n_chunks: int, threads: int = 2, seeds: tuple[int | None, ...] = (None,), states: tuple[int, ...] = (8,),
        baselines: bool = True, n: int = 512, text: str | None = None, model: str | None = None,
        sink: int = 0) -> None:
    import torch
    from transformers import DynamicCache

    from .. import data
    from ..gguf_meta import read_metadata
    from ..hf import load
    from . import kvlab

    torch.set_num_threads(threads)
    lm = load(model)
    lab = kvlab.load(kvlab.dumped(lm.gguf))  # the dump's Q/K give the channel scale
    neox = kvlab.rope_neox(read_metadata(lm.gguf).get("general.architecture"))
    scales = kvlab.channel_scales(lab, neox)
    if not neox:  # the dump is in llama.cpp's channel order, the model here in transformers'
        scales = kvlab.transformers_order(scales)
    # a head of 64 (SmolLM2) stores its twin, 64-value groups with their own norm
    G = min(kvlab.D, lab[0]["k0"].shape[2])
    V = kvlab.Variant
    configs = {"q4_0": lambda s: (kvlab.mainline("q4_0"),) * 2} if baselines and G == kvlab.D else {}
    for b in (3, 2):
        if baselines:
            configs[f"turboq{b}"] = lambda s, b=b: (kvlab.tq(V(b, seed=s, group=G), protect=sink, scales=scales),
                                                    kvlab.tq(V(b, seed=s, group=G), protect=sink))
        for L in states:
            configs[f"turboq{b}, trellis 2^{L}"] = lambda s, b=b, L=L: (
                kvlab.tq(V(b, seed=s, trellis=L, group=G), protect=sink, scales=scales),
                kvlab.tq(V(b, seed=s, trellis=L, group=G), protect=sink))

    class Coded(DynamicCache):
        def __init__(self, k, v):
            super().__init__(config=lm.model.config)
            self.k, self.v = k, v

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            def code(t, f, which):
                x = t[0].permute(1, 0, 2).float().numpy()           # [T, H, D]
                return torch.from_numpy(f(x, layer_idx, which)).permute(1, 0, 2)[None].to(t.dtype)
            return super().update(code(key_states, self.k, "k"), code(value_states, self.v, "v"), layer_idx,
                                  *args, **kwargs)

    # llama-perplexity's chunks: the text tokenized after a BOS, cut every n tokens, each chunk's
    # first token replaced by BOS
    tokens = [lm.bos_id, *lm.tokenize(data.corpus_path(text).read_text(encoding="utf-8"), add_bos=False)]
    chunks = [[lm.bos_id, *tokens[i * n + 1:(i + 1) * n]] for i in range(n_chunks)]
    if len(chunks[-1]) < n:
        raise SystemExit(f"the text has {len(tokens)} tokens: fewer than {n_chunks} chunks of {n}")
    cap = getattr(lm.model.config, "final_logit_softcapping", None)

    def hidden(ids, cache):
        """The final hidden states of the positions llama-perplexity scores (n/2 .. n-2, each
        predicting the next token): the vocabulary's logits are made from them a slice at a time,
        as a long chunk's would not fit in memory at once."""
        with torch.inference_mode():
            out = lm.model.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        return out.last_hidden_state[0, n // 2:n - 1]

    def logp(h):
        with torch.inference_mode():
            logits = lm.model.lm_head(h)
            if cap:
                logits = torch.tanh(logits / cap) * cap
        return torch.log_softmax(logits.double(), -1)

    def kld(hp, hq, rows=256):
        out = []
        for a in range(0, len(hp), rows):
            lp, lq = logp(hp[a:a + rows]), logp(hq[a:a + rows])
            out.append((lp.exp() * (lp - lq)).sum(-1).numpy())
        return np.concatenate(out)

    base = [hidden(c, DynamicCache(config=lm.model.config)) for c in chunks]
    print(f"{lm.gguf.name}: {n_chunks} chunks of {n} (second half scored), KLD vs the exact cache, mean over the "
          f"chunks' tokens; {len(seeds)} rotation draw(s); {G}-value groups; first {sink} token(s) exact\n\n"
          "| K/V | mean KLD | median | p99.9 |\n|---|---|---|---|", flush=True)
    for name, make in configs.items():
        for s in seeds:
            klds = []
            for c, hp in zip(chunks, base):
                klds.append(kld(hp, hidden(c, Coded(*make(s)))))
            k = np.concatenate(klds)
            print(f"| {name}{'' if s is None else f' (draw {s})'} | {k.mean():.5f} | {np.median(k):.5f} | "
                  f"{np.quantile(k, 0.999):.4f} |", flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", choices=("mse", "e2e"), default="mse")
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=1, help="rotation draws (the shipped one + N-1 others)")
    ap.add_argument("--states", type=int, nargs="+", default=[8], help="e2e: the trellises' L (2^L states)")
    ap.add_argument("--no-baselines", action="store_true", help="e2e: the trellis rows only (not q4_0, turboq3, turboq2)")
    ap.add_argument("--ctx", type=int, default=512, help="e2e: tokens per chunk (llama-perplexity's -c)")
    ap.add_argument("--text", help="e2e: a text file, or botchan / pydoc (default: botchan)")
    ap.add_argument("--model", help="e2e: a GGUF path, gemma3-270m or smollm2-135m (default: the bundled Gemma 3)")
    ap.add_argument("--sink", type=int, default=0, help="e2e: the first N tokens kept exact, as sink rows keep them")
    a = ap.parse_args()
    if a.what == "e2e":
        e2e(a.chunks, a.threads, (None, *range(1, a.seeds)), tuple(a.states), not a.no_baselines, a.ctx, a.text,
            a.model, a.sink)
    else:
        main()
