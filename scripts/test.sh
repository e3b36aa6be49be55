#!/usr/bin/env bash
# Runs the whole test suite (setting up first, which is a no-op when nothing changed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m pytest -q -ra tests "$@"
