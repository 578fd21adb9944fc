#!/usr/bin/env bash
# Set everything up, then run nanguard's demo. nanguard_demo.csv and
# nanguard_demo.png land in the directory this was run from (unless --out
# says otherwise); the demo itself runs outside the source tree, so the
# installed package is what runs.
set -euo pipefail
OUT=$PWD
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh >/dev/null
cd /tmp && "$PY" -m nanguard demo --out "$OUT" "$@"
