#!/usr/bin/env bash
# Apply .clang-format to the C, CUDA C and C++ sources tracked by git in
# kernels/, ops/, shim/, tests/c/ and tests/cuda_emu/.
#   bash scripts/format.sh          rewrite the files in place
#   bash scripts/format.sh --check  change nothing; fail if any file would change
# clang-format is the pinned PyPI wheel that scripts/setup.sh installs, so that
# every machine formats alike; CLANG_FORMAT=/path/to/clang-format overrides it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ -z "${CLANG_FORMAT:-}" ]]; then
  CLANG_FORMAT=$("$PY" -c 'import clang_format; print(clang_format.get_executable("clang-format"))') || {
    echo "format.sh: clang-format is not installed for $PY (bash scripts/setup.sh installs it)" >&2
    exit 1
  }
fi

mapfile -t files < <(git ls-files -- \
  'kernels/*.c' 'kernels/*.h' 'kernels/*.cu' 'kernels/*.cuh' 'kernels/*.inc' 'kernels/*.cpp' \
  'ops/*.c' 'ops/*.h' 'ops/*.cu' 'ops/*.cuh' 'ops/*.inc' 'ops/*.cpp' \
  'shim/*.c' 'shim/*.h' 'shim/*.cu' 'shim/*.cuh' 'shim/*.inc' 'shim/*.cpp' \
  'tests/c/*.c' 'tests/c/*.h' 'tests/c/*.cu' 'tests/c/*.cuh' 'tests/c/*.inc' 'tests/c/*.cpp' \
  'tests/cuda_emu/*.c' 'tests/cuda_emu/*.h' 'tests/cuda_emu/*.cu' 'tests/cuda_emu/*.cuh' \
  'tests/cuda_emu/*.inc' 'tests/cuda_emu/*.cpp')

if [[ "${1:-}" == "--check" ]]; then
  "$CLANG_FORMAT" --dry-run -Werror "${files[@]}"
else
  "$CLANG_FORMAT" -i "${files[@]}"
fi
