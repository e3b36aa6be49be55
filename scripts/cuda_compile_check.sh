#!/usr/bin/env bash
# CUDA compile check (no GPU needed): compiles, for sm_90, only the ggml-cuda objects that the
# pyturbo series touches or adds (every ggml-cuda .cu that mentions turboq), and fails on any
# compile error or on a compiler warning in one of our files; then configures the pip route
# (CMAKE_ARGS="-DGGML_CUDA=on" pip wheel) without compiling.
#
#   scripts/cuda_compile_check.sh
#
# Environment (all optional):
#   PYTURBO_UPSTREAM_DIR  patched llama.cpp tree; default: upstream_src of $MAIN_BUILD/pyturbo-build.json,
#                         else $MAIN_BUILD/upstream/llama.cpp (what `cmake -B build` prepares)
#   PYTURBO_BUILD_DIR     the main build dir (default: scripts/build_dirs.sh's)
#   CUDA_CHECK_BUILD      the CUDA build dir (default: scripts/build_dirs.sh's; never the main build)
#   CUDA_CHECK_JOBS       parallel compiles (default: nproc)
#   CUDA_CHECK_ARCH       CMAKE_CUDA_ARCHITECTURES (default: 90)
#   CUDA_CHECK_OBJECTS    space-separated .cu paths relative to ggml/src/ggml-cuda (default: the turboq set)
#   CUBLAS_DIR            a cuBLAS root with include/ and lib/ (default: the toolkit's, else the
#                         nvidia-cublas wheel installed with pip into ~/.cache/pyturbo/nvidia-cublas-wheel)
#   CUBLAS_PIP_SPEC       the pip requirement tried first (default nvidia-cublas==13.1.1.3)
# The machine needs nvcc; nothing is run on a GPU. Idempotent: re-running reuses the build dir and ccache.
set -euo pipefail

t_start=$(date +%s)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

source scripts/build_dirs.sh
MAIN_BUILD=$PYTURBO_BUILD_DIR
BDIR=${CUDA_CHECK_BUILD:-$PYTURBO_CUDA_CHECK_BUILD_DIR}
JOBS=${CUDA_CHECK_JOBS:-$(nproc)}
ARCH=${CUDA_CHECK_ARCH:-90}

log() { echo "[cuda-check] $*"; }
die() { echo "[cuda-check] ERROR: $*" >&2; exit 1; }

case "$(cd "$(dirname "$BDIR")" 2>/dev/null && pwd)/$(basename "$BDIR")" in
    "$(cd "$(dirname "$MAIN_BUILD")" 2>/dev/null && pwd)/$(basename "$MAIN_BUILD")") die "CUDA_CHECK_BUILD must differ from the main build dir";;
esac

# ---- the patched upstream tree ----
UPSTREAM=${PYTURBO_UPSTREAM_DIR:-}
if [ -z "$UPSTREAM" ] && [ -f "$MAIN_BUILD/pyturbo-build.json" ]; then
    UPSTREAM=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["upstream_src"])' "$MAIN_BUILD/pyturbo-build.json")
fi
UPSTREAM=${UPSTREAM:-$MAIN_BUILD/upstream/llama.cpp}
[ -f "$UPSTREAM/ggml/src/ggml-cuda/turboq.cu" ] || die "no patched upstream with ggml-cuda/turboq.cu at '$UPSTREAM' (build the main tree first or set PYTURBO_UPSTREAM_DIR)"
UPSTREAM=$(cd "$UPSTREAM" && pwd)
log "upstream: $UPSTREAM"

# ---- nvcc ----
NVCC=${CUDACXX:-$(command -v nvcc || true)}
if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
    NVCC=/usr/local/cuda/bin/nvcc
fi
[ -n "$NVCC" ] && [ -x "$NVCC" ] || die "nvcc not found"
if ! command -v ninja >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ninja-build >/dev/null 2>&1 \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ninja-build >/dev/null; }
fi
command -v ninja >/dev/null || die "ninja not found (object targets need the Ninja generator)"
log "nvcc: $NVCC ($("$NVCC" --version | tail -n 2 | head -n 1))"

# ---- cuBLAS: the toolkit's, or the nvidia-cublas wheel via pip ----
cublas_root() { # prints a dir holding include/cublas_v2.h and lib/libcublas.so*, if any
    local d
    for d in "$@"; do
        [ -n "$d" ] || continue
        if [ -f "$d/include/cublas_v2.h" ] && ls "$d"/lib*/libcublas.so* >/dev/null 2>&1; then
            echo "$d"; return 0
        fi
    done
    return 1
}
nvcc_root=$(cd "$(dirname "$(readlink -f "$NVCC")")/.." && pwd)
CUBLAS_EXTRA=()
if CUB=$(cublas_root "${CUBLAS_DIR:-}"); then
    :
elif CUB=$(cublas_root "$nvcc_root" "$nvcc_root/targets/x86_64-linux" /usr/local/cuda /usr); then
    log "cuBLAS from the toolkit: $CUB"
    CUB=""
else
    # outside the clone: the wheel is ~570 MB, and a fresh clone should not fetch it again
    WHEEL_DIR="${PYTURBO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pyturbo}/nvidia-cublas-wheel"
    CUB=$(ls -d "$WHEEL_DIR"/nvidia/cu*/ "$WHEEL_DIR"/nvidia/cublas/ 2>/dev/null | head -n 1 || true)
    CUB=${CUB%/}
    if [ -z "$CUB" ] || [ ! -f "$CUB/include/cublas_v2.h" ]; then
        log "cuBLAS not found: pip install nvidia-cublas into $WHEEL_DIR"
        # a cu13 wheel that the local index already holds first (no 450 MB download), then any
        python3 -m pip install --quiet --no-deps --target "$WHEEL_DIR" "${CUBLAS_PIP_SPEC:-nvidia-cublas==13.1.1.3}" \
            || python3 -m pip install --quiet --no-deps --target "$WHEEL_DIR" nvidia-cublas \
            || die "pip install nvidia-cublas failed"
        CUB=$(ls -d "$WHEEL_DIR"/nvidia/cu*/ "$WHEEL_DIR"/nvidia/cublas/ 2>/dev/null | head -n 1 || true)
        CUB=${CUB%/}
        [ -n "$CUB" ] && [ -f "$CUB/include/cublas_v2.h" ] || die "the nvidia-cublas wheel has no include/cublas_v2.h"
    fi
fi
if [ -n "$CUB" ]; then
    CUB=$(cd "$CUB" && pwd)
    for lib in cublas cublasLt; do # the wheel ships only the .so.N names
        if [ ! -e "$CUB/lib/lib$lib.so" ]; then
            so=$(ls "$CUB"/lib/lib$lib.so.* 2>/dev/null | head -n 1 || true)
            [ -n "$so" ] || die "no lib$lib.so* in $CUB/lib"
            ln -sf "$(basename "$so")" "$CUB/lib/lib$lib.so"
        fi
    done
    log "cuBLAS: $CUB"
    CUBLAS_EXTRA=(
        "-DCUDA_cublas_LIBRARY=$CUB/lib/libcublas.so"
        "-DCUDA_cublasLt_LIBRARY=$CUB/lib/libcublasLt.so"
        "-DCMAKE_CUDA_FLAGS=-I$CUB/include"
        "-DCMAKE_CXX_FLAGS=-I$CUB/include"
    )
fi

# ---- configure (once; cmake re-runs itself when inputs change) ----
if [ -f "$BDIR/CMakeCache.txt" ] && ! grep -q "^CMAKE_GENERATOR:INTERNAL=Ninja\$" "$BDIR/CMakeCache.txt"; then
    die "$BDIR was not configured with Ninja; remove it"
fi
LAUNCHER=()
if command -v ccache >/dev/null; then
    LAUNCHER=("-DCMAKE_CUDA_COMPILER_LAUNCHER=env;CCACHE_BASEDIR=$ROOT;CCACHE_NOHASHDIR=1;$(command -v ccache)")
fi
if [ ! -f "$BDIR/CMakeCache.txt" ] || ! grep -q "^PYTURBO_UPSTREAM_DIR:PATH=$UPSTREAM\$" "$BDIR/CMakeCache.txt"; then
    log "configuring $BDIR"
    mkdir -p "$BDIR"
    cmake -S "$ROOT" -B "$BDIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DPYTURBO_UPSTREAM_DIR="$UPSTREAM" \
        -DCMAKE_CUDA_COMPILER="$NVCC" \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DGGML_CUDA_NO_VMM=ON \
        "${LAUNCHER[@]}" "${CUBLAS_EXTRA[@]}" > "$BDIR/cuda-check-configure.log" 2>&1 \
        || { tail -n 40 "$BDIR/cuda-check-configure.log"; die "configure failed (log: $BDIR/cuda-check-configure.log)"; }
fi

# ---- the objects ----
CUDA_SRC="$UPSTREAM/ggml/src/ggml-cuda"
if [ -n "${CUDA_CHECK_OBJECTS:-}" ]; then
    read -r -a SRCS <<< "$CUDA_CHECK_OBJECTS"
else
    mapfile -t SRCS < <(cd "$CUDA_SRC" && grep -l -i turboq -- *.cu template-instances/*.cu | sort)
fi
[ "${#SRCS[@]}" -gt 0 ] || die "no CUDA sources to compile"

OBJDIR=$(cd "$BDIR" && find . -type d -path '*/ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir' | head -n 1)
[ -n "$OBJDIR" ] || die "no ggml-cuda object dir in $BDIR (was GGML_CUDA enabled?)"
OBJDIR=${OBJDIR#./}
TARGETS=()
for s in "${SRCS[@]}"; do
    TARGETS+=("$OBJDIR/$s.o")
done
# CMake globs the instance files when it configures, so a source added since then (a new instance)
# is no target yet: configure again
for t in "${TARGETS[@]}"; do
    if ! grep -qF "build $t:" "$BDIR/build.ninja"; then
        log "configuring $BDIR again: $t is new"
        cmake -S "$ROOT" -B "$BDIR" > "$BDIR/cuda-check-configure.log" 2>&1 \
            || { tail -n 40 "$BDIR/cuda-check-configure.log"; die "configure failed (log: $BDIR/cuda-check-configure.log)"; }
        break
    fi
done
log "compiling ${#TARGETS[@]} objects with -j$JOBS: ${SRCS[*]}"

BUILD_LOG="$BDIR/cuda-check-build.log"
t_build=$(date +%s)
if ! cmake --build "$BDIR" -j "$JOBS" --target "${TARGETS[@]}" > "$BUILD_LOG" 2>&1; then
    grep -E "error|Error" "$BUILD_LOG" | head -n 60 || true
    tail -n 30 "$BUILD_LOG"
    die "compile failed (log: $BUILD_LOG)"
fi
# warnings in our files (turboq*) fail the check; upstream's own warnings are only shown
if grep -E "turboq[^ ]*\.(cu|cuh)[^ ]*: *(warning|Warning)|turboq[^ ]*\.(cu|cuh)\([0-9]+\): warning" "$BUILD_LOG"; then
    die "compiler warnings in the turboq CUDA files (log: $BUILD_LOG)"
fi
grep -iE "warning" "$BUILD_LOG" | head -n 20 || true

# ---- the pip route: what `CMAKE_ARGS="-DGGML_CUDA=on" pip install .` configures ----
# scikit-build-core passes CMAKE_ARGS to the same CMakeLists; building only the `help` target and
# installing an empty component stops it before compiling, in a build dir of its own
PIP_DIR="$BDIR/pip"
PIP_LOG="$BDIR/cuda-check-pip.log"
rm -rf "$PIP_DIR"
mkdir -p "$PIP_DIR"
pip_args=("-DGGML_CUDA=on" "-DCMAKE_CUDA_COMPILER=$NVCC" "-DCMAKE_CUDA_ARCHITECTURES=$ARCH" "-DGGML_CUDA_NO_VMM=ON"
          "-DPYTURBO_UPSTREAM_DIR=$UPSTREAM" "${CUBLAS_EXTRA[@]}")
if ! CMAKE_ARGS="${pip_args[*]}" python3 -m pip wheel "$ROOT" --no-deps --quiet -w "$PIP_DIR/wheel" \
        --config-settings=build-dir="$PIP_DIR/build" --config-settings=build.targets=help \
        --config-settings=install.components=none > "$PIP_LOG" 2>&1; then
    tail -n 30 "$PIP_LOG"
    die "pip with CMAKE_ARGS=-DGGML_CUDA=on did not configure (log: $PIP_LOG)"
fi
grep -q "^GGML_CUDA:BOOL=on$" "$PIP_DIR/build/CMakeCache.txt" || die "the pip build did not take GGML_CUDA from CMAKE_ARGS"
PIP_MAKE=$(find "$PIP_DIR/build" -path '*ggml-cuda.dir/build.make' | head -n 1)
[ -n "$PIP_MAKE" ] && grep -q "turboq.cu" "$PIP_MAKE" || die "the pip build's ggml-cuda target has no turboq.cu"
log "pip route: CMAKE_ARGS=-DGGML_CUDA=on configures ggml-cuda with the turboq kernels"

t_end=$(date +%s)
log "OK: ${#TARGETS[@]} objects; build $((t_end - t_build)) s, wall $((t_end - t_start)) s"
