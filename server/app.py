"""`python -m server --model M.gguf --cache-type-k turboq3 --cache-type-v turboq3 [--layer-adaptive 7]`

llama-cpp-python's server (FastAPI + uvicorn) with three additions: cache types by name and
layer-adaptive precision per model, a /health endpoint, and a 404 (not a silent fallback to the
default model) for a request that names a model the server does not have.

llama-cpp-python serves one request at a time; concurrent requests queue. For parallel slots use
the patched C++ server: `python -m pyturbo llama-server -- -m M.gguf -ctk turboq3 -ctv turboq3 -np 4`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyturbo.llama as pl  # noqa: E402  (sets LLAMA_CPP_LIB_PATH before llama_cpp loads)
from pyturbo import data  # noqa: E402
from pyturbo.types import CACHE_TYPES, cache_type  # noqa: E402

import uvicorn  # noqa: E402
from fastapi import Request  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402
from llama_cpp.server import model as server_model  # noqa: E402
from llama_cpp.server.app import create_app  # noqa: E402
from llama_cpp.server.settings import ModelSettings, ServerSettings  # noqa: E402


class TurboModelSettings(ModelSettings):
    layer_adaptive: int = 0


_load_upstream = server_model.LlamaProxy.load_llama_from_model_settings


def _load_model(settings: ModelSettings):
    """llama-cpp-python's loader, with this model's TURBO_LAYER_ADAPTIVE and llama.cpp's error text."""
    mode = getattr(settings, "layer_adaptive", 0)
    with pl._create_lock, pl._layer_adaptive_env(mode), pl._captured_llama_log(settings.verbose) as log:
        try:
            return _load_upstream(settings)
        except ValueError as e:
            reason = pl._errors(log)
            raise pl.ContextError(f"{e}: {reason}" if reason else str(e)) from None


server_model.LlamaProxy.load_llama_from_model_settings = staticmethod(_load_model)


def build_app(model: str, cache_type_k: str = "f16", cache_type_v: str = "f16", layer_adaptive: int = 0,
              n_ctx: int = 4096, n_threads: int | None = None, alias: str | None = None,
              host: str = "127.0.0.1", port: int = 8000, verbose: bool = True):
    tk, tv = cache_type(cache_type_k), cache_type(cache_type_v)
    if layer_adaptive not in pl.LAYER_ADAPTIVE_MODES:
        raise ValueError(f"--layer-adaptive {layer_adaptive}: valid modes are {pl.LAYER_ADAPTIVE_MODES}")
    ms = TurboModelSettings(model=model, model_alias=alias or Path(model).name, n_ctx=n_ctx, type_k=tk.ggml_id,
                            type_v=tv.ggml_id, flash_attn=True, layer_adaptive=layer_adaptive, verbose=verbose,
                            # llama-cpp-python's default keeps n_ctx x n_vocab logits: 32 GiB for Gemma 3 at 32k
                            logits_all=False,
                            **({"n_threads": n_threads, "n_threads_batch": n_threads} if n_threads else {}))
    app = create_app(server_settings=ServerSettings(host=host, port=port), model_settings=[ms])
    known = {ms.model_alias, ms.model}

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": ms.model_alias, "cache_type_k": tk.name, "cache_type_v": tv.name,
                "layer_adaptive": layer_adaptive}

    @app.middleware("http")
    async def reject_bad_requests(request: Request, call_next):
        if request.method == "POST" and request.url.path.startswith("/v1/"):
            body = await request.body()
            try:
                payload = json.loads(body) if body else {}
            except ValueError as e:
                # llama-cpp-python's error handler would turn this into a 500
                return JSONResponse(status_code=400, content={"error": {
                    "message": f"request body is not valid JSON: {e}", "type": "invalid_request_error"}})
            requested = payload.get("model") if isinstance(payload, dict) else None
            if isinstance(requested, str) and requested not in known:
                return JSONResponse(status_code=404, content={"error": {
                    "message": f"model '{requested}' not found; this server has: {ms.model_alias}",
                    "type": "invalid_request_error", "code": "model_not_found"}})
        return await call_next(request)

    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m server", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF path (default: the bundled Gemma 3 270M)")
    names = ", ".join(CACHE_TYPES)
    ap.add_argument("--cache-type-k", "-ctk", default="f16", help=f"K cache type: {names}")
    ap.add_argument("--cache-type-v", "-ctv", default="f16", help=f"V cache type: {names}")
    ap.add_argument("--layer-adaptive", type=int, default=0, help="TURBO_LAYER_ADAPTIVE mode: " + ", ".join(map(str, pl.LAYER_ADAPTIVE_MODES)))
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--n-threads", type=int, default=None)
    ap.add_argument("--parallel", type=int, default=1,
                    help="accepted for llama-server compatibility; requests are served one at a time (see above)")
    ap.add_argument("--alias", default=None, help="model name clients use (default: the file name)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    try:
        app = build_app(args.model or str(data.default_model()), args.cache_type_k, args.cache_type_v,
                        args.layer_adaptive, args.n_ctx, args.n_threads, args.alias, args.host, args.port,
                        verbose=not args.quiet)
    except (ValueError, pl.ContextError) as e:
        sys.exit(f"server: {e}")
    if args.parallel > 1:
        print("server: --parallel > 1: llama-cpp-python serves one request at a time; extra requests queue",
              file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning" if args.quiet else "info")
