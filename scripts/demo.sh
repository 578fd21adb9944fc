#!/usr/bin/env bash
# Set everything up, then run nanguard's demo. nanguard_demo.csv,
# nanguard_demo.png, nanguard_demo_history.png and the stock run's flight
# record (nanguard_demo_records/) land in the directory this was run from
# (unless --out says otherwise); the demo itself runs outside the source
# tree, so the installed package is what runs.
set -euo pipefail
OUT=$PWD
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh >/dev/null
cd /tmp && "$PY" -m nanguard demo --out "$OUT" "$@"
