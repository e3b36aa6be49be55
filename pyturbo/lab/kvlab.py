"""K/V lab: real attention tensors from a model, replayed in NumPy with any K/V encoder variant.

    python -m pyturbo kvlab dump --chunks 2              # Q/K/V of every layer -> ~/.cache/pyturbo/kvlab/
    python -m pyturbo kvlab replay --only turboq3         # the variant table (3 rotation draws each)
    python -m pyturbo kvlab validate                     # + llama-perplexity KLD and the rank correlation

`dump` runs the model (f16 cache, flash attention) on chunks of botchan.txt as
llama-perplexity does (first token of each chunk replaced by BOS) and keeps the post-RoPE
"Qcur"/"Kcur"/"Vcur" tensors of each layer through llama.cpp's graph eval callback.
`replay` re-runs each layer's causal attention with K and V passed through an encoder
variant and reports, per layer and summed, the errors that end-to-end KLD is made of: the
logit error, the softmax-mass error (total variation) and the attention-output error, over the
query rows that llama-perplexity scores (the second half of each chunk).
"""
from __future__ import annotations

import ctypes as C
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from .. import k_centering
from .._paths import cache_dir
from ..format import reference as ref
from ..format import trellis
from ..format.codebook import D, codebooks, lloyd_max, thresholds
from ..format.signs import sign_lists

GGML_MAX_DIMS = 4
GGML_MAX_OP_PARAMS = 64
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64
GGML_TYPE_F32 = 0
GGML_OP_ROPE = 48  # enum ggml_op of the pinned ggml


class _Tensor(C.Structure):
    """struct ggml_tensor of the pinned ggml (ggml.h); only read, never allocated here."""
    _fields_ = [("type", C.c_int), ("buffer", C.c_void_p),
                ("ne", C.c_int64 * GGML_MAX_DIMS), ("nb", C.c_size_t * GGML_MAX_DIMS),
                ("op", C.c_int), ("op_params", C.c_int32 * (GGML_MAX_OP_PARAMS // 4)), ("flags", C.c_int32),
                ("src", C.c_void_p * GGML_MAX_SRC), ("view_src", C.c_void_p), ("view_offs", C.c_size_t),
                ("data", C.c_void_p), ("name", C.c_char * GGML_MAX_NAME), ("extra", C.c_void_p),
                ("padding", C.c_char * 8)]


def lab_dir() -> Path:
    p = cache_dir() / "kvlab"
    p.mkdir(parents=True, exist_ok=True)
    return p


def dump(model: Path, text: Path, n_ctx: int = 512, chunks: int = 4, out: Path | None = None) -> Path:
    """Write {out}/chunk{i}.npz with q{il}, k{il}, v{il} as float32 [T, heads, head_dim]."""
    from ..llama import llama_cpp  # sets the library path to the patched build first

    out = out or lab_dir() / model.stem
    out.mkdir(parents=True, exist_ok=True)
    want = ("Qcur-", "Kcur-", "Vcur-")
    seen: dict[str, np.ndarray] = {}
    ops: dict[str, int] = {}

    @llama_cpp.ggml_backend_sched_eval_callback
    def cb(t_ptr, ask, _ud):
        t = C.cast(t_ptr, C.POINTER(_Tensor)).contents
        name = t.name.decode(errors="replace")
        if not name.startswith(want) or not name.split("-", 1)[1].isdigit():
            return False if ask else True
        if ask:
            return True
        if t.type != GGML_TYPE_F32 or not t.data:
            return True
        ne = [t.ne[i] for i in range(4)]
        nb = [t.nb[i] for i in range(4)]
        nbytes = sum((ne[i] - 1) * nb[i] for i in range(4)) + 4
        buf = (C.c_char * nbytes).from_address(t.data)
        a = np.ndarray(shape=ne[::-1], dtype=np.float32, buffer=buf, strides=nb[::-1])
        seen[name] = np.array(a[0])
        ops[name] = t.op  # [tokens, heads, head_dim]; the last tensor of a name wins (post-RoPE)
        return True

    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    m = llama_cpp.llama_model_load_from_file(str(model).encode(), mp)
    if not m:
        raise RuntimeError(f"cannot load {model}")
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = n_ctx
    cp.n_ubatch = n_ctx
    cp.n_threads = cp.n_threads_batch = 2
    cp.flash_attn_type = 1
    cp.cb_eval = cb
    cp.cb_eval_user_data = None
    ctx = llama_cpp.llama_init_from_model(m, cp)
    vocab = llama_cpp.llama_model_get_vocab(m)
    raw = text.read_text(encoding="utf-8").encode()
    toks = (llama_cpp.llama_token * (len(raw) + 16))()
    n = llama_cpp.llama_tokenize(vocab, raw, len(raw), toks, len(toks), True, False)
    bos = llama_cpp.llama_vocab_bos(vocab)
    mem = llama_cpp.llama_get_memory(ctx)
    for ci in range(chunks):
        if (ci + 1) * n_ctx > n:
            break
        chunk = list(toks[ci * n_ctx:(ci + 1) * n_ctx])
        chunk[0] = bos
        arr = (llama_cpp.llama_token * n_ctx)(*chunk)
        llama_cpp.llama_memory_clear(mem, True)
        seen.clear()
        rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, n_ctx))
        if rc != 0:
            raise RuntimeError(f"llama_decode failed: {rc}")
        not_roped = [k for k in seen if k[0] in "QK" and ops[k] != GGML_OP_ROPE]
        if not_roped:
            raise RuntimeError(f"expected the post-RoPE tensors, got other ops for {not_roped[:3]}")
        arrays = {k[0].lower() + k.split("-")[1]: v for k, v in seen.items()}
        np.savez(out / f"chunk{ci}.npz", **arrays)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(m)
    return out


def load(path: Path) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(f)) for f in sorted(path.glob("chunk*.npz"))]


def lab_path(model: Path, ctx: int = 512) -> Path:
    """Where the lab keeps model's chunks of ctx tokens."""
    return lab_dir() / (model.stem if ctx == 512 else f"{model.stem}-c{ctx}")


def dumped(model: Path, ctx: int = 512, chunks: int = 2) -> Path:
    """lab_path(model, ctx), dumped first (chunks of botchan.txt) when it holds no chunk."""
    from .. import data

    path = lab_path(model, ctx)
    if not any(path.glob("chunk*.npz")):
        dump(model, data.corpus(), n_ctx=ctx, chunks=chunks, out=path)
    return path


# ---- encoder variants (float64 NumPy; the shipped codec is `Variant(bits)` with the built-in signs) ----

@lru_cache(maxsize=None)
def rotation(kind: str = "wht", seed: int | None = None, d: int = D) -> np.ndarray:
    """Orthogonal R [128,128] with y = R x: the randomized WHT (signs from pyturbo.format.signs;
    seed None = the shipped signs), or RotorQuant's block rotations:
    "planar" (random 2-D Givens rotations of pairs) and "iso" (random 4-D rotations, the
    quaternion blocks)."""
    if kind == "wht":
        s = np.concatenate(sign_lists(seed))
        h = np.array([[1.0]])
        while h.shape[0] < d:
            h = np.block([[h, h], [h, -h]])
        return (s[D:D + d, None] * h * s[None, :d]) / np.sqrt(d)
    rng = np.random.default_rng(0 if seed is None else seed)
    b = {"planar": 2, "iso": 4}[kind]
    r = np.zeros((d, d))
    for i in range(0, d, b):
        q, rr = np.linalg.qr(rng.standard_normal((b, b)))
        r[i:i + b, i:i + b] = q * np.sign(np.diag(rr))
    return r


@dataclass(frozen=True)
class Variant:
    """How one 128-group is encoded. bits: 2/3/4 (Lloyd-Max levels) or 8 (absmax grid)."""
    bits: int
    scale: str = "corrected"   # corrected ||x||/||c|| | ls <y,c>/||c||^2 | unbiased ||y||^2/<y,c> | search
    halves: bool = False       # a second scale for rotated coordinates 64..127 (turboq4's rnorm field)
    alpha: float = 1.0         # multiplier on the stored scale (the forks' 1.02)
    rot: str = "wht"           # wht | planar | iso
    qjl: bool = False          # (bits)-bit MSE codes + a 1-bit QJL sketch of the residual, ||r|| in rnorm
    seed: int | None = None    # rotation draw
    group: int = D             # values per rotation group (and fp16 norm): 128 ships; 64 and 32 for
                               # heads that are not a multiple of 128 (issue 22), with their own codebooks
    trellis: int = 0           # L > 0: the bits index a bit-shift trellis of 2^L states (pyturbo.lab.trellis)
                               # instead of the scalar codebook, at the same bits per value

    @property
    def name(self) -> str:
        return f"turboq{self.bits}"


def _nearest(y: np.ndarray, name: str, group: int = D) -> np.ndarray:
    thr = thresholds()[name] if group == D else _lloyd_max(group, int(name[-1]))[1]
    return np.searchsorted(thr, y.ravel(), side="left").reshape(y.shape)


def _lloyd_max(d: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(centroids, thresholds) of the Lloyd-Max quantizer for groups of d values (pyturbo.format.codebook's)."""
    lm = lloyd_max(bits, d=d)
    return lm.centroids, lm.thresholds


def _ls(y: np.ndarray, c: np.ndarray) -> np.ndarray:
    den = np.sum(c * c, -1, keepdims=True)
    return np.divide(np.sum(y * c, -1, keepdims=True), den, out=np.zeros_like(den), where=den > 0)


def encode_decode(x: np.ndarray, v: Variant) -> np.ndarray:
    """x [..., head_dim] -> decoded x_hat, groups of 128 along the last axis."""
    shape = x.shape
    G = v.group
    g = x.reshape(-1, G).astype(np.float64)
    nrm = np.sqrt(np.sum(g * g, 1, keepdims=True))
    nrm = np.where(nrm == 0, 1, nrm)
    R = rotation(v.rot, v.seed, G)
    y = (g / nrm) @ R.T
    cb = codebooks()[v.name].astype(np.float64) if G == D or v.bits == 8 else _lloyd_max(G, v.bits)[0]
    if v.trellis:
        c = trellis.quantize(y * np.sqrt(G), v.bits, v.trellis) / np.sqrt(G)
    elif v.bits == 8:
        a = np.max(np.abs(y), 1, keepdims=True)
        c = cb[np.clip(np.floor(y * (127.5 / a) + 128.0), 0, 255).astype(int)] * a
    else:
        c = cb[_nearest(y, v.name, G)]
    out = np.zeros_like(y)
    for sl in ([slice(0, G // 2), slice(G // 2, G)] if v.halves else [slice(0, G)]):
        yy, cc = y[:, sl], c[:, sl]
        if v.scale == "corrected":
            s = np.sqrt(np.sum(yy * yy, 1, keepdims=True) / np.maximum(np.sum(cc * cc, 1, keepdims=True), 1e-30))
        elif v.scale == "ls":
            s = _ls(yy, cc)
        elif v.scale == "unbiased":
            s = np.sum(yy * yy, 1, keepdims=True) / np.sum(yy * cc, 1, keepdims=True)
        elif v.scale == "search":  # alternate: indices for the scale, least-squares scale for the indices
            s = _ls(yy, cc)
            for _ in range(4 if v.bits < 8 else 0):
                cc = cb[_nearest(yy / np.where(s == 0, 1, s), v.name, G)]
                s = _ls(yy, cc)
        else:
            raise ValueError(v.scale)
        out[:, sl] = s * v.alpha * cc
    xh = (out @ R) * nrm
    if v.qjl:
        r = g - xh
        S = np.random.default_rng(1234 if v.seed is None else v.seed + 1).standard_normal((G, G))
        rn = np.sqrt(np.sum(r * r, 1, keepdims=True))
        xh = xh + rn * np.sqrt(np.pi / 2) / G * (np.sign(r @ S.T) @ S)
    return xh.astype(np.float32).reshape(shape)


def q_mainline(x: np.ndarray, kind: str) -> np.ndarray:
    """q8_0 / q4_0 on 32-value blocks after a 128-point Hadamard (mainline's attn_rot)."""
    shape = x.shape
    g = x.reshape(-1, D).astype(np.float32)
    h = ref.fwht(g) / np.float32(np.sqrt(D))
    b = h.reshape(-1, 32)
    if kind == "q8_0":
        d = np.max(np.abs(b), 1, keepdims=True) / 127
        r = np.round(b / np.where(d == 0, 1, d)) * d
    else:
        mx = b[np.arange(len(b)), np.argmax(np.abs(b), 1)][:, None]
        d = mx / -8
        r = (np.clip(np.floor(b / np.where(d == 0, 1, d) + 8.5), 0, 15) - 8) * d
    r = r.reshape(-1, D).astype(np.float16).astype(np.float32)
    return (ref.fwht(r) / np.float32(np.sqrt(D))).reshape(shape)


# ---- replay ----

@dataclass
class LayerError:
    logit_rmse: float  # RMS error of the scaled logits over the scored causal entries
    tv: float          # mean total variation between the softmax rows
    out_rel: float     # sum ||o_hat - o||^2 / sum ||o||^2


def replay_layer(q: np.ndarray, k: np.ndarray, v: np.ndarray, kh: np.ndarray, vh: np.ndarray,
                 scale: float, window: int = 0, recent: int = 0) -> LayerError:
    """`window`: the layer's sliding window; `recent`: each query reads its own last `recent`
    keys and values exact (an f16 tail that quantizes a token as it leaves it)."""
    T, Hq, _ = q.shape
    Hk = k.shape[1]
    rows = np.arange(T // 2, T)
    pos = np.arange(T)
    mask = pos[None, :] <= rows[:, None]
    if window:
        mask &= rows[:, None] - pos[None, :] < window
    tail = mask & (rows[:, None] - pos[None, :] < recent)
    se = tv = on = od = 0.0
    cnt = 0
    for h in range(Hq):
        j = h // (Hq // Hk)
        qs = q[rows, h].astype(np.float64) * scale
        L = qs @ k[:, j].astype(np.float64).T
        Lh = np.where(tail, L, qs @ kh[:, j].astype(np.float64).T)
        d = np.where(mask, Lh - L, 0)
        L = np.where(mask, L, -np.inf)
        Lh = np.where(mask, Lh, -np.inf)
        se += np.sum(d * d)
        cnt += np.sum(mask)
        P = np.exp(L - L.max(1, keepdims=True)); P /= P.sum(1, keepdims=True)
        Ph = np.exp(Lh - Lh.max(1, keepdims=True)); Ph /= Ph.sum(1, keepdims=True)
        tv += 0.5 * np.sum(np.abs(P - Ph))
        o = P @ v[:, j].astype(np.float64)
        oh = Ph @ vh[:, j].astype(np.float64) + (Ph * tail) @ (v[:, j] - vh[:, j]).astype(np.float64)
        on += np.sum((oh - o) ** 2)
        od += np.sum(o * o)
    return LayerError(float(np.sqrt(se / cnt)), float(tv / (Hq * len(rows))), float(on / od))


Codec = Callable[[np.ndarray, int, str], np.ndarray]  # (x [T,H,D], layer, "k"|"v") -> x_hat


def replay(chunks: list[dict[str, np.ndarray]], k_codec: Codec, v_codec: Codec, scale: float,
           windows: dict[int, int] | None = None, recent: int = 0) -> list[LayerError]:
    """Per-layer errors averaged over the chunks."""
    n_layer = sum(1 for key in chunks[0] if key.startswith("k"))
    res = []
    for il in range(n_layer):
        errs = []
        for ch in chunks:
            q, k, v = ch[f"q{il}"], ch[f"k{il}"], ch[f"v{il}"]
            errs.append(replay_layer(q, k, v, k_codec(k, il, "k"), v_codec(v, il, "v"), scale,
                                     (windows or {}).get(il, 0), recent))
        res.append(LayerError(*(float(np.mean([getattr(e, f) for e in errs]))
                                for f in ("logit_rmse", "tv", "out_rel"))))
    return res


# ---- the variant table ----

def tq(v: Variant, center: bool = True, protect: int = 0, scales: dict[int, np.ndarray] | None = None) -> Codec:
    """A turboq codec as a replay codec: K centered on the mean of the chunk, the first `protect`
    tokens kept exact (an f16 side-car); with `scales` (layer -> [KV heads, head_dim], see
    channel_scales) K is stored as (k - mu)*s and read back as k'/s + mu, which is what attention
    with q/s against the stored k' computes."""
    def f(x: np.ndarray, il: int, which: str) -> np.ndarray:
        mu = x.mean(0, keepdims=True) if center and which == "k" else 0
        s = scales[il][None] if scales is not None and which == "k" else 1
        xh = encode_decode((x - mu) * s, v) / s + mu
        if protect:
            xh[:protect] = x[:protect]
        return xh
    return f


def rope_neox(arch: str | None) -> bool:
    """Whether a GGUF architecture's RoPE pairs channels (c, c + d/2) (NEOX) rather than (2c, 2c + 1),
    for the architectures run here, as llama.cpp decides."""
    return arch not in ("llama", "mistral", "granite")


def transformers_order(scales: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Per-channel K scales of a non-NEOX model in transformers' channel order: llama.cpp's dump keeps
    the GGUF's interleaved RoPE pairs (2c, 2c + 1), and transformers' GGUF loader permutes Q and K back
    to (c, c + d/2), so its channel j*d/2 + c is the dump's 2c + j."""
    return {il: np.concatenate([s[:, 0::2], s[:, 1::2]], 1) for il, s in scales.items()}


def channel_scales(chunks: list[dict[str, np.ndarray]], neox: bool = True) -> dict[int, np.ndarray]:
    """The K channel scale of llama-turboq-center.cpp (channel_scale) per layer, [KV heads, head_dim], from
    the chunks' post-RoPE Q and K: s = (E[q^2]/E[(k - mu)^2])^(1/4) over each RoPE pair (NEOX pairs
    (c, c + D/2) as in Gemma, else (2c, 2c+1)), floors of 1e-3 of the head's mean energy, clipped to
    [1e-3, 1e3], geometric mean 1 per head."""
    out = {}
    n_layer = sum(1 for key in chunks[0] if key.startswith("k"))
    for il in range(n_layer):
        q = np.concatenate([c[f"q{il}"] for c in chunks]).astype(np.float64)
        k = np.concatenate([c[f"k{il}"] for c in chunks]).astype(np.float64)
        hq, hk, d = q.shape[1], k.shape[1], k.shape[2]
        a = (q ** 2).mean(0).reshape(hk, hq // hk, d).mean(1)
        b = k.var(0)
        pa = a + (np.roll(a, d // 2, 1) if neox else a.reshape(hk, d // 2, 2)[:, :, ::-1].reshape(hk, d))
        pb = b + (np.roll(b, d // 2, 1) if neox else b.reshape(hk, d // 2, 2)[:, :, ::-1].reshape(hk, d))
        pa += 1e-3 * a.mean(1, keepdims=True)
        pb += 1e-3 * b.mean(1, keepdims=True)
        e = np.clip((pa / pb) ** 0.25, 1e-3, 1e3)
        out[il] = (e / np.exp(np.log(e).mean(1, keepdims=True))).astype(np.float32)
    return out


def kvarn(bits: int, per: str, tile: int = 128, rounds: int = 4) -> Codec:
    """A reading of KVarN (arXiv 2606.03458, from its description, not its code) as a replay codec:
    per KV head and tile of `tile` tokens, the Hadamard along channels (turboq's, in groups of up to
    128), then `rounds` of log-space Sinkhorn normalization (each token's RMS, then each channel's,
    kept as fp16 exponents), then asymmetric round-to-nearest at `bits` with an fp16 minimum and
    step per channel (`per="channel"`, its K) or per token (`"token"`, its V). Without its fp16
    tail for the open tile (which is an exact window by another name)."""
    def f(x: np.ndarray, il: int, which: str) -> np.ndarray:
        T, H, d = x.shape
        g = min(d, D)
        R = np.kron(np.eye(d // g), rotation("wht", None, g))
        out = np.empty(x.shape, np.float64)
        for h in range(H):
            for t0 in range(0, T, tile):
                X = x[t0:t0 + tile, h].astype(np.float64) @ R.T
                r, c = np.zeros(X.shape[0]), np.zeros(d)
                for _ in range(rounds):
                    Y = X / np.exp(r)[:, None] / np.exp(c)[None, :]
                    r += np.log(np.sqrt((Y * Y).mean(1)) + 1e-30)
                    Y = X / np.exp(r)[:, None] / np.exp(c)[None, :]
                    c += np.log(np.sqrt((Y * Y).mean(0)) + 1e-30)
                r, c = (a.astype(np.float16).astype(np.float64) for a in (r, c))
                Y = X / np.exp(r)[:, None] / np.exp(c)[None, :]
                ax = 0 if per == "channel" else 1
                lo = Y.min(ax, keepdims=True).astype(np.float16).astype(np.float64)
                step = ((Y.max(ax, keepdims=True) - lo) / (2 ** bits - 1)).astype(np.float16).astype(np.float64)
                step = np.where(step == 0, 1, step)
                Yh = np.clip(np.round((Y - lo) / step), 0, 2 ** bits - 1) * step + lo
                out[t0:t0 + tile, h] = (Yh * np.exp(r)[:, None] * np.exp(c)[None, :]) @ R
        return out.astype(np.float32)
    return f


def kvarn_bpw(bits: int, per: str, d: int, tile: int = 128) -> float:
    """Bits per value of `kvarn`: the codes, the fp16 minimum and step (per channel and tile, or per
    token), the fp16 token exponent (per token) and channel exponent (per channel and tile)."""
    return bits + (32 / tile if per == "channel" else 32 / d) + 16 / d + 16 / tile


def mainline(kind: str) -> Codec:
    return lambda x, il, which: q_mainline(x, kind)


def exact(x: np.ndarray, il: int, which: str) -> np.ndarray:
    return x


def variant_table(scales: dict[int, np.ndarray] | None = None, ctx: int = 512,
                  d: int = D) -> list[tuple[str, float, Callable[[int | None], tuple[Codec, Codec]]]]:
    """(name, bits per value of K and V together, seed -> (K codec, V codec)); with `scales`,
    also the rows of the K channel scale; d: the model's head size (KVarN's bits depend on it)."""
    V = Variant
    rows: list = [
        ("f16 K / turboq3 V", 9.5625, lambda s: (exact, tq(V(3, seed=s)))),
        ("q8_0", 8.5, lambda s: (mainline("q8_0"),) * 2),
        ("q4_0", 4.5, lambda s: (mainline("q4_0"),) * 2),
    ]
    bpw = {2: 2.125, 3: 3.125, 4: 4.25, 8: 8.125}
    for b in (8, 4, 3, 2):
        rows.append((f"turboq{b} uncentered", bpw[b], lambda s, b=b: (tq(V(b, seed=s), False), tq(V(b, seed=s)))))
        rows.append((f"turboq{b} (K centered)", bpw[b], lambda s, b=b: (tq(V(b, seed=s)), tq(V(b, seed=s)))))
    for b in (4, 3, 2):
        for sc in ("ls", "unbiased", "search"):
            rows.append((f"turboq{b} + {sc} scale", bpw[b], lambda s, b=b, sc=sc: (tq(V(b, sc, seed=s)), tq(V(b, sc, seed=s)))))
        rows.append((f"turboq{b} + alpha 1.02", bpw[b], lambda s, b=b: (tq(V(b, alpha=1.02, seed=s)), tq(V(b, alpha=1.02, seed=s)))))
        rows.append((f"turboq{b} + sink token exact", bpw[b], lambda s, b=b: (tq(V(b, seed=s), protect=1), tq(V(b, seed=s), protect=1))))
    rows.append(("turboq4 + second scale (rnorm)", 4.25, lambda s: (tq(V(4, "ls", True, seed=s)), tq(V(4, "ls", True, seed=s)))))
    rows.append(("turboq4 budget: 3-bit + 1-bit QJL K", 4.25, lambda s: (tq(V(3, qjl=True, seed=s)), tq(V(4, seed=s)))))
    for b in (4, 3):
        for rot in ("planar", "iso"):
            rows.append((f"turboq{b} {rot} rotation", bpw[b], lambda s, b=b, rot=rot: (tq(V(b, rot=rot, seed=s)), tq(V(b, rot=rot, seed=s)))))
    rows.append(("turboq4 K / turboq3 V", 3.6875, lambda s: (tq(V(4, seed=s)), tq(V(3, seed=s)))))
    # variance normalization across tokens (issue 60), K per channel / V per token; the rotation draw
    # does not apply (the shipped signs)
    for kb, vb in ((3, 2), (4, 2), (3, 3), (2, 2)):
        rows.append((f"KVarN K{kb}/V{vb}", (kvarn_bpw(kb, "channel", d) + kvarn_bpw(vb, "token", d)) / 2,
                     lambda s, kb=kb, vb=vb: (kvarn(kb, "channel"), kvarn(vb, "token"))))
    rows.append(("turboq3 K / turboq4 V", 3.6875, lambda s: (tq(V(3, seed=s)), tq(V(4, seed=s)))))
    if scales is not None:
        for b in (4, 3, 2):
            sc = scales
            rows.append((f"turboq{b} + channel scale", bpw[b],
                         lambda s, b=b: (tq(V(b, seed=s), scales=sc), tq(V(b, seed=s)))))
            rows.append((f"turboq{b} + channel scale + sink token exact", bpw[b],
                         lambda s, b=b: (tq(V(b, seed=s), protect=1, scales=sc), tq(V(b, seed=s), protect=1))))
            rows.append((f"turboq{b} + channel scale + ls scale", bpw[b],
                         lambda s, b=b: (tq(V(b, "ls", seed=s), scales=sc), tq(V(b, "ls", seed=s)))))
        rows.append(("turboq3 K / turboq4 V + channel scale", 3.6875,
                     lambda s: (tq(V(3, seed=s), scales=scales), tq(V(4, seed=s)))))
        # the same bits through a trellis of 2^L states (issue 21's trellis-coding lever)
        for b in (3, 2):
            for L in (8, 10):
                rows.append((f"turboq{b} + channel scale, trellis 2^{L}", bpw[b],
                             lambda s, b=b, L=L: (tq(V(b, seed=s, trellis=L), scales=scales), tq(V(b, seed=s, trellis=L)))))
            rows.append((f"turboq{b} + channel scale, trellis 2^8 + last 16 tokens exact", bpw[b] + (16 - bpw[b]) * 16 / ctx,
                         lambda s, b=b: (tq(V(b, seed=s, trellis=8), scales=scales), tq(V(b, seed=s, trellis=8)), 16)))
        # smaller rotation groups, each with its own fp16 norm (issue 22: head_dim 64, 96, 80)
        for g in (64, 32):
            for b in (4, 3, 2):
                rows.append((f"turboq{b} + channel scale, {g}-value groups", b + 16 / g,
                             lambda s, b=b, g=g: (tq(V(b, seed=s, group=g), scales=scales), tq(V(b, seed=s, group=g)))))
        # bits per value at the lab's context: W of its ctx tokens at 16 bits
        for w in (1, 4, 16, 64):
            for b in (3, 2):
                rows.append((f"turboq{b} + channel scale + last {w} tokens exact", bpw[b] + (16 - bpw[b]) * w / ctx,
                             lambda s, b=b, w=w: (tq(V(b, seed=s), scales=scales), tq(V(b, seed=s)), w)))
            rows.append((f"turboq3 K / turboq4 V + channel scale + last {w} tokens exact", 3.6875 + (16 - 3.6875) * w / ctx,
                         lambda s, w=w: (tq(V(3, seed=s), scales=scales), tq(V(4, seed=s)), w)))
    return rows


def run_table(chunks: list[dict[str, np.ndarray]], scale: float, seeds: list[int | None],
              only: list[str] | None = None, neox: bool = True,
              windows: dict[int, int] | None = None, exact: bool = False) -> list[tuple[str, float, np.ndarray]]:
    """Per variant: (name, bpw, array [seeds, 3] of summed logit RMS, summed TV, summed output error);
    only: names that contain one of these (exact: names in it); neox: the model's RoPE pairs
    (c, c + d/2), else (2c, 2c + 1); windows: layer -> sliding window."""
    out = []
    ctx = len(chunks[0]["k0"])
    for name, bpw, make in variant_table(channel_scales(chunks, neox), ctx, chunks[0]["k0"].shape[2]):
        if only and not (name in only if exact else any(o in name for o in only)):
            continue
        vals = []
        for s in seeds:
            k, v, *recent = make(s)
            errs = replay(chunks, k, v, scale, windows, recent=recent[0] if recent else 0)
            vals.append([sum(e.logit_rmse for e in errs), sum(e.tv for e in errs), sum(e.out_rel for e in errs)])
        out.append((name, bpw, np.array(vals)))
    return out


# ---- end to end: the same variants through llama-perplexity, where the C code has them ----

# lab variant name -> (K type, V type, environment)
_UNCENTERED, _UNSCALED = {k_centering.ENV: "off"}, {k_centering.SCALE_ENV: "off"}
END_TO_END = {
    "q8_0": ("q8_0", "q8_0", {}),
    "q4_0": ("q4_0", "q4_0", {}),
    "f16 K / turboq3 V": ("f16", "turboq3", {}),
    **{f"turboq{b} uncentered": (f"turboq{b}", f"turboq{b}", _UNCENTERED) for b in (8, 4, 3, 2)},
    **{f"turboq{b} (K centered)": (f"turboq{b}", f"turboq{b}", _UNSCALED) for b in (8, 4, 3, 2)},
    **{f"turboq{b} + channel scale": (f"turboq{b}", f"turboq{b}", {}) for b in (4, 3, 2)},
    "turboq4 K / turboq3 V": ("turboq4", "turboq3", _UNSCALED),
    "turboq3 K / turboq4 V": ("turboq3", "turboq4", _UNSCALED),
    "turboq3 K / turboq4 V + channel scale": ("turboq3", "turboq4", {}),
}


def end_to_end(names: list[str], chunks: int, threads: int = 2) -> dict[str, tuple[float, float, float]]:
    """name -> (PPL, mean KLD vs f16, its error) from llama-perplexity on botchan.txt, c=512, with the
    build's rotation signs (another draw end to end: a build with -DPYTURBO_SIGN_SEED=<n>, run
    with PYTURBO_BUILD_DIR pointing at it)."""
    import tempfile

    from .. import data
    from ..tools import llama_perplexity as perplexity

    model, text = data.default_model(), data.corpus()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "f16.kld"
        perplexity(model, text, "f16", "f16", chunks=chunks, threads=threads, kld_base=base, write_base=True)
        for name in names:
            k, v, env = END_TO_END[name]
            r = perplexity(model, text, k, v, chunks=chunks, threads=threads, kld_base=base, env=env)
            out[name] = (r.ppl, r.kld, r.kld_err)
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def main(args) -> None:
    """`pyturbo kvlab {dump,replay,validate}`: see the module docstring."""
    from .. import data

    from ..gguf_meta import read_metadata

    model = Path(args.model) if args.model else data.default_model()
    ctx = args.ctx
    if args.action == "dump":
        print(dump(model, data.corpus(), n_ctx=ctx, chunks=args.chunks, out=lab_path(model, ctx)))
        return
    chunks = load(dumped(model, ctx, max(args.chunks, 2)))[:args.chunks]
    scale = args.attn_scale
    seeds: list[int | None] = [None, *range(1, args.seeds)]
    only = list(END_TO_END) if args.action == "validate" else args.only
    meta = read_metadata(model)
    arch = meta.get("general.architecture")
    neox = rope_neox(arch)
    windows = None
    if arch == "gemma3" and ctx > int(meta.get("gemma3.attention.sliding_window", ctx)):
        # llama.cpp's Gemma 3: every sixth layer is global, the others slide (not stored in the GGUF)
        n_layer = sum(1 for key in chunks[0] if key.startswith("k"))
        windows = {il: int(meta["gemma3.attention.sliding_window"]) for il in range(n_layer) if (il + 1) % 6}
    rows = run_table(chunks, scale, seeds, only, neox, windows, exact=args.action == "validate")
    e2e = end_to_end([r[0] for r in rows], args.e2e_chunks, args.threads) if args.action == "validate" else {}
    print(f"\n{model.name}: {len(chunks)} chunks of {ctx} tokens, {len(seeds)} rotation draw(s); sums over layers, "
          "mean ± spread over the draws\n")
    head = "| variant | bpw | logit RMS | softmax TV | attention-output error |"
    if e2e:
        head += f" KLD vs f16 ({args.e2e_chunks} chunks) | PPL |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name, bpw, a in rows:
        m, sd = a.mean(0), a.std(0)
        line = f"| {name} | {bpw:.3f} | {m[0]:.2f} ± {sd[0]:.2f} | {m[1]:.3f} ± {sd[1]:.3f} | {m[2]:.3f} ± {sd[2]:.3f} |"
        if e2e:
            ppl, kld, err = e2e[name]
            line += f" {kld:.4f} ± {err:.4f} | {ppl:.3f} |"
        print(line, flush=True)
    if e2e:
        names = [r[0] for r in rows]
        print(f"\nSpearman rank correlation with end-to-end KLD: attention-output error "
              f"{spearman([a.mean(0)[2] for _, _, a in rows], [e2e[n][1] for n in names]):.3f}, softmax TV "
              f"{spearman([a.mean(0)[1] for _, _, a in rows], [e2e[n][1] for n in names]):.3f}")
