"""The trellis types' code (turboq3t, turboq2t): a bit-shift trellis over the rotated coordinates
of a group, as QTIP and the turbo*_tcq forks use it.

Each value still costs `bits` bits, but the value it decodes to is read from a codebook of 2^L
entries by the state, the last L bits of the code stream: s_t = ((s_{t-1} << bits) | c_t) mod 2^L,
s_{-1} = 0. The encoder picks the whole path at once (Viterbi), so a group of 128 values is
quantized as one vector from a code of 2^(128*bits) paths, which is where the gain over the
scalar Lloyd-Max codebook comes from. The decoder stays a table lookup per value; the encoder
costs 2^L states per value, which is what the type pays on every token written.

This is the format's one copy of the path search: the C encoders (ggml-turboq-trellis.h,
bench/trellis_viterbi.c), the NumPy reference and the torch codec are checked against it. The
measurements that chose the trellis live in the lab (`python -m pyturbo.lab.trellis [e2e]`).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np


def viterbi(y: np.ndarray, cb: np.ndarray, bits: int, batch: int = 2048) -> np.ndarray:
    """y [G, n] -> the states [G, n] (int64) of the path that minimizes sum_t (y_t - cb[s_t])^2."""
    S = len(cb)
    lo = S >> bits                       # groups of 2^bits states that share their low L - bits bits
    G, n = y.shape
    out = np.empty((G, n), np.int64)
    cbf = cb.astype(np.float32)
    for g0 in range(0, G, batch):
        yy = y[g0:g0 + batch].astype(np.float32)
        g = len(yy)
        cost = np.full((g, S), np.inf, np.float32)
        cost[:, 0] = 0                   # s_{-1} = 0
        back = np.empty((n, g, lo), np.uint16)
        for t in range(n):
            # the predecessors of state m are h*lo + (m >> bits), h < 2^bits
            c3 = cost.reshape(g, 1 << bits, lo)
            h = np.argmin(c3, 1)
            back[t] = h
            best = np.take_along_axis(c3, h[:, None, :], 1)[:, 0, :]
            cost = np.repeat(best, 1 << bits, 1) + (yy[:, t, None] - cbf[None, :]) ** 2
        s = np.argmin(cost, 1)
        for t in range(n - 1, -1, -1):
            out[g0:g0 + g, t] = s
            p = s >> bits
            s = back[t][np.arange(g), p].astype(np.int64) * lo + p
    return out


@lru_cache(maxsize=None)
def codebook(bits: int, L: int, iters: int = 12, groups: int = 4096, n: int = 128, seed: int = 0) -> np.ndarray:
    """The 2^L reconstruction values for unit-variance Gaussian coordinates: Lloyd iterations
    (Viterbi paths, then each state's value the mean of the samples it took), started from
    Gaussian quantiles in a random order so that no two states begin alike."""
    from statistics import NormalDist

    rng = np.random.default_rng(seed)
    S = 1 << L
    q = np.array([NormalDist().inv_cdf((i + 0.5) / S) for i in range(S)])
    cb = q[rng.permutation(S)]
    y = rng.standard_normal((groups, n))
    for _ in range(iters):
        st = viterbi(y, cb, bits)
        sums = np.bincount(st.ravel(), y.ravel(), S)
        cnt = np.bincount(st.ravel(), None, S)
        cb = np.where(cnt > 0, sums / np.maximum(cnt, 1), cb)
    return cb


def quantize(y: np.ndarray, bits: int, L: int) -> np.ndarray:
    """y [G, n] of unit-variance coordinates -> their trellis reconstruction."""
    cb = codebook(bits, L)
    return cb[viterbi(y, cb, bits)]
