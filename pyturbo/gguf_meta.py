"""The key/value metadata of a GGUF file, read without loading its tensors or vocabulary.

gguf.GGUFReader parses every field and tensor record (about 10 s for a 262k-token vocabulary);
the server and kv_bytes need a few scalars and strings, so arrays are skipped, not decoded.
"""
from __future__ import annotations

import struct
from pathlib import Path

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    pass


def read_metadata(path: str | Path) -> dict[str, object]:
    """key -> value for scalar and string keys; array keys map to None (present, not decoded)."""
    return _read(path, None)[0]


def longest_token_bytes(path: str | Path) -> int | None:
    """The longest entry of the vocabulary (tokenizer.ggml.tokens) in UTF-8 bytes, None without
    one. No token stands for more bytes of text than its entry has: SentencePiece's "\u2581" and
    "<0x0A>" and byte-level BPE's one character per byte are at least as long as what they decode
    to. So a text of n bytes is at least n / this many tokens, known without tokenizing it."""
    return _read(path, "tokenizer.ggml.tokens")[1]


def _read(path: str | Path, measure: str | None) -> tuple[dict[str, object], int | None]:
    """read_metadata's values, and the longest string of the string array `measure`."""
    out: dict[str, object] = {}
    longest: int | None = None
    with open(path, "rb") as f:
        def take(fmt: str):
            n = struct.calcsize(fmt)
            raw = f.read(n)
            if len(raw) != n:
                raise GGUFError(f"{path}: truncated GGUF header")
            return struct.unpack(fmt, raw)[0]

        size = f.seek(0, 2)
        f.seek(0)

        def string() -> str:
            n = take("<Q")
            if n > size - f.tell():
                raise GGUFError(f"{path}: a string of {n} bytes runs past the end of the file")
            raw = f.read(n)
            if len(raw) != n:
                raise GGUFError(f"{path}: truncated GGUF header")
            return raw.decode("utf-8", errors="replace")

        def skip(vtype: int) -> None:
            if vtype == _STRING:
                f.seek(take("<Q"), 1)
            elif vtype == _ARRAY:
                etype, count = take("<I"), take("<Q")
                if count > size - f.tell():
                    raise GGUFError(f"{path}: an array of {count} values runs past the end of the file")
                if etype in _SCALARS:
                    f.seek(struct.calcsize(_SCALARS[etype]) * count, 1)
                else:
                    for _ in range(count):
                        skip(etype)
            elif vtype in _SCALARS:
                f.seek(struct.calcsize(_SCALARS[vtype]), 1)
            else:
                raise GGUFError(f"{path}: unknown GGUF value type {vtype}")

        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (bad magic)")
        version = take("<I")
        if version < 2:
            raise GGUFError(f"{path}: GGUF version {version} is not supported")
        take("<Q")  # tensor count
        for _ in range(take("<Q")):
            key, vtype = string(), take("<I")
            if vtype == _STRING:
                out[key] = string()
            elif vtype in _SCALARS:
                out[key] = take(_SCALARS[vtype])
            elif key == measure and vtype == _ARRAY:
                etype, count = take("<I"), take("<Q")
                if etype != _STRING or count > size - f.tell():
                    raise GGUFError(f"{path}: {key} is not an array of strings that fits the file")
                longest = 0
                for _ in range(count):
                    n = take("<Q")
                    longest = max(longest, n)
                    f.seek(n, 1)
                out[key] = None
            else:
                skip(vtype)
                out[key] = None
    return out, longest
