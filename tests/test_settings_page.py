"""docs/settings.md's environment table names exactly the environment variables the code reads.

The rule (stated the same way at the top of docs/settings.md):

- C/C++: every name, whatever its prefix, that the project's C/C++ code reads: the files the
  patch series creates (as the series leaves them), the lines the patches add to upstream's files
  (ggml_patches/*.patch, lines starting with '+'), and the project's own C/C++ sources outside them (tests/harness,
  tests/portable, bench/*.c). A read is `getenv(...)` / `std::getenv(...)` with a string literal,
  with a macro that a `#define NAME "..."` in those sources spells out, or with the `const char *`
  parameter of a helper whose calls pass a literal (`env_positions("TURBOQ_EXACT_TAIL", ...)`);
  an added `.set_env(...)` (common/arg.cpp's environment alias of a flag) counts as well. A
  getenv whose argument none of these resolves fails the test, so a new kind of read is noticed.
- Python and shell: a name that starts with PYTURBO_, TURBOQ_, TURBO_, GGML_ or LLAMA_, or is CI,
  read in pyturbo/, server/, tests/, scripts/, bench/ or ggml_patches/*.py: Python's
  `os.environ.get(X)`, `os.environ.setdefault(X, ...)`, `os.environ[X]` (not as an assignment or
  a `del`), `X in os.environ` and `os.getenv(X)`, where X is a string literal or a module
  constant assigned one (`ENV = "LLAMA_ARG_KV_K_CENTER"`), and the shell's `$NAME` and
  `${NAME...}` (`${NAME:-default}`, `${NAME:=default}`) outside comment lines. Names outside the
  prefixes (MODEL, PORT, CUDA_CHECK_*, XDG_CACHE_HOME, ...) are the scripts' own or other
  programs' and are not in the table. Setting a variable for a child process is not a read.

Standard library only; reads files, builds nothing.
"""
from __future__ import annotations

import re
from pathlib import Path

from pyturbo._paths import series_io

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "settings.md"
SECTION = "## Environment variables"

PREFIXES = ("PYTURBO_", "TURBOQ_", "TURBO_", "GGML_", "LLAMA_")
EXACT = {"CI", "OMP_WAIT_POLICY"}  # the names without a project prefix that the Python side reads
KINDS = {"user setting", "alias", "deprecated alias", "feature gate", "debug A/B switch", "build-dir", "test-suite control"}
# issue 57: at most this many debug switches on the C/C++ side besides the LLAMA_ARG_* aliases
MAX_C_DEBUG_SWITCHES = 6

C_SUFFIXES = {".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".cuh", ".inc", ".glsl", ".comp"}
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def python_rule(name: str) -> bool:
    return name.startswith(PREFIXES) or name in EXACT


# ---------------------------------------------------------------- C/C++ ----

def c_sources() -> list[tuple[str, str]]:
    """(label, text) of the project's C/C++ code: the new files the series creates (their final
    content), the lines the patches add to upstream's files, and the C/C++ files of tests/ and bench/."""
    new_files = series_io().new_files()
    out = [(rel, text) for rel, text in sorted(new_files.items()) if Path(rel).suffix in C_SUFFIXES]
    for patch in sorted((ROOT / "ggml_patches").glob("*.patch")):
        # upstream files' added lines; the new files are read whole above, as the series leaves them
        sections = re.split(r"^(?=diff --git )", patch.read_text(errors="replace"), flags=re.MULTILINE)
        added = [ln[1:] for sec in sections if not any(sec.startswith(f"diff --git a/{r} ") for r in new_files)
                 for ln in sec.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
        out.append((patch.name, "\n".join(added)))
    others = []
    for sub in ("tests", "bench"):
        others += [p for p in (ROOT / sub).rglob("*") if p.is_file()]
    for path in sorted(others):
        if path.suffix in C_SUFFIXES:
            out.append((str(path.relative_to(ROOT)), path.read_text(errors="replace")))
    return out


def c_env_names(sources: list[tuple[str, str]] | None = None) -> tuple[set[str], list[str]]:
    """The names the C/C++ code reads (sources: (label, text), default c_sources()), and the
    getenv calls that could not be resolved."""
    sources = c_sources() if sources is None else sources
    defines = {}
    for _, text in sources:
        for m in re.finditer(rf'^\s*#\s*define\s+({IDENT})\s+"({IDENT})"\s*$', text, re.MULTILINE):
            defines[m[1]] = m[2]
    names: set[str] = set()
    unresolved: list[str] = []

    def resolve(arg: str, label: str, text: str, pos: int, call: str) -> None:
        arg = arg.strip()
        if m := re.fullmatch(rf'"({IDENT})"', arg):
            names.add(m[1])
        elif arg in defines:
            names.add(defines[arg])
        elif re.fullmatch(IDENT, arg):
            # a helper's parameter: the nearest function before the call that takes `const char * arg`
            heads = list(re.finditer(rf"\b({IDENT})\s*\(\s*const\s+char\s*\*\s*{arg}\b", text[:pos]))
            if not heads:
                unresolved.append(f"{label}: {call}")
                return
            helper = heads[-1][1]
            found = False
            for _, other in sources:
                for c in re.finditer(rf'\b{helper}\s*\(\s*"({IDENT})"', other):
                    names.add(c[1])
                    found = True
            if not found:
                unresolved.append(f"{label}: {call} (helper {helper} is never called with a literal)")
        else:
            unresolved.append(f"{label}: {call}")

    for label, text in sources:
        for m in re.finditer(r"\b(?:std::)?(?:secure_)?getenv\s*\(([^()]*)\)", text):
            resolve(m[1], label, text, m.start(), m[0])
        if label.endswith(".patch"):
            for m in re.finditer(r"\.set_env\s*\(([^()]*)\)", text):
                resolve(m[1], label, text, m.start(), m[0])
    return names, unresolved


# ------------------------------------------------------ Python and shell ----

def script_sources() -> list[Path]:
    files: list[Path] = []
    for sub in ("pyturbo", "server", "tests", "scripts", "bench"):
        files += [p for p in (ROOT / sub).rglob("*") if p.is_file() and p.suffix in (".py", ".sh")]
    files += sorted((ROOT / "ggml_patches").glob("*.py"))
    this = Path(__file__).resolve()
    return sorted(p for p in files if p.resolve() != this and "__pycache__" not in p.parts)


PY_ARG = r"""(?:"([^"]+)"|'([^']+)'|(?:\w+\.)?([A-Z][A-Z0-9_]*))"""
PY_READS = [
    re.compile(rf"\benviron\.(?:get|setdefault)\(\s*{PY_ARG}"),
    re.compile(rf"\bgetenv\(\s*{PY_ARG}"),
    re.compile(rf"\benviron\[\s*{PY_ARG}\s*\]"),
    re.compile(rf"{PY_ARG}\s+(?:not\s+)?in\s+(?:os\.)?environ\b"),
]
SH_READ = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")


def python_env_names() -> set[str]:
    files = script_sources()
    texts = {p: p.read_text(errors="replace") for p in files}
    constants = {}
    for p, text in texts.items():
        if p.suffix == ".py":
            for m in re.finditer(r'^([A-Z][A-Z0-9_]*)\s*=\s*["\']([^"\']+)["\']', text, re.MULTILINE):
                constants[m[1]] = m[2]
    names: set[str] = set()
    for p, text in texts.items():
        for rx in PY_READS:
            for m in rx.finditer(text):
                if rx.pattern.startswith(r"\benviron\["):
                    line_start = text.rfind("\n", 0, m.start()) + 1
                    if re.search(r"\bdel\s+(?:os\.)?$", text[line_start:m.start()]):
                        continue  # del os.environ[X]
                    if re.match(r"\s*=(?!=)", text[m.end():]):
                        continue  # os.environ[X] = ...
                name = m[1] or m[2] or constants.get(m[3] or "")
                if name and python_rule(name):
                    names.add(name)
        if p.suffix == ".sh":
            for line in text.splitlines():
                if line.lstrip().startswith("#"):
                    continue
                names.update(n for n in SH_READ.findall(line) if python_rule(n))
    return names


# ----------------------------------------------------------------- page ----

def page_rows() -> dict[str, list[str]]:
    """The environment table's rows by name: {NAME: [cells]}."""
    text = PAGE.read_text()
    assert text.startswith("# Settings"), "docs/settings.md must start with '# Settings'"
    assert SECTION in text, f"docs/settings.md has no '{SECTION}' section"
    section = text.split(SECTION, 1)[1]
    section = re.split(r"^## ", section, maxsplit=1, flags=re.MULTILINE)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`([A-Za-z_][A-Za-z0-9_]*)`\s*\|(.*)\|\s*$", line)
        if m:
            assert m[1] not in rows, f"{m[1]} has two rows in the environment table"
            rows[m[1]] = [c.strip() for c in m[2].split("|")]
    return rows


def _diff(what: str, page: set[str], code: set[str]) -> str:
    missing, stale = sorted(code - page), sorted(page - code)
    return (f"{what}: docs/settings.md's environment table and the code disagree; "
            f"read by the code but missing from the page: {missing or 'none'}; "
            f"on the page but read nowhere (stale): {stale or 'none'}")


def test_every_c_getenv_is_resolved():
    _, unresolved = c_env_names()
    assert not unresolved, f"getenv calls this test cannot name (extend its rule and the page): {unresolved}"


def test_the_c_scan_resolves_each_kind_of_read():
    """The scanner itself, on made-up sources: a literal, a #define, a helper's parameter, an added
    set_env; a getenv it cannot name is reported, not dropped."""
    src = [
        ("files/a.cpp", '#define MY_ENV "FAKE_MACRO"\n'
                        'static int f() { return std::getenv("FAKE_LITERAL") != nullptr; }\n'
                        'static int g() { return getenv(MY_ENV) != nullptr; }\n'
                        'static int pos(const char * name, int d) { const char * s = getenv(name); return s ? 1 : d; }\n'
                        'int h() { return pos("FAKE_HELPER", 0); }\n'
                        'int k(const char * p) { return getenv(p + 1) != nullptr; }\n'),
        ("0099-x.patch", '    ).set_env("FAKE_SET_ENV"));\n'),
    ]
    names, unresolved = c_env_names(src)
    assert names == {"FAKE_LITERAL", "FAKE_MACRO", "FAKE_HELPER", "FAKE_SET_ENV"}, names
    assert unresolved == ["files/a.cpp: getenv(p + 1)"], unresolved


def test_the_python_rule():
    assert all(python_rule(n) for n in ("PYTURBO_CACHE", "TURBOQ_X", "TURBO_X", "GGML_CUDA_X", "LLAMA_ARG_X", "CI"))
    assert not any(python_rule(n) for n in ("MODEL", "PORT", "XDG_CACHE_HOME", "CIRCLE", "TURBOQ", "PYTHONPATH"))


def test_the_page_is_not_empty():
    assert len(page_rows()) >= 10, "the environment table was not found or lost its rows"


def test_page_lists_exactly_the_environment_the_code_reads():
    c_names, _ = c_env_names()
    py_names = python_env_names()
    code = c_names | py_names
    page = set(page_rows())
    assert page == code, _diff("C/C++ and Python/scripts", page, code)


def test_page_rows_are_complete():
    kinds_seen = set()
    for name, cells in page_rows().items():
        assert len(cells) == 4 and all(cells), f"{name}: the row needs read in | default | kind | what it is for"
        kind = cells[2]
        assert kind in KINDS, f"{name}: kind {kind!r} is not one of {sorted(KINDS)}"
        kinds_seen.add(kind)
    assert kinds_seen <= KINDS


def test_the_c_side_keeps_few_debug_switches():
    """Debug switches are for A/B runs and tests, each with a reason and a row here; a measurement
    that is done becomes a setting or goes. Fails when a seventh appears on the C/C++ side."""
    c_names, _ = c_env_names()
    rows = page_rows()
    debug = sorted(n for n in c_names if rows.get(n, ["", "", ""])[2] == "debug A/B switch")
    assert len(debug) <= MAX_C_DEBUG_SWITCHES, debug
