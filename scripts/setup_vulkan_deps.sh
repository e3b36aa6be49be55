#!/usr/bin/env bash
# System packages for the Vulkan backend on a machine without a GPU: the Vulkan headers, glslc and
# Mesa's software driver (lavapipe). Debian 12's Mesa 22 lavapipe corrupts its heap in
# flash-attention workloads, so Mesa 25 comes from bookworm-backports.
set -euo pipefail

have_mesa25() {
    dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null | grep -q '^2[5-9]\.'
}
if command -v glslc >/dev/null && [ -f /usr/include/vulkan/vulkan.hpp ] && have_mesa25; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "setup_vulkan_deps: need root and apt-get to install libvulkan-dev glslc spirv-headers and Mesa >= 25 lavapipe" >&2
    exit 1
fi

# A backports entry made from the machine's own Debian source (its mirror, its keyring).
src=/etc/apt/sources.list.d/debian.sources
bp=/etc/apt/sources.list.d/pyturbo-bookworm-backports.sources
if [ ! -f "$bp" ] && [ -f "$src" ]; then
    awk 'BEGIN{RS=""; ORS="\n\n"} /Suites:[^\n]*bookworm( |$|-updates)/ && !/security/ {
            sub(/Suites:[^\n]*/, "Suites: bookworm-backports"); print; exit }' "$src" > "$bp"
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libvulkan-dev glslc spirv-headers >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t bookworm-backports mesa-vulkan-drivers >/dev/null
have_mesa25 || { echo "setup_vulkan_deps: Mesa >= 25 lavapipe was not installed" >&2; exit 1; }
