# The CUDA architectures of the nanguard wheel; sourced by scripts/wheel.sh
# and scripts/wheel_smoke.sh, so that the check lists what the build chose.
#
# NANGUARD_WHEEL_ARCHS (default "75 80 86 89 90 100 120") lists the SASS
# targets; where nvcc is found, those it cannot build (nvcc --list-gpu-code)
# are dropped with a message. PTX is added for the newest one kept, for GPUs
# newer than every SASS target. Sets NG_WHEEL_SASS (e.g. "75 80 90"),
# NG_WHEEL_PTX (e.g. "90") and NG_WHEEL_CMAKE_ARCHS, CMAKE_CUDA_ARCHITECTURES'
# form ("75-real;80-real;90-real;90-virtual").
NG_WHEEL_SASS=""
for a in ${NANGUARD_WHEEL_ARCHS:-75 80 86 89 90 100 120}; do
  if ! [[ "$a" =~ ^[0-9]+$ ]]; then
    echo "wheel: NANGUARD_WHEEL_ARCHS takes compute capabilities as numbers (75 80 ...), not '$a'" >&2
    exit 2
  fi
  if command -v nvcc >/dev/null 2>&1; then
    if ! nvcc --list-gpu-code | grep -qx "sm_$a" || ! nvcc --list-gpu-arch | grep -qx "compute_$a"; then
      echo "wheel: nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p') cannot build sm_$a; left out" >&2
      continue
    fi
  fi
  NG_WHEEL_SASS="$NG_WHEEL_SASS $a"
done
NG_WHEEL_SASS=$(printf '%s\n' $NG_WHEEL_SASS | sort -n | uniq | tr '\n' ' ' | sed 's/ $//')
if [[ -z "$NG_WHEEL_SASS" ]]; then
  echo "wheel: no CUDA architecture left to build (NANGUARD_WHEEL_ARCHS='${NANGUARD_WHEEL_ARCHS:-}')" >&2
  exit 2
fi
NG_WHEEL_PTX=${NG_WHEEL_SASS##* }
NG_WHEEL_CMAKE_ARCHS="$(printf '%s-real;' $NG_WHEEL_SASS)${NG_WHEEL_PTX}-virtual"
