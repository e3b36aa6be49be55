"""pyturbo's OpenAI-compatible server: `python -m pyturbo.server --cache-type-k turboq3 ...` (in a checkout,
also `python -m server`).

Two engines behind the same flags:
- `llama-server` (default): the patched C++ llama-server, run as a supervised child process
  (`pyturbo.server.llama_server`): parallel slots, continuous batching, /metrics, --api-key.
- `python`: llama-cpp-python's FastAPI server on the patched libllama (`pyturbo.server.python_engine`),
  one request at a time.
"""
