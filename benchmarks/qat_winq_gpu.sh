#!/usr/bin/env bash
# Issue 25 on one GPU: the bundled model's shape (SmolLM2-135M: 30 layers x 576, 9 heads / 3 KV heads,
# MLP 1536, tied embeddings; an 8192-token BPE instead of 49152) pre-trained from scratch for a few
# minutes on the Python sources of that machine (its stdlib + installed packages, capped at CORPUS_MB),
# then benchmarks/qat_winq.py's protocol at W2 and ternary, STE vs WinQ, seed 0, bf16 autocast.
# Nothing is carried and nothing is downloaded: the corpus is built there.
#
#   OUT=/path/to/results BUDGET_S=540 bash benchmarks/qat_winq_gpu.sh
#
# BUDGET_S bounds the whole command (default 540 s): the organism build (corpus, tokenizer, tokens,
# pre-training) gets ORGANISM_PCT% of it, QAT the rest less a 40 s reserve; both time a few steps and
# scale their step counts to fit. Writes $OUT/organism_gpu.json (+ .png: the pre-training curve),
# $OUT/qat_winq_gpu.json (+ loss PNGs), summary.md, env.txt and the logs; no checkpoint or model file
# comes back (a 135M-shape model with its optimizer state is over a GB).
set -euo pipefail
OUT=${OUT:?set OUT to the results folder}
BUDGET_S=${BUDGET_S:-540}
ORGANISM_PCT=${ORGANISM_PCT:-50}
CORPUS_MB=${CORPUS_MB:-60}
PY=${PYTHON:-python}
WORK=${WORK:-/tmp/lowbit-qat-winq-gpu}
export PYTHONPATH=src TOKENIZERS_PARALLELISM=true
start=$(date +%s)
mkdir -p "$OUT" "$WORK"
{ nvidia-smi --query-gpu=name,memory.total --format=csv || true; $PY -c "import torch, transformers, sys; print(sys.version, torch.__version__, transformers.__version__)"; } > "$OUT/env.txt" 2>&1

# 1. corpus, tokenizer, tokens and pre-training, within ORGANISM_PCT% of the budget
$PY -m benchmarks.organism --out "$WORK/organism" --sources stdlib,site --max-mb "$CORPUS_MB" --vocab 8192 \
    --hidden 576 --intermediate 1536 --layers 30 --heads 9 --kv-heads 3 --max-positions 2048 \
    --seqlen 512 --batch-size 32 --steps 4000 --warmup 100 --lr 1e-3 --min-lr 1e-4 --weight-decay 0.1 \
    --eval-every 100 --eval-windows 32 --device cuda --dtype bf16 --threads 8 --checkpoint-every 0 \
    --budget-s "$(( BUDGET_S * ORGANISM_PCT / 100 ))" --results "$OUT/organism_gpu.json" \
    > "$OUT/organism.log" 2>&1 || { echo "organism failed"; tail -30 "$OUT/organism.log"; exit 1; }

# 2. QAT, the rest of the budget
left=$(( BUDGET_S - ($(date +%s) - start) - 40 ))
$PY -m benchmarks.qat_winq --organism "$WORK/organism" --plan main --schemes w2,ternary --seeds 0 \
    --variants ste,winq --steps 2000 --batch-size 16 --seqlen 512 --lr 5e-4 --eval-seqlen 512 \
    --eval-windows 64 --eval-loss-windows 16 --diag-iters 8 --diag-batch 4 --checkpoint-every 0 \
    --device cuda --dtype bf16 --threads 8 --budget-s "$left" --workdir "$WORK/qat" \
    --results "$OUT/qat_winq_gpu.json" > "$OUT/qat_winq.log" 2>&1 || { tail -30 "$OUT/qat_winq.log"; exit 1; }
$PY -m benchmarks.qat_winq --report --results "$OUT/qat_winq_gpu.json" | tee "$OUT/summary.md"
echo "seconds: $(( $(date +%s) - start ))"
