# The build directories, in one place. Every script sources this file; pyturbo/_paths.py
# (build_dirs()) and the tests read it, and a test checks pyproject.toml's build-dir against it.
# Each is a default: the variable, when set, wins.
: "${PYTURBO_BUILD_DIR:=build}"                    # the main build (scripts/setup.sh, pip install .)
: "${PYTURBO_VULKAN_BUILD_DIR:=build-vulkan}"      # scripts/setup_vulkan.sh, for tests/test_vulkan.py
: "${PYTURBO_CUDA_CHECK_BUILD_DIR:=build-cuda-check}"  # scripts/cuda_compile_check.sh
: "${PYTURBO_CUDA_BENCH_BUILD_DIR:=build-cuda}"    # bench/cuda_check.sh, on a GPU machine
: "${PYTURBO_SEEDED_BUILD_DIR:=build-seeded}"  # scripts/build_seeded.sh: other rotation signs, for the sign-seed tests
: "${PYTURBO_ASAN_BUILD_DIR:=build-asan}"          # scripts/asan_state_check.sh
: "${PYTURBO_AARCH64_BUILD_DIR:=build-aarch64}"    # scripts/build_portable.sh, for tests/test_portable_kernels.py
: "${PYTURBO_AARCH64_DOTPROD_BUILD_DIR:=build-aarch64-dotprod}"  # the same, AArch64 with the dot-product extension
: "${PYTURBO_SCALAR_BUILD_DIR:=build-scalar}"      # the same, x86 without AVX2/FMA
: "${PYTURBO_AVX2_BUILD_DIR:=build-avx2}"          # the same, x86 with AVX2/FMA and without AVX-512
: "${PYTURBO_AVX512_BUILD_DIR:=build-avx512}"      # the same, x86 with AVX-512 BW and VNNI, without VBMI

# -DCMAKE_C_COMPILER/-DCMAKE_CXX_COMPILER for a new CPU build dir: the compilers that `pip install .`
# (scikit-build-core) configures the same build dir with ($CC/$CXX, else Python's own), so that a
# later pip install does not rebuild every object under other names, which ccache would all miss
compiler_args() {
    python3 -c 'import os, shlex, shutil, sysconfig
for lang, var, default in (("C", "CC", "cc"), ("CXX", "CXX", "c++")):
    name = shlex.split(os.environ.get(var) or sysconfig.get_config_var(var) or default)[0]
    print(f"-DCMAKE_{lang}_COMPILER={shutil.which(name) or name}")'
}

# the patched llama.cpp tree that the main build prepared (its pyturbo-build.json says where)
patched_upstream() {
    python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["upstream_src"])' "$PYTURBO_BUILD_DIR/pyturbo-build.json"
}
