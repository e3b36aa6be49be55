"""`pyturbo bench needle`: retrieval at long context, a hit table per cache configuration against f16.

A number (the needle) is hidden at several depths of filler text, and the model is asked for it at
the end, answered greedily:

    <filler ... "The secret number is 48213." ... filler>
    What is the secret number? The secret number is

A hit is an answer whose first digits are the number. Every configuration sees the same prompts
(same filler, same numbers, same positions in tokens), so the table compares caches, not luck.

`--style passkey` is the classic pass-key test instead, which a base model completes as readily
as an instruct one: the filler is one short paragraph repeated ("The grass is green. The sky is
blue. ..."), the needle "The pass key is 48213. Remember it. 48213 is the pass key.", the prompt
ends "What is the pass key? The pass key is". Repetitive filler leaves the needle the one thing
that differs, which makes attention's job easy for f16 and its errors visible for a cache.

Hits move in whole probes, so a few dozen probes cannot rank caches that differ by two. The table
also gives the log-probability of the number itself, teacher-forced after the question (natural
log, summed over its tokens), and its mean change against f16 over the same probes: a continuous
measure that says how close a cache is to losing a needle, hit or not.

  pyturbo bench needle [--model M] [--text botchan|pydoc|FILE] [--style secret|passkey]
                       [--ctx 4096 8192 16384] [--depths 0.1 0.5 0.9] [--trials 2]
                       [--types f16 q4_0 turboq3/turboq4:3 ...]
"""
from __future__ import annotations

import argparse
import math
import random
import re
import sys
import time
from dataclasses import dataclass

from .. import data
from .cpu import parse_config

NEEDLE_TYPES = ["f16", "q8_0", "q4_0", "turboq4", "turboq3:win32", "turboq3/turboq4:3", "turboq3", "turboq2"]
MAX_NEW = 8
# per style: the needle (with {n} for the number) and the question; the passkey style's filler
STYLES = {"secret": (" The secret number is {n}. ", "\n\nWhat is the secret number? The secret number is"),
          "passkey": (" The pass key is {n}. Remember it. {n} is the pass key. ", "\n\nWhat is the pass key? The pass key is")}
# a leading space and none after, so that copies join as the tokenizer splits running text
PASSKEY_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@dataclass(frozen=True)
class Probe:
    ctx: int
    depth: float
    trial: int
    number: str
    tokens: tuple[int, ...]


def make_probes(llm, text: str, ctxs: list[int], depths: list[float], trials: int, seed: int = 0,
                style: str = "secret") -> list[Probe]:
    """The prompts, in tokens: filler cut to ctx - (needle, question, answer room), the needle
    inserted at depth (a fraction of the filler), the question last. style: STYLES' key; "passkey"
    repeats its own filler instead of `text`."""
    tok = lambda s, bos=False: llm.tokenize(s.encode("utf-8"), add_bos=bos, special=False)
    needle_text, question = STYLES[style]
    if style == "passkey":
        unit = tok(PASSKEY_FILLER)
        filler = unit * (max(ctxs) // max(1, len(unit)) + 2)
    else:
        filler = tok(text)
    bos = tok("", bos=True)
    q = tok(question)
    rng = random.Random(seed)
    # room for the answer, and for the number teacher-forced where a tokenizer spends more on it
    room = max(MAX_NEW, len(tok(" 99999")))
    probes = []
    for ctx in ctxs:
        for trial in range(trials):
            # each trial reads the filler from another offset, so trials are different texts (for the
            # pass-key test, the same paragraphs from another phase)
            start = (trial * 7919) % max(1, len(filler) // 2)
            for depth in depths:
                number = str(rng.randrange(10000, 100000))
                needle = tok(needle_text.format(n=number))
                n_fill = ctx - len(bos) - len(needle) - len(q) - room - 1
                body = (filler[start:] + filler)[:n_fill]
                if len(body) < n_fill:
                    raise SystemExit(f"the text has {len(filler)} tokens; {n_fill} are needed at ctx {ctx}")
                at = int(depth * n_fill)
                probes.append(Probe(ctx, depth, trial, number, tuple(bos + body[:at] + needle + body[at:] + q)))
    return probes


def _hit(answer: str, number: str) -> bool:
    digits = re.sub(r"[^0-9]", "", answer.split("\n")[0])
    return digits.startswith(number)


def open_llama(model, config: str, ctx: int, threads: int):
    """A pyturbo.Llama with config's cache: its types, layer mode and exact window as parameters
    (llama-cpp-python reads no LLAMA_ARG_* alias), the debug switches (':unscaled', ...) in the
    environment while the model and its caches are set up, which is when libllama reads them."""
    from .. import exact_window, k_centering
    from ..llama import Llama, scoped_env
    _, k, v, env = parse_config(config)
    la = int(env.pop("LLAMA_ARG_LAYER_ADAPTIVE", 0) or 0)
    window = exact_window.env_window(env)  # -1: auto; None: the model's (auto beside a turboq cache)
    env.pop(exact_window.ENV, None)
    margin = env.pop(exact_window.MARGIN_ENV, None)
    sink = exact_window.setting(env.pop(exact_window.SINK_ENV, None))  # None: the model's, else auto
    center = env.pop(k_centering.ENV, None)
    scale = env.pop(k_centering.SCALE_ENV, None)
    with scoped_env(env):
        return Llama(str(model), n_ctx=ctx, n_batch=2048, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                     flash_attn=True, cache_type_k=k, cache_type_v=v, layer_adaptive=la or None,
                     kv_exact_window=window, kv_exact_window_margin=None if margin is None else int(margin),
                     kv_exact_sink=sink,
                     k_center=None if center is None else center == "on", k_scale=scale, verbose=False)


@dataclass(frozen=True)
class Answer:
    hit: bool
    text: str        # the greedy answer
    logprob: float   # log p(the number | prompt), teacher-forced


def _last_logits(llm):
    import numpy as np
    import llama_cpp
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float64)


def _log_p(z, token: int) -> float:
    import numpy as np
    m = z.max()
    return float(z[token] - m - math.log(np.exp(z - m).sum()))


def answer_probe(llm, p: Probe) -> Answer:
    """The greedy answer, decoded as llama-cpp-python's greedy completion decodes it (the prompt in
    one evaluation, then a token at a time), then the number's tokens teacher-forced from where the
    answer leaves them: the logits already computed serve as far as the answer agrees, and the cache
    is rolled back to that point for the rest, so the prompt is evaluated once."""
    target = llm.tokenize(f" {p.number}".encode(), add_bos=False, special=False)
    prompt = list(p.tokens)
    llm.reset()
    llm.eval(prompt)
    logits, answer = [_last_logits(llm)], []
    while len(answer) < MAX_NEW:
        t = int(logits[-1].argmax())
        if t == llm.token_eos():
            break
        answer.append(t)
        llm.eval([t])
        logits.append(_last_logits(llm))
    text = llm.detokenize(answer, prev_tokens=prompt).decode("utf-8", errors="ignore")  # as create_completion
    agree = 0
    while agree < min(len(answer), len(target)) and answer[agree] == target[agree]:
        agree += 1
    logprob = sum(_log_p(logits[i], target[i]) for i in range(min(agree + 1, len(target))))
    if agree + 1 < len(target):
        llm.n_tokens = len(prompt) + agree  # eval drops the cache's rows from here on
        for i in range(agree, len(target) - 1):
            llm.eval([target[i]])
            logprob += _log_p(_last_logits(llm), target[i + 1])
    return Answer(_hit(text, p.number), text, logprob)


def run_config(model, config: str, probes: list[Probe], threads: int) -> dict[tuple[int, float, int], Answer]:
    out = {}
    for ctx in sorted({p.ctx for p in probes}):
        llm = open_llama(model, config, ctx, threads)
        try:
            for p in (p for p in probes if p.ctx == ctx):
                t0 = time.time()
                a = answer_probe(llm, p)
                out[(p.ctx, p.depth, p.trial)] = a
                print(f"# {config} ctx {ctx} depth {p.depth} trial {p.trial}: {p.number} -> {a.text!r} "
                      f"(log p {a.logprob:.3f}; {time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        finally:
            llm.close()
    return out


def needle(args: argparse.Namespace) -> None:
    from ..llama import Llama
    model, text = data.model_path(args.model), data.corpus_path(args.text)
    types = ["f16", *[t for t in args.types if t != "f16"]]
    tok = Llama(str(model), vocab_only=True, verbose=False)
    try:
        probes = make_probes(tok, text.read_text(encoding="utf-8"), args.ctx, args.depths, args.trials,
                             style=args.style)
    finally:
        tok.close()
    results = {t: run_config(model, t, probes, args.threads) for t in types}
    cells = sorted({(p.ctx, p.depth) for p in probes})
    where = "repeated filler (the pass-key test)" if args.style == "passkey" else text.name
    print(f"\n{model.name}, needle in {where}, greedy; hits of {args.trials} trial(s) per cell; "
          "'same as f16' counts probes whose answers equal f16's; log p: the number's log-probability, "
          "teacher-forced, the mean over probes, and its mean change against f16's on the same probes\n")
    print("| K/V | " + " | ".join(f"{f'{c // 1024}k' if c % 1024 == 0 else c} @ {d:.0%}" for c, d in cells)
          + " | hits | same answers as f16 | log p, mean | vs f16 |")
    print("|---|" + "---|" * (len(cells) + 4))
    base = results["f16"]
    for t in types:
        r = results[t]
        row = [sum(r[(c, d, i)].hit for i in range(args.trials)) for c, d in cells]
        same = sum(r[key].text == base[key].text for key in r)
        mean = sum(a.logprob for a in r.values()) / len(r)
        delta = sum(r[key].logprob - base[key].logprob for key in r) / len(r)
        print(f"| {t} | " + " | ".join(f"{h}/{args.trials}" for h in row)
              + f" | {sum(row)}/{len(r)} | {same}/{len(r)} | {mean:.3f} | {delta:+.3f} |")


def add_parsers(sub) -> None:
    n = sub.add_parser("needle", help="retrieval of a number hidden in long filler text, hits per cache type vs f16")
    n.add_argument("--model", help="a GGUF path or gemma3-270m / smollm2-135m (default: Gemma 3 270M)")
    n.add_argument("--text", help="the filler: a text file, or botchan / pydoc (default: botchan)")
    n.add_argument("--style", choices=sorted(STYLES), default="secret",
                   help="secret: a number in --text; passkey: the pass-key test in repeated filler")
    n.add_argument("--ctx", type=int, nargs="+", default=[4096, 8192, 16384])
    n.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    n.add_argument("--trials", type=int, default=2)
    n.add_argument("--threads", type=int, default=2)
    n.add_argument("--types", nargs="+", default=NEEDLE_TYPES,
                   help="'t' or 'k/v', plus ':N' (layer mode), ':winW' (exact window; ':winauto' sized by the context), ':winWmM' (and its margin), ':unscaled', ':scaled', ':uncentered'")
    n.set_defaults(func=needle)
