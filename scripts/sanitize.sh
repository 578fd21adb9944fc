#!/usr/bin/env bash
# The kernel suite under AddressSanitizer + UndefinedBehaviorSanitizer: the C
# kernels, and the CUDA kernels on the emulator, built in build/sanitize
# (no PyTorch, no nvcc) and run by ctest. scripts/test.sh runs it after
# the normal build's ctest; extra arguments go to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build/sanitize -G Ninja -DNG_SANITIZE=ON -DNG_TORCH=OFF -DNG_CUDA=OFF \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/sanitize -j2 >/dev/null
# the sm_75 / sm_86 sets run in the normal build only (with its race
# detector): under the sanitizers they took a quarter of this run, for kernel
# code the sample below also runs (a plain `ctest` here runs them too)
ctest --test-dir build/sanitize --output-on-failure -j2 -E '^cuda_emu_sm(75|86)$' "$@"
