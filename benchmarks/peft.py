"""QWHA vs LoRA, LoftQ and FourierFT on the bundled model quantized with RTN.

For each base (w2g64, w3g128 by default) and each adapter at the same parameter budget
(rank r in LoRA terms: r*(in+out) per layer), measure eval perplexity right after
initialisation and after N training steps on the training split, plus the median step
time. Everything is configurable so a shared CPU can run a short but real version:

    OMP_NUM_THREADS=2 python -m benchmarks.peft --steps 20 --eval-every 10 --windows 8
    python -m benchmarks.peft --bases w3g128 --adapters lora,qwha --blocks 1 --steps 2 --eval-every 1 \
        --windows 1 --nsamples 8 --calib 2 --seqlen 64 --dry      # smoke (writes nothing)

Writes benchmarks/results/peft.json (only from real runs) and peft.png (ppl vs steps).
Training rows come from the calibration/training split; perplexity from the eval split.
QWHA, LoRA, LoftQ and FourierFT are all lowbit's own adapters (no peer library runs here).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import adapter_step_macs, bundled_model, calibration, machine, out_path, rtn_base
from lowbit.data import eval_tokens
from lowbit.eval import perplexity
from lowbit.io import atomic_write_bytes, atomic_write_text
from lowbit.models import linear_layers
from lowbit.models.activations import second_moments
from lowbit.peft import KINDS, PeftConfig, adapters_of, apply_adapters, count_trainable
from lowbit.peft.finetune import lm_rows, train_adapters
from lowbit.peft.qwha import QWHAAdapter
from lowbit.train import TrainConfig

LR = {"qwha": 2e-4, "lora": 2e-4, "loftq": 2e-4, "fourierft": 2e-3}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bases", default="w2g64,w3g128", help="RTN schemes of the quantized bases")
    p.add_argument("--adapters", default=",".join(KINDS))
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--nsamples", type=int, default=64, help="training rows (training split)")
    p.add_argument("--calib", type=int, default=16, help="rows of the training split used for QWHA's XtX")
    p.add_argument("--windows", type=int, default=8, help="eval windows of --eval-seqlen tokens")
    p.add_argument("--eval-seqlen", type=int, default=512)
    p.add_argument("--blocks", type=int, default=0, help="adapters on the first K decoder blocks only (0 = all)")
    p.add_argument("--lr-scale", type=float, default=1.0, help="multiply every adapter's learning rate")
    p.add_argument("--qwha-scale", type=float, default=PeftConfig.scale,
                   help="QWHA value scale (a learning-rate multiplier of its coefficients; Delta_W unchanged)")
    p.add_argument("--paths", action="store_true", help="also time QWHA's dense vs sparse forward paths")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/peft.json; + .png)")
    p.add_argument("--dry", action="store_true", help="do not write results (smoke run)")
    p.add_argument("--combine", default=None, metavar="A.json,B.json",
                   help="only merge finished per-base result files into --out (+ PNG); runs nothing")
    return p


def targets(model, blocks: int) -> list[str]:
    names = list(linear_layers(model))
    if blocks:
        names = [n for n in names if int(n.split(".layers.")[1].split(".")[0]) < blocks]
    return names


def run_adapter(q, kind: str, args, fp_w, xtx, rows, ev) -> dict:
    m = copy.deepcopy(q)
    t0 = time.perf_counter()
    extra = {"scale": args.qwha_scale} if kind == "qwha" else {}
    apply_adapters(m, PeftConfig(kind, rank=args.rank, **extra), fp_weights=fp_w, xtx=xtx, names=list(fp_w))
    init_s = time.perf_counter() - t0
    ppl = lambda model: perplexity(model, ev, seqlen=args.eval_seqlen, windows=args.windows).ppl  # noqa: E731
    curve = [{"step": 0, "ppl": ppl(m)}]
    print(f"  {kind:9s} init ppl {curve[0]['ppl']:.3f} ({init_s:.1f}s init)", file=sys.stderr, flush=True)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=LR[kind] * args.lr_scale,
                      warmup=max(0, int(0.06 * args.steps)), eval_every=args.eval_every, progress=False)
    result, timer = train_adapters(m, rows, cfg, eval_fn=lambda model: {"ppl": ppl(model)})
    curve += [{"step": e["step"], "ppl": e["ppl"]} for e in result.evals]
    print(f"  {kind:9s} final ppl {curve[-1]['ppl']:.3f}, step {timer.median():.3f}s", file=sys.stderr, flush=True)
    return {"adapter": kind, "trainable_params": count_trainable(m), "init_seconds": round(init_s, 2),
            "ppl_init": curve[0]["ppl"], "ppl_final": curve[-1]["ppl"], "curve": curve,
            "step_seconds_median": round(timer.median(), 4), "losses": [round(x, 4) for x in result.losses]}


def time_paths(q, fp_w, xtx, args, tokens: int = 1024) -> dict:
    """Forward+backward time of every QWHA layer under each path, for one token count."""
    m = copy.deepcopy(q)
    apply_adapters(m, PeftConfig("qwha", rank=args.rank), fp_weights=fp_w, xtx=xtx, names=list(fp_w))
    out = {}
    for path in ("dense", "sparse"):
        total = 0.0
        for a in adapters_of(m).values():
            assert isinstance(a, QWHAAdapter)
            a.path = path
            x = torch.randn(tokens, a.in_features)
            t0 = time.perf_counter()
            a(x).square().sum().backward()
            total += time.perf_counter() - t0
        out[path] = round(total, 4)
    return {"tokens": tokens, "seconds_all_layers": out}


def save(results: dict, args, complete: bool) -> None:
    """Rewrite the results file after every adapter, so a cut-short run keeps what it measured."""
    if args.dry:
        return
    out = out_path(args.out, "peft.json")
    atomic_write_text(out, json.dumps({**results, "complete": complete}, indent=1))
    if complete:
        plot(results, out.with_suffix(".png"))


def run_base(fp, tok, scheme: str, args, ev, rows, results: dict) -> dict:
    names = targets(fp, args.blocks)
    q = copy.deepcopy(fp)
    fp_w = rtn_base(q, names, scheme)
    t0 = time.perf_counter()
    xtx = second_moments(q, rows[: args.calib, 0], names)
    xtx_s = time.perf_counter() - t0
    base = {"scheme": scheme, "method": "rtn", "targets": len(names), "xtx_seconds": round(xtx_s, 2),
            "ppl_base": perplexity(q, ev, seqlen=args.eval_seqlen, windows=args.windows).ppl, "adapters": []}
    print(f"{scheme}: un-repaired ppl {base['ppl_base']:.3f}", file=sys.stderr, flush=True)
    results["bases"].append(base)
    for kind in args.adapters.split(","):
        base["adapters"].append(run_adapter(q, kind, args, fp_w, xtx, rows, ev))
        save(results, args, complete=False)
    if args.paths:
        base["qwha_paths"] = time_paths(q, fp_w, xtx, args)
    return base


def plot(results: dict, path: Path) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bases = results["bases"]
    fig, axes = plt.subplots(1, len(bases), figsize=(6 * len(bases), 4), squeeze=False)
    for ax, b in zip(axes[0], bases, strict=True):
        for a in b["adapters"]:
            ax.plot([c["step"] for c in a["curve"]], [c["ppl"] for c in a["curve"]], marker="o", label=a["adapter"])
        ax.axhline(b["ppl_base"], color="gray", ls="--", label="un-repaired base")
        ax.axhline(results["ppl_fp"], color="black", ls=":", label="full precision")
        ax.set(title=f"SmolLM2-135M {b['scheme']} RTN, r={results['rank']}", xlabel="training step",
               ylabel="eval perplexity", yscale="log")
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())


def combine(files: list[str], out: Path) -> None:
    """One results file from runs of single bases (e.g. run in parallel on a shared machine)."""
    parts = [json.loads(Path(f).read_text()) for f in files]
    merged = {**parts[0], "bases": [b for p in parts for b in p["bases"]],
              "complete": all(p.get("complete") for p in parts), "combined_from": files}
    atomic_write_text(out, json.dumps(merged, indent=1))
    plot(merged, out.with_suffix(".png"))


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.combine:
        combine(args.combine.split(","), out_path(args.out, "peft.json"))
        return
    lm = bundled_model(threads=None)  # threads from OMP_NUM_THREADS, as the runs so far
    fp, tok = lm.model, lm.tokenizer
    ev = eval_tokens(tok)
    rows = lm_rows(calibration(tok, args.nsamples, args.seqlen))
    results = {"model": lm.source, "rank": args.rank, "settings": vars(args),
               "machine": {"python": platform.python_version(), **machine()},
               "ppl_fp": perplexity(fp, ev, seqlen=args.eval_seqlen, windows=args.windows).ppl, "bases": []}
    print(f"fp ppl {results['ppl_fp']:.3f}", file=sys.stderr, flush=True)
    results["gemm_floor"] = adapter_step_macs(fp, targets(fp, args.blocks), args.rank,
                                              args.batch_size * args.seqlen, args.seqlen)
    for scheme in args.bases.split(","):
        run_base(fp, tok, scheme, args, ev, rows, results)
    print(json.dumps(results, indent=1))
    save(results, args, complete=True)


if __name__ == "__main__":
    main()
