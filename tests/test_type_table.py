"""The TurboQuant types are listed once on each side: ggml-turboq-types.h in C (ggml's traits,
declarations, switches and backend case lists expand its rows, and ggml.c's static_asserts hold it
to the enum and the block layouts) and pyturbo.types in Python; here the two are held to each other."""
from __future__ import annotations

import re

from pyturbo import types
from pyturbo._paths import series_io

HEADER = "ggml/src/ggml-turboq-types.h"
ROW = re.compile(r"^\s*X\((\w+),\s*(\w+),\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+)\)", re.MULTILINE)
LISTS = ("GGML_TURBOQ_BASE_TYPES", "GGML_TURBOQ_TWIN_TYPES", "GGML_TURBOQ_TRELLIS_TYPES", "GGML_TURBOQ_TRELLIS_TWIN_TYPES")


def header_rows(text: str) -> dict[str, list[tuple[str, str, int, int, int, int]]]:
    """list macro -> its rows (ENUM, name, id, bits, group, bytes), in order."""
    out = {}
    for name in LISTS:
        body = re.search(rf"#define {name}\(X\)((?:.*\\\n)*.*)", text)
        assert body, f"{HEADER} has no {name}"
        out[name] = [(e, n, int(i), int(b), int(g), int(s)) for e, n, i, b, g, s in ROW.findall(body.group(1))]
    return out


def python_rows() -> dict[str, list[tuple[str, str, int, int, int, int]]]:
    def row(t: types.CacheType) -> tuple[str, str, int, int, int, int]:
        bits = int(re.match(r"turboq(\d)", t.name).group(1))
        return (t.name.upper(), t.name, t.ggml_id, bits, t.block_size, t.block_bytes)
    return {
        "GGML_TURBOQ_BASE_TYPES": [row(types.CACHE_TYPES[n]) for n in types.TURBOQ_TYPES],
        "GGML_TURBOQ_TWIN_TYPES": [row(t) for t in types.TWIN_TYPES.values()],
        "GGML_TURBOQ_TRELLIS_TYPES": [row(t) for t in types.TRELLIS_TYPES.values()],
        "GGML_TURBOQ_TRELLIS_TWIN_TYPES": [row(t) for t in types.TRELLIS_TWIN_TYPES.values()],
    }


def test_the_c_and_python_type_tables_agree():
    text = series_io().new_files()[HEADER]
    c = header_rows(text)
    assert sum(len(r) for r in c.values()) == 20
    assert c == python_rows()


def test_every_type_name_follows_ggmls_rule():
    """A type's name is its enum's suffix in lower case (GGML_TYPE_TURBOQ3: "turboq3"), as for
    every upstream type; the enum in ggml.h is checked against the rows by ggml.c's static_asserts."""
    for rows in header_rows(series_io().new_files()[HEADER]).values():
        for enum, name, *_ in rows:
            assert enum.lower() == name


def test_the_row_parser_sees_a_wrong_row():
    """The comparison can fail: one changed block size in the header is a difference."""
    text = series_io().new_files()[HEADER]
    bad = re.sub(r"X\(TURBOQ4_G32, turboq4_g32, 70, 4,  32,  18\)", "X(TURBOQ4_G32, turboq4_g32, 70, 4,  32,  20)", text)
    assert bad != text
    assert header_rows(bad) != python_rows()
