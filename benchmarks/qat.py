"""WinQ vs the STE baseline on the bundled model: speed-up to the baseline's final loss, ppl.

For each scheme (w2 = 2-bit stretched elastic, ternary by default) and seed, train the
same QAT model twice on the training (calibration) split — ``ste`` (no re-init, no noise)
and ``winq`` (re-init every steps/4 with a = 0.2, noise) — then measure:

- speed-up = (steps ste needs to reach its own final smoothed loss) / (steps winq needs),
  on a trailing moving average of ``--smooth`` steps;
- eval perplexity of both (default eval split, first ``--windows`` windows).

Cost: one step of batch 4 x 128 tokens takes ~12.7 s on one thread of this CPU (about
8.6 s of it is the GEMM work of forward + backward, the rest fake quantization and
AdamW), so the full benchmark (``--steps 300 --seeds 0,1``, two schemes, ste and winq)
is ~2400 steps, i.e. several hours even on two free cores; a shared machine runs a
smoke version, e.g.

    OMP_NUM_THREADS=1 python -m benchmarks.qat --schemes w2 --steps 24 --seeds 0 --batch-size 2 --seqlen 64
    python -m benchmarks.qat --schemes w2 --seeds 0 --steps 4 --batch-size 1 --seqlen 32 --windows 1 \
        --eval-seqlen 64 --smooth 1 --out /tmp/qat_smoke.json              # smoke

Writes benchmarks/results/qat.json (only from real runs) and qat.png (loss curves);
``--merge`` combines finished files into a sweep table (results/qat_sweep.json + .png).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

from benchmarks.common import bundled_model, out_path, save_results


def winq_config(args, seed: int):
    from lowbit.qat import WinQConfig

    return WinQConfig(reinit=not args.no_reinit, a=args.a, every=args.every, noise=not args.no_noise,
                      sigma_w=args.sigma_w, sigma_a=args.sigma_a, relative=args.relative, seed=seed)


def train_config(args, seed: int):
    from lowbit.train import TrainConfig

    return TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=max(args.steps // 10, 1),
                       seed=seed, progress=True)


def check(args) -> None:
    """Refuse settings a run would fail on (schemes, re-init period, warm-up) before the model loads."""
    from lowbit.errors import LowbitError
    from lowbit.qat import resolve

    try:
        for scheme in args.schemes.split(","):
            resolve(scheme)
        winq_config(args, 0).period(args.steps)
        train_config(args, 0)
    except LowbitError as e:
        raise SystemExit(f"error: {e}") from None


def run_one(base, rows, ev, scheme: str, method: str, seed: int, args) -> dict:
    from lowbit.eval import perplexity
    from lowbit.qat import STE, WinQCallback, resolve, to_qat, to_quant_linear
    from lowbit.train import train

    model = copy.deepcopy(base)
    to_qat(model, resolve(scheme))
    cb = WinQCallback(winq_config(args, seed) if method == "winq" else STE)
    before = codes(model)
    cfg = train_config(args, seed)
    r = train(model, rows, cfg, callbacks=[cb])
    changed = changed_fraction(before, codes(model))
    to_quant_linear(model)
    ppl = perplexity(model, ev, seqlen=args.eval_seqlen, windows=args.windows, progress=False).ppl
    return {"scheme": scheme, "method": method, "seed": seed, "losses": r.losses, "final_loss": r.final_loss,
            "seconds": r.seconds, "ppl": ppl, "reinits": cb.reinits, "changed_codes": changed}


def codes(model) -> dict:
    """Integer code of every QAT weight: how far training moved the weights on the grid."""
    from lowbit.qat.convert import qat_layers

    return {n: layer.to_qtensor().codes for n, layer in qat_layers(model).items()}


def changed_fraction(before: dict, after: dict) -> float:
    """Share of weights whose code differs: re-init and noise can only matter if this is not ~0."""
    total = sum(c.numel() for c in before.values())
    return sum((before[n] != after[n]).sum().item() for n in before) / total


def reused_ste(args) -> list[dict]:
    """ste runs of an earlier results file, refused unless it was trained with the same settings."""
    if not args.reuse_ste:
        return []
    prev = json.loads(Path(args.reuse_ste).read_text())
    keys = ("steps", "batch_size", "seqlen", "lr", "eval_seqlen", "windows")
    diff = {k: (prev["settings"].get(k), getattr(args, k)) for k in keys if prev["settings"].get(k) != getattr(args, k)}
    if diff:
        raise SystemExit(f"--reuse-ste {args.reuse_ste} was run with other settings {diff}; rerun the baseline")
    return [r for r in prev["runs"] if r["method"] == "ste"]


def summarise(runs: list[dict], window: int) -> list[dict]:
    from lowbit.train import speedup

    out = []
    for ste in (r for r in runs if r["method"] == "ste"):
        winq = next(r for r in runs if r["method"] == "winq" and r["scheme"] == ste["scheme"]
                    and r["seed"] == ste["seed"])
        s = speedup(ste["losses"], winq["losses"], window)
        out.append({"scheme": ste["scheme"], "seed": ste["seed"], **s, "ppl_ste": ste["ppl"],
                    "ppl_winq": winq["ppl"], "ppl_winq_not_worse": winq["ppl"] <= ste["ppl"]})
    return out


def variant(settings: dict) -> str:
    """Short label of a run's WinQ switches, e.g. 're-init a=0.2 + noise abs 0.001/0.001'."""
    parts = []
    if not settings.get("no_reinit"):
        parts.append(f"re-init a={settings.get('a', 0.2)}" + (f" every {settings['every']}" if settings.get("every")
                                                               else ""))
    if not settings.get("no_noise"):
        kind = "rel" if settings.get("relative") else "abs"
        parts.append(f"noise {kind} {settings.get('sigma_w')}/{settings.get('sigma_a')}")
    return " + ".join(parts) or "neither"


def merge(files: list[str], out: Path, window: int) -> dict:
    """One sweep file from several runs sharing their ste baselines: a row per WinQ variant."""
    from lowbit.train.metrics import smooth
    from lowbit.train.plot import plot_losses

    rows, curves = [], {}
    for f in files:
        d = json.loads(Path(f).read_text())
        label = variant(d["settings"])
        for r in d["runs"]:
            name = f"{r['scheme']} s{r['seed']} " + ("ste" if r["method"] == "ste" else label)
            curves[name] = r["losses"]
        for srow in summarise(d["runs"], window):
            winq = next(r for r in d["runs"] if r["method"] == "winq" and (r["scheme"], r["seed"])
                        == (srow["scheme"], srow["seed"]))
            rows.append({"variant": label, "source": Path(f).name, **srow,
                         "winq_final_smoothed_loss": smooth(winq["losses"], window)[-1]})
    merged = {"window": window, "rows": rows, "curves": curves, "sources": files}
    save_results(out, merged)
    plot_losses(curves, out.with_suffix(".png"), window, title="WinQ sweep on SmolLM2-135M")
    for r in rows:
        print(f"| {r['scheme']} | {r['seed']} | {r['variant']} | {r['target_loss']:.2f} | "
              f"{r['winq_final_smoothed_loss']:.2f} | {r['speedup']} | {r['ppl_ste']:.0f} | {r['ppl_winq']:.0f} |")
    return merged


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.qat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schemes", default="w2,ternary")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--a", type=float, default=0.2, help="re-init mix: W <- a*W + (1-a)*Q(W)")
    p.add_argument("--every", type=int, default=None, help="re-init period (default steps // 4)")
    p.add_argument("--sigma-w", type=float, default=1e-3)
    p.add_argument("--sigma-a", type=float, default=1e-3)
    p.add_argument("--relative", action="store_true", help="noise sigmas relative to each row's scale")
    p.add_argument("--no-reinit", action="store_true", help="ablation: winq without re-initialisation")
    p.add_argument("--no-noise", action="store_true", help="ablation: winq without noise")
    p.add_argument("--reuse-ste", default=None, help="take the ste runs from this earlier results JSON "
                   "(same settings) instead of training them again")
    p.add_argument("--smooth", type=int, default=10)
    p.add_argument("--eval-seqlen", type=int, default=256)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--out", default=None,
                   help="results file (default benchmarks/results/qat.json, or qat_sweep.json with --merge; + .png)")
    p.add_argument("--merge", default=None, metavar="A.json,B.json",
                   help="only combine finished result files into --out as a sweep table (+ PNG); runs nothing")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.merge:
        merge(args.merge.split(","), out_path(args.out, "qat_sweep.json"), args.smooth)
        return
    out = out_path(args.out, "qat.json")
    check(args)

    from lowbit.data import eval_tokens
    from lowbit.data.batches import training_windows
    from lowbit.eval import perplexity
    from lowbit.train.plot import plot_losses

    lm = bundled_model(threads=None)  # threads from OMP_NUM_THREADS
    rows = training_windows(lm.tokenizer, None, args.seqlen, "calib")
    ev = eval_tokens(lm.tokenizer, None)
    t0 = time.perf_counter()
    ppl_fp = perplexity(lm.model, ev, seqlen=args.eval_seqlen, windows=args.windows, progress=False).ppl
    old = reused_ste(args)
    runs = []
    for scheme in args.schemes.split(","):
        for seed in map(int, args.seeds.split(",")):
            for method in ("ste", "winq"):
                prior = [r for r in old if (r["scheme"], r["method"], r["seed"]) == (scheme, "ste", seed)]
                if method == "ste" and prior:
                    runs.append(prior[0])
                    continue
                runs.append(run_one(lm.model, rows, ev, scheme, method, seed, args))
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "losses"}), flush=True)
    summary = summarise(runs, args.smooth)
    png = out.with_suffix(".png")
    plot_losses({f"{r['scheme']} {r['method']} s{r['seed']}": r["losses"] for r in runs}, png, args.smooth,
                title="QAT on SmolLM2-135M")
    result = {"settings": {**vars(args), "out": str(out)}, "ppl_fp": ppl_fp, "train_rows": len(rows),
              "summary": summary, "runs": runs, "seconds": round(time.perf_counter() - t0, 1), "plot": png.name}
    save_results(out, result)
    print(json.dumps({"summary": summary, "ppl_fp": ppl_fp}))


if __name__ == "__main__":
    main()
