"""Restore truncated and corrupted llama-server slot files into an ASan build (scripts/asan_state_check.sh).

Usage: python3 tests/harness/slot_state_asan.py BUILD_BIN [N_CORRUPT]
Exit status 0 when every bad file was refused or restored without an ASan report and the server
is still up; the ASan log, if any, is printed.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from pyturbo import data
from pyturbo.bench.local_server import free_port, post_json as post


def main() -> int:
    bin_dir = Path(sys.argv[1]).resolve()
    n_corrupt = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    slots = Path(tempfile.mkdtemp(prefix="asan-slots-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(slots / "server.log", "w+")
    env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir), "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0"}
    results: dict[str, int] = {}
    for k, v, model in (("turboq3", "turboq3", data.tiny_model()), ("q8_0", "turboq4", data.tiny_model()),
                        ("turboq3", "turboq4", data.default_model())):
        proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(model), "-ctk", k, "-ctv", v, "-fa", "on",
                                 "-c", "512", "-np", "1", "--port", str(port), "--host", "127.0.0.1",
                                 "--slot-save-path", str(slots)], stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            for _ in range(600):
                try:
                    urllib.request.urlopen(url + "/health", timeout=2)
                    break
                except OSError:
                    time.sleep(0.5)
            post(url + "/v1/completions", {"prompt": "The old man looked at the sea", "max_tokens": 8, "id_slot": 0})
            assert post(url + "/slots/0?action=save", {"filename": "good.bin"})[0] == 200
            raw = (slots / "good.bin").read_bytes()
            rng = random.Random(0)
            cases = [raw[:cut] for cut in range(0, len(raw), max(1, len(raw) // 60))] + [raw[:-1]]
            for _ in range(n_corrupt):
                b = bytearray(raw)
                for _ in range(rng.randrange(1, 5)):
                    pos = rng.randrange(0, min(len(b), 4096)) if rng.random() < 0.7 else rng.randrange(0, len(b))
                    b[pos] ^= rng.randrange(1, 256)
                cases.append(bytes(b))
            for i, case in enumerate(cases):
                (slots / "bad.bin").write_bytes(case)
                status, _ = post(url + "/slots/0?action=restore", {"filename": "bad.bin"})
                what = 'refused' if status == 400 else 'restored' if status == 200 else str(status)
                if status == 200 and case == raw:
                    what = "restored (flips cancelled: the good file)"
                elif status == 200 and case == raw[:-8]:
                    what = "restored (only the CRC-32 record cut: the state is whole, read as an unsealed file)"
                key = f"{k}/{v} {what}"
                if what == "restored":
                    diff = [p for p in range(min(len(case), len(raw))) if case[p] != raw[p]]
                    print(f"restored a bad file: {len(case)} of {len(raw)} bytes, differing at {diff[:8]}", flush=True)
                results[key] = results.get(key, 0) + 1
                if proc.poll() is not None:
                    break
            alive = proc.poll() is None
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        if not alive:
            break
    log.seek(0)
    text = log.read()
    asan = "ERROR: AddressSanitizer" in text
    print(json.dumps(results, indent=1))
    print(f"ASan reports: {text.count('ERROR: AddressSanitizer')}; server survived every case: {alive}")
    if asan:
        start = text.index("ERROR: AddressSanitizer")
        print(text[start:start + 4000])
    return 0 if (alive and not asan) else 1


if __name__ == "__main__":
    sys.exit(main())
