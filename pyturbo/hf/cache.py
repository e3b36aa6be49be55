"""TurboQuantCache: a transformers DynamicCache that keeps K and V as llama.cpp cache rows.

Layout. llama.cpp stores one cache row per token and layer: the K (or V) values of all KV heads,
n_head_kv * head_dim of them, in blocks of the cache type. This cache stores exactly those rows,
[batch, tokens, row_bytes] uint8, with the same bytes the C codec writes for the same input.
As in llama.cpp, a head size that is a multiple of 64 but not of 128 (SmolLM2: 64, 3 KV heads,
192 values a row) takes the turboq type's _g64 twin, 64-value groups, and one that is a multiple of
32 but not of 64 (Phi-3: 96) its _g32 twin, 32-value groups, and one that is a multiple of 16 but
not of 32 (Phi-2: 80) its _g16 twin, 16-value groups (pyturbo.types.layer_cache_type): turboq3 then
takes 3.25, 3.5 or 4 bits per value, and a block never spans two heads. Otherwise the row of
all KV heads is grouped (head_dim 256, Gemma 3: a block is half a head); a row that is not a
whole number of blocks (a head size llama.cpp refuses) is padded with zeros to the next block;
zeros change neither the group's norm nor its rotation and are dropped again on decoding.

What attention reads. As in llama.cpp, new K/V are encoded first and attention reads the decoded
cache, the new tokens included, so a prompt already sees quantized K/V.

K centering (as llama.cpp's patch 26 does, but with another mean). A layer with a turboq K type
stores k - mu, mu being the per-channel mean of the first `center_tokens` (512) tokens written
into the empty layer, per batch row; an emptied layer takes a new mean. llama.cpp now centers on
a mean calibrated once per model (llama-turboq-center.h), so that a request's answer never depends on
other requests; a TurboQuantCache serves one generation, whose mean comes from its own prompt.
llama.cpp leaves mu out of attention (softmax ignores the per-query constant q.mu); here decoding
adds it back, so that the returned keys approximate k for any attention (soft-capping or masks
included), at the cost of one add.

Sliding-window layers keep the last sliding_window - 1 tokens, as DynamicSlidingWindowLayer does.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from .. import layer_adaptive as la
from ..types import TRELLIS_TYPES, requested_cache_type, trellis_scalar
from . import torch_codec as tc

CENTER_TOKENS = 512


def padded_row(name: str, n: int) -> int:
    """Values per stored row: n rounded up to a whole number of blocks of the type."""
    bs = tc.check_type(name).block_size
    return (n + bs - 1) // bs * bs


class _Codec:
    """One side (K or V) of a layer: type, geometry, encode to / decode from stored rows."""

    def __init__(self, type_name: str, requested: str | None = None) -> None:
        # a user's name (a _g64, _g32 or _g16 twin is picked per head size in init, as llama.cpp does)
        self.type = tc.check_type(requested_cache_type(type_name)).name
        # what the user asked for where a layer-adaptive mode chose type_name
        self.requested = self.type if requested is None else tc.check_type(requested_cache_type(requested)).name
        self.n_heads = 0
        self.head_dim = 0

    def init(self, states: torch.Tensor, side: str) -> None:
        if states.dim() != 4:
            raise ValueError(f"{side} states must be [batch, kv_heads, tokens, head_dim], got shape {tuple(states.shape)}")
        _, h, _, d = states.shape
        if h < 1 or d < 1:
            raise ValueError(f"{side} states with {h} heads of head_dim {d}: both must be positive")
        self.n_heads, self.head_dim = h, d
        self.type = la.stored_type(self.type, self.requested, d).name  # what llama.cpp stores for this head size
        if self.type in TRELLIS_TYPES and d % TRELLIS_TYPES[self.type].block_size:
            # as libllama refuses it: no 32- or 16-value trellis forms, and a group across heads would store padding
            raise ValueError(f"{side} cache {self.type}: the trellis types store groups of 128 or 64 values, and these states' "
                             f"head_dim is {d}; the scalar {trellis_scalar(self.type)} of the same bits takes it")
        self.n = h * d
        self.n_pad = padded_row(self.type, self.n)

    def check(self, states: torch.Tensor, side: str) -> None:
        if states.dim() != 4 or states.shape[1] != self.n_heads or states.shape[3] != self.head_dim:
            raise ValueError(f"{side} states of shape {tuple(states.shape)} do not match the cache's "
                             f"{self.n_heads} heads of head_dim {self.head_dim}")

    def rows(self, states: torch.Tensor) -> torch.Tensor:
        b, h, t, d = states.shape
        r = states.transpose(1, 2).reshape(b, t, h * d)
        if self.n_pad != self.n:
            r = torch.nn.functional.pad(r, (0, self.n_pad - self.n))
        return r

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return tc.encode(rows, self.type)

    def decode(self, stored: torch.Tensor, dtype: torch.dtype, exact: bool) -> torch.Tensor:
        b, t = stored.shape[:2]
        r = tc.decode(stored, self.type, self.n_pad, torch.float32, exact)[..., :self.n]
        return r.reshape(b, t, self.n_heads, self.head_dim).transpose(1, 2).to(dtype)


class TurboQuantLayer(DynamicLayer):
    """A full-attention layer whose `keys`/`values` are the stored rows, [batch, tokens, row bytes]
    (tokens on dim -2, so DynamicLayer's crop, reorder and batch methods work unchanged)."""

    def __init__(self, type_k: str = "turboq3", type_v: str = "turboq3", k_center: bool = True,
                 center_tokens: int = CENTER_TOKENS, exact_decode: bool = False,
                 requested: tuple[str, str] | None = None, **_: object) -> None:
        """requested: the (K, V) types the user asked for, where a layer-adaptive mode chose type_k/type_v."""
        super().__init__()
        self.exact_decode = exact_decode
        self.k = _Codec(type_k, requested and requested[0])
        self.v = _Codec(type_v, requested and requested[1])
        self._k_center = k_center
        self.center_tokens = center_tokens
        self.k_mean: torch.Tensor | None = None  # [batch, 1, n_pad] float32

    def __repr__(self) -> str:
        return f"{type(self).__name__}(K={self.k.type}, V={self.v.type})"

    @property
    def k_center(self) -> bool:
        # from the stored K type, which init settles per head size (a mode's q8_0 may be turboq8 there)
        return self._k_center and self.k.type.startswith("turboq")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.k.init(key_states, "key")
        self.v.init(value_states, "value")
        self.dtype, self.device = key_states.dtype, key_states.device
        b = key_states.shape[0]
        self.keys = torch.empty((b, 0, self._width(self.k)), dtype=self._store_dtype(self.k), device=self.device)
        self.values = torch.empty((b, 0, self._width(self.v)), dtype=self._store_dtype(self.v), device=self.device)
        self.is_initialized = True

    @staticmethod
    def _width(c: _Codec) -> int:
        return c.n_pad if c.type in tc.FLOAT_TYPES else tc.row_bytes(c.type, c.n_pad)

    @staticmethod
    def _store_dtype(c: _Codec) -> torch.dtype:
        return tc.FLOAT_TYPES.get(c.type, torch.uint8)

    def _encode_new(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.k.check(key_states, "key")
        self.v.check(value_states, "value")
        kr = self.k.rows(key_states.float())
        if self.k_center:
            if self.k_mean is None or self.get_seq_length() == 0:
                first = kr[:, :self.center_tokens]
                # sum, then scale by 1/n: llama.cpp's ggml_sum_rows + ggml_scale
                self.k_mean = first.sum(dim=1, keepdim=True) * (1.0 / first.shape[1])
            kr = kr - self.k_mean
        return self.k.encode(kr), self.v.encode(self.v.rows(value_states))

    def _decode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k.decode(keys, torch.float32, self.exact_decode)
        if self.k_center:
            k = k + self._mean_heads()
        return k.to(self.dtype), self.v.decode(values, self.dtype, self.exact_decode)

    def _mean_heads(self) -> torch.Tensor:
        b = self.k_mean.shape[0]
        return self.k_mean[..., :self.k.n].reshape(b, 1, self.k.n_heads, self.k.head_dim).transpose(1, 2)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        k_new, v_new = self._encode_new(key_states, value_states)
        self.keys = torch.cat([self.keys, k_new], dim=-2)
        self.values = torch.cat([self.values, v_new], dim=-2)
        return self._decode(self.keys, self.values)

    def reset(self) -> None:
        if self.is_initialized:
            self.keys = self.keys[:, :0]
            self.values = self.values[:, :0]
        self.k_mean = None
        if hasattr(self, "cumulative_length"):
            self.cumulative_length = 0

    def nbytes(self) -> int:
        """Bytes of torch storage this layer holds (rows and the K-centering mean)."""
        if not self.is_initialized:
            return 0
        n = self.keys.nbytes + self.values.nbytes
        return n + (self.k_mean.nbytes if self.k_mean is not None else 0)


class TurboQuantSlidingWindowLayer(TurboQuantLayer):
    """A sliding-window layer: keeps the last sliding_window - 1 tokens' rows (DynamicSlidingWindowLayer's rule)."""

    is_sliding = True
    get_mask_sizes = DynamicSlidingWindowLayer.get_mask_sizes
    get_max_length = DynamicSlidingWindowLayer.get_max_length
    activate_past_recording = DynamicSlidingWindowLayer.activate_past_recording

    def __init__(self, sliding_window: int, type_k: str = "turboq3", type_v: str = "turboq3", k_center: bool = True,
                 center_tokens: int = CENTER_TOKENS, exact_decode: bool = False,
                 requested: tuple[str, str] | None = None, **_: object) -> None:
        super().__init__(type_k, type_v, k_center, center_tokens, exact_decode, requested)
        self.sliding_window = sliding_window
        self.cumulative_length = 0
        self._sliding_window_tensor = torch.tensor(sliding_window, dtype=torch.long)
        self.record_past = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        k_new, v_new = self._encode_new(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        full_k = torch.cat([self.keys, k_new], dim=-2)
        full_v = torch.cat([self.values, v_new], dim=-2)
        if self.record_past:
            self.keys, self.values = full_k, full_v
        else:
            self.keys = full_k[:, -self.sliding_window + 1:]
            self.values = full_v[:, -self.sliding_window + 1:]
        return self._decode(full_k, full_v)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def crop(self, tokens_to_remove: int) -> None:
        if self.cumulative_length >= self.sliding_window:
            raise ValueError("TurboQuantCache cannot crop a sliding-window layer that has filled its window")
        super().crop(tokens_to_remove)
        self.cumulative_length = self.keys.shape[-2]


def k_gains_from_gguf(path: str | Path) -> list[float]:
    """Each layer's K gain as llama.cpp's layer-adaptive mode 3 measures it: the RMS of
    blk.N.attn_k_norm.weight, else of blk.N.attn_k.weight, from the GGUF's stored values."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    gains = []
    il = 0
    while f"blk.{il}.attn_k.weight" in by_name or f"blk.{il}.attn_k_norm.weight" in by_name:
        t = by_name.get(f"blk.{il}.attn_k_norm.weight") or by_name[f"blk.{il}.attn_k.weight"]
        x = dequantize(t.data, t.tensor_type).astype(np.float64)
        gains.append(float(np.sqrt(np.mean(x * x))))
        il += 1
    if not gains:
        raise ValueError(f"{path}: no blk.N.attn_k(_norm).weight tensors to rank layers by K gain")
    return gains


def layer_cache_types(n_layer: int, type_k: str, type_v: str, layer_adaptive: int = 0,
                      k_gains: Sequence[float] | None = None,
                      sliding: Sequence[bool] | None = None) -> list[tuple[str, str]]:
    """(K type, V type) of every layer under a layer-adaptive mode, from libllama's table.

    The modes that rank layers by K gain (3, 4) pick the n_layer // k_gain_div (at least 1) largest
    of k_gains (k_gains_from_gguf), ties to the lower layer, as llama.cpp does; mode 4 ranks only
    the layers that attend over the whole context and picks all of them, so it needs `sliding`
    (True for a sliding-window layer; TurboQuantCache passes the model config's) and no k_gains.
    """
    tk, tv = (tc.check_type(requested_cache_type(t)).name for t in (type_k, type_v))
    return la.layer_cache_types(layer_adaptive, n_layer, tk, tv, k_gains, sliding)


class TurboQuantCache(DynamicCache):
    """A DynamicCache whose layers store K and V as llama.cpp cache rows of the chosen types.

    cache_type_k / cache_type_v: turboq2/3/4/8, turboq3t/2t (heads a multiple of 64), q8_0, f16, bf16 or f32 (any case).
    layer_adaptive: a layer-adaptive mode, its number or name (pyturbo.layer_adaptive); mode 3 needs k_gains.
    k_center: K centering of turboq K layers, as llama.cpp does by default (its key turboq.k_center).
    exact_decode: decode reads with the C's butterflies bit for bit instead of the faster matmul.
    """

    def __init__(self, config, cache_type_k: str = "turboq3", cache_type_v: str = "turboq3", layer_adaptive: int | str = 0,
                 k_gains: Sequence[float] | None = None, k_center: bool = True,
                 center_tokens: int = CENTER_TOKENS, exact_decode: bool = False) -> None:
        decoder = config.get_text_config(decoder=True)
        layer_types, kwargs = get_layer_types_and_kwargs(decoder)
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"TurboQuantCache supports full and sliding-window attention layers, not {', '.join(unknown)}")
        layer_adaptive = la.check_mode(layer_adaptive)
        self.layer_types_kv = layer_cache_types(len(layer_types), cache_type_k, cache_type_v, layer_adaptive, k_gains,
                                                [kind == "sliding_attention" for kind in layer_types])
        requested = (cache_type_k, cache_type_v)
        layers: list[DynamicLayer] = []
        for kind, (tk, tv) in zip(layer_types, self.layer_types_kv):
            if kind == "sliding_attention":
                layers.append(TurboQuantSlidingWindowLayer(kwargs["sliding_window"], tk, tv, k_center, center_tokens,
                                                           exact_decode, requested))
            else:
                layers.append(TurboQuantLayer(tk, tv, k_center, center_tokens, exact_decode, requested))
        # DynamicCache.__init__ would build its own layers from the config; the base Cache takes ours
        super(DynamicCache, self).__init__(layers=layers)

    def nbytes(self) -> int:
        """Bytes of torch storage the cache holds."""
        return sum(layer.nbytes() for layer in self.layers)


def dynamic_cache_nbytes(cache: DynamicCache) -> int:
    """Bytes of torch storage a plain DynamicCache holds (for comparisons)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)
