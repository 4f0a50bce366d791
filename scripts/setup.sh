#!/usr/bin/env bash
# Create the project virtualenv and install lowbit with its dev and demo extras.
# torch is installed first, pinned to the CPU wheel this machine provides, when the
# venv has no torch yet: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "$VENV/bin/pip" install -q "torch==2.13.0"
fi
"$VENV/bin/pip" install -q -e ".[dev,demo]"
"$VENV/bin/python" -c "import lowbit, torch; print('lowbit', lowbit.__version__, 'torch', torch.__version__)"
