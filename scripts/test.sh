#!/usr/bin/env bash
# Set everything up, check the style (ruff over the Python, clang-format over
# the C / CUDA C / C++ sources), then run every test: the ctest suite of the build pip
# just made (kernels, the CUDA kernels on the CPU emulator of the CUDA
# execution model, shim ABI check), the wheel of that build installed in a
# fresh venv and smoke-tested, the kernel suite again under
# AddressSanitizer + UndefinedBehaviorSanitizer, pytest against the
# installed package, and the op suites once more on the composite path.
# The sanitizer build and its ctest run in the background beside pytest,
# which keeps one core busy and leaves the other mostly idle; their log is
# build/sanitize/test.log, printed when they are done.
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

# in the background, in its own process group (setsid), so that the exit
# trap stops all of it if pytest fails first
mkdir -p build/sanitize
san_log=build/sanitize/test.log
setsid bash scripts/sanitize.sh >"$san_log" 2>&1 &
san=$!
trap 'kill -- "-$san" 2>/dev/null || true' EXIT

# run from outside the source tree so the installed package is what is tested
(
  cd tests/python
  "$PY" -m pytest -q -p no:cacheprovider "$@" .
  # the op suites and replay again on the composite path (every op in PyTorch
  # operations, what a device without nanguard kernels runs); the tests of
  # what only the C library has are marked requires_kernels and skip
  NANGUARD_COMPOSITE=1 "$PY" -m pytest -q -p no:cacheprovider "$@" test_layernorm.py test_attention.py \
    test_grad_guard.py test_tensor_stats.py test_misuse.py test_replay.py
)

san_rc=0
wait "$san" || san_rc=$?
trap - EXIT
echo "---- AddressSanitizer + UndefinedBehaviorSanitizer build ($san_log)"
cat "$san_log"
if [[ $san_rc -ne 0 ]]; then
  echo "the sanitizer build or its ctest failed (exit $san_rc)" >&2
  exit "$san_rc"
fi
