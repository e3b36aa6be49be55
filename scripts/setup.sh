#!/usr/bin/env bash
# Sets a fresh machine up: system packages, Python packages, the patched llama.cpp build, and the
# real data (`python -m pyturbo fetch`: the models and botchan.txt, into pyturbo's cache).
# Re-running it is cheap: pip is a no-op and the build is incremental (ccache when present).
# `setup.sh --serve` sets up only what `python -m server` runs on its default engine (the [server]
# extra, the libraries and llama-server), for scripts/serve.sh; the test command sets up all.
set -euo pipefail
cd "$(dirname "$0")/.."
serve_only=0
case "${1:-}" in
    "") ;;
    --serve) serve_only=1 ;;
    *) echo "setup: unknown argument '$1' (the only one is --serve)" >&2; exit 2 ;;
esac

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v g++ >/dev/null || need+=(g++)
command -v ccache >/dev/null || need+=(ccache)
command -v git >/dev/null || need+=(git)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
        echo "setup: please install: ${need[*]}" >&2
        [[ " ${need[*]} " == *" ccache "* && ${#need[@]} -eq 1 ]] || exit 1
    fi
fi

if [ $serve_only = 1 ]; then extras=(server); else extras=(--all --exclude llama-cpp-python); fi
reqs=$(python3 scripts/requirements.py "${extras[@]}")  # a failure here stops the setup (set -e)
python3 -m pip install --quiet --disable-pip-version-check -r /dev/stdin <<< "$reqs"

source scripts/build_dirs.sh
BUILD_DIR=$PYTURBO_BUILD_DIR
# the interpreter is named each time: `pip install .` configures the same build dir from its own
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$(command -v python3)" $(compiler_args) >/dev/null
if [ $serve_only = 1 ]; then
    cmake --build "$BUILD_DIR" -j"$(nproc)" --target pyturbo-serve
    python3 -m pyturbo fetch gemma3-270m >/dev/null  # the model that `python -m server` serves by default
    exec python3 -m pyturbo doctor
fi
cmake --build "$BUILD_DIR" -j"$(nproc)" --target pyturbo
python3 -m pyturbo fetch >/dev/null  # the models and the text that the tests and benches use

# llama-cpp-python from the same pinned sdist, without its own llama.cpp: pyturbo points it at
# build/bin through LLAMA_CPP_LIB_PATH
pinned=$(python3 -c 'import json; print(json.load(open("pyturbo/upstream.json"))["sdist_version"])')
if [ "$(python3 -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null)" != "$pinned" ]; then
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF -DMTMD_BUILD=OFF" python3 -m pip install --quiet \
        --disable-pip-version-check --no-deps "$(python3 ggml_patches/prepare.py --print-sdist)"
fi
python3 -m pyturbo doctor
