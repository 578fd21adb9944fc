#!/usr/bin/env bash
# Set everything up, check the style (ruff over the Python, clang-format over
# the C / CUDA C / C++ sources), then run every test: the ctest suite of the build pip
# just made (kernels, the CUDA kernels on the CPU emulator of the CUDA
# execution model, shim ABI check), the kernel suite again under
# AddressSanitizer + UndefinedBehaviorSanitizer, and pytest against the
# installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh

# style first: it takes seconds and fails on any finding
"$PY" -m ruff check .
bash scripts/format.sh --check

# -j2: the CUDA emulator's runs (tests/cuda_emu) are single-threaded
ctest --test-dir build/pip --output-on-failure -j2

cmake -S . -B build/sanitize -G Ninja -DNG_SANITIZE=ON -DNG_TORCH=OFF -DNG_CUDA=OFF \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/sanitize -j2 >/dev/null
ctest --test-dir build/sanitize --output-on-failure -j2

# run from outside the source tree so the installed package is what is tested
cd tests/python && "$PY" -m pytest -q -p no:cacheprovider "$@" .
