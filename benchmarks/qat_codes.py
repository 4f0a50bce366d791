"""How far QAT moves the weights on the grid: the quantity WinQ's two mechanisms act on.

Re-init (W <- a*W + (1-a)*Q(W)) pulls each latent weight back towards its grid point and
noise shakes it across decision boundaries; both only matter if training moves weights
between codes. This trains the bundled model at W2 (stretched elastic) with the
benchmark's protocol (80 steps of 4 x 64 tokens of the calibration split) and reports
the share of weights whose code changed, the median latent drift |W_end - W_0| next to
the median grid step (alpha / 2), the smoothed final loss and the eval ppl (4 x 256).

    OMP_NUM_THREADS=1 python -m benchmarks.qat_codes --lr 1e-3 --method ste
    OMP_NUM_THREADS=1 python -m benchmarks.qat_codes --lr 1e-3 --method winq --no-noise
    python -m benchmarks.qat_codes --steps 2 --out /tmp/qat_codes_smoke     # smoke

Writes benchmarks/results/qat_codes/<method>_lr<lr>[_nonoise]_s<seed>.json (``--out``: another folder).
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from benchmarks.common import RESULTS, bundled_model, save_results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.qat_codes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--method", choices=("ste", "winq"), default="ste")
    p.add_argument("--no-noise", action="store_true", help="winq: re-init only")
    p.add_argument("--a", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/qat_codes)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)

    import torch

    from lowbit.data import eval_tokens
    from lowbit.data.batches import training_windows
    from lowbit.errors import LowbitError
    from lowbit.eval import perplexity
    from lowbit.qat import STE, WinQCallback, WinQConfig, resolve, to_qat, to_quant_linear
    from lowbit.qat.convert import qat_layers
    from lowbit.train import TrainConfig, train
    from lowbit.train.metrics import smooth

    try:  # settings a run would fail on are refused before the model loads
        cfg = WinQConfig(a=args.a, noise=not args.no_noise, seed=args.seed) if args.method == "winq" else STE
        cfg.period(args.steps)
        tc = TrainConfig(steps=args.steps, batch_size=4, lr=args.lr, warmup=max(args.steps // 10, 1),
                         seed=args.seed, progress=False)
    except LowbitError as e:
        raise SystemExit(f"error: {e}") from None
    lm = bundled_model(threads=None)  # threads from OMP_NUM_THREADS
    rows = training_windows(lm.tokenizer, None, 64, "calib")
    model = copy.deepcopy(lm.model)
    to_qat(model, resolve("w2"))
    layers = qat_layers(model)
    codes0 = {n: q.to_qtensor().codes for n, q in layers.items()}
    w0 = {n: q.weight.detach().clone() for n, q in layers.items()}
    r = train(model, rows, tc, callbacks=[WinQCallback(cfg)])
    total = sum(c.numel() for c in codes0.values())
    changed = sum((codes0[n] != q.to_qtensor().codes).sum().item() for n, q in layers.items()) / total
    drift = torch.cat([(q.weight.detach() - w0[n]).abs().flatten()[::97] for n, q in layers.items()]).median()
    step = torch.cat([(q.alpha.detach().abs() / 2).flatten() for q in layers.values()]).median()
    to_quant_linear(model)
    ppl = perplexity(model, eval_tokens(lm.tokenizer, None), seqlen=256, windows=4, progress=False).ppl
    res = {"settings": vars(args), "changed_codes": changed, "median_drift": drift.item(),
           "median_grid_step": step.item(), "final_smoothed_loss": smooth(r.losses, 8)[-1], "ppl": ppl,
           "losses": r.losses}
    name = f"{args.method}_lr{args.lr:g}" + ("_nonoise" if args.no_noise and args.method == "winq" else "")
    folder = RESULTS / "qat_codes" if args.out is None else Path(args.out).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    save_results(folder / f"{name}_s{args.seed}.json", res)
    print(json.dumps({k: v for k, v in res.items() if k != "losses"}))


if __name__ == "__main__":
    main()
