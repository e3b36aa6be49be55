"""The K-centering calibration cached on disk (llama-turboq-center.cpp, "the calibration cache").

The first load of a model with a turboq K cache runs the calibration and writes its statistics to
$PYTURBO_CACHE/k-calibration (else $XDG_CACHE_HOME/pyturbo/..., else $HOME/.cache/pyturbo/...); the
next load reads them back and gives the same bits: the same logits (llama-perplexity's
--kl-divergence-base file, byte for byte) and the same K records in a saved state, which restores
under either. A damaged file, a file of another model or calibration version, is recomputed with
the reason in the log line, and rewritten as it was; a cache that cannot be written is no cache.

The tools read the environment of their own process: each run gets PYTURBO_CACHE=<tmp dir> (run_tool's
env). Tiny random GGUFs, and Gemma 3 270M in the one slow test.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import k_records
from pyturbo import data
from pyturbo.tools import llama_perplexity

# the calibration's one log line: read from the cache, or computed (why), then saved or not
LINE = re.compile(r"^(?:\S+ (?P<level>[IWE]) )?llama_turboq_calibrate_k_means: K means calibrated for (?P<layers>\d+) layers, "
                  r"Q statistics \(the channel scale's\) for \d+(?:: read from (?P<read>\S+) in \d+ ms \(the model file's digest: \d+ ms\)"
                  r"|, in \d+ ms(?: \(the model file's digest: \d+ ms\))?: computed \((?P<why>.*)\)"
                  r"(?:; saved to (?P<saved>\S+)|; not saved: (?P<not_saved>.*))?)$",
                  re.MULTILINE)
NAME = re.compile(r"[0-9a-f]{16}-[0-9a-f]{16}\.kcal")


@dataclass
class Calibration:
    level: str | None  # the tools' log level (I: info); None from llama-cpp-python's log
    layers: int
    read: str | None
    why: str | None
    saved: str | None
    not_saved: str | None


def calibration(log: str) -> Calibration:
    lines = LINE.findall(log)
    assert len(lines) == 1, f"expected one calibration line, got {len(lines)}:\n{log[-3000:]}"
    m = LINE.search(log)
    return Calibration(m["level"], int(m["layers"]), m["read"], m["why"], m["saved"], m["not_saved"])


def run(model: Path, text: Path, cache: Path | None, base: Path, *, write: bool = True, threads: int = 2,
        env: dict[str, str] | None = None):
    """llama-perplexity with turboq3 K and V, writing (or reading) a KLD base of its logits."""
    e = {} if cache is None else {"PYTURBO_CACHE": str(cache)}
    e.update(env or {})
    r = llama_perplexity(model, text, "turboq3", "turboq3", ctx=128, chunks=2, threads=threads, kld_base=base,
                         write_base=write, env=e, timeout=600)
    assert r.ppl == r.ppl, r.log[-3000:]
    return r, calibration(r.log)


def files(cache: Path) -> list[Path]:
    d = cache / "k-calibration"
    return sorted(d.iterdir()) if d.exists() else []


def inode(path: Path) -> int:
    """A rewrite is a new file renamed over the name: another inode."""
    return path.stat().st_ino


@pytest.fixture(scope="module")
def other_tiny(build_info):
    """The tiny model's shapes with other random weights."""
    return data.tiny_model(head_dim=128, seed=1)


@pytest.fixture
def cold(tiny128, short_text, tmp_path):
    """A first run on an empty cache: (cache root, the file it wrote, its bytes, the KLD base, the result)."""
    cache = tmp_path / "cache"
    base = tmp_path / "cold.kld"
    r, c = run(tiny128, short_text, cache, base)
    assert c.level == "I" and c.why == "not in the cache" and c.saved, c
    path = Path(c.saved)
    assert path.parent == cache / "k-calibration" and NAME.fullmatch(path.name), path
    assert files(cache) == [path]  # no temporary file left behind
    return cache, path, path.read_bytes(), base, r


def test_the_first_load_saves_the_statistics_and_the_next_reads_them(tiny128, short_text, tmp_path, cold):
    cache, path, content, base, r1 = cold
    before = inode(path)
    r2, c = run(tiny128, short_text, cache, tmp_path / "warm.kld")
    assert c.level == "I" and c.read == str(path), c
    assert inode(path) == before and path.read_bytes() == content  # read, not written again
    assert r2.ppl == r1.ppl
    assert (tmp_path / "warm.kld").read_bytes() == base.read_bytes()  # the same logits
    # and the calibration is deterministic: a second cold start writes the same bytes
    r3, c3 = run(tiny128, short_text, tmp_path / "again", tmp_path / "again.kld")
    assert c3.why == "not in the cache" and Path(c3.saved).name == path.name
    assert Path(c3.saved).read_bytes() == content


def test_a_cached_and_a_fresh_calibration_give_the_same_state(Llama, tiny128, tmp_path, monkeypatch, capsys):
    """In one process (the library reads PYTURBO_CACHE when a context is created): a model that
    computed its statistics and one that read them store the same K records (mu, s) in a saved
    state, bit for bit, and each restores the other's state."""
    monkeypatch.setenv("PYTURBO_CACHE", str(tmp_path / "cache"))

    def make():
        llm = Llama(str(tiny128), cache_type_k="turboq3", cache_type_v="turboq3", n_ctx=256, n_batch=256,
                    flash_attn=True, verbose=True, seed=1, logits_all=True, n_threads=2)
        return llm, calibration(capsys.readouterr().err)

    fresh, c1 = make()
    cached, c2 = make()
    assert c1.why == "not in the cache" and c1.saved and c2.read == c1.saved, (c1, c2)
    tokens = fresh.tokenize(b"The old man looked at the sea and said that the fish would come back")
    states = []
    for llm in (fresh, cached):
        llm.eval(tokens)
        states.append(llm.save_state())
    recs = [k_records(bytes(s.llama_state)) for s in states]
    assert len(recs[0]) == 2 and len(recs[0]) == len(recs[1])
    for (_, a), (_, b) in zip(*recs):
        assert a.tobytes() == b.tobytes()
    assert bytes(states[0].llama_state) == bytes(states[1].llama_state)
    fresh.load_state(states[1])
    cached.load_state(states[0])


def flip(path: Path, at: int) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= 0x10
    path.write_bytes(bytes(b))


def reformat(path: Path, fmt: int) -> None:
    """The file with another layout number (and a CRC-32 that matches)."""
    b = path.read_bytes()
    body = b[:8] + fmt.to_bytes(4, "little") + b[12:-4]
    path.write_bytes(body + zlib.crc32(body).to_bytes(4, "little"))


def rewrite_key(path: Path, old: str, new: str) -> None:
    """The file with `old` replaced by `new` in its key, and a CRC-32 that matches: a whole file of
    another calibration."""
    b = path.read_bytes()
    n = int.from_bytes(b[12:16], "little")
    key = b[16:16 + n].decode()
    assert old in key, key
    k2 = key.replace(old, new).encode()
    body = b[:12] + len(k2).to_bytes(4, "little") + k2 + b[16 + n:-4]
    path.write_bytes(body + zlib.crc32(body).to_bytes(4, "little"))


DAMAGE = {
    "a flipped float": (lambda p: flip(p, p.stat().st_size - 40), "is corrupt or short (its CRC-32 does not match)"),
    "a flipped byte in the key": (lambda p: flip(p, 20), "is corrupt or short (its CRC-32 does not match)"),
    "a flipped CRC": (lambda p: flip(p, p.stat().st_size - 1), "is corrupt or short (its CRC-32 does not match)"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-100]), "is corrupt or short (its CRC-32 does not match)"),
    "empty": (lambda p: p.write_bytes(b""), "is not a calibration file"),
    "another calibration version": (lambda p: rewrite_key(p, "calibration=2\n", "calibration=1\n"),
                                    "is of another calibration (calibration: 1 there, 2 here)"),
    "other rotation signs": (lambda p: rewrite_key(p, " shipped\n", " seed 7\n"),
                             "is of another calibration (signs: "),
    "another file layout": (lambda p: reformat(p, 2), "has format 2, this build reads 1"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_or_stale_file_is_recomputed(tiny128, short_text, tmp_path, cold, damage):
    cache, path, content, base, r1 = cold
    spoil, reason = DAMAGE[damage]
    spoil(path)
    spoiled = path.read_bytes()
    assert spoiled != content
    with open(path, "rb") as held:  # a reader that opened the file before it is rewritten
        r2, c = run(tiny128, short_text, cache, tmp_path / "again.kld")
        assert held.read() == spoiled  # still reads the file it opened: the new one was renamed over the name
    assert c.level == "I" and c.read is None and c.saved == str(path), c
    assert c.why.startswith(f"the cached file {path} {reason}"), c.why
    assert path.read_bytes() == content  # rewritten as the first run wrote it
    assert r2.ppl == r1.ppl and (tmp_path / "again.kld").read_bytes() == base.read_bytes()


def test_another_models_file_is_recomputed(tiny128, other_tiny, short_text, tmp_path, cold):
    """The other model has the same shapes (the same layer sizes), other weights: its statistics
    would read as valid; the key's digest of the model file tells them apart."""
    cache, path, content, base, _ = cold
    r_other, c_other = run(other_tiny, short_text, cache, tmp_path / "other.kld")
    assert c_other.why == "not in the cache", c_other
    other_path = Path(c_other.saved)
    assert other_path.name.split("-")[0] != path.name.split("-")[0]  # the model's digest leads the name
    other_content = other_path.read_bytes()
    assert other_content != content
    shutil.copyfile(path, other_path)
    r, c = run(other_tiny, short_text, cache, tmp_path / "again.kld")
    assert c.read is None and c.why.startswith(f"the cached file {other_path} is of another calibration (model: "), c
    assert c.saved == str(other_path) and other_path.read_bytes() == other_content
    assert r.ppl == r_other.ppl and (tmp_path / "again.kld").read_bytes() == (tmp_path / "other.kld").read_bytes()
    assert path.read_bytes() == content  # the first model's own file is untouched


@pytest.mark.parametrize("where", ["a file on the path", "k-calibration is a file"])
def test_a_cache_that_cannot_be_written_is_no_cache(tiny128, short_text, tmp_path, cold, where):
    _, _, _, base, r1 = cold
    blocked = tmp_path / "blocked"
    if where == "a file on the path":
        blocked.write_text("not a directory")
        cache = blocked / "below"
    else:
        blocked.mkdir()
        (blocked / "k-calibration").write_text("not a directory")
        cache = blocked
    for i in range(2):  # nothing is kept: both runs compute
        r, c = run(tiny128, short_text, cache, tmp_path / f"blocked{i}.kld")
        assert r.ppl == r1.ppl and (tmp_path / f"blocked{i}.kld").read_bytes() == base.read_bytes()
        assert c.level == "I" and c.read is None and c.saved is None, c
        assert c.not_saved.startswith("cannot create ") and "Not a directory" in c.not_saved, c
        assert not re.search(r"^\S+ [EW] ", r.log, re.MULTILINE), "an unwritable cache is no error or warning"


def test_the_directory_follows_pyturbos_cache_dir(tiny128, short_text, tmp_path, monkeypatch):
    """PYTURBO_CACHE, else XDG_CACHE_HOME/pyturbo, else HOME/.cache/pyturbo (empty counts as unset),
    as pyturbo._paths.cache_dir() finds it."""
    from pyturbo import _paths
    cases = [{"PYTURBO_CACHE": str(tmp_path / "p"), "XDG_CACHE_HOME": str(tmp_path / "x"), "HOME": str(tmp_path / "h")},
             {"PYTURBO_CACHE": "", "XDG_CACHE_HOME": str(tmp_path / "x"), "HOME": str(tmp_path / "h")},
             {"PYTURBO_CACHE": "", "XDG_CACHE_HOME": "", "HOME": str(tmp_path / "h")}]
    for i, env in enumerate(cases):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        expected = _paths.cache_dir() / "k-calibration"
        _, c = run(tiny128, short_text, None, tmp_path / f"{i}.kld", env=env)
        assert c.saved and Path(c.saved).parent == expected, (env, c)
    # none of them: no cache, said so
    none = {"PYTURBO_CACHE": "", "XDG_CACHE_HOME": "", "HOME": ""}
    _, c = run(tiny128, short_text, None, tmp_path / "none.kld", env=none)
    assert c.why == "no cache: PYTURBO_CACHE, XDG_CACHE_HOME and HOME are unset or empty", c
    assert c.saved is None and c.not_saved is None


def test_what_the_key_holds_and_leaves_out(tiny128, short_text, tmp_path, cold):
    """The thread count is not in the key: -t 1 computes the same bytes as -t 2 and reads -t 2's file.
    Neither is the channel scale's setting (--kv-k-scale): the statistics hold what both choices
    need, so on and off read the same file and give other floats, one of them auto's."""
    cache, path, content, base, r1 = cold
    r, c = run(tiny128, short_text, tmp_path / "t1", tmp_path / "t1.kld", threads=1)
    assert Path(c.saved).name == path.name and Path(c.saved).read_bytes() == content
    _, c = run(tiny128, short_text, cache, tmp_path / "t1b.kld", threads=1)
    assert c.read == str(path)
    r_off, c_off = run(tiny128, short_text, cache, tmp_path / "off.kld", env={"LLAMA_ARG_KV_K_SCALE": "off"})
    r_on, c_on = run(tiny128, short_text, cache, tmp_path / "on.kld", env={"LLAMA_ARG_KV_K_SCALE": "on"})
    assert c_off.read == str(path) and c_on.read == str(path), (c_off, c_on)
    assert r_off.ppl != r_on.ppl and r1.ppl in (r_off.ppl, r_on.ppl)
    assert len(files(cache)) == 1 and path.read_bytes() == content


def test_files_not_read_for_30_days_are_removed_when_one_is_written(tiny128, short_text, tmp_path, cold):
    """A read touches its file; a write removes the .kcal files nobody read for 30 days and the
    temporary files of writers that died (a day old); nothing else in the directory."""
    cache, path, _, _, _ = cold
    d = cache / "k-calibration"
    now = time.time()
    made = {}
    for name, age in [("0" * 16 + "-" + "1" * 16 + ".kcal", 31), ("0" * 16 + "-" + "2" * 16 + ".kcal", 29),
                      (path.name + ".tmp-1-" + "3" * 16, 2), (path.name + ".tmp-2-" + "4" * 16, 0.5),
                      ("notes.txt", 400)]:
        made[name] = d / name
        made[name].write_bytes(b"x")
        os.utime(made[name], (now - age * 86400, now - age * 86400))
    os.utime(path, (now - 31 * 86400, now - 31 * 86400))
    _, c = run(tiny128, short_text, cache, tmp_path / "read.kld")
    assert c.read == str(path) and all(p.exists() for p in made.values())  # a read removes nothing
    assert path.stat().st_mtime > now - 3600  # and touches its file
    # a GGML_* variable is in the key (it may choose kernels): another file, so a write
    _, c = run(tiny128, short_text, cache, tmp_path / "write.kld", env={"GGML_PYTURBO_TEST_KEY": "1"})
    assert c.saved and Path(c.saved).exists() and path.exists()
    gone = sorted(name for name, p in made.items() if not p.exists())
    assert gone == sorted(["0" * 16 + "-" + "1" * 16 + ".kcal", path.name + ".tmp-1-" + "3" * 16]), gone


def test_concurrent_first_loads_leave_one_whole_file(tiny128, short_text, tmp_path, cold):
    """Processes that start at once on an empty cache each compute and write (a temporary file, then
    a rename): every one finishes, and the file that stays is whole and the same."""
    from pyturbo._paths import binary, tool_env
    _, path, content, _, _ = cold
    cache = tmp_path / "shared"
    args = [str(binary("llama-perplexity")), "-m", str(tiny128), "-f", str(short_text), "-c", "128", "-b", "128",
            "--chunks", "1", "-fa", "on", "-t", "1", "-ctk", "turboq3", "-ctv", "turboq3", "-lv", "4"]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                              env=tool_env({"PYTURBO_CACHE": str(cache)})) for _ in range(4)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-2000:]
        c = calibration(out)
        assert c.read == str(cache / "k-calibration" / path.name) or c.saved == str(cache / "k-calibration" / path.name), c
    assert [f.name for f in files(cache)] == [path.name]
    assert files(cache)[0].read_bytes() == content


@pytest.mark.slow
def test_gemma_reads_its_statistics_back(short_text, tmp_path):
    """Gemma 3 270M (two caches: global and sliding-window layers): the second load reads the file,
    with the same logits, and says how long each took."""
    gemma = data.default_model()
    cache = tmp_path / "cache"
    r1, c1 = run(gemma, short_text, cache, tmp_path / "cold.kld")
    assert c1.why == "not in the cache" and c1.saved and c1.layers == 18, c1
    r2, c2 = run(gemma, short_text, cache, tmp_path / "warm.kld")
    assert c2.read == c1.saved
    assert r2.ppl == r1.ppl and (tmp_path / "warm.kld").read_bytes() == (tmp_path / "cold.kld").read_bytes()
    timings = [ln.split("llama_turboq_calibrate_k_means: ")[1] for r in (r1, r2) for ln in r.log.splitlines()
               if "llama_turboq_calibrate_k_means: " in ln]
    print("\n".join(timings))
