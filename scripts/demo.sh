#!/usr/bin/env bash
# Set everything up, then run nanguard's demo.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh >/dev/null
cd /tmp && "$PY" -m nanguard demo "$@"
