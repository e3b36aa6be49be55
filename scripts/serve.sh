#!/usr/bin/env bash
# The recommended configuration: set up, then serve the bundled default model (Gemma 3 270M) with a turboq3 K cache
# through the OpenAI-compatible server on http://127.0.0.1:${PORT:-8000}/v1. A turboq3 V, a turboq4
# K on the layers that attend over the whole context (layer-adaptive mode 4, k4-global), an exact window of
# 32 and one sink row (each sequence's first position read exact) are the best measured settings for a
# turboq3 K at <= 4 bits per value of KV memory at long context on Gemma 3, and the sink row is what
# dense models need most (docs/quality.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --serve
exec python3 -m server --cache-type-k turboq3 --cache-type-v turboq3 --layer-adaptive k4-global --kv-exact-window 32 --kv-exact-sink 1 --host 127.0.0.1 --port "${PORT:-8000}" "$@"
