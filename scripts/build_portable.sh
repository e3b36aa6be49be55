#!/usr/bin/env bash
# The portable-kernel builds that tests/test_portable_kernels.py runs: the patched ggml and
# tests/portable/turboq_check.c, (1) cross-compiled for AArch64 (NEON; and again with the dot-product
# extension) and run under qemu-aarch64,
# (2) for x86 with AVX2 and FMA off (the generic kernels), (3) for x86 with AVX2 and FMA but no
# AVX-512 (the AVX2 kernels, which a native build on an AVX-512 machine never compiles), (4) for x86
# with AVX-512 BW and VNNI but no VBMI (Cascade Lake's: the packed kernels' trellis lookups without
# vpermb, which a native build on a VBMI machine never compiles). Needs the
# tree that scripts/setup.sh prepared. Installs Debian's cross toolchain and qemu-user when missing (as root).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu)
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
        echo "build_portable: please install: ${need[*]}" >&2
        exit 1
    fi
fi

source scripts/build_dirs.sh
upstream=$(patched_upstream)
launcher=()
if command -v ccache >/dev/null; then
    launcher=(-DCMAKE_C_COMPILER_LAUNCHER="env;CCACHE_BASEDIR=$PWD;CCACHE_NOHASHDIR=1;ccache"
              -DCMAKE_CXX_COMPILER_LAUNCHER="env;CCACHE_BASEDIR=$PWD;CCACHE_NOHASHDIR=1;ccache")
fi

# AArch64, the compiler's baseline (armv8-a: NEON, no dotprod or fp16 arithmetic)
cmake -S tests/portable -B "$PYTURBO_AARCH64_BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DPYTURBO_UPSTREAM_SRC="$upstream" \
    -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
    -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ \
    -DGGML_NATIVE=OFF "${launcher[@]}" >/dev/null
cmake --build "$PYTURBO_AARCH64_BUILD_DIR" -j"$(nproc)" --target turboq-check

# AArch64 with the dot-product extension (SDOT/UDOT: the packed decode step's other version;
# qemu-aarch64's default CPU has it)
cmake -S tests/portable -B "$PYTURBO_AARCH64_DOTPROD_BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DPYTURBO_UPSTREAM_SRC="$upstream" \
    -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
    -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ \
    -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod "${launcher[@]}" >/dev/null
cmake --build "$PYTURBO_AARCH64_DOTPROD_BUILD_DIR" -j"$(nproc)" --target turboq-check

# x86 without AVX2/FMA (SSE4.2 stays): every turboq kernel takes its generic version
cmake -S tests/portable -B "$PYTURBO_SCALAR_BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DPYTURBO_UPSTREAM_SRC="$upstream" \
    -DGGML_NATIVE=OFF -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_AVX512=OFF \
    -DGGML_AVX_VNNI=OFF -DGGML_BMI2=OFF "${launcher[@]}" >/dev/null
cmake --build "$PYTURBO_SCALAR_BUILD_DIR" -j"$(nproc)" --target turboq-check

# x86 with AVX2, FMA and F16C, without AVX-512: the AVX2 versions of the kernels
cmake -S tests/portable -B "$PYTURBO_AVX2_BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DPYTURBO_UPSTREAM_SRC="$upstream" \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF \
    -DGGML_AVX_VNNI=OFF "${launcher[@]}" >/dev/null
cmake --build "$PYTURBO_AVX2_BUILD_DIR" -j"$(nproc)" --target turboq-check

# x86 with AVX-512 (F, CD, VL, DQ, BW) and VNNI, without VBMI
cmake -S tests/portable -B "$PYTURBO_AVX512_BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DPYTURBO_UPSTREAM_SRC="$upstream" \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON \
    -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF "${launcher[@]}" >/dev/null
cmake --build "$PYTURBO_AVX512_BUILD_DIR" -j"$(nproc)" --target turboq-check
