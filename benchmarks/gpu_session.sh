#!/usr/bin/env bash
# One GPU session for issue 22 (lowbit on the GPU at the scale users run), ~9 minutes in all:
#   1. pytest tests/test_cuda.py                      (timeout 170 s)
#   2. which SDPA kernels take fp32 + grouped KV heads (the "eager" attention of the H200 profile)
#   3. python -m benchmarks.ptq_gpu run               (rows in priority order under a time budget)
#   4. python -m benchmarks.eval_memory --device cuda (if time remains: W4 checkpoint vs float eval)
#   5. a short table, printed last
# Everything goes to $OUT (JSON + session.log). Run from the repository root:
#   bash benchmarks/gpu_session.sh              # on the GPU machine
#   bash benchmarks/gpu_session.sh --cpu-check  # here: tiny shapes on the CPU, checks the script's logic
#
# lowbit runs from the repo (PYTHONPATH=src). The GPU machine has torch 2.11 (cu130),
# transformers 5.17, accelerate, safetensors, numpy, tqdm, matplotlib, pytest, hypothesis,
# peft; lowbit needs nothing else at import (gguf is imported only by the GGUF export).
# auto-round is carried as wheels in .whl/ (carry: [".whl"], 64 MiB at most), downloaded with
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       --platform manylinux2014_x86_64 --no-deps -d .whl \
#       auto-round==0.16.1 datasets==5.2.0 pyarrow==18.1.0 pandas==3.1.1 multiprocess==0.70.19 \
#       dill==0.4.1 xxhash==4.1.0 py-cpuinfo==9.0.0 pydantic==2.14.4 pydantic-core==2.50.5 \
#       annotated-types==0.8.0 typing-inspection==0.4.5
# (sizes: pyarrow 18.1.0 40.1 MB, pandas 12.0 MB, pydantic-core 2.3 MB, auto-round 1.5 MB,
# the rest < 1 MB each: ~58 MB in all. pyarrow 26 is 55 MB and does not fit beside pandas.
# `from auto_round import AutoRound` imports datasets -> pandas, pyarrow, multiprocess, dill,
# xxhash, and pydantic, cpuinfo; add requests/urllib3/idna/certifi/charset-normalizer if the
# machine lacks them.) If auto-round cannot be imported, its rows record the error and the
# lowbit rows still run.
set -u
CPU_CHECK=""
[[ "${1:-}" == "--cpu-check" ]] && CPU_CHECK="--cpu-check"
OUT="${OUT:-/tmp/gpu_session_out}"
TOTAL="${TOTAL:-540}"  # seconds for the whole session
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
START=$(date +%s)
left() { echo $((TOTAL - ($(date +%s) - START))); }
PY=python3
if [[ -n "$CPU_CHECK" && -z "${PYTHON:-}" ]]; then PY="${PYTHON:-python3}"; fi
PY="${PYTHON:-$PY}"

export PYTHONPATH=src
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
fi
$PY - <<'EOF' > "$OUT/env.json"
import json, platform, torch, transformers
info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available()}
if torch.cuda.is_available():
    info.update(gpu=torch.cuda.get_device_name(), gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30))
try:
    import auto_round
    info["auto_round"] = auto_round.__version__
except Exception as e:  # noqa: BLE001 - reported, the lowbit rows still run
    info["auto_round_error"] = repr(e)[:300]
print(json.dumps(info))
EOF
cat "$OUT/env.json"

echo "== 1. tests/test_cuda.py ($(left) s left)"
if [[ -n "$CPU_CHECK" ]]; then
  LOWBIT_TEST_DEVICE=cpu timeout 600 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "puts_the_model_back or sync" \
    --junitxml="$OUT/test_cuda.xml" 2>&1 | tail -15
else
  timeout 170 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py --junitxml="$OUT/test_cuda.xml" 2>&1 | tail -25
fi

echo "== 2. SDPA kernels for fp32 with grouped KV heads ($(left) s left)"
timeout 60 $PY - <<'EOF' > "$OUT/sdpa.json"
import json, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
dev = "cuda" if torch.cuda.is_available() else "cpu"
out = {}
for dtype in (torch.float32, torch.bfloat16):
    q = torch.randn(2, 32, 512, 64, device=dev, dtype=dtype)
    kv = torch.randn(2, 4, 512, 64, device=dev, dtype=dtype)
    for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        for gqa in (True, False):
            k = kv if gqa else kv.repeat_interleave(8, 1)
            try:
                with sdpa_kernel([b]):
                    F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=gqa)
                ok = "ok"
            except RuntimeError as e:
                ok = "no: " + str(e).splitlines()[0][:80]
            out[f"{str(dtype)[6:]} {b.name} {'gqa' if gqa else 'expanded'}"] = ok
print(json.dumps(out, indent=1))
EOF
cat "$OUT/sdpa.json"

echo "== 3. ptq_gpu rows ($(left) s left)"
RESERVE=$([[ -n "$CPU_CHECK" ]] && echo 0 || echo 95)  # for the eval-memory row
BUDGET=$(( $(left) - RESERVE - 15 ))
if [[ -n "$CPU_CHECK" ]]; then
  $PY -m benchmarks.ptq_gpu run --cpu-check --out "$OUT/ptq_gpu.json" --repeats 1 --budget "$BUDGET" \
    --rows 1.1b-w4g128-50-lowbit,1.1b-w2g64-50-lowbit,1.1b-w4g128-50-lowbit-cache-cpu,1.1b-w4g128-50-autoround
else
  $PY -m benchmarks.ptq_gpu run --out "$OUT/ptq_gpu.json" --repeats 2 --budget "$BUDGET" --timeout 200
fi

echo "== 4. eval memory: W4 checkpoint vs float model ($(left) s left)"
if (( $(left) > 70 )); then
  if [[ -n "$CPU_CHECK" ]]; then
    timeout 300 $PY -m benchmarks.eval_memory --layers 1 --device cpu --seqlen 64 --windows 1 --no-save \
      > "$OUT/eval_memory.jsonl"
  else
    timeout $(( $(left) - 10 )) $PY -m benchmarks.eval_memory --layers 22 --device cuda --seqlen 512 \
      --windows 4 --folder /tmp/evalmem --no-save > "$OUT/eval_memory.jsonl"
  fi
  cat "$OUT/eval_memory.jsonl"
else
  echo "skipped: $(left) s left"
fi

echo "== 5. summary ($(left) s left)"
[[ -f "$OUT/ptq_gpu.json" ]] && $PY -m benchmarks.ptq_gpu table "$OUT/ptq_gpu.json"
echo "session seconds: $(( $(date +%s) - START ))"
