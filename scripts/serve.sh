#!/usr/bin/env bash
# The main job: set up, then serve the bundled default model (Gemma 3 270M) with a turboq3 K cache
# through the OpenAI-compatible server on http://127.0.0.1:${PORT:-8000}/v1. turboq4 V and layer
# mode 3 are the best measured settings for a turboq3 K at <= 4 bits per value (README, Quality).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --serve
exec python3 -m server --cache-type-k turboq3 --cache-type-v turboq4 --layer-adaptive 3 --host 127.0.0.1 --port "${PORT:-8000}" "$@"
