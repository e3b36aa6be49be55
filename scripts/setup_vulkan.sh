#!/usr/bin/env bash
# The Vulkan build that the tests run on Mesa's software driver (lavapipe): system packages, then
# test-backend-ops and llama-perplexity with -DGGML_VULKAN=ON in build-vulkan/, from the patched
# tree that the main build prepared (run scripts/setup.sh first). ccache shares the CPU objects.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup_vulkan_deps.sh

source scripts/build_dirs.sh
VK_BUILD=$PYTURBO_VULKAN_BUILD_DIR
upstream=$(patched_upstream)
cmake -S . -B "$VK_BUILD" -DCMAKE_BUILD_TYPE=Release -DPYTURBO_UPSTREAM_DIR="$upstream" -DGGML_VULKAN=ON >/dev/null
cmake --build "$VK_BUILD" -j"$(nproc)" --target test-backend-ops llama-perplexity
