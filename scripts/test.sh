#!/usr/bin/env bash
# Set everything up, check the style (ruff over the Python, clang-format over
# the C / CUDA C / C++ sources), then run every test: the ctest suite of the build pip
# just made (kernels, the CUDA kernels on the CPU emulator of the CUDA
# execution model, shim ABI check), the wheel of that build installed in a
# fresh venv and smoke-tested, the kernel suite again under
# AddressSanitizer + UndefinedBehaviorSanitizer, pytest against the
# installed package, and the op suites once more on the composite path.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh

# style first: it takes seconds and fails on any finding
"$PY" -m ruff check .
bash scripts/format.sh --check

# -j2: the CUDA emulator's runs (tests/cuda_emu) are single-threaded
ctest --test-dir build/pip --output-on-failure -j2

# the wheel of that build (nothing compiled again), tagged and checked by
# auditwheel, installed in a fresh venv with torch 2.13 and smoke-tested
# (scripts/wheel.sh without NANGUARD_WHEEL_DEV builds the release fatbin)
NANGUARD_WHEEL_DEV=1 bash scripts/wheel.sh >/dev/null
NANGUARD_WHEEL_DEV=1 bash scripts/wheel_smoke.sh

# the kernel suite under AddressSanitizer + UndefinedBehaviorSanitizer. Not
# beside pytest: there torch's OpenMP threads and the sanitizer jobs
# oversubscribed the two cores, and pytest took 845 s instead of 294.
bash scripts/sanitize.sh

# run from outside the source tree so the installed package is what is tested
cd tests/python && "$PY" -m pytest -q -p no:cacheprovider "$@" .

# the op suites and replay again on the composite path (every op in PyTorch
# operations, what a device without nanguard kernels runs); the tests of
# what only the C library has are marked requires_kernels and skip
NANGUARD_COMPOSITE=1 "$PY" -m pytest -q -p no:cacheprovider "$@" test_layernorm.py test_attention.py \
  test_grad_guard.py test_tensor_stats.py test_misuse.py test_replay.py
