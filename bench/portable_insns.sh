#!/usr/bin/env bash
# Guest instructions that the turboq CPU paths execute on AArch64, NEON build against the generic
# kernels (-DGGML_TURBOQ_GENERIC), counted by qemu-aarch64 (-singlestep -d exec: one log line per
# executed instruction). Wall time under qemu says little about NEON on real hardware (qemu runs
# vector ops through helpers); executed instructions are a steadier proxy, still not a speed.
# Per 128-value row (two blocks of a _g64 twin, four of a _g32 twin): SET_ROWS + GET_ROWS of the row, plus one-row-query flash attention over it
# (4 heads on one KV head), from the difference between 64 and 192 rows (startup cancels out).
# Usage: bash bench/portable_insns.sh NEON_BUILD_DIR GENERIC_BUILD_DIR   (each with bin/turboq-check;
# TYPES="id:name ..." for other types than all twelve). FA_ONLY=1 counts the tiled flash attention
# alone (two rounds of it less one, so the codec cancels out) and compares any two builds, e.g. one
# with patch 46's packed decode step and one without.
set -euo pipefail
neon=$1 generic=$2
count() {  # build tiled(1/0) type rows [fa_rounds]
    TURBOQ_FA_TILED=$2 qemu-aarch64 -singlestep -d exec,nochain -D /dev/stderr "$1/bin/turboq-check" speed "$3" "$4" 1 "${5:-1}" \
        2>&1 >/dev/null | grep -c Trace
}
if [ "${FA_ONLY:-0}" = 1 ]; then
    fa() {  # build type: instructions per cached row of one flash attention (4 query heads)
        echo $(( ($(count "$1" 1 "$2" 192 2) - $(count "$1" 1 "$2" 192 1) - $(count "$1" 1 "$2" 64 2) + $(count "$1" 1 "$2" 64 1)) / 128 ))
    }
    echo "| type | $neon insns/row | $generic insns/row | ratio |"
    echo "|---|---|---|---|"
    for t in ${TYPES:-60:turboq2 61:turboq3 62:turboq4 64:turboq2_g64 65:turboq3_g64 66:turboq4_g64}; do
        a=$(fa "$neon" ${t%%:*}) b=$(fa "$generic" ${t%%:*})
        echo "| ${t#*:} | $a | $b | $(python3 -c "print(f'{$b/$a:.2f}')") |"
    done
    exit 0
fi
echo "| type | FA path | NEON insns/row | generic insns/row | generic/NEON |"
echo "|---|---|---|---|---|"
for t in ${TYPES:-60:turboq2 61:turboq3 62:turboq4 63:turboq8 64:turboq2_g64 65:turboq3_g64 66:turboq4_g64 67:turboq8_g64
    68:turboq2_g32 69:turboq3_g32 70:turboq4_g32 71:turboq8_g32}; do
    for tiled in 1 0; do
        n=$(( ($(count "$neon" $tiled ${t%%:*} 192) - $(count "$neon" $tiled ${t%%:*} 64)) / 128 ))
        g=$(( ($(count "$generic" $tiled ${t%%:*} 192) - $(count "$generic" $tiled ${t%%:*} 64)) / 128 ))
        path=$([ $tiled = 1 ] && echo tiled || echo one-row)
        echo "| ${t#*:} | $path | $n | $g | $(python3 -c "print(f'{$g/$n:.2f}')") |"
    done
done
