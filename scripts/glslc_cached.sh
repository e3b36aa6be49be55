#!/usr/bin/env bash
# glslc with its outputs cached, as ccache caches the C++ objects: a Vulkan build in a fresh clone
# (every CI run) compiles about 1,300 shader variants, 85 s of a warm 128 s Vulkan build on 2 cores,
# and nothing else keeps them. scripts/setup_vulkan.sh configures the build with this file as glslc.
#
# The key is glslc itself (path, size, mtime), the arguments with the output and dependency-file
# paths taken out, the source's name, and the name and content of every .comp and .glsl file in the
# source's directory, where its #includes resolve (vulkan-shaders-gen passes no -I). A hit writes the
# .spv and the -MF dependency file that the compile would have written. A call that is not one
# source compiled to one file (the configure step's feature tests write to stdout), a compile that
# fails or says anything on stderr, and a machine without a cache directory go to glslc unchanged.
# The cache lives in $PYTURBO_CACHE/glslc (else $XDG_CACHE_HOME/pyturbo, else ~/.cache/pyturbo),
# one directory per state of the shader sources, the newest 4 kept.
set -uo pipefail

real=$(command -v glslc) || { echo "glslc_cached.sh: no glslc on PATH" >&2; exit 127; }
if [ -n "${PYTURBO_CACHE:-}" ]; then base=$PYTURBO_CACHE
elif [ -n "${XDG_CACHE_HOME:-}" ]; then base=$XDG_CACHE_HOME/pyturbo
elif [ -n "${HOME:-}" ]; then base=$HOME/.cache/pyturbo
else base=""
fi

out="" dep="" src="" key_args=() n_src=0
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    a=${args[i]}
    case "$a" in
        -o) out=${args[i + 1]:-}; i=$((i + 1)) ;;
        -MF) dep=${args[i + 1]:-}; i=$((i + 1)); key_args+=(-MF) ;;
        -*) key_args+=("$a") ;;
        *) src=$a; n_src=$((n_src + 1)) ;;
    esac
done
if [ -z "$base" ] || [ "$n_src" != 1 ] || [ -z "$out" ] || [ "$out" = - ] || [ ! -f "$src" ]; then
    exec "$real" "$@"
fi

srcdir=$(dirname "$src")
tree=$(cd "$srcdir" && sha256sum -- *.comp *.glsl 2>/dev/null | sha256sum | cut -c1-16)
key=$( { stat -Lc '%n %s %Y' "$real"; printf '%s\n' "${key_args[@]}" "$(basename "$src")"; } | sha256sum | cut -c1-32)
dir=$base/glslc/$tree
entry=$dir/$key

if [ -f "$entry.spv" ] && { [ -z "$dep" ] || [ -f "$entry.d" ]; }; then
    cp "$entry.spv" "$out" || exit 1
    if [ -n "$dep" ]; then
        # the dependency file names the output and the sources by their paths in this build
        t=$(<"$entry.d") || exit 1
        t=${t//@PYTURBO_OUT@/"$out"}
        printf '%s\n' "${t//@PYTURBO_SRC@/"$srcdir"}" > "$dep" || exit 1
    fi
    exit 0
fi

err=$(mktemp)
"$real" "$@" 2>"$err"
rc=$?
cat "$err" >&2
if [ "$rc" = 0 ] && [ ! -s "$err" ] && [ -f "$out" ] && mkdir -p "$dir" 2>/dev/null; then
    if [ ! -f "$dir/.made" ]; then
        touch "$dir/.made"
        # keep the newest 4 states of the sources
        ls -1dt "$base"/glslc/*/ 2>/dev/null | tail -n +5 | xargs -r rm -rf
    fi
    tmp=$entry.$$
    if [ -n "$dep" ]; then
        t=$(<"$dep") && t=${t//"$out"/@PYTURBO_OUT@} &&
            printf '%s\n' "${t//"$srcdir"/@PYTURBO_SRC@}" > "$tmp.d" && mv -f "$tmp.d" "$entry.d"
    fi
    cp "$out" "$tmp.spv" && mv -f "$tmp.spv" "$entry.spv"
fi
rm -f "$err"
exit "$rc"
