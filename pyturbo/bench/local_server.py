"""The plumbing that the benches, the tests and the test harnesses share to talk to a server on
this machine: a free port, waiting for /health, and a JSON POST that returns error bodies too."""
from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from typing import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180,
                 log: Callable[[], str] = lambda: "") -> None:
    """Returns once GET url/health answers 200; raises with the tail of log() if proc exits first."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.3)
    raise TimeoutError(f"server at {url} did not become healthy within {timeout:.0f} s")


def post_json(url: str, body: dict | bytes, headers: dict | None = None, timeout: float = 300) -> tuple[int, dict]:
    """(HTTP status, decoded body); an error status returns its body (as {"raw": text} when it is
    not JSON) instead of raising, so that callers can check error responses."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}
