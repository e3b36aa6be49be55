#!/usr/bin/env bash
# The main job: set up, then serve the bundled default model (Gemma 3 270M) with turboq3 K/V
# through the OpenAI-compatible server on http://127.0.0.1:${PORT:-8000}/v1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m server --cache-type-k turboq3 --cache-type-v turboq3 --host 127.0.0.1 --port "${PORT:-8000}" "$@"
