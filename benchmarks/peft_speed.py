"""Adapter training step time, each adapter alone on the machine: QWHA (auto / dense / sparse path) vs LoRA.

``benchmarks/peft.py`` records step times too, but its runs shared the two cores with
other jobs (LoRA and LoftQ, the same computation, differed by 10-20% there). This script
times only the training steps, one adapter per subprocess, one thread, the other core
idle: the bundled model with every Linear RTN-quantized (w3g128; the base scheme does not
change the adapter's work), rank 8 (QWHA at LoRA's parameter count), batch 4 x 128
tokens like peft.py, ``--steps`` optimizer steps (the first excluded), ``--repeats``
runs of each adapter in alternating order, medians reported.

The physical reference is peft.py's multiply-add count: QWHA's dense path must form each
layer's weight gradient, a floor of ~1.34x LoRA's work no dense kernel can beat; the
sparse path's own work is LoRA's (3 x tokens x nnz per layer) plus the activations' WHT.

    python benchmarks/peft_speed.py --steps 6 --repeats 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# this folder holds scripts named like packages (benchmarks/peft.py); never import them as such
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
RESULTS = ROOT / "benchmarks" / "results" / "peft_speed.json"
VARIANTS = {"lora": ("lora", None), "qwha": ("qwha", "auto"), "qwha-dense": ("qwha", "dense"),
            "qwha-sparse": ("qwha", "sparse")}


def _peft_bench():
    spec = importlib.util.spec_from_file_location("peft_bench", ROOT / "benchmarks" / "peft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child(variant: str, args: argparse.Namespace) -> dict:
    import torch

    from lowbit.data import calibration_batches
    from lowbit.formats import Scheme
    from lowbit.formats.plan import Plan
    from lowbit.models import linear_layers, load_model
    from lowbit.nn import replace_linears
    from lowbit.peft import PeftConfig, apply_adapters, collect_xtx
    from lowbit.peft.finetune import lm_rows, train_adapters
    from lowbit.train import TrainConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    kind, path = VARIANTS[variant]
    lm = load_model(None)
    model = lm.model
    names = list(linear_layers(model))
    fp_w = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    replace_linears(model, Plan.uniform(names, Scheme.parse(args.scheme)))
    rows = lm_rows(calibration_batches(lm.tokenizer, None, nsamples=args.batch_size * (args.steps + 2),
                                       seqlen=args.seqlen, seed=0))
    xtx = collect_xtx(model, names, rows[:8, 0]) if kind == "qwha" else None
    extra = {"path": path} if path else {}
    apply_adapters(model, PeftConfig(kind, rank=args.rank, **extra), fp_weights=fp_w, xtx=xtx, names=names)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=2e-4, warmup=0, progress=False)
    t0 = time.perf_counter()
    _, timer = train_adapters(model, rows, cfg)
    return {"variant": variant, "step_seconds": timer.median(), "steps": args.steps,
            "train_seconds": time.perf_counter() - t0, "times": timer.times}


def run_child(variant: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", variant, "--steps", str(args.steps), "--rank", str(args.rank),
           "--scheme", args.scheme, "--batch-size", str(args.batch_size), "--seqlen", str(args.seqlen)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{variant} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict], args: argparse.Namespace, floor: dict) -> dict:
    med = {v: statistics.median(r["step_seconds"] for r in runs if r["variant"] == v)
           for v in dict.fromkeys(r["variant"] for r in runs)}
    base = med.get("lora")
    return {"scheme": args.scheme, "rank": args.rank, "tokens_per_step": args.batch_size * args.seqlen,
            "steps": args.steps, "repeats": args.repeats, "threads": 1,
            "median_step_seconds": {k: round(v, 3) for k, v in med.items()},
            "over_lora": {k: round(v / base, 3) for k, v in med.items()} if base else {},
            "qwha_dense_floor_over_lora": floor["qwha_over_lora_floor"], "runs": runs}


def table(row: dict) -> str:
    lines = [f"{row['tokens_per_step']} tokens/step, rank {row['rank']}, median of {row['repeats']} runs "
             f"(dense-path MAC floor {row['qwha_dense_floor_over_lora']}x LoRA)",
             "| adapter | step s | / LoRA |", "| --- | --- | --- |"]
    for k, v in row["median_step_seconds"].items():
        lines.append(f"| {k} | {v:.3f} | {row['over_lora'].get(k, float('nan')):.3f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="lora,qwha,qwha-dense")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--scheme", default="w3g128")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or "lora" not in variants:
        raise SystemExit(f"--variants must include lora and come from {sorted(VARIANTS)}; got {variants}")
    runs = []
    for rep in range(args.repeats):
        for v in variants if rep % 2 == 0 else variants[::-1]:
            r = run_child(v, args)
            print(f"repeat {rep} {v}: {r['step_seconds']:.3f} s/step", file=sys.stderr, flush=True)
            runs.append({**r, "repeat": rep})
    from lowbit.models import linear_layers, load_model

    fp = load_model(None).model
    floor = _peft_bench().gemm_floor(fp, list(linear_layers(fp)), args.rank, args.batch_size * args.seqlen,
                                     args.seqlen)
    row = summarize(runs, args, floor)
    from lowbit.io import atomic_write_text

    atomic_write_text(RESULTS, json.dumps(row, indent=1))
    print(table(row))


if __name__ == "__main__":
    main()
