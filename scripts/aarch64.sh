#!/usr/bin/env bash
# Cross-build the C kernels and their ctest suite (tests/c) for aarch64 and
# run it under qemu-user: the NEON path and the baseline one, each test
# looping over both (NG_FOR_EACH_ISA). A C-only build (no PyTorch, no CUDA,
# no CUDA emulator) in build/aarch64, or BUILD=... . Installs the Debian
# packages it needs when they are missing (as root, or through sudo).
# Arguments go to ctest (e.g. -R attention). qemu proves the code and the
# numerics, not speed: no timing taken under it means anything.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build/aarch64}
JOBS=${JOBS:-$(nproc)}

need=()
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu)
[[ -e /usr/aarch64-linux-gnu/include/stdio.h ]] || need+=(libc6-dev-arm64-cross)
command -v qemu-aarch64 >/dev/null || command -v qemu-aarch64-static >/dev/null || need+=(qemu-user)
command -v ninja >/dev/null || need+=(ninja-build)
if ((${#need[@]})); then
  sudo=()
  [[ $(id -u) -eq 0 ]] || sudo=(sudo)
  "${sudo[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends "${need[@]}"
fi

cmake -S . -B "$BUILD" -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
      -DNG_TORCH=OFF -DNG_CUDA=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j"$JOBS" >/dev/null
ctest --test-dir "$BUILD" --output-on-failure -j"$JOBS" "$@"
