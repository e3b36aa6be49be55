"""TurboQuant codebooks and rotation signs: the single source of truth for the C tables.

After a random rotation, one coordinate of a unit vector in R^d (d = 128) has the density
    f(x) = (1 - x^2)^((d-3)/2) / B(1/2, (d-1)/2),   -1 < x < 1.
turboq2/3/4 use the Lloyd-Max quantizer of that density with 4/8/16 levels. turboq8 uses a
uniform 256-level grid scaled per block to the absmax of the rotated group.

The rotation is y = D2 . H . D1 . x / sqrt(d) with H the Sylvester-Hadamard matrix and D1, D2
diagonal +-1 matrices, drawn in pyturbo/format/signs.py (standard library only, as the build's
seeded-signs option needs).

`python -m pyturbo.format.codebook --write` writes the tables that the patch series carries into the
patches that create them: the C header (ggml/src/ggml-turboq-tables.h, also compiled by CUDA) and its
GLSL twin for the Vulkan shaders (.../ggml-vulkan/vulkan-shaders/turboq_tables.glsl); a test
regenerates both and diffs.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .._paths import series_io
from ..types import TRELLIS_TWIN_TYPES, TRELLIS_TYPES, TWIN_GROUPS  # the twins' groups: 64, 32 and 16
from . import signs as _signs
from . import trellis
from .signs import D, SIGN_SEED  # noqa: F401 (the lab and hf/ import them from here)

LLOYD_MAX_BITS = (2, 3, 4)
GRID8_LEVELS = 256

# where the series puts them in llama.cpp's tree; the patches that create them
HEADER_PATH = "ggml/src/ggml-turboq-tables.h"
GLSL_PATH = "ggml/src/ggml-vulkan/vulkan-shaders/turboq_tables.glsl"
HEADER_PATCH = "*-ggml-turboq2-3-4-8-block-layouts-*.patch"
GLSL_PATCH = "*-vulkan-turboq2-3-4-8-*.patch"


@lru_cache(maxsize=None)
def rotation_signs() -> tuple[np.ndarray, np.ndarray]:
    """(D1, D2) as float32 arrays of +-1."""
    s1, s2 = _signs.sign_lists()
    return np.array(s1, dtype=np.float32), np.array(s2, dtype=np.float32)


def _grid(n: int = 1 << 20, d: int = D) -> tuple[np.ndarray, np.ndarray]:
    """Midpoint grid on (-1, 1) with the normalised coordinate density (of a unit vector in R^d)."""
    x = (np.arange(n, dtype=np.float64) + 0.5) * (2.0 / n) - 1.0
    logf = (d - 3) / 2.0 * np.log1p(-x * x)
    w = np.exp(logf - logf.max())
    w /= w.sum()
    return x, w


@dataclass(frozen=True)
class LloydMax:
    bits: int
    centroids: np.ndarray  # float64, ascending
    mse: float  # expected squared error of one coordinate

    @property
    def thresholds(self) -> np.ndarray:
        return 0.5 * (self.centroids[1:] + self.centroids[:-1])

    @property
    def vector_mse(self) -> float:
        """Expected ||u - Q(u)||^2 for a unit vector u (sum over the d coordinates)."""
        return D * self.mse


@lru_cache(maxsize=None)
def lloyd_max(bits: int, iters: int = 5000, d: int = D) -> LloydMax:
    """The shipped codebooks at d = 128; other d for rotation groups of d values (pyturbo.lab.kvlab)."""
    x, w = _grid(d=d)
    levels = 1 << bits
    sigma = 1.0 / np.sqrt(d)
    # start from Gaussian-quantile placement and iterate the two Lloyd conditions
    c = sigma * np.linspace(-2.5, 2.5, levels)
    cw = np.cumsum(w)
    cwx = np.cumsum(w * x)
    for _ in range(iters):
        t = 0.5 * (c[1:] + c[:-1])
        edges = np.searchsorted(x, t)
        lo = np.concatenate(([0], edges))
        hi = np.concatenate((edges, [len(x)]))
        mass = cw[hi - 1] - np.where(lo > 0, cw[lo - 1], 0.0)
        first = cwx[hi - 1] - np.where(lo > 0, cwx[lo - 1], 0.0)
        c_new = first / mass
        c_new = 0.5 * (c_new - c_new[::-1])  # the density is symmetric; keep the codebook exactly so
        done = np.max(np.abs(c_new - c)) < 1e-13
        c = c_new
        if done:
            break
    idx = np.searchsorted(0.5 * (c[1:] + c[:-1]), x)
    mse = float(np.sum(w * (x - c[idx]) ** 2))
    return LloydMax(bits, c, mse)


def grid8_centroids() -> np.ndarray:
    i = np.arange(GRID8_LEVELS, dtype=np.float64)
    return (i - 127.5) / 127.5


def grid8_vector_mse() -> float:
    """Expected ||u - Q(u)||^2 for turboq8 on a unit vector, before the norm correction.

    Step is 2a/255 with a = max_i |y_i|; the coordinate at the absmax is exact, the other
    d-1 see a uniform error of variance step^2/12. E[a^2] uses the max of d independent
    coordinates with the exact marginal (the dependence of a unit vector's coordinates is O(1/d)).
    """
    x, w = _grid()
    pos = x > 0
    xa = x[pos]
    wa = 2.0 * w[pos]
    cdf = np.cumsum(wa)
    cdf_max = np.clip(cdf, 0, 1) ** D
    pdf_max = np.diff(np.concatenate(([0.0], cdf_max)))
    ea2 = float(np.sum(pdf_max * xa * xa))
    step2 = 4.0 * ea2 / (255.0 ** 2)
    return (D - 1) * step2 / 12.0


def codebooks() -> dict[str, np.ndarray]:
    """float32 centroid tables, by type name (the _gN types' for a unit vector in R^N)."""
    out = {f"turboq{b}": lloyd_max(b).centroids.astype(np.float32) for b in LLOYD_MAX_BITS}
    for g in TWIN_GROUPS:
        out.update({f"turboq{b}_g{g}": lloyd_max(b, d=g).centroids.astype(np.float32) for b in LLOYD_MAX_BITS})
        out[f"turboq8_g{g}"] = grid8_centroids().astype(np.float32)
    out["turboq8"] = grid8_centroids().astype(np.float32)
    return out


def thresholds() -> dict[str, np.ndarray]:
    """float32 decision thresholds of the Lloyd-Max types: index = count(threshold < y)."""
    out = {f"turboq{b}": lloyd_max(b).thresholds.astype(np.float32) for b in LLOYD_MAX_BITS}
    for g in TWIN_GROUPS:
        out.update({f"turboq{b}_g{g}": lloyd_max(b, d=g).thresholds.astype(np.float32) for b in LLOYD_MAX_BITS})
    return out


TRELLIS_L = 6        # the trellis types' state bits: 64 states (bench/results/quality-per-bit.md)
# code bits per value: turboq3t and turboq3t_g64 3
TRELLIS_BITS = {name: int(name[len("turboq")]) for name in (*TRELLIS_TYPES, *TRELLIS_TWIN_TYPES)}
# A _g64 form reads its 128-value type's codebook; its search sees the rotated coordinates, sqrt(2)
# larger than a 128-value group's, times this (TURBOQ_TRELLIS_G64_FIT in the generated C and GLSL
# tables), and the corrected norm absorbs the scale.
TRELLIS_G64_FIT = np.float32(np.sqrt(0.5))


@lru_cache(maxsize=None)
def trellis_codebooks() -> dict[str, np.ndarray]:
    """float32 reconstruction values of the trellis types' 2^TRELLIS_L states, for one coordinate
    of a rotated unit vector in R^128: pyturbo.format.trellis's Lloyd-trained codebook (for unit
    variance) over sqrt(128). The encoder and the decoders index it by state; the _g64 forms read
    their 128-value type's (TRELLIS_G64_FIT)."""
    return {name: (trellis.codebook(TRELLIS_BITS[name], TRELLIS_L) / np.sqrt(D)).astype(np.float32)
            for name in TRELLIS_TYPES}


def theoretical_vector_mse(type_name: str) -> float:
    """For turboq2/3/4/8 (the _gN types are not covered)."""
    if type_name == "turboq8":
        return grid8_vector_mse()
    return lloyd_max(int(type_name[-1])).vector_mse


def _c_floats(values: np.ndarray, per_line: int = 4) -> str:
    items = [f"{float(v):.9e}f" for v in np.asarray(values, dtype=np.float32)]
    lines = [", ".join(items[i:i + per_line]) for i in range(0, len(items), per_line)]
    return "    " + ",\n    ".join(lines)


def render_header() -> str:
    cbs = codebooks()
    thr = thresholds()
    parts = [
        "// Generated by `python -m pyturbo.format.codebook --write`: do not edit.",
        "// Lloyd-Max codebooks for one coordinate of a random unit vector in R^128, the turboq8",
        "// grid, and the +-1 signs of the randomized Walsh-Hadamard rotation",
        f"// (splitmix64, seed 0x{SIGN_SEED:x}; see pyturbo/format/codebook.py).",
        "#pragma once",
        "",
        f"#define TURBOQ_GROUP {D}",
        f"#define TURBOQ_INV_SQRT_GROUP {float(np.float32(1.0 / np.sqrt(D))):.9e}f",
        *(f"#define TURBOQ_G{g}_INV_SQRT_GROUP {float(np.float32(1.0 / np.sqrt(g))):.9e}f" for g in TWIN_GROUPS),
        "",
        "// CUDA includes this with TURBOQ_TABLE defined as `static __constant__ const`",
        "#ifndef TURBOQ_TABLE",
        "#define TURBOQ_TABLE static const",
        "#endif",
        "",
    ]
    parts.append(_signs.c_block())
    for b in LLOYD_MAX_BITS:
        lm = lloyd_max(b)
        parts.append(f"// {1 << b} levels; E||u - Q(u)||^2 = {lm.vector_mse:.6f} for a unit vector")
        parts.append(f"TURBOQ_TABLE float turboq{b}_centroids[{1 << b}] = {{\n{_c_floats(cbs[f'turboq{b}'])}\n}};")
        parts.append(f"TURBOQ_TABLE float turboq{b}_thresholds[{(1 << b) - 1}] = {{\n{_c_floats(thr[f'turboq{b}'])}\n}};\n")
    for g in TWIN_GROUPS:
        parts.append(f"// The _g{g} types ({g}-value groups): the first {g} signs of each table above, and")
        parts.append(f"// Lloyd-Max codebooks for a unit vector in R^{g}; turboq8_g{g} takes turboq8's grid.")
        for b in LLOYD_MAX_BITS:
            lm = lloyd_max(b, d=g)
            parts.append(f"// {1 << b} levels; E||u - Q(u)||^2 = {g * lm.mse:.6f} for a unit vector in R^{g}")
            parts.append(f"TURBOQ_TABLE float turboq{b}_g{g}_centroids[{1 << b}] = {{\n{_c_floats(cbs[f'turboq{b}_g{g}'])}\n}};")
            parts.append(f"TURBOQ_TABLE float turboq{b}_g{g}_thresholds[{(1 << b) - 1}] = {{\n{_c_floats(thr[f'turboq{b}_g{g}'])}\n}};\n")
    parts.append("// The trellis types: value t of a group is the entry of the state s_t = (s_(t-1) << bits | code_t)")
    parts.append(f"// mod 2^{TRELLIS_L} (s_-1 = 0), Lloyd-trained with Viterbi paths (pyturbo/format/trellis.py).")
    parts.append(f"#define TURBOQ_TRELLIS_L {TRELLIS_L}")
    parts.append("// a 64-value group's search scales its rotated coordinates to these 128-value codebooks")
    parts.append(f"#define TURBOQ_TRELLIS_G64_FIT {float(TRELLIS_G64_FIT):.9e}f")
    for name, cb in trellis_codebooks().items():
        parts.append(f"TURBOQ_TABLE float {name}_codebook[{len(cb)}] = {{\n{_c_floats(cb)}\n}};")
    parts.append("")
    parts.append(f"// uniform grid (i - 127.5) / 127.5; E||u - Q(u)||^2 ~= {grid8_vector_mse():.3e} for a unit vector")
    parts.append(f"TURBOQ_TABLE float turboq8_centroids[{GRID8_LEVELS}] = {{\n{_c_floats(cbs['turboq8'])}\n}};")
    return "\n".join(parts) + "\n"


def _glsl_floats(name: str, values: np.ndarray) -> str:
    vals = np.asarray(values, dtype=np.float32)
    return f"const float {name}[{len(vals)}] = float[{len(vals)}](\n{_c_floats(vals).replace('f,', ',').rstrip('f')}\n);"


def render_glsl() -> str:
    """The same tables for the Vulkan shaders; signs as bit masks (bit i set = -1)."""
    cbs = codebooks()
    thr = thresholds()
    parts = [
        "// Generated by `python -m pyturbo.format.codebook --write`: do not edit.",
        "// The tables of ggml-turboq-tables.h for GLSL (see pyturbo/format/codebook.py).",
        "#if !defined(TURBOQ_TABLES_GLSL)",
        "#define TURBOQ_TABLES_GLSL",
        "",
        f"const uint TURBOQ_GROUP = {D}u;",
        f"const float TURBOQ_INV_SQRT_GROUP = {float(np.float32(1.0 / np.sqrt(D))):.9e};",
        *(line for g in TWIN_GROUPS for line in (
            f"const uint TURBOQ_G{g}_GROUP = {g}u;",
            f"const float TURBOQ_G{g}_INV_SQRT_GROUP = {float(np.float32(1.0 / np.sqrt(g))):.9e};")),
        "",
    ]
    parts.append(_signs.glsl_block())
    parts.append("")
    for b in LLOYD_MAX_BITS:
        parts.append(_glsl_floats(f"turboq{b}_centroids", cbs[f"turboq{b}"]))
        parts.append(_glsl_floats(f"turboq{b}_thresholds", thr[f"turboq{b}"]))
    parts.append(_glsl_floats("turboq8_centroids", cbs["turboq8"]))
    parts.append("")
    for g in TWIN_GROUPS:
        parts.append(f"// the _g{g} types: the first {g} signs above, their own Lloyd-Max tables, turboq8's grid")
        for b in LLOYD_MAX_BITS:
            parts.append(_glsl_floats(f"turboq{b}_g{g}_centroids", cbs[f"turboq{b}_g{g}"]))
            parts.append(_glsl_floats(f"turboq{b}_g{g}_thresholds", thr[f"turboq{b}_g{g}"]))
    parts.append("")
    parts.append(f"// the trellis types: entry s is the value of state s (the last {TRELLIS_L} code-stream bits)")
    parts.append(f"const uint TURBOQ_TRELLIS_L = {TRELLIS_L}u;")
    parts.append(f"const float TURBOQ_TRELLIS_G64_FIT = {float(TRELLIS_G64_FIT):.9e};")
    for name, cb in trellis_codebooks().items():
        parts.append(_glsl_floats(f"{name}_codebook", cb))
    parts.append("")
    parts.append("#endif")
    return "\n".join(parts) + "\n"


def generated_files() -> dict[str, str]:
    """upstream path -> content"""
    return {HEADER_PATH: render_header(), GLSL_PATH: render_glsl()}


def main() -> None:
    ap = argparse.ArgumentParser(description="Generate the turboq C tables")
    ap.add_argument("--write", action="store_true", help="write the C header and the GLSL tables into the patches that create them")
    ap.add_argument("--report", action="store_true", help="print each codebook's theoretical MSE")
    args = ap.parse_args()
    if args.report or not args.write:
        for name in ("turboq2", "turboq3", "turboq4", "turboq8"):
            print(f"{name}: E||u-Q(u)||^2 = {theoretical_vector_mse(name):.6g}")
    if args.write:
        files = generated_files()
        for patch, path in ((HEADER_PATCH, HEADER_PATH), (GLSL_PATCH, GLSL_PATH)):
            for rel in series_io().write_new_files(patch, {path: files[path]}):
                print(f"wrote {rel} in {patch}")


if __name__ == "__main__":
    main()
