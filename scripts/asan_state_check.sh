#!/usr/bin/env bash
# Saved-state reading under AddressSanitizer (issue 11; run by hand, not in CI: an ASan build of
# llama + llama-server takes about 10 minutes on 2 cores). Builds build-asan/ from the patched
# tree of the main build (run scripts/setup.sh first), then tests/harness/slot_state_asan.py
# restores truncated and corrupted slot files into an ASan llama-server with turboq caches.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/build_dirs.sh
ASAN_BUILD=$PYTURBO_ASAN_BUILD_DIR
upstream=$(patched_upstream)
cmake -S . -B "$ASAN_BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPYTURBO_UPSTREAM_DIR="$upstream" \
    -DLLAMA_SANITIZE_ADDRESS=ON -DGGML_SANITIZE_ADDRESS=ON -DLLAMA_BUILD_TESTS=OFF >/dev/null
cmake --build "$ASAN_BUILD" -j"$(nproc)" --target llama-server
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec python3 tests/harness/slot_state_asan.py "$ASAN_BUILD/bin" "$@"
