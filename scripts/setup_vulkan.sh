#!/usr/bin/env bash
# The Vulkan build that the tests run on Mesa's software driver (lavapipe): system packages, then
# test-backend-ops and llama-perplexity with -DGGML_VULKAN=ON in build-vulkan/, from the patched
# tree that the main build prepared (run scripts/setup.sh first). ccache shares the CPU objects.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup_vulkan_deps.sh

MAIN_BUILD=${PYTURBO_BUILD_DIR:-build}
VK_BUILD=${PYTURBO_VULKAN_BUILD_DIR:-build-vulkan}
upstream=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["upstream_src"])' "$MAIN_BUILD/pyturbo-build.json")
cmake -S . -B "$VK_BUILD" -DCMAKE_BUILD_TYPE=Release -DPYTURBO_UPSTREAM_DIR="$upstream" -DGGML_VULKAN=ON >/dev/null
cmake --build "$VK_BUILD" -j"$(nproc)" --target test-backend-ops llama-perplexity
