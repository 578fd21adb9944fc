#!/usr/bin/env bash
# Smoke test of a nanguard wheel (default: the newest dist/*manylinux*.whl
# that scripts/wheel.sh made), as a user gets it: a fresh virtual environment
# without the system's site-packages, torch 2.13.0 and the wheel installed by
# pip, then tests/wheel/smoke.py run from outside the source tree (the
# package and libnanguard.so must come from the wheel; safe_sdpa forward and
# backward, stable_layernorm and fused_unscale_clip_ against references;
# `python -m nanguard info`). Last, the CUDA library's fatbin: cuobjdump
# must list SASS for every architecture and PTX for the newest
# (scripts/wheel_archs.sh, so NANGUARD_WHEEL_ARCHS as the build had it).
#
#   bash scripts/wheel_smoke.sh [WHEEL]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
whl=${1:-$(ls -t dist/nanguard-*manylinux*.whl 2>/dev/null | head -1)}
if [[ -z "$whl" || ! -f "$whl" ]]; then
  echo "wheel smoke: no wheel (build one with: bash scripts/wheel.sh)" >&2
  exit 1
fi
whl=$(cd "$(dirname "$whl")" && pwd)/$(basename "$whl")
if [[ "${NANGUARD_WHEEL_DEV:-0}" == 1 ]]; then # a wheel of the development build (scripts/wheel.sh)
  export NANGUARD_WHEEL_ARCHS="75 80 90"
fi
source scripts/wheel_archs.sh

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
"$PY" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q "torch==2.13.0"
"$tmp/venv/bin/python" -m pip install -q "$whl"
echo "wheel smoke: environment ready in $(($(date +%s) - start)) s"

# -I: neither the current folder, nor the script's, nor PYTHONPATH on sys.path
cd "$tmp"
out=$(env -u NANGUARD_LIB_DIR -u NANGUARD_COMPOSITE "$tmp/venv/bin/python" -I "$root/tests/wheel/smoke.py") || {
  echo "$out"
  exit 1
}
echo "$out"
cuda_lib=$(echo "$out" | sed -n 's/^cuda_library=//p')

# The fatbin: cuobjdump from the CUDA toolkit, else from PyPI's
# nvidia-cuda-cuobjdump in the throwaway environment.
cuobjdump=$(command -v cuobjdump || true)
if [[ -z "$cuobjdump" && -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/cuobjdump" ]]; then
  cuobjdump=$CUDA_HOME/bin/cuobjdump
fi
if [[ -z "$cuobjdump" ]] && "$tmp/venv/bin/python" -m pip install -q "nvidia-cuda-cuobjdump==13.2.51" 2>/dev/null; then
  cuobjdump=$(find "$tmp/venv" -type f -name cuobjdump -perm -u+x | head -1)
fi
if [[ -z "$cuobjdump" ]]; then
  echo "wheel smoke: SKIP the fatbin check: no cuobjdump (neither the CUDA toolkit's nor nvidia-cuda-cuobjdump)"
else
  elf=$("$cuobjdump" --list-elf "$cuda_lib")
  ptx=$("$cuobjdump" --list-ptx "$cuda_lib")
  bad=0
  for a in $NG_WHEEL_SASS; do
    grep -q "\.sm_$a\.cubin" <<<"$elf" || {
      echo "wheel smoke: FAIL: no sm_$a SASS in $cuda_lib" >&2
      bad=1
    }
  done
  grep -q "\.sm_$NG_WHEEL_PTX\.ptx" <<<"$ptx" || {
    echo "wheel smoke: FAIL: no compute_$NG_WHEEL_PTX PTX in $cuda_lib" >&2
    bad=1
  }
  # every translation unit carries every architecture: one count for all
  counts=$(grep -o 'sm_[0-9]*\.cubin' <<<"$elf" | sort | uniq -c | awk '{print $1}' | sort -u | wc -l)
  if [[ $counts != 1 ]]; then
    echo "wheel smoke: FAIL: the architectures' SASS counts differ (some files lack one):" >&2
    grep -o 'sm_[0-9]*\.cubin' <<<"$elf" | sort | uniq -c >&2
    bad=1
  fi
  have=$(grep -o 'sm_[0-9]*\.cubin' <<<"$elf" | sort -u -V | sed 's/\.cubin//' | tr '\n' ' ')
  have_ptx=$(grep -o 'sm_[0-9]*\.ptx' <<<"$ptx" | sort -u -V | sed 's/sm_\(.*\)\.ptx/compute_\1/' | tr '\n' ' ')
  [[ $bad == 0 ]] || exit 1
  echo "ok  fatbin of libnanguard_cuda.so: SASS ${have% }; PTX ${have_ptx% } (cuobjdump $("$cuobjdump" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p'))"
fi
echo "wheel smoke: passed in $(($(date +%s) - start)) s"
