"""Adapter training step time, each adapter alone on the machine: QWHA (auto / dense / sparse path) vs LoRA.

``benchmarks.peft`` records step times too, but its runs shared the two cores with
other jobs (LoRA and LoftQ, the same computation, differed by 10-20% there). This script
times only the training steps, one adapter per subprocess, one thread, the other core
idle: the bundled model with every Linear RTN-quantized (w3g128; the base scheme does not
change the adapter's work), rank 8 (QWHA at LoRA's parameter count), batch 4 x 128
tokens like benchmarks.peft, ``--steps`` optimizer steps (the first excluded), ``--repeats``
runs of each adapter in alternating order, medians reported.

The physical reference is the adapters' multiply-add count (``common.adapter_step_macs``): QWHA's dense path must form each
layer's weight gradient, a floor of ~1.34x LoRA's work no dense kernel can beat; the
sparse path's own work is LoRA's (3 x tokens x nnz per layer) plus the activations' WHT.

    python -m benchmarks.peft_speed --steps 6 --repeats 3
    python -m benchmarks.peft_speed --steps 2 --repeats 1 --seqlen 32 --variants lora,qwha \
        --out /tmp/peft_speed_smoke.json        # smoke

Writes benchmarks/results/peft_speed.json (one summary, replaced by each run).
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.common import (
    adapter_step_macs,
    alternating,
    bundled_model,
    calibration,
    emit,
    machine,
    median,
    out_path,
    rtn_base,
    run_child,
    save_results,
)

VARIANTS = {"lora": ("lora", None), "qwha": ("qwha", "auto"), "qwha-dense": ("qwha", "dense"),
            "qwha-sparse": ("qwha", "sparse")}


def child(variant: str, args: argparse.Namespace) -> dict:
    from lowbit.models import linear_layers
    from lowbit.models.activations import second_moments
    from lowbit.peft import PeftConfig, apply_adapters
    from lowbit.peft.finetune import lm_rows, train_adapters
    from lowbit.train import TrainConfig

    kind, path = VARIANTS[variant]
    lm = bundled_model(threads=1)
    model = lm.model
    names = list(linear_layers(model))
    fp_w = rtn_base(model, names, args.scheme)
    rows = lm_rows(calibration(lm.tokenizer, args.batch_size * (args.steps + 2), args.seqlen))
    xtx = second_moments(model, rows[:8, 0], names) if kind == "qwha" else None
    extra = {"path": path} if path else {}
    apply_adapters(model, PeftConfig(kind, rank=args.rank, **extra), fp_weights=fp_w, xtx=xtx, names=names)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=2e-4, warmup=0, progress=False)
    t0 = time.perf_counter()
    _, timer = train_adapters(model, rows, cfg)
    return {"variant": variant, "step_seconds": timer.median(), "steps": args.steps,
            "train_seconds": time.perf_counter() - t0, "times": timer.times}


def child_args(variant: str, args: argparse.Namespace) -> list[str]:
    return ["--child", variant, "--steps", str(args.steps), "--rank", str(args.rank), "--scheme", args.scheme,
            "--batch-size", str(args.batch_size), "--seqlen", str(args.seqlen)]


def summarize(runs: list[dict], args: argparse.Namespace, floor: dict) -> dict:
    med = {v: median(r["step_seconds"] for r in runs if r["variant"] == v)
           for v in dict.fromkeys(r["variant"] for r in runs)}
    base = med.get("lora")
    return {"scheme": args.scheme, "rank": args.rank, "tokens_per_step": args.batch_size * args.seqlen,
            "steps": args.steps, "repeats": args.repeats, "threads": 1, "cpu": machine()["cpu"],
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peft_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="lora,qwha,qwha-dense", help=f"comma-separated, from {sorted(VARIANTS)}")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--scheme", default="w3g128")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/peft_speed.json)")
    p.add_argument("--table", action="store_true", help="print the results file as a table and exit")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    out = out_path(args.out, "peft_speed.json")
    if args.table:
        from benchmarks.common import load_results

        print(table(load_results(out)))
        return
    if args.child:
        emit(child(args.child, args))
        return
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or "lora" not in variants:
        raise SystemExit(f"error: --variants must include lora and come from {sorted(VARIANTS)}; got {variants}")
    runs = []
    for rep, v in alternating(variants, args.repeats):
        try:
            r = run_child("peft_speed", child_args(v, args), threads=1)
        except RuntimeError as e:
            raise SystemExit(f"error: {v} run failed: {e}") from None
        print(f"repeat {rep} {v}: {r['step_seconds']:.3f} s/step", file=sys.stderr, flush=True)
        runs.append({**r, "repeat": rep})
    from lowbit.models import linear_layers

    fp = bundled_model(threads=1).model
    floor = adapter_step_macs(fp, list(linear_layers(fp)), args.rank, args.batch_size * args.seqlen, args.seqlen)
    row = summarize(runs, args, floor)
    save_results(out, row)
    print(table(row))


if __name__ == "__main__":
    main()
