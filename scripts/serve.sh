#!/usr/bin/env bash
# The recommended configuration: set up, then serve the bundled default model (Gemma 3 270M) with a turboq3 K cache
# through the OpenAI-compatible server on http://127.0.0.1:${PORT:-8000}/v1. A turboq3 V, a turboq4
# K on the layers that attend over the whole context (layer-adaptive mode 4, k4-global), an exact window
# sized by the context (auto: 28 positions and a margin of 14 for each slot's 4096, at most 32 and 16; its
# rows cost at most 1/6 bit per value of the context's cells) and one sink row (each sequence's first position read exact) are
# the best measured settings for a turboq3 K within 4 bits per value of KV memory on Gemma 3 and on a
# dense model, at 512 positions and at 8192; the sink row is what dense models need most (docs/quality.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --serve
exec python3 -m server --cache-type-k turboq3 --cache-type-v turboq3 --layer-adaptive k4-global --kv-exact-window auto --kv-exact-sink 1 --host 127.0.0.1 --port "${PORT:-8000}" "$@"
