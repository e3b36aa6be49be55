"""kv_bytes: the KV-cache size llama.cpp allocates, from the model's GGUF metadata.

Follows llama.cpp's rules for this pin: the cache holds n_ctx cells padded to 256; a model with
sliding-window layers (Gemma 3: every 6th layer is global) gets a second cache for those layers
of min(n_ctx, n_swa * n_seq + n_ubatch) cells, padded the same way. Each layer stores
n_head_kv * head_dim values of K and of V per cell, in blocks of the cache type (for a turboq type,
of its _g64 twin where the head size is a multiple of 64 but not of 128, of its _g32 twin where it
is a multiple of 32 but not of 64, of its _g16 twin where it is a multiple of 16 but not of 32:
pyturbo.types.layer_cache_type; a layer-adaptive mode's q8_0 where 32 does not divide the head
size: turboq8 in its twin, pyturbo.layer_adaptive.stored_type). An MLA model (DeepSeek-V2/V3:
the GGUF has both MLA head lengths, key_length_mla and value_length_mla) caches K alone, in K's type; its attention reads V out of K's rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import exact_window as _ew
from .layer_adaptive import boundary_layers, needs_gains, policies, stored_type

KV_PAD = 256
# architectures whose sliding-window layers follow a fixed pattern: every n-th layer is global
SWA_PATTERNS = {"gemma3": 6, "gemma2": 2}


@dataclass(frozen=True)
class KvGeometry:
    arch: str
    n_layer: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_swa: int
    swa_pattern: int
    mla: bool = False  # K alone is cached; V is a view of it

    def is_swa(self, il: int) -> bool:
        return self.n_swa > 0 and self.swa_pattern > 0 and (il + 1) % self.swa_pattern != 0

    def sliding(self) -> list[bool]:
        """is_swa of every layer, as pyturbo.layer_adaptive's `sliding` takes it."""
        return [self.is_swa(il) for il in range(self.n_layer)]


def kv_geometry(model: str | Path) -> KvGeometry:
    from .gguf_meta import read_metadata

    meta = read_metadata(model)

    def field(key: str, default=None):
        value = meta.get(key)
        return default if value is None else value

    arch = field("general.architecture")
    n_head = field(f"{arch}.attention.head_count")
    n_embd = field(f"{arch}.embedding_length")
    head_dim_k = field(f"{arch}.attention.key_length", n_embd // n_head)
    head_dim_v = field(f"{arch}.attention.value_length", head_dim_k)
    n_swa = field(f"{arch}.attention.sliding_window", 0) or 0
    pattern = SWA_PATTERNS.get(arch, 0)
    # llama.cpp's hparams.is_mla(): both MLA head lengths are set
    mla = field(f"{arch}.attention.key_length_mla") is not None and field(f"{arch}.attention.value_length_mla") is not None
    return KvGeometry(arch, field(f"{arch}.block_count"), field(f"{arch}.attention.head_count_kv", n_head),
                      head_dim_k, head_dim_v, n_swa if pattern else 0, pattern, mla)


def pad_cells(n: int) -> int:
    """The cells llama.cpp allocates for n positions (padded to KV_PAD)."""
    return (n + KV_PAD - 1) // KV_PAD * KV_PAD


def kv_bytes(model: str | Path, n_ctx: int, cache_type_k: str = "f16", cache_type_v: str = "f16",
             layer_adaptive: int = 0, n_seq: int = 1, n_ubatch: int = 512, swa_full: bool = False,
             n_stream: int = 1, upper_bound: bool = False, exact_window: int | str | None = 0,
             exact_window_margin: int | None = None, exact_sink: int | str = 0) -> int:
    """Bytes of K and V that llama.cpp allocates for this model and context.

    swa_full: sliding-window layers keep all n_ctx cells (llama.cpp's --swa-full; llama-cpp-python's
    Llama defaults to it, llama.cpp's tools do not).
    n_stream: separate caches of n_ctx / n_stream cells each, one per sequence: llama-server's
    slots without --kv-unified (n_stream = n_seq = --parallel).
    upper_bound: allowed for the modes that pick their layers from the model's K weights (3),
    which this function does not read: their boundary layers are taken to be those with the
    most cells, so the result is at least what llama.cpp allocates. Without it those modes
    raise ValueError.
    exact_window: W of --kv-exact-window (exact_window.AUTO: auto's, sized by the context's cells
    per sequence, on every layer; None: llama.cpp's default when the setting is not given, auto's
    beside a turboq cache, exact_window.window_default); each layer with a quantized K or V then also holds F16
    rows of K and V, rows_per_sequence(W, exact_window_margin) per sequence plus one, whatever the
    streams (exact_window_margin: --kv-exact-window-margin; None: the default); exact_sink: S of
    --kv-exact-sink, S more such rows per sequence; "auto" (or -1: llama.cpp's default when the
    setting is not given) counts auto's rows (exact_window.sink_count; none on an MLA model), for a
    cache on the CPU (auto keeps none in a layer whose device would read them through a copy). The
    default 0 counts the cache alone, as llama.cpp's "llama_kv_cache: size" line does.
    """
    sink = _ew.check_sink(exact_sink)  # _ew: kv_bytes' argument exact_window shadows the module's name
    if sink == _ew.SINK_AUTO or exact_window is None:
        auto_keeps = not kv_geometry(model).mla  # llama.cpp's defaults keep no rows on an MLA model
        if sink == _ew.SINK_AUTO:
            sink = _ew.sink_count(sink, cache_type_k, cache_type_v) if auto_keeps else 0
        if exact_window is None:
            exact_window = _ew.window_default(cache_type_k, cache_type_v) if auto_keeps else 0
    if exact_window or sink:
        # an auto window is sized by the context's cells per sequence (a stream's cells x streams / sequences),
        # on the sliding-window layers too
        seq_cells = pad_cells(n_ctx // n_stream) * n_stream // max(1, n_seq)
        return kv_bytes(model, n_ctx, cache_type_k, cache_type_v, layer_adaptive, n_seq, n_ubatch, swa_full,
                        n_stream, upper_bound, exact_sink=0) + window_bytes(model, cache_type_k, cache_type_v, layer_adaptive,
                                                                            n_seq, exact_window, exact_window_margin, sink,
                                                                            seq_cells)
    if n_stream > 1:
        return n_stream * kv_bytes(model, n_ctx // n_stream, cache_type_k, cache_type_v, layer_adaptive,
                                   max(1, n_seq // n_stream), n_ubatch, swa_full, upper_bound=upper_bound, exact_sink=0)
    g = kv_geometry(model)
    cells = layer_cells(g, n_ctx, n_seq, n_ubatch, swa_full)
    policy = policies().get(layer_adaptive) if layer_adaptive else None
    sliding = g.sliding()
    # a mode that takes every candidate (4: the layers without a sliding window) picks the same
    # layers whatever the gains; only one that picks among them needs the model's K weights
    ranked = needs_gains(layer_adaptive)
    if ranked and not upper_bound:
        raise ValueError(f"layer-adaptive mode {layer_adaptive} picks its layers from the model's K weights; "
                         "pass upper_bound=True for a bound")
    # for a bound, the layers with the most cells stand in for those of largest K gain
    boundary = boundary_layers(layer_adaptive, g.n_layer, cells if policy and policy.k_gain_div else None, sliding)

    def row_bytes(t: str, requested: str, hd: int) -> int:
        ct = stored_type(t, requested, hd)
        return g.n_head_kv * hd // ct.block_size * ct.block_bytes

    total = 0
    for il in range(g.n_layer):
        tk, tv = policy.types(boundary[il], cache_type_k, cache_type_v) if policy else (cache_type_k, cache_type_v)
        if ranked:
            # the boundary type may be smaller than the requested one: bound each by the larger
            tk = max((tk, cache_type_k), key=lambda t: row_bytes(t, cache_type_k, g.head_dim_k))
        total += cells[il] * (row_bytes(tk, cache_type_k, g.head_dim_k) +
                              (0 if g.mla else row_bytes(tv, cache_type_v, g.head_dim_v)))
    return total


def layer_cells(g: KvGeometry, n_ctx: int, n_seq: int, n_ubatch: int = 512, swa_full: bool = False) -> list[int]:
    """Each layer's cache cells for a stream of n_ctx cells and n_seq sequences (a sliding-window
    layer keeps n_swa per sequence and a ubatch, unless swa_full)."""
    cells_full = pad_cells(n_ctx)
    cells_swa = (cells_full if swa_full else min(cells_full, pad_cells(g.n_swa * n_seq + n_ubatch))) if g.n_swa else 0
    return [cells_swa if g.is_swa(il) else cells_full for il in range(g.n_layer)]


def window_bytes(model: str | Path, cache_type_k: str, cache_type_v: str, layer_adaptive: int, n_seq: int,
                  w: int, margin: int | None = None, sink: int = 0, cells: int | None = None) -> int:
    """The exact window's and sink rows' F16 rows (llama-turboq-window.h) in the layers that keep them. For the
    modes that rank layers by K gain, their boundary types are quantized as well (q8_0, turboq4), so
    which layers they are does not change the count. An auto window (exact_window.AUTO) is sized by
    `cells`, the context's cells per sequence (every layer's, a sliding-window one's included)."""
    g = kv_geometry(model)
    if g.mla:
        raise ValueError("the exact window is refused on MLA models (llama.cpp refuses it: attention reads V out of K)")
    policy = policies().get(layer_adaptive) if layer_adaptive else None
    boundary = boundary_layers(layer_adaptive, g.n_layer, [1] * g.n_layer) if policy and not policy.k_gain_div else \
        [False] * g.n_layer
    per_seq = _ew.rows_per_sequence(w, margin, sink, cells)
    rows = n_seq * per_seq + 1 if per_seq else 0  # and the slot for rows no sequence keeps
    total = 0
    for il in range(g.n_layer):
        tk, tv = policy.types(boundary[il], cache_type_k, cache_type_v) if policy else (cache_type_k, cache_type_v)
        if stored_type(tk, cache_type_k, g.head_dim_k).bpw < 16 or stored_type(tv, cache_type_v, g.head_dim_v).bpw < 16:
            total += rows * g.n_head_kv * (g.head_dim_k + g.head_dim_v) * 2
    return total
