"""OpenAI-compatible server for pyturbo: llama-cpp-python's FastAPI server on the patched libllama."""
