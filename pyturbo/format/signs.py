"""The rotation signs and their C and GLSL renderings, standard library only.

D1 and D2 of the rotation y = D2 . H . D1 . x / sqrt(d) come from splitmix64: bit 0 of outputs
0..127 gives D1, of outputs 128..255 gives D2 (bit set -> -1). SIGN_SEED draws the shipped signs.

A build may draw others (`cmake -DPYTURBO_SIGN_SEED=<n>`, a debug option for measuring how much a
result depends on the rotation draw): ggml_patches/prepare.py, which runs before pyturbo is
installed and loads this file by path, swaps the sign blocks of the generated tables with
`seeded()`, so that every backend of that build compiles the same signs, and the C block then also
defines TURBOQ_SIGN_SEED_BUILD, which the library records in saved state.
"""
from __future__ import annotations

D = 128
SIGN_SEED = 0x7475726271  # "turbq" in ASCII


def splitmix64(seed: int, n: int) -> list[int]:
    mask = (1 << 64) - 1
    state = seed & mask
    out = []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


def sign_lists(seed: int | None = None) -> tuple[list[float], list[float]]:
    """(D1, D2) as lists of +-1.0; seed None: the shipped signs."""
    bits = [v & 1 for v in splitmix64(SIGN_SEED if seed is None else seed, 2 * D)]
    signs = [-1.0 if b else 1.0 for b in bits]
    return signs[:D], signs[D:]


def parse_seed(text: str) -> int:
    """A seed as CMake passes it: decimal or 0x-hex, below 2^64."""
    try:
        seed = int(text, 0)
    except ValueError:
        raise ValueError(f"PYTURBO_SIGN_SEED={text!r}: not an integer (decimal or 0x-hex)") from None
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"PYTURBO_SIGN_SEED={text!r}: out of range (0 .. 2^64-1)")
    return seed


def c_block(seed: int | None = None) -> str:
    """The header's sign arrays; a seeded block also names its seed for the library."""
    parts = []
    if seed is not None:
        parts.append("// a seeded build (PYTURBO_SIGN_SEED): caches and states of other signs read as noise")
        parts.append(f'#define TURBOQ_SIGN_SEED_BUILD "{seed}"\n')
    for name, signs in zip(("turboq_sign1", "turboq_sign2"), sign_lists(seed)):
        rows = [", ".join(f"{v:+.1f}f" for v in signs[i:i + 16]) for i in range(0, D, 16)]
        body = "    " + ",\n    ".join(rows)
        parts.append(f"TURBOQ_TABLE float {name}[{D}] = {{\n{body}\n}};\n")
    return "\n".join(parts)


def glsl_block(seed: int | None = None) -> str:
    """The GLSL twin: the signs as bit masks (bit i set = -1)."""
    parts = []
    for name, signs in zip(("turboq_sign1_bits", "turboq_sign2_bits"), sign_lists(seed)):
        words = []
        for w in range(D // 32):
            bits = sum(1 << i for i in range(32) if signs[32 * w + i] < 0)
            words.append(f"0x{bits:08x}u")
        parts.append(f"const uint {name}[{D // 32}] = uint[{D // 32}]({', '.join(words)});")
    return "\n".join(parts)


def seeded(text: str, seed: int, glsl: bool) -> str:
    """A generated table file (C header or GLSL) with its shipped sign block replaced by seed's."""
    block = glsl_block if glsl else c_block
    shipped = block()
    if text.count(shipped) != 1:
        raise ValueError("the generated table has no shipped sign block to replace (regenerate it: "
                         "python -m pyturbo.format.codebook --write)")
    return text.replace(shipped, block(seed))
