#!/usr/bin/env bash
# TurboQuant CUDA check on a GPU machine (made for the lent H200: 16 cores, no network).
#
# Two steps:
#   1. here (with network/cache):  bench/cuda_check.sh prepare
#        packs the patched upstream tree (no .git/docs/models) and two zero-weight model headers
#        (Llama-3.1-8B's shapes, Gemma 3 270M) into build/cuda-carry/ (~21 MB; the `run` tool
#        carries at most 64 MiB with the repo: carry ["build/cuda-carry"]). MODEL_CARRY=<gguf ...>
#        packs whole models too, if they fit.
#   2. on the GPU machine, from the repo root:  bench/cuda_check.sh
#        configure + build test-backend-ops and llama-bench (-j16), run test-backend-ops on CUDA0
#        (SET_ROWS, GET_ROWS, CPY, FLASH_ATTN_EXT; fails unless CUDA0 ran N/N tests with N > 0),
#        and the turboq FA cases again with GGML_CUDA_TURBOQ_FA=packed (the packed-block kernel at
#        every batch size), the _g64/_g32/_g16 twins' and the trellis types' cases (the build has
#        -DGGML_CUDA_TURBOQ_TWINS=ON), then
#        llama-bench -ngl 99 -fa 1 -p 512 -n 64 -d 0,8192,32768 for each configuration, on the
#        zero-weight 8B-shaped model first, and one ratio table to f16.
#
# Environment (step 2):
#   PYTURBO_UPSTREAM_DIR  patched llama.cpp tree (default: the main build's, else the
#                         carried build/cuda-carry/upstream.tar.gz, else upstream-wt/)
#   MODEL                 gguf for llama-bench (default: `python3 -m pyturbo model-path`, else the
#                         carried models in build/cuda-carry/*.gguf); all found models are benched
#   OUT                   results folder (default: $PYTURBO_CUDA_BENCH_BUILD_DIR/out)
#   BUDGET_S              total seconds (default 570): benches that would overrun are skipped
#   BENCH_DEPTHS          default 0,8192,32768;  BENCH_REPS default 2
#   BENCH_CONFIGS         K/V configurations, each TYPE or K/V, then :MODE (LLAMA_ARG_LAYER_ADAPTIVE) and/or
#                         :wW (an exact window of W, LLAMA_ARG_KV_EXACT_WINDOW, :w0 none, else libllama's default:
#                         auto's beside a turboq cache; read beside a turboq
#                         cache: the packed kernel in decode, the F16 conversion in prefill), default "f16 turboq3 turboq3:4:w32 turboq3:4 q4_0 q8_0
#                         turboq3:w32 turboq3/turboq4:3 q8_0/turboq3 turboq4" (turboq3:4:w32 is the
#                         recommended configuration; on a model without sliding-window layers mode 4 is a turboq4 K
#                         beside a turboq3 V); the budget may skip the last ones
#   TURBOQ_FILTER         test-backend-ops -p regex for the turboq cases (default: turboq)
#   JOBS                  build parallelism (default: nproc)
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
source scripts/build_dirs.sh
CARRY_REL="$PYTURBO_BUILD_DIR/cuda-carry"  # what the run tool's carry names
CARRY="$ROOT/$CARRY_REL"
BDIR=$PYTURBO_CUDA_BENCH_BUILD_DIR
MAIN_UPSTREAM=$( [ -f "$PYTURBO_BUILD_DIR/pyturbo-build.json" ] && patched_upstream || echo "$PYTURBO_BUILD_DIR/upstream/llama.cpp")

# ---------------------------------------------------------------- step 1: prepare (local)
if [ "${1:-}" = "prepare" ]; then
    set -e
    UP=${PYTURBO_UPSTREAM_DIR:-}
    if [ -z "$UP" ]; then
        for c in "$MAIN_UPSTREAM" upstream-wt; do
            [ -f "$c/ggml/src/ggml-cuda/turboq.cu" ] && { UP=$c; break; }
        done
    fi
    [ -n "$UP" ] && [ -f "$UP/ggml/src/ggml-cuda/turboq.cu" ] || { echo "prepare: no patched upstream tree (set PYTURBO_UPSTREAM_DIR)"; exit 1; }
    mkdir -p "$CARRY"
    rm -f "$CARRY"/upstream.tar.gz "$CARRY"/*.gguf
    tar -C "$UP" -czf "$CARRY/upstream.tar.gz" \
        --exclude=.git --exclude=./docs --exclude='*.gguf' --exclude='*.png' --exclude='*.jpg' \
        --exclude='./tools/ui/node_modules' --exclude='./build*' .
    for m in ${MODEL_CARRY:-}; do
        cp "$m" "$CARRY/"
    done
    # Gemma 3 270M (253 MB) does not fit the carry: take its GGUF header (metadata, vocabulary,
    # tensor table) and let the device fill the tensor data with zeros. Same shapes and types, so
    # the same kernels and the same throughput; the outputs are meaningless, which llama-bench ignores.
    python3 -m pyturbo fetch gemma3-270m >/dev/null || echo "cuda_check: no Gemma 3 270M (see above); its rows are left out" >&2
    gemma=$(python3 -m pyturbo model-path 2>/dev/null || true)
    rm -f "$CARRY"/*.header "$CARRY"/*.size
    # Llama-3.1-8B's shapes (head_dim 128, GQA 4), the model of the project's H200 table
    python3 -m pyturbo.bench.zero_model "$CARRY"
    if [ -n "$gemma" ] && [ -f "$gemma" ]; then
        off=$(python3 -c 'import sys, gguf; print(gguf.GGUFReader(sys.argv[1]).data_offset)' "$gemma")
        head -c "$off" "$gemma" > "$CARRY/$(basename "$gemma" .gguf).header"
        stat -c %s "$gemma" > "$CARRY/$(basename "$gemma" .gguf).size"
    fi
    du -sh "$CARRY" "$CARRY"/*
    total=$(du -sm "$CARRY" | cut -f1)
    [ "$total" -lt 64 ] || echo "prepare: WARNING: $total MiB is over the 64 MiB carry limit"
    echo "prepare: done; run on the device with carry [\"$CARRY_REL\"] and command: bench/cuda_check.sh"
    exit 0
fi

# ---------------------------------------------------------------- step 2: device
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-570}
OUT=${OUT:-$ROOT/$BDIR/out}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAIL=0
JOBS=${JOBS:-$(nproc)}

say()     { echo "[cuda-check] $*" | tee -a "$SUMMARY"; }
elapsed() { echo $(( $(date +%s) - T0 )); }
left()    { echo $(( BUDGET_S - $(date +%s) + T0 )); }

say "start $(date -u +%FT%TZ) on $(hostname), $(nproc) cores"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/[cuda-check] gpu: /' | tee -a "$SUMMARY"

# -- the patched upstream tree
UP=${PYTURBO_UPSTREAM_DIR:-}
if [ -z "$UP" ]; then
    if [ -f "$MAIN_UPSTREAM/ggml/src/ggml-cuda/turboq.cu" ]; then
        UP=$MAIN_UPSTREAM
    elif [ -f "$CARRY/upstream.tar.gz" ]; then
        UP=$BDIR-src/llama.cpp
        if [ ! -f "$UP/ggml/src/ggml-cuda/turboq.cu" ]; then
            mkdir -p "$UP" && tar -C "$UP" -xzf "$CARRY/upstream.tar.gz"
        fi
    elif [ -f upstream-wt/ggml/src/ggml-cuda/turboq.cu ]; then
        UP=upstream-wt
    fi
fi
if [ -z "$UP" ] || [ ! -f "$UP/ggml/src/ggml-cuda/turboq.cu" ]; then
    say "FAIL: no patched upstream tree (run 'bench/cuda_check.sh prepare' here and carry $CARRY_REL)"
    exit 1
fi
UP=$(cd "$UP" && pwd)
say "upstream: $UP"

# -- toolchain and cuBLAS
NVCC=${CUDACXX:-$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)}
[ -n "$NVCC" ] || { say "FAIL: nvcc not found"; exit 1; }
say "nvcc: $NVCC ($("$NVCC" --version | grep release))"
cuda_root=$(cd "$(dirname "$(readlink -f "$NVCC")")/.." && pwd)
CUBLAS_ARGS=()
have_cublas=0
for d in "$cuda_root" "$cuda_root/targets/x86_64-linux" /usr/local/cuda /usr; do
    if [ -f "$d/include/cublas_v2.h" ] && ls "$d"/lib*/libcublas.so* >/dev/null 2>&1; then
        have_cublas=1; say "cuBLAS: toolkit ($d)"; break
    fi
done
if [ "$have_cublas" = 0 ]; then
    # only what is already on the machine: a wheel file, or pip's cache (no network here)
    WD="$ROOT/$BDIR-cublas"
    whl=$(find "$HOME/.cache" /opt /tmp -name 'nvidia_cublas*.whl' 2>/dev/null | head -n 1 || true)
    if [ -n "$whl" ]; then
        say "cuBLAS: not in the toolkit; using the wheel $whl"
        python3 -m pip install --quiet --no-deps --no-index --target "$WD" "$whl" >> "$OUT/cublas.log" 2>&1 || true
    else
        say "cuBLAS: not in the toolkit; trying pip (cache only, no network)"
        timeout 120 python3 -m pip install --quiet --no-deps --target "$WD" nvidia-cublas >> "$OUT/cublas.log" 2>&1 || true
    fi
    CUB=$(ls -d "$WD"/nvidia/cu*/ "$WD"/nvidia/cublas/ 2>/dev/null | head -n 1 || true)
    CUB=${CUB%/}
    if [ -z "$CUB" ] || [ ! -f "$CUB/include/cublas_v2.h" ]; then
        say "FAIL: no cuBLAS (toolkit lacks it and no cached nvidia-cublas wheel; see $OUT/cublas.log)"
        exit 1
    fi
    for lib in cublas cublasLt; do
        [ -e "$CUB/lib/lib$lib.so" ] || ln -sf "$(basename "$(ls "$CUB"/lib/lib$lib.so.* | head -n 1)")" "$CUB/lib/lib$lib.so"
    done
    export LD_LIBRARY_PATH="$CUB/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    say "cuBLAS: from the nvidia-cublas wheel at $CUB"
    CUBLAS_ARGS=(-DCUDA_cublas_LIBRARY="$CUB/lib/libcublas.so" -DCUDA_cublasLt_LIBRARY="$CUB/lib/libcublasLt.so"
                 -DCMAKE_CUDA_FLAGS="-I$CUB/include" -DCMAKE_CXX_FLAGS="-I$CUB/include")
fi

# -- configure and build
GEN=()
command -v ninja >/dev/null && [ ! -f "$BDIR/CMakeCache.txt" ] && GEN=(-G Ninja)
LAUNCH=()
command -v ccache >/dev/null && LAUNCH=(-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
t=$(date +%s)
if ! cmake -S "$ROOT" -B "$BDIR" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DPYTURBO_UPSTREAM_DIR="$UP" \
        -DGGML_CUDA_TURBOQ_TWINS=ON \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$NVCC" \
        "${LAUNCH[@]}" "${CUBLAS_ARGS[@]}" > "$OUT/configure.log" 2>&1; then
    tail -n 30 "$OUT/configure.log"; say "FAIL: configure (see configure.log)"; exit 1
fi
say "configure: $(( $(date +%s) - t )) s"
t=$(date +%s)
if ! cmake --build "$BDIR" -j "$JOBS" --target test-backend-ops llama-bench > "$OUT/build.log" 2>&1; then
    grep -E "error" "$OUT/build.log" | head -n 40; say "FAIL: build (see build.log)"; exit 1
fi
say "build: $(( $(date +%s) - t )) s"
BIN="$BDIR/bin"

# -- test-backend-ops on CUDA0
tbo() { # name, args...
    local name=$1; shift
    local log="$OUT/tbo-$name.log"
    timeout 300 "$BIN/test-backend-ops" -b CUDA0 "$@" > "$log" 2>&1
    local rc=$?
    local clean
    clean=$(sed 's/\x1b\[[0-9;]*m//g' "$log")
    local passed total
    passed=$(echo "$clean" | sed -n 's/^ *\([0-9]*\)\/\([0-9]*\) tests passed.*/\1/p' | tail -n 1)
    total=$(echo "$clean" | sed -n 's/^ *\([0-9]*\)\/\([0-9]*\) tests passed.*/\2/p' | tail -n 1)
    if [ "$rc" = 0 ] && echo "$clean" | grep -q "Backend CUDA0: OK" && [ -n "$total" ] && [ "$total" -gt 0 ] && [ "$passed" = "$total" ]; then
        say "PASS test-backend-ops $name: $passed/$total on CUDA0"
    else
        say "FAIL test-backend-ops $name: rc=$rc, ${passed:-?}/${total:-?} tests passed (CUDA0 must run N/N, N > 0; see $(basename "$log"))"
        echo "$clean" | grep -E "FAIL|not supported|error" | head -n 10 | sed 's/^/    /' | tee -a "$SUMMARY"
        FAIL=1
    fi
}
TQF=${TURBOQ_FILTER:-turboq}
tbo set_rows        -o SET_ROWS
tbo set_rows-turboq -o SET_ROWS -p "$TQF"
tbo get_rows        -o GET_ROWS
tbo get_rows-turboq -o GET_ROWS -p "$TQF"
tbo cpy             -o CPY
tbo cpy-turboq      -o CPY -p "$TQF"
tbo fa-turboq       -o FLASH_ATTN_EXT -p "$TQF"
GGML_CUDA_TURBOQ_FA=packed tbo fa-turboq-packed -o FLASH_ATTN_EXT -p "$TQF"
# exact rows through the F16 conversion (prefill's path) in every case, decode's included
GGML_CUDA_TURBOQ_FA=f16 tbo fa-exact-f16 -o FLASH_ATTN_EXT -p "n_exact="
# the _g64/_g32/_g16 twins (head sizes 64, 96, 192, MLA's 576; 80) and the trellis types turboq3t
# and turboq2t, which CUDA declines unless built with -DGGML_CUDA_TURBOQ_TWINS=ON (as this build
# is): their kernels have run only under CPU emulation (tests/test_cuda_emulation.py)
for op in SET_ROWS GET_ROWS CPY FLASH_ATTN_EXT; do
    tbo "twins-$op" -o "$op" -p 'turboq[2348]_g(64|32|16)|turboq[23]t'
done
# the packed kernel has no _g16 cases (head size 80 converts K/V to f16 for mainline's kernels)
GGML_CUDA_TURBOQ_FA=packed tbo twins-fa-packed -o FLASH_ATTN_EXT -p 'turboq[2348]_g(64|32)|turboq[23]t'

# -- llama-bench
MODELS=()
if [ -n "${MODEL:-}" ]; then
    MODELS=("$MODEL")
else
    m=$(python3 -m pyturbo model-path 2>/dev/null | tail -n 1 || true)
    [ -n "$m" ] && [ -f "$m" ] && MODELS+=("$m")
    for m in "$CARRY"/*.gguf; do [ -f "$m" ] && MODELS+=("$m"); done
fi
for h in $(ls "$CARRY"/*.header 2>/dev/null | sort -r); do # zero-weight copies of models too big to carry (see prepare); llama-8b first
    z="$BDIR/$(basename "$h" .header)-zero-weights.gguf"
    if [ ! -f "$z" ]; then
        cp "$h" "$z" && truncate -s "$(cat "${h%.header}.size")" "$z"
    fi
    MODELS=("$z" "${MODELS[@]}")
done
if [ "${#MODELS[@]}" = 0 ]; then
    say "SKIP llama-bench: no model (set MODEL, or carry one via 'prepare')"
fi
DEPTHS=${BENCH_DEPTHS:-0,8192,32768}
REPS=${BENCH_REPS:-2}
for m in "${MODELS[@]}"; do
    base=$(basename "$m" .gguf)
    for cfg in ${BENCH_CONFIGS:-f16 turboq3 turboq3:4:w32 turboq3:4 q4_0 q8_0 turboq3:w32 turboq3/turboq4:3 q8_0/turboq3 turboq4}; do
        IFS=: read -r kv rest <<< "$cfg"
        mode=0; win=""  # unset: libllama's default window (auto's beside a turboq cache); :w0 for none
        for f in ${rest//:/ }; do
            case $f in w*) win=${f#w} ;; *) mode=$f ;; esac
        done
        ctk=${kv%%/*}; ctv=${kv#*/}
        budget=$(left)
        if [ "$budget" -lt 20 ]; then
            say "SKIP llama-bench $base $cfg: time budget spent ($(elapsed) s)"
            continue
        fi
        log="$OUT/bench-$base-${ctk}-${ctv}-m${mode}${win:+-w$win}"
        env ${win:+LLAMA_ARG_KV_EXACT_WINDOW=$win} LLAMA_ARG_LAYER_ADAPTIVE=$mode timeout "$budget" "$BIN/llama-bench" -m "$m" -ngl 99 -fa 1 -p 512 -n 64 -d "$DEPTHS" -r "$REPS" \
            -ctk "$ctk" -ctv "$ctv" -o jsonl > "$log.jsonl" 2> "$log.log"
        rc=$?
        if [ "$rc" = 0 ]; then
            say "bench $base $cfg: $(python3 "$ROOT/pyturbo/bench/ratio_table.py" --one "$log.jsonl" 2>/dev/null)"
        else
            say "FAIL llama-bench $base $cfg: rc=$rc (see $(basename "$log").log)"
            tail -n 5 "$log.log" | sed 's/^/    /' | tee -a "$SUMMARY"
            FAIL=1
        fi
    done
done
# one table of ratios to f16 per model, from this run's jsonl files
python3 "$ROOT/pyturbo/bench/ratio_table.py" "$OUT" >> "$SUMMARY" 2>&1 || say "(no ratio table: python3 or the jsonl files missing)"

say "done in $(elapsed) s: $([ "$FAIL" = 0 ] && echo PASS || echo FAIL)"
exit "$FAIL"
