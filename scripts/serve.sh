#!/usr/bin/env bash
# The main job: set up, then serve the bundled default model (Gemma 3 270M) with turboq3 K/V.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m pyturbo llama-server --default-model -- -ctk turboq3 -ctv turboq3 -fa on --host 127.0.0.1 --port "${PORT:-8080}" "$@"
