"""pyturbo's OpenAI-compatible server: `python -m server --cache-type-k turboq3 ...`.

Two engines behind the same flags:
- `llama-server` (default): the patched C++ llama-server, run as a supervised child process
  (`server.llama_server`): parallel slots, continuous batching, /metrics, --api-key.
- `python`: llama-cpp-python's FastAPI server on the patched libllama (`server.python_engine`),
  one request at a time.
"""
