"""`--engine python`: llama-cpp-python's server (FastAPI + uvicorn) on the patched libllama.

Additions to llama-cpp-python's server: cache types by name and layer-adaptive precision per
model, the chat template fallback, /health, a 404 (not a silent fallback to the default model)
for a request that names another model, and 400 for a body that is not JSON. It serves one
request at a time; concurrent requests queue.
"""
from __future__ import annotations

import json
from pathlib import Path

import pyturbo.llama as pl  # sets LLAMA_CPP_LIB_PATH before llama_cpp loads
from pyturbo import exact_window, gguf_meta, k_centering, layer_adaptive
from pyturbo.types import requested_cache_type

import uvicorn
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from llama_cpp.server import model as server_model
from llama_cpp.server.errors import ErrorResponse, RouteErrorHandler
from llama_cpp.server.app import create_app
from llama_cpp.server.settings import ModelSettings, ServerSettings

from .chat_template import Fallback


class TurboModelSettings(ModelSettings):
    layer_adaptive: int = 0
    kv_exact_window: int | None = None  # -1: auto; None: the model's, else auto beside a turboq cache
    kv_exact_window_margin: int | None = None
    kv_exact_sink: int | None = None  # None: the model's, else auto; -1: auto
    k_center: bool | None = None
    k_scale: str | None = None
    chat_template_file: str | None = None
    chat_end_of_turn: str | None = None


_load_upstream = server_model.LlamaProxy.load_llama_from_model_settings


def _load_model(settings: ModelSettings):
    """llama-cpp-python's loader inside pyturbo's context guard, with the layer-adaptive mode as
    the model's kv override, plus the chat template fallback."""
    # also 0, which beats a mode that the GGUF holds, as --layer-adaptive 0 does for llama-server
    (k, v), = layer_adaptive.kv_override(getattr(settings, "layer_adaptive", 0)).items()
    window = exact_window.kv_override(getattr(settings, "kv_exact_window", None),
                                      getattr(settings, "kv_exact_window_margin", None))
    sink = getattr(settings, "kv_exact_sink", None)
    if sink is not None:
        window[exact_window.sink_key()] = exact_window.check_sink(sink)  # also 0, which beats the GGUF's
    # K centering and its channel scale: passed only when given, so the model's own keys stand otherwise
    center, scale = getattr(settings, "k_center", None), getattr(settings, "k_scale", None)
    k_keys = ([] if center is None else [f"{k_centering.key()}=bool:{str(center).lower()}"]) + \
             ([] if scale is None else [f"{k_centering.scale_key()}=str:{k_centering.check_scale(scale)}"])
    settings = settings.model_copy(update={"kv_overrides": [*(settings.kv_overrides or []), f"{k}=int:{v}",
                                                            *(f"{key}=int:{n}" for key, n in window.items()),
                                                            *k_keys]})
    with pl.creating_context(verbose=settings.verbose):
        llm = _load_upstream(settings)
    # a reused prompt prefix is processed again where the window no longer holds its end (or the sink
    # rows their positions); asked of libllama on every call, as both are on by default beside a turboq cache
    upstream_eval = llm.eval
    llm.eval = lambda tokens: upstream_eval(pl.window_tokens(llm, tokens))
    path = getattr(settings, "chat_template_file", None)
    if path:
        bos = llm._model.token_get_text(llm.token_bos()) if llm.token_bos() >= 0 else ""
        llm.chat_handler = Jinja2ChatFormatter(Path(path).read_text(), eos_token=settings.chat_end_of_turn,
                                               bos_token=bos).to_chat_handler()
    return llm


server_model.LlamaProxy.load_llama_from_model_settings = staticmethod(_load_model)

_wrap_upstream = RouteErrorHandler.error_message_wrapper


def _error_response(self, error: Exception, body=None):
    """llama-cpp-python's route wrapper answers a request that fails validation (a wrong type, an
    out-of-range value) with 500; it is the client's error: 400, with the fields named."""
    if isinstance(error, RequestValidationError):
        where = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}"
                          for e in error.errors()[:5])
        return 400, ErrorResponse(message=f"invalid request: {where}", type="invalid_request_error", param=None,
                                  code=None)
    return _wrap_upstream(self, error, body)


RouteErrorHandler.error_message_wrapper = _error_response


def _client_error(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": "invalid_request_error", "param": None, "code": code}})


def _prompt_texts(path: str, payload: dict) -> tuple[list[str], int]:
    """The request's prompt texts, and the length of its longest prompt given as token ids."""
    if path == "/v1/completions":
        prompt = payload.get("prompt")
        items = prompt if isinstance(prompt, list) else [prompt]
        texts = [p for p in items if isinstance(p, str)]
        ids = max((len(p) for p in items if isinstance(p, list)), default=0)
        if items and all(isinstance(p, int) for p in items):
            texts, ids = [], len(items)
        return texts, ids
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return [], 0  # refused as it is elsewhere
    texts = []  # chat: every message's text goes into one prompt
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        parts = content if isinstance(content, list) else [content]
        texts += [p if isinstance(p, str) else p.get("text") for p in parts if isinstance(p, (str, dict))]
    return ["".join(t for t in texts if isinstance(t, str))], 0


def build_app(model: str, cache_type_k: str = "f16", cache_type_v: str = "f16", layer_adaptive: int = 0,
              n_ctx: int = 4096, n_threads: int | None = None, alias: str | None = None,
              host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
              chat_fallback: Fallback | None = None, verbose: bool = True, kv_exact_window: int | str | None = None,
              kv_exact_window_margin: int | None = None, k_center: bool | None = None, kv_exact_sink: int | str | None = None,
              k_scale: str | None = None):
    tk, tv = requested_cache_type(cache_type_k), requested_cache_type(cache_type_v)
    ms = TurboModelSettings(model=model, model_alias=alias or Path(model).name, n_ctx=n_ctx, type_k=tk.ggml_id,
                            type_v=tv.ggml_id, flash_attn=True, layer_adaptive=layer_adaptive,
                            kv_exact_window=None if kv_exact_window is None else exact_window.check(kv_exact_window),
                            kv_exact_window_margin=None if kv_exact_window_margin is None
                            else exact_window.check_margin(kv_exact_window_margin), k_center=k_center,
                            k_scale=None if k_scale is None else k_centering.check_scale(k_scale),
                            kv_exact_sink=None if kv_exact_sink is None else exact_window.check_sink(kv_exact_sink),
                            verbose=verbose,
                            chat_template_file=str(chat_fallback.path) if chat_fallback else None,
                            chat_end_of_turn=chat_fallback.end_of_turn if chat_fallback else None,
                            # llama-cpp-python's default keeps n_ctx x n_vocab logits: 32 GiB for Gemma 3 at 32k
                            logits_all=False,
                            **({"n_threads": n_threads, "n_threads_batch": n_threads} if n_threads else {}))
    app = create_app(server_settings=ServerSettings(
        host=host, port=port, api_key=api_key,
        # llama-cpp-python's default cuts a running stream short whenever another request arrives
        interrupt_requests=False), model_settings=[ms])
    known = {ms.model_alias, ms.model, Path(ms.model).name, ""}
    longest_token: list[int] = []  # read once, at the first prompt longer than n_ctx bytes

    def too_long(path: str, payload: dict) -> JSONResponse | None:
        """A prompt that cannot fit the context, refused before it is tokenized: tokenizing 20 MB
        took llama-cpp-python 20-35 s of the one thread that serves every request."""
        texts, ids = _prompt_texts(path, payload)
        size = max((len(t.encode("utf-8")) for t in texts), default=0)
        tokens = ids
        if size >= n_ctx:
            if not longest_token:
                longest_token.append(gguf_meta.longest_token_bytes(model) or 0)
            if longest_token[0] > 0:
                tokens = max(tokens, -(-size // longest_token[0]))
        if tokens < n_ctx:
            return None
        what = "your prompt is" if path == "/v1/completions" else "your messages are"
        why = f" ({size} bytes; no token of this model is longer than {longest_token[0]})" if tokens > ids else ""
        return _client_error(400, f"This model's maximum context length is {n_ctx} tokens, however {what} at least "
                                  f"{tokens} tokens long{why}. Please reduce the length of the prompt.",
                             "context_length_exceeded")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": ms.model_alias, "cache_type_k": tk.name, "cache_type_v": tv.name,
                "layer_adaptive": layer_adaptive, "kv_exact_window": kv_exact_window,
                "kv_exact_window_margin": kv_exact_window_margin, "kv_exact_sink": kv_exact_sink, "k_center": k_center,
                "k_scale": k_scale}

    @app.middleware("http")
    async def reject_bad_requests(request: Request, call_next):
        if request.method == "POST" and request.url.path.startswith("/v1/"):
            body = await request.body()
            try:
                payload = json.loads(body) if body else {}
                # a lone surrogate (\ud800) parses, then fails deep inside tokenization as a 500
                json.dumps(payload, ensure_ascii=False).encode("utf-8")
            except RecursionError:
                return _client_error(400, "request body is nested too deeply")
            except UnicodeEncodeError as e:
                return _client_error(400, f"request text is not valid Unicode: {e.reason} at {e.start}")
            except ValueError as e:
                # llama-cpp-python's error handler would turn this into a 500
                return _client_error(400, f"request body is not valid JSON: {e}")
            # llama-cpp-python fills these in (an empty prompt, no messages) and answers 200
            if isinstance(payload, dict) and request.url.path == "/v1/chat/completions" and not payload.get("messages"):
                return _client_error(400, "'messages' must contain at least one message")
            if isinstance(payload, dict) and request.url.path == "/v1/completions" and "prompt" not in payload:
                return _client_error(400, "'prompt' is required")
            requested = payload.get("model") if isinstance(payload, dict) else None
            if isinstance(requested, str) and requested not in known:
                return _client_error(404, f"model '{requested}' not found; this server has: {ms.model_alias}",
                                     "model_not_found")
            if isinstance(payload, dict) and request.url.path in ("/v1/completions", "/v1/chat/completions"):
                refused = too_long(request.url.path, payload)
                if refused is not None:
                    return refused
        return await call_next(request)

    return app


def run(app, host: str, port: int, quiet: bool) -> int:
    uvicorn.run(app, host=host, port=port, log_level="warning" if quiet else "info")
    return 0
