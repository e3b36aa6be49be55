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
    out: dict[str, object] = {}
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
            else:
                skip(vtype)
                out[key] = None
    return out
