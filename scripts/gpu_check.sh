#!/usr/bin/env bash
# The CUDA checks in one run, for a machine with an NVIDIA GPU (sm_75 or
# newer) and a CUDA build of PyTorch: build with CUDA, run the CUDA ctest
# binary (every launcher against the CPU kernel: the cases the CPU emulator
# runs in CI, all of them, on the device), the CUDA cases of pytest
# (the CUDA ops against the CPU ops, through PyTorch), the attention suite
# twice: with nanguard's own kernels only (NANGUARD_SDPA_BACKEND=nanguard)
# and with every call the conditions allow delegated to PyTorch's fused
# kernels (fused-if-allowed; docs/attention.md, "Delegation"), then the
# attention benchmarks against PyTorch: training shapes against its flash
# backend with delegation off and on (safe_sdpa's default, auto), and
# decode steps with their KV-read bandwidth, through the SIMT decode kernel
# (NANGUARD_CUDA_DECODE=simt) and through the tensor-core one (bf16).
#
#   bash scripts/gpu_check.sh             # everything, about 10 minutes on 16 cores
#   bash scripts/gpu_check.sh --no-bench  # tests only
#
# Needs the test extras (pip install --no-build-isolation ".[test]").
# Results: stdout, and rows of bench/results/attention_cuda.jsonl in the
# series flash_nanguard (delegation off), flash (auto: the fused kernel where
# allowed), decode_simt and decode.
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

export NANGUARD_LIB_DIR="$PWD/$build" PYTHONPATH="$PWD/python"
status=0
"$build/test_cuda" || status=1
NANGUARD_SDPA_BACKEND=nanguard "$PY" -m pytest -q -p no:cacheprovider -k cuda tests/python || status=1
# the attention suite, delegation off then on (the CPU cases run both ways too)
attention=(tests/python/test_attention.py tests/python/test_attention_delegate.py)
for mode in nanguard fused-if-allowed; do
    echo "== attention suite, NANGUARD_SDPA_BACKEND=$mode"
    NANGUARD_SDPA_BACKEND=$mode "$PY" -m pytest -q -p no:cacheprovider "${attention[@]}" || status=1
done

if [[ "${1:-}" != --no-bench && $status -eq 0 ]]; then
    NANGUARD_SDPA_BACKEND=nanguard "$PY" bench/bench_attention.py --flash --series flash_nanguard
    NANGUARD_SDPA_BACKEND=auto "$PY" bench/bench_attention.py --flash
    # decode: the SIMT kernel first (NANGUARD_CUDA_DECODE=simt), series
    # decode_simt, then the tensor-core one where it applies
    NANGUARD_CUDA_DECODE=simt NANGUARD_SDPA_BACKEND=nanguard "$PY" bench/bench_attention.py --device cuda --decode \
        --series decode_simt
    NANGUARD_SDPA_BACKEND=nanguard "$PY" bench/bench_attention.py --device cuda --decode
fi
exit $status
