#!/usr/bin/env bash
# The CUDA checks in one run, for a machine with an NVIDIA GPU (sm_75 or
# newer) and a CUDA build of PyTorch: build with CUDA, run the CUDA ctest
# binary (every launcher against the CPU kernel: the cases the CPU emulator
# runs in CI, all of them, on the device), the CUDA cases of pytest
# (the CUDA ops against the CPU ops, through PyTorch), then the attention
# benchmarks against PyTorch: training shapes against its flash backend,
# and decode steps (the split-KV decode kernel) with their KV-read bandwidth.
#
#   bash scripts/gpu_check.sh             # everything, about 10 minutes on 16 cores
#   bash scripts/gpu_check.sh --no-bench  # tests only
#
# Needs the test extras (pip install --no-build-isolation ".[test]").
# Results: stdout, bench/results/attention_cuda_flash.{json,md} and
# bench/results/attention_cuda_decode.{json,md}.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
build=${NANGUARD_GPU_BUILD:-build/gpu}

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no usable CUDA device')"
"$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'{p.name}, sm_{p.major}{p.minor}, torch {torch.__version__}')"

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$build" "${generator[@]}" -DNG_CUDA=ON -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j"$(nproc)"

status=0
"$build/test_cuda" || status=1
NANGUARD_LIB_DIR="$PWD/$build" PYTHONPATH="$PWD/python" \
    "$PY" -m pytest -q -p no:cacheprovider -k cuda tests/python || status=1

if [[ "${1:-}" != --no-bench && $status -eq 0 ]]; then
    NANGUARD_LIB_DIR="$PWD/$build" PYTHONPATH="$PWD/python" "$PY" bench/bench_attention.py --flash
    NANGUARD_LIB_DIR="$PWD/$build" PYTHONPATH="$PWD/python" "$PY" bench/bench_attention.py --device cuda --decode
fi
exit $status
