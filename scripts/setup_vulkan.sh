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
# glslc through its cache (scripts/glslc_cached.sh): the shaders are most of a warm Vulkan build
cmake -S . -B "$VK_BUILD" -DCMAKE_BUILD_TYPE=Release -DPYTURBO_UPSTREAM_DIR="$upstream" -DGGML_VULKAN=ON \
    -DVulkan_GLSLC_EXECUTABLE="$PWD/scripts/glslc_cached.sh" >/dev/null
# the shader generator is an ExternalProject, configured during the build: ccache reaches it
# through CMake's environment default for a new build's launcher (the main build has its own)
CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1 CMAKE_CXX_COMPILER_LAUNCHER=$(command -v ccache || true) \
    cmake --build "$VK_BUILD" -j"$(nproc)" --target test-backend-ops llama-perplexity
