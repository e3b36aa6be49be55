#!/usr/bin/env bash
# A build whose turboq rotation signs come from another seed (-DPYTURBO_SIGN_SEED=7, a debug
# option), for the tests that check that its caches and states stay its own: libllama,
# llama-perplexity and ggml-rpc-server only. Its prepared tree differs from the main build's in the generated tables
# alone, so ccache serves every other object (run scripts/setup.sh first).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/build_dirs.sh
cmake -S . -B "$PYTURBO_SEEDED_BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$(command -v python3)" \
    $(compiler_args) -DPYTURBO_SIGN_SEED=7 >/dev/null
cmake --build "$PYTURBO_SEEDED_BUILD_DIR" -j"$(nproc)" --target llama llama-perplexity ggml-rpc-server
