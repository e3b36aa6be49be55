"""The default engine: the patched C++ llama-server as a supervised child process.

The child owns the port; this process validates the flags first, starts it, forwards SIGINT,
SIGTERM and SIGHUP, and exits with its status. The child gets SIGTERM if this process dies
(PR_SET_PDEATHSIG), so a killed supervisor never leaves a server behind, and a child that dies
is reported with its exit status or signal instead of leaving a port with nothing behind it.
"""
from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from dataclasses import dataclass, field

from pyturbo import exact_window
from pyturbo._paths import binary, tool_env

from .chat_template import Fallback


def kv_unified(extra: list[str], embeddings: str | None) -> bool:
    """Whether llama-server's slots share one KV cache: asked for with --kv-unified, or implied by
    --embeddings. With a cache per slot, llama.cpp splits a batch into ubatches of equal tokens per
    sequence, and a pooled embedding then covers only its last ubatch's tokens (an input batched
    beside one of another length came back with cosine 0.90 to itself)."""
    return bool(embeddings) or any(a in ("--kv-unified", "-kvu") for a in extra)


@dataclass(frozen=True)
class Draft:
    """Speculative decoding: the draft model and its cache (llama-server's -md, -ctkd, -ctvd)."""
    model: str
    cache_type_k: str
    cache_type_v: str
    max_tokens: int | None = None

    def argv(self) -> list[str]:
        # llama-server loads a -md model but drafts with it only when the type is named
        argv = ["-md", self.model, "--spec-type", "draft-simple", "-ctkd", self.cache_type_k, "-ctvd", self.cache_type_v]
        return argv + (["--spec-draft-n-max", str(self.max_tokens)] if self.max_tokens else [])


@dataclass
class LaunchSpec:
    model: str
    cache_type_k: str
    cache_type_v: str
    layer_adaptive: int
    n_ctx: int  # per slot
    parallel: int
    host: str
    port: int
    alias: str
    api_key: str | None = None
    n_threads: int | None = None
    chat_fallback: Fallback | None = None
    quiet: bool = False
    extra: list[str] = field(default_factory=list)
    draft: Draft | None = None
    embeddings: str | None = None  # the pooling, when /v1/embeddings is served
    kv_exact_window: int | None = None  # -1: auto; None: the model's, else auto beside a turboq cache
    kv_exact_window_margin: int | None = None  # None: the model's
    kv_k_center: str | None = None  # "on" or "off"; None: the model's
    kv_exact_sink: int | None = None  # None: the model's, else auto (one row beside a turboq cache); -1: auto
    kv_k_scale: str | None = None  # "auto", "on" or "off"; None: the model's

    def argv(self) -> list[str]:
        argv = [str(binary("llama-server")), "-m", self.model, "-a", self.alias,
                "-ctk", self.cache_type_k, "-ctv", self.cache_type_v, "-fa", "on",
                # llama-server's -c is the total that its slots share
                "-c", str(self.n_ctx * self.parallel), "-np", str(self.parallel),
                "--host", self.host, "--port", str(self.port)]
        # also when 0: the argument beats a LLAMA_ARG_LAYER_ADAPTIVE in the caller's environment
        argv += ["--layer-adaptive", str(self.layer_adaptive)]
        if self.kv_exact_window is not None:  # also 0, which beats the GGUF's
            argv += ["--kv-exact-window", "auto" if self.kv_exact_window == exact_window.AUTO else str(self.kv_exact_window)]
        if self.kv_exact_sink is not None:  # also 0, which beats the GGUF's
            argv += ["--kv-exact-sink", "auto" if self.kv_exact_sink == exact_window.SINK_AUTO else str(self.kv_exact_sink)]
        if self.kv_exact_window_margin is not None:
            argv += ["--kv-exact-window-margin", str(self.kv_exact_window_margin)]
        if self.kv_k_center is not None:
            argv += ["--kv-k-center", self.kv_k_center]
        if self.kv_k_scale is not None:
            argv += ["--kv-k-scale", self.kv_k_scale]
        if self.n_threads:
            argv += ["-t", str(self.n_threads), "-tb", str(self.n_threads)]
        if self.chat_fallback:
            argv += ["--chat-template-file", str(self.chat_fallback.path)]
        if self.draft:
            argv += self.draft.argv()
        if self.embeddings:
            argv += ["--embeddings", "--pooling", self.embeddings]
        if kv_unified(self.extra, self.embeddings) and not kv_unified(self.extra, None):
            argv += ["--kv-unified"]
        if self.quiet:
            argv += ["-lv", "2"]
        return argv + self.extra

    def env(self) -> dict[str, str]:
        extra = {}
        if self.api_key:
            extra["LLAMA_API_KEY"] = self.api_key  # not on the command line, where `ps` shows it
        return tool_env(extra)


def _die_with_parent() -> None:
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with status {rc}"


def run(spec: LaunchSpec) -> int:
    if spec.chat_fallback:
        print(f"server: {spec.chat_fallback.describe()}", file=sys.stderr, flush=True)
    # its own session: a terminal Ctrl-C reaches llama-server once, through forward(), not twice
    # (a second SIGINT makes it exit at once, skipping its shutdown)
    proc = subprocess.Popen(spec.argv(), env=spec.env(), preexec_fn=_die_with_parent, start_new_session=True)
    stopping = False

    def forward(signum, _frame):
        nonlocal stopping
        stopping = True
        if proc.poll() is None:
            proc.send_signal(signum)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, forward)
    rc = proc.wait()
    if rc != 0 and not stopping:
        print(f"server: llama-server {describe_exit(rc)}; the server is down (see its log above)",
              file=sys.stderr, flush=True)
    return rc if rc >= 0 else 128 - rc
