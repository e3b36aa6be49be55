"""The Vulkan backend, run on Mesa's software driver (lavapipe), against the CPU backend.

test-backend-ops compares every turboq case on Vulkan0 with the CPU backend (its own NMSE
tolerances), the _g64, _g32 and _g16 twins' and the trellis types' included, and llama-perplexity -ngl 99
with turboq3 K/V must give the CPU's logits at head sizes 128, 64, 96 and 80, as must turboq3t and turboq2t
at 128, and the exact window, whose rows a cache on Vulkan0 reads beside it (one more split of the
flash-attention shader) or, where a debug switch forces it, after an F16 copy of its rows.

build-vulkan/ comes from scripts/setup_vulkan.sh, which scripts/test.sh runs. Without it these
tests skip, except under CI (CI=true) or PYTURBO_REQUIRE_VULKAN=1, where they fail: a run that did
not exercise Vulkan0 must not pass.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import numpy as np

from pyturbo import data
from pyturbo._paths import build_dirs, cache_dir, tool_env
from pyturbo.format import reference
from pyturbo.tools import llama_perplexity as perplexity
from pyturbo.types import cache_type
from helpers import assert_reads_beside, decode_step_ops, special_groups

pytestmark = pytest.mark.vulkan

VK_BUILD = build_dirs()["PYTURBO_VULKAN_BUILD_DIR"]
REQUIRED = os.environ.get("CI") == "true" or os.environ.get("PYTURBO_REQUIRE_VULKAN") == "1"

# Tolerances of the end-to-end check: the same cache bytes and the same rotated-domain attention,
# so only float summation order differs between the backends (and, through the weights' products
# on Vulkan0, a few codebook indices: at head size 96, 32-value groups, the PPL differed by 0.12%
# at a KLD of 3.6e-5). KLD_TOL is the tight check.
PPL_REL_TOL = 0.002
KLD_TOL = 1e-4


def vk_env() -> dict[str, str]:
    # lavapipe is a CPU device, which ggml-vulkan hides unless it is named
    env = tool_env({"GGML_VK_VISIBLE_DEVICES": "0"}, libs=VK_BUILD / "bin")
    # lavapipe JIT-compiles each pipeline; its disk cache keeps reruns fast (outside the clone)
    env.setdefault("MESA_SHADER_CACHE_DIR", str(cache_dir() / "mesa-shader-cache"))
    # and without LLVM's optimization passes: on an empty cache (a fresh machine) JIT time was
    # most of these tests' time, and their shaders run on small tensors
    env.setdefault("GALLIVM_PERF", "nopt")
    return env


@pytest.fixture(scope="module")
def vk_bin() -> Path:
    exe = VK_BUILD / "bin" / "test-backend-ops"
    if not exe.exists():
        msg = f"{exe} is missing: run scripts/setup_vulkan.sh"
        if REQUIRED:
            pytest.fail(msg)
        pytest.skip(msg)
    r = subprocess.run([str(exe), "-b", "Vulkan0", "-o", "SET_ROWS", "-p", "turboq3"], env=vk_env(),
                       capture_output=True, text=True, timeout=600)
    if "Backend 1/2: Vulkan0" not in r.stdout:
        msg = f"no Vulkan0 device (lavapipe: scripts/setup_vulkan_deps.sh):\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
        if REQUIRED:
            pytest.fail(msg)
        pytest.skip(msg)
    return VK_BUILD / "bin"


def backend_ops(vk_bin: Path, op: str, *patterns: str, timeout: float = 1800) -> int:
    """Runs test-backend-ops on Vulkan0, one process per pattern at the same time (lavapipe compiles
    each pipeline on the thread that first needs it, so on an empty shader cache one process keeps
    one core busy); returns the number of cases that ran and passed."""
    procs: list[subprocess.Popen] = []
    n = 0
    try:
        for pattern in patterns:
            procs.append(subprocess.Popen([str(vk_bin / "test-backend-ops"), "-b", "Vulkan0", "-o", op, "-p", pattern],
                                          env=vk_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for proc in procs:
            out = proc.communicate(timeout=timeout)[0]
            assert proc.returncode == 0, out[-6000:]
            assert "Backend 1/2: Vulkan0" in out and "Backend Vulkan0: \x1b[1;32mOK" in out, out[-6000:]
            # a case the backend does not claim would run on the CPU in a real graph: none allowed
            unsupported = [line for line in out.splitlines() if "not supported" in line]
            assert not unsupported, "\n".join(unsupported[:20])
            m = re.search(r"(\d+)/(\d+) tests passed", out)
            assert m and m.group(1) == m.group(2), out[-6000:]
            n += int(m.group(2))
    finally:
        for proc in procs:  # the others, when one failed
            proc.kill()
            proc.wait()
    return n


# SET_ROWS of f32 rows (stdin, float32) into a tensor of type argv[2] on Vulkan0, in the order
# argv[3] (row i goes to row idx[i]); prints the destination's bytes. A separate process: ggml-vulkan
# reads GGML_VK_VISIBLE_DEVICES when it loads.
SET_ROWS_ON_VULKAN = r"""
import ctypes as C, sys
import numpy as np
from pathlib import Path
from pyturbo._paths import library
from pyturbo.ggml import InitParams
d = Path(sys.argv[1])
base, ggml = (library(n, directory=d, mode=C.RTLD_GLOBAL) for n in ("ggml-base", "ggml"))
vp, i64 = C.c_void_p, C.c_int64
for lib, name, res, args in [
        (ggml, "ggml_backend_dev_by_name", vp, [C.c_char_p]), (ggml, "ggml_backend_dev_init", vp, [vp, C.c_char_p]),
        (base, "ggml_init", vp, [InitParams]), (base, "ggml_new_tensor_2d", vp, [vp, C.c_int, i64, i64]),
        (base, "ggml_new_tensor_1d", vp, [vp, C.c_int, i64]), (base, "ggml_set_rows", vp, [vp, vp, vp, vp]),
        (base, "ggml_backend_alloc_ctx_tensors", vp, [vp, vp]), (base, "ggml_new_graph", vp, [vp]),
        (base, "ggml_build_forward_expand", None, [vp, vp]), (base, "ggml_backend_graph_compute", C.c_int, [vp, vp]),
        (base, "ggml_backend_tensor_set", None, [vp, vp, C.c_size_t, C.c_size_t]),
        (base, "ggml_backend_tensor_get", None, [vp, vp, C.c_size_t, C.c_size_t]), (base, "ggml_nbytes", C.c_size_t, [vp])]:
    getattr(lib, name).restype, getattr(lib, name).argtypes = res, args
x = np.frombuffer(sys.stdin.buffer.read(), np.float32)
n, width, type_id = len(sys.argv[3].split(",")), len(x) // len(sys.argv[3].split(",")), int(sys.argv[2])
idx = np.array([int(i) for i in sys.argv[3].split(",")], np.int64)
dev = ggml.ggml_backend_dev_by_name(b"Vulkan0")
assert dev, "no Vulkan0"
backend = ggml.ggml_backend_dev_init(dev, None)
ctx = base.ggml_init(InitParams(1 << 20, None, True))
src = base.ggml_new_tensor_2d(ctx, 0, width, n)
rows = base.ggml_new_tensor_1d(ctx, 27, n)  # GGML_TYPE_I64
dst = base.ggml_new_tensor_2d(ctx, type_id, width, n)
out = base.ggml_set_rows(ctx, dst, src, rows)
assert base.ggml_backend_alloc_ctx_tensors(ctx, backend)
base.ggml_backend_tensor_set(src, x.ctypes.data, 0, x.nbytes)
base.ggml_backend_tensor_set(rows, idx.ctypes.data, 0, idx.nbytes)
g = base.ggml_new_graph(ctx)
base.ggml_build_forward_expand(g, out)
assert base.ggml_backend_graph_compute(backend, g) == 0
res = np.empty(base.ggml_nbytes(dst), np.uint8)
base.ggml_backend_tensor_get(dst, res.ctypes.data, 0, res.nbytes)
sys.stdout.buffer.write(res.tobytes())
"""


@pytest.mark.parametrize("type_name", ["turboq3", "turboq2", "turboq4", "turboq8", "turboq3_g64", "turboq3_g16",
                                       "turboq3t", "turboq2t"])
def test_vulkan_cache_writes_are_the_reference_bytes(vk_bin, rng, type_name):
    """Vulkan0's SET_ROWS writes the blocks that the CPU (and the NumPy reference) writes, special
    groups included: a cache is the same bytes on every backend, so saved state moves between them
    and a trellis type's Viterbi search takes the same path."""
    x = np.concatenate(list(special_groups(rng).values())).astype(np.float32)
    order = rng.permutation(len(x))
    r = subprocess.run([sys.executable, "-c", SET_ROWS_ON_VULKAN, str(vk_bin), str(cache_type(type_name).ggml_id),
                        ",".join(map(str, order))], input=x.tobytes(), env=vk_env(), capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    got = np.frombuffer(r.stdout, np.uint8).reshape(len(x), -1)
    want = reference.quantize(x.reshape(-1), type_name).reshape(len(x), -1)
    bad = [i for i in range(len(x)) if not np.array_equal(got[order[i]], want[i])]
    assert not bad, f"{len(bad)} of {len(x)} rows differ, the first: {bad[:8]}"


@pytest.mark.parametrize("op, n_cases", [("SET_ROWS", 12), ("GET_ROWS", 8), ("CPY", 18)])
def test_turboq_cache_ops_on_vulkan(vk_bin, op, n_cases):
    # the 128-value types (a name followed by "," or ")"), not their _g64 twins
    assert backend_ops(vk_bin, op, "turboq[2348][,)]") == n_cases


@pytest.mark.parametrize("op, n_cases", [("SET_ROWS", 8), ("GET_ROWS", 4), ("CPY", 28), ("FLASH_ATTN_EXT", 40)])
def test_the_64_value_twins_on_vulkan(vk_bin, op, n_cases):
    """The _g64 twins (head sizes 64 and 192; issue 22): each type's SET_ROWS (from f32 with i64
    rows, from f16 with i32 rows), GET_ROWS, CPY from f32 and to f32 and f16 (and to and from views into
    rows, as an MLA K-shift copies), and flash attention
    at head sizes 64 and 192 (batches of 1 and 35), f16 beside a twin on either side, a q8_0 V,
    llama.cpp's layout at head size 64, and MLA's K of 576 read as V through a view of its first
    512 (batches of 1 and 35)."""
    assert backend_ops(vk_bin, op, "turboq[2348]_g64") == n_cases


@pytest.mark.parametrize("op, n_cases", [("SET_ROWS", 8), ("GET_ROWS", 4), ("CPY", 12), ("FLASH_ATTN_EXT", 20)])
def test_the_32_value_twins_on_vulkan(vk_bin, op, n_cases):
    """The _g32 twins (head size 96: Phi-3; issue 22): each type's SET_ROWS (from f32 with i64 rows,
    from f16 with i32 rows), GET_ROWS, CPY from f32 and to f32 and f16, and flash attention at head
    size 96 (batches of 1 and 35), f16 beside a twin on either side and llama.cpp's layout."""
    assert backend_ops(vk_bin, op, "_g32") == n_cases


@pytest.mark.parametrize("op, n_cases", [("SET_ROWS", 8), ("GET_ROWS", 4), ("CPY", 12), ("FLASH_ATTN_EXT", 20)])
def test_the_16_value_twins_on_vulkan(vk_bin, op, n_cases):
    """The _g16 twins (head size 80: Phi-2; issue 22): the _g32 twins' cases at head size 80."""
    assert backend_ops(vk_bin, op, "_g16") == n_cases


def test_copies_to_and_from_a_quantized_view_on_vulkan(vk_bin):
    """An MLA K-shift's copies (patch 16): f32 to and from a view that starts blocks into each row
    of a q8_0, q4_0, turboq3 or _g64 tensor. The views one block in start where lavapipe's
    storage-buffer alignment does not divide, so the shader must add the misalignment offset."""
    assert backend_ops(vk_bin, "CPY", "ne_row=") == 26


def test_a_twin_at_a_head_size_vulkan_declines_is_refused(vk_bin, monkeypatch):
    """Head size 320 takes the _g64 twins, whose flash attention Vulkan0 declines there (it takes
    64 and 192): llama.cpp asks the device and refuses the layer, naming it and what works, instead
    of letting the scheduler run that attention on the CPU; with the cache kept on the CPU it runs."""
    monkeypatch.setenv("PYTURBO_BUILD_DIR", str(VK_BUILD))
    for k, v in vk_env().items():
        monkeypatch.setenv(k, v)
    model, text = data.tiny_model(head_dim=320, n_head=2, n_head_kv=1), data.corpus_slice(12000)
    with pytest.raises(RuntimeError, match=r"layer 0: head size 320: .*turboq3_g64.*Vulkan0, which declines.*--no-kv-offload"):
        perplexity(model, text, "turboq3", "turboq3", ctx=256, chunks=1, extra=("-ngl", "99"))
    kept = perplexity(model, text, "turboq3", "turboq3", ctx=256, chunks=1, extra=("-ngl", "99", "--no-kv-offload"))
    assert kept.ppl > 0


def test_mla_cache_and_attention_on_vulkan_give_the_cpu_cache_logits(vk_bin, tmp_path, monkeypatch):
    """A tiny MLA model (DeepSeek-V2 layout, K of 576, V its view) with a turboq3 cache, all on
    Vulkan0, against the same build with the cache and its attention on the CPU (--no-kv-offload):
    the weights' products run on Vulkan0 in both, so what differs is the cache and the attention.
    (Against the CPU-only build the weights' products differ too, which turboq's indices amplify:
    KLD 3e-4 with either cache placement, against 1e-6 for f16.)"""
    monkeypatch.setenv("PYTURBO_BUILD_DIR", str(VK_BUILD))
    for k, v in vk_env().items():
        monkeypatch.setenv(k, v)
    model, text = data.tiny_mla_model(), data.corpus_slice(12000)
    run = dict(ctx=256, chunks=4, threads=2)
    base = tmp_path / "cpu-cache.kld"
    cpu = perplexity(model, text, "turboq3", "turboq3", kld_base=base, write_base=True,
                     extra=("-ngl", "99", "--no-kv-offload"), **run)
    vk = perplexity(model, text, "turboq3", "turboq3", kld_base=base, extra=("-ngl", "99"), **run)
    assert "Vulkan0 KV buffer size" in vk.log and "Vulkan0 KV buffer size" not in cpu.log, vk.log[-3000:]
    assert "head size 576: K turboq3_g64 (turboq in 64-value groups), read as V through its first 512 values" in vk.log
    print(f"\nMLA turboq3: PPL cache on CPU {cpu.ppl:.4f} | on Vulkan0 {vk.ppl:.4f} | KLD {vk.kld:.3g}")
    assert abs(vk.ppl / cpu.ppl - 1) < PPL_REL_TOL
    assert vk.kld is not None and vk.kld < KLD_TOL


def test_the_exact_window_on_vulkan_gives_the_cpu_cache_logits(vk_bin, tmp_path, monkeypatch):
    """A window of 16 with the cache on Vulkan0, in ubatches of 64 (so each layer reads the ring that
    lives there too): each layer reads its window beside the cache (turboq_fa_exact.comp, one more
    split of the flash attention), and the logits are those of the same build with the cache kept
    on the CPU, which reads the rows beside too; so are they through the F16 copy that
    TURBOQ_WINDOW_COPY forces (the path a q8_0 cache with a window takes); without the window
    they are not (5.9e-4)."""
    monkeypatch.setenv("PYTURBO_BUILD_DIR", str(VK_BUILD))
    for k, v in vk_env().items():
        monkeypatch.setenv(k, v)
    model, text = data.tiny_model(head_dim=128), data.corpus_slice(12000)
    run = dict(ctx=256, chunks=3, threads=2)
    win = ("--kv-exact-window", "16", "-ngl", "99", "-ub", "64")
    base = tmp_path / "cpu-cache.kld"
    cpu = perplexity(model, text, "turboq3", "turboq2", kld_base=base, write_base=True, extra=(*win, "--no-kv-offload"), **run)
    vk = perplexity(model, text, "turboq3", "turboq2", kld_base=base, extra=win, **run)
    monkeypatch.setenv("TURBOQ_WINDOW_COPY", "1")
    vk_copy = perplexity(model, text, "turboq3", "turboq2", kld_base=base, extra=win, **run)
    monkeypatch.delenv("TURBOQ_WINDOW_COPY")
    plain = perplexity(model, text, "turboq3", "turboq2", kld_base=base, extra=("--kv-exact-window", "0", "-ngl", "99", "-ub", "64"), **run)
    assert "Vulkan0 KV buffer size" in vk.log and "Vulkan0 KV buffer size" not in cpu.log, vk.log[-3000:]
    assert "F16 rows beside the cache" in vk.log and "F16 rows beside the cache" in cpu.log, vk.log[-3000:]
    assert "F16 rows after an F16 copy of the cache" in vk_copy.log, vk_copy.log[-3000:]
    print(f"\nwindow 16: PPL cache on CPU {cpu.ppl:.4f} | on Vulkan0 {vk.ppl:.4f} (KLD {vk.kld:.3g}), through the copy "
          f"{vk_copy.ppl:.4f} (KLD {vk_copy.kld:.3g}) | no window {plain.ppl:.4f} (KLD {plain.kld:.3g})")
    for got in (vk, vk_copy):
        assert abs(got.ppl / cpu.ppl - 1) < PPL_REL_TOL
        assert got.kld is not None and got.kld < KLD_TOL
    assert plain.kld is not None and plain.kld > 4 * max(vk.kld, vk_copy.kld)


def test_flash_attention_reads_exact_rows_beside_a_turboq_cache_on_vulkan(vk_bin):
    """test-backend-ops' FLASH_ATTN_EXT cases with exact sources (ggml-fa-exact.h) against the CPU
    backend: head sizes 128 and 256, F32 and F16 rows, 4 query heads per KV head and none, one to 8
    queries of several sequences (decode) and 16 to 64 (prefill, which CUDA reads through its F16
    conversion), sinks, and f16 or q8_0 beside a turboq type."""
    assert backend_ops(vk_bin, "FLASH_ATTN_EXT", "n_exact=") == 20


def test_a_decode_step_on_vulkan_reads_the_window_without_copying_the_cache(vk_bin):
    """The graph of a decode step with the cache and the window on Vulkan0: no CPY or PAD of the
    cache, as on the CPU (test_exact_window.py), and the attention on Vulkan0 (patch 31 had pinned
    every node with exact rows to the CPU, which then read the cache from the device); through the
    copy (TURBOQ_WINDOW_COPY) each layer converts its whole K and V cache to F16."""
    exe, model, text = vk_bin / "llama-perplexity", data.tiny_model(head_dim=128), data.corpus_slice(12000)
    beside = decode_step_ops(exe, model, text, vk_env(), ("-ngl", "99"))
    copy = decode_step_ops(exe, model, text, {**vk_env(), "TURBOQ_WINDOW_COPY": "1"}, ("-ngl", "99"))
    assert_reads_beside(beside, copy, "Vulkan0")  # the attention runs there, not on the CPU
    print(f"\ndecode step nodes on Vulkan0: {len(beside)} beside the cache, {len(copy)} through the copy")


_WINDOW_STATE_SCRIPT = r"""
import json, sys
import numpy as np
from pyturbo.llama import Llama
from helpers import continuation  # tests/, on PYTHONPATH

def make(window):
    return Llama(sys.argv[1], cache_type_k="turboq3", cache_type_v="turboq3", kv_exact_window=window, n_ctx=256,
                 n_batch=256, n_gpu_layers=99, flash_attn=True, verbose=True, seed=1, logits_all=True)

a = make(8)
a.eval(a.tokenize(b"The old man said that the fish would come back when the wind turned, and then he slept."))
state = a.save_state()
first = int(np.argmax(a.scores[a.n_tokens - 1]))
tokens, logits = continuation(a, first)
b = make(8)
b.eval(b.tokenize(b"Another text, another cache, with other rows in its window than the first had."))
b.load_state(state)
again, logits2 = continuation(b, first)
print(json.dumps({"same_tokens": again == tokens, "max_diff": max(float(np.abs(x - y).max()) for x, y in zip(logits, logits2))}))
"""


def test_a_state_with_an_exact_window_on_vulkan_restores_bit_identically(vk_bin):
    """The window's rings live on Vulkan0 beside the cache: pyturbo.Llama on the Vulkan build saves a
    state, and a fresh context whose window held other rows continues from it bit for bit (the
    rows travel through the backend's tensor reads and writes, as the cache's own)."""
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, **vk_env(), "PYTURBO_BUILD_DIR": str(VK_BUILD),
           "PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, "-c", _WINDOW_STATE_SCRIPT, str(data.tiny_model(head_dim=128))], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Vulkan0 KV buffer size" in r.stderr and "F16 rows beside the cache" in r.stderr, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"same_tokens": True, "max_diff": 0.0}


@pytest.mark.parametrize("mode", [3, 7])
def test_layer_adaptive_modes_at_head_size_80_on_vulkan(vk_bin, tmp_path, monkeypatch, mode):
    """A mode's q8_0 at head size 80 is turboq8_g16 (test_head_sizes.py), so a layer mixes it with
    turboq3_g16 (mode 3: K turboq8_g16 on one layer; mode 7: V turboq8_g16 on both): with every
    layer and its cache on Vulkan0 the logits are the CPU's."""
    model, text = data.tiny_model(head_dim=80), data.corpus_slice(12000)
    base = tmp_path / "cpu.kld"
    run = dict(ctx=256, chunks=4, threads=2)
    la = ("--layer-adaptive", str(mode))
    cpu = perplexity(model, text, "turboq3", "turboq3", kld_base=base, write_base=True, extra=la, **run)
    monkeypatch.setenv("PYTURBO_BUILD_DIR", str(VK_BUILD))
    for k, v in vk_env().items():
        monkeypatch.setenv(k, v)
    vk = perplexity(model, text, "turboq3", "turboq3", kld_base=base, extra=(*la, "-ngl", "99"), **run)
    assert "Vulkan0 KV buffer size" in vk.log, vk.log[-3000:]
    assert re.search(rf"layer-adaptive mode {mode}: (K turboq8_g16, V turboq3_g16|K turboq3_g16, V turboq8_g16)", vk.log)
    assert abs(vk.ppl / cpu.ppl - 1) < PPL_REL_TOL
    assert vk.kld is not None and vk.kld < KLD_TOL


def test_turboq_flash_attention_on_vulkan_hs128(vk_bin):
    # every turboq type as K and as V (with itself, f16 and q8_0 on the other side), 4 query heads
    # per KV head, batches of 1, 8 (the grouped-heads path) and 35 (row tiles, one partial); batches
    # of 64 and 200 (one and several query tiles of the CPU's tiled path, the reference here) with
    # turboq and f16 K; llama.cpp's layout (1 KV head, 3 streams, permuted views):
    # 4 types x (5 pairs x 3 shapes + 2 pairs x 2 shapes + 1). Each case has one turboq type, so
    # the two patterns split the cases between two processes
    assert backend_ops(vk_bin, "FLASH_ATTN_EXT", "hsk=128,.*turboq[23][,)]", "hsk=128,.*turboq[48][,)]") == 80


@pytest.mark.parametrize("op, n_cases", [("SET_ROWS", 4), ("GET_ROWS", 2), ("CPY", 6), ("FLASH_ATTN_EXT", 12)])
def test_the_trellis_types_on_vulkan(vk_bin, op, n_cases):
    """turboq3t and turboq2t (issue 21): SET_ROWS (from f32 with i64 rows, from f16 with i32 rows),
    GET_ROWS, CPY from f32 and to f32 and f16, and flash attention at head sizes 128 (batches of 1
    and 35) and 256, f16 beside a trellis type on either side, and llama.cpp's layout."""
    assert backend_ops(vk_bin, op, "turboq[23]t[,)]") == n_cases


@pytest.mark.parametrize("op, n_cases", [("SET_ROWS", 4), ("GET_ROWS", 2), ("CPY", 6), ("FLASH_ATTN_EXT", 12)])
def test_the_64_value_trellis_forms_on_vulkan(vk_bin, op, n_cases):
    """turboq3t_g64 and turboq2t_g64 (what a head of 64 stores for turboq3t and turboq2t): SET_ROWS,
    GET_ROWS and CPY as above at row sizes 64 and 192, and flash attention at head sizes 64 and 192
    (batches of 1 and 35), f16 K beside one, and llama.cpp's layout at head size 64."""
    assert backend_ops(vk_bin, op, "turboq[23]t_g64") == n_cases


@pytest.mark.parametrize("cache, head_dim", [("turboq3t", 128), ("turboq2t", 128), ("turboq3t", 64), ("turboq2t", 64)])
def test_trellis_perplexity_vulkan_matches_cpu(vk_bin, tmp_path, monkeypatch, cache, head_dim):
    """llama-perplexity with a trellis cache on Vulkan0 gives the CPU's logits: the shader's Viterbi
    search writes the CPU's blocks (a different path in a few groups would move the KLD past
    KLD_TOL, as turboq3 against turboq3t does), and its attention reads them as the CPU does; at head
    size 64 in the _g64 forms."""
    model = data.tiny_model(head_dim=head_dim)
    text = data.corpus_slice(12000)
    base = tmp_path / "cpu.kld"
    run = dict(ctx=256, chunks=4, threads=2)
    cpu = perplexity(model, text, cache, cache, kld_base=base, write_base=True, **run)
    # the scalar type of the same bits, against the trellis on the CPU: the check below sees a type change
    scalar = cache[:-1]
    cpu_scalar = perplexity(model, text, scalar, scalar, kld_base=base, **run)
    monkeypatch.setenv("PYTURBO_BUILD_DIR", str(VK_BUILD))
    for k, v in vk_env().items():
        monkeypatch.setenv(k, v)
    vk = perplexity(model, text, cache, cache, kld_base=base, extra=("-ngl", "99"), **run)

    assert "offloaded 3/3 layers to GPU" in vk.log, vk.log[-3000:]
    assert re.search(r"Vulkan0 KV buffer size", vk.log), vk.log[-3000:]
    if head_dim == 64:
        assert f"head size 64: K {cache}_g64, V {cache}_g64" in vk.log, vk.log[-3000:]
    print(f"\n{cache}, head size {head_dim}: PPL CPU {cpu.ppl:.4f} | Vulkan {vk.ppl:.4f} | KLD Vulkan vs CPU {vk.kld:.3g}"
          f" | KLD {scalar} vs {cache} (CPU) {cpu_scalar.kld:.3g}")
    assert abs(vk.ppl / cpu.ppl - 1) < PPL_REL_TOL
    assert vk.kld is not None and vk.kld < KLD_TOL
    assert cpu_scalar.kld > 10 * KLD_TOL


@pytest.mark.parametrize("head_dim, stored", [(128, "turboq3"), (64, "turboq3_g64"), (96, "turboq3_g32"),
                                              (80, "turboq3_g16")])
def test_turboq_perplexity_vulkan_matches_cpu(build_info, vk_bin, tmp_path, monkeypatch, head_dim, stored):
    """llama-perplexity with every layer and its turboq3 cache on Vulkan0 gives the CPU's logits;
    at head sizes 64, 96 and 80 the cache stores the _g64, _g32 and _g16 twins on Vulkan0."""
    model = data.tiny_model(head_dim=head_dim)
    text = data.corpus_slice(12000)
    base = tmp_path / "cpu-turboq3.kld"
    f16_base = tmp_path / "cpu-f16.kld"
    run = dict(ctx=256, chunks=4, threads=2)
    # the references come from the CPU-only build: a Vulkan build would offload the weight
    # matrix products of large batches to Vulkan0 even with -ngl 0
    cpu_f16 = perplexity(model, text, "f16", "f16", kld_base=f16_base, write_base=True, **run)
    cpu = perplexity(model, text, "turboq3", "turboq3", kld_base=base, write_base=True, **run)
    # turboq3 against f16 on the CPU: the check below is tight enough to see a cache type change
    cpu_vs_f16 = perplexity(model, text, "turboq3", "turboq3", kld_base=f16_base, **run)
    monkeypatch.setenv("PYTURBO_BUILD_DIR", str(VK_BUILD))
    for k, v in vk_env().items():
        monkeypatch.setenv(k, v)
    vk = perplexity(model, text, "turboq3", "turboq3", kld_base=base, extra=("-ngl", "99"), **run)

    assert "offloaded 3/3 layers to GPU" in vk.log, vk.log[-3000:]
    assert re.search(r"Vulkan0 KV buffer size", vk.log), vk.log[-3000:]
    if stored != "turboq3":
        assert f"head size {head_dim}: K {stored}, V {stored}" in vk.log, vk.log[-3000:]
    print(f"\nhead size {head_dim}: PPL f16 CPU {cpu_f16.ppl:.4f} | turboq3 CPU {cpu.ppl:.4f} | turboq3 Vulkan {vk.ppl:.4f}"
          f" | KLD Vulkan vs CPU {vk.kld:.3g} | KLD turboq3 vs f16 (CPU) {cpu_vs_f16.kld:.3g}")
    assert abs(vk.ppl / cpu.ppl - 1) < PPL_REL_TOL
    assert vk.kld is not None and vk.kld < KLD_TOL
    assert cpu_vs_f16.kld > 10 * KLD_TOL


def test_the_glslc_cache_gives_glslcs_bytes_and_misses_when_an_include_changes(tmp_path):
    """scripts/glslc_cached.sh, which the Vulkan build compiles its shaders with: a hit writes the
    .spv and the dependency file that glslc writes (the latter with this build's paths), and a
    changed #include file is a miss, not a stale shader."""
    import shutil
    glslc = shutil.which("glslc")
    if glslc is None:
        if REQUIRED:
            pytest.fail("no glslc on PATH (scripts/setup_vulkan_deps.sh installs it)")
        pytest.skip("no glslc on PATH")
    wrapper = Path(__file__).resolve().parent.parent / "scripts" / "glslc_cached.sh"
    env = {**os.environ, "PYTURBO_CACHE": str(tmp_path / "cache")}

    def write_sources(d: Path, value: str) -> Path:
        d.mkdir(parents=True, exist_ok=True)
        (d / "inc.glsl").write_text(f"const float VALUE = {value};\n")
        (d / "a.comp").write_text("#version 450\n#extension GL_GOOGLE_include_directive : require\n"
                                  '#include "inc.glsl"\nlayout(local_size_x = 1) in;\n'
                                  "layout(binding = 0) buffer B { float x[]; };\n"
                                  "void main() { x[0] = VALUE * float(N); }\n")
        return d / "a.comp"

    def compile_with(exe: str, src: Path, out: Path) -> tuple[bytes, str]:
        args = [exe, "-fshader-stage=compute", "--target-env=vulkan1.2", str(src), "-o", str(out), "-O",
                "-MD", "-MF", str(out) + ".d", "-DN=3"]
        subprocess.run(args, env=env, check=True, capture_output=True)
        return out.read_bytes(), Path(str(out) + ".d").read_text().strip()

    src = write_sources(tmp_path / "one", "2.0")
    want = compile_with(glslc, src, tmp_path / "real.spv")
    assert compile_with(str(wrapper), src, tmp_path / "miss.spv") == (want[0], want[1].replace("real.spv", "miss.spv"))
    entries = list((tmp_path / "cache" / "glslc").glob("*/*.spv"))
    assert len(entries) == 1
    # a hit: the cached bytes come back (marked here to tell them from a compile)
    entries[0].write_bytes(want[0] + b"HIT")
    assert compile_with(str(wrapper), src, tmp_path / "hit.spv")[0] == want[0] + b"HIT"
    entries[0].write_bytes(want[0])
    # the same sources at another path: a hit whose dependency file names this path
    other = write_sources(tmp_path / "two", "2.0")
    want_other = compile_with(glslc, other, tmp_path / "real2.spv")
    got = compile_with(str(wrapper), other, tmp_path / "hit2.spv")
    assert got == (want_other[0], want_other[1].replace("real2.spv", "hit2.spv"))
    # an include that changes is a miss
    changed = write_sources(tmp_path / "one", "5.0")
    want_changed = compile_with(glslc, changed, tmp_path / "real3.spv")
    assert want_changed[0] != want[0]
    assert compile_with(str(wrapper), changed, tmp_path / "miss3.spv")[0] == want_changed[0]
    # the configure step's feature tests write to stdout: passed through
    r = subprocess.run([str(wrapper), "-o", "-", "-fshader-stage=compute", "-DN=1", str(changed)], env=env,
                       capture_output=True, check=True)
    assert r.stdout[:4] == b"\x03\x02\x23\x07"  # SPIR-V's magic, little-endian
