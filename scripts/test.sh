#!/usr/bin/env bash
# Runs the whole test suite (setting up first, which is a no-op when nothing changed).
# The GPU backends: the Vulkan build that tests/test_vulkan.py runs on lavapipe, and the CUDA
# compile check (nvcc, no GPU). PYTURBO_SKIP_GPU_BACKENDS=1 leaves both out (the Vulkan tests
# then skip, except under CI=true). The portable-kernel builds (AArch64 under qemu, x86 without
# AVX2/FMA) for tests/test_portable_kernels.py: PYTURBO_SKIP_PORTABLE=1 leaves them out.
# --quick: setup.sh's CPU build and tiny models only, pytest -m "$QUICK" (pyproject.toml's markers); args go to pytest.
# pytest runs the test files on as many workers as there are cores, up to 4 (pytest-xdist, a file per
# worker at a time, so a module's fixtures are made once): on 2 cores much of a test's time is a
# process starting, a server answering, a compiler or pip, which the other worker overlaps.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK="not (slow or vulkan or portable or cuda_emulation or package or seeded)"
n=$(nproc)
WORKERS=(-n "$(( n < 4 ? n : 4 ))" --dist loadfile)
quick=0
args=()
for a in "$@"; do
    if [ "$a" = --quick ]; then quick=1; else args+=("$a"); fi
done
t0=$(date +%s)
bash scripts/setup.sh
if [ "$quick" = 1 ]; then
    echo "test.sh --quick: setup $(( $(date +%s) - t0 )) s"
    rc=0
    python3 -m pytest -q -ra --durations=15 "${WORKERS[@]}" -m "$QUICK" tests ${args[@]+"${args[@]}"} || rc=$?
    echo "test.sh --quick: $(( $(date +%s) - t0 )) s in all"
    exit "$rc"
fi
bash scripts/build_seeded.sh
t1=$(date +%s)
echo "test.sh: setup and the seeded build $((t1 - t0)) s"
if [ "${PYTURBO_SKIP_GPU_BACKENDS:-0}" != 1 ]; then
    bash scripts/setup_vulkan.sh
    t2=$(date +%s)
    bash scripts/cuda_compile_check.sh
    t3=$(date +%s)
    echo "test.sh: Vulkan build $((t2 - t1)) s, CUDA compile check $((t3 - t2)) s"
fi
if [ "${PYTURBO_SKIP_PORTABLE:-0}" != 1 ]; then
    t4=$(date +%s)
    bash scripts/build_portable.sh
    echo "test.sh: portable-kernel builds (AArch64, x86 without AVX2, AVX2, AVX-512 without VBMI) $(( $(date +%s) - t4 )) s"
fi
rc=0
python3 -m pytest -q -ra --durations=15 "${WORKERS[@]}" tests ${args[@]+"${args[@]}"} || rc=$?
echo "test.sh: $(( $(date +%s) - t0 )) s in all"
exit "$rc"
