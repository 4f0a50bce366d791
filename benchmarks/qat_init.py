"""Does QAT start lower from a SignRound-initialised model than from RTN? (issue 6)

All starts (plain RTN, importance-searched RTN, SignRoundV2) use the same scheme (default w2g64, fake-quantized through the lowbit
scheme, so the QAT model's first forward *is* the PTQ model) and the same training rows
(training split). For each start: the training loss before any step, the loss curve of
``--steps`` STE steps, and the eval perplexity before and after. The SignRound start is
rebuilt from a finished SignRound work folder (``--workdir`` of ``benchmarks.ptq``,
e.g. DIR/w2g64): every block is replayed from disk, nothing is re-tuned; its settings
must match (iters, tuning dtype, calibration), or the pipeline refuses. The calibration is
``benchmarks.ptq``'s (32 x 256 tokens, seed 0), the tuning settings those of its w2g64 row
(50 iters, fp32 products, batch 8).

    python -m benchmarks.qat_init --workdir /tmp/ptq/w2g64 --steps 8
    python -m benchmarks.qat_init --workdir /tmp/qat_init_smoke --iters 1 --calib-nsamples 4 \
        --calib-seqlen 64 --steps 2 --batch-size 1 --seqlen 32 --windows 1 --eval-seqlen 64 \
        --out /tmp/qat_init_smoke.json                      # smoke: tunes a fresh 1-iteration folder

Writes benchmarks/results/qat_init.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

from benchmarks.common import BATCH, NSAMPLES, SEQLEN, bundled_model, calibration, out_path, save_results

STARTS = ("rtn", "rtn-search", "signround2")


def start_model(base, kind: str, scheme: str, calib, workdir: str | None, iters: int, tune_dtype: str):
    """A deep copy of ``base`` quantized by one start (the SignRound start replays ``workdir``)."""
    from lowbit.models import linear_layers
    from lowbit.plans.plan import Plan
    from lowbit.ptq import quantize_model

    m = copy.deepcopy(base)
    plan = Plan.uniform(linear_layers(m), scheme)
    if kind == "rtn":
        quantize_model(m, plan, "rtn", {"search": False})
    elif kind == "rtn-search":
        quantize_model(m, plan, "rtn", {"search": True}, calib=calib)
    else:
        quantize_model(m, plan, "signround2", {"iters": iters, "batch_size": BATCH, "tune_dtype": tune_dtype},
                       calib=calib, workdir=workdir, progress=True)
    return m


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.qat_init", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheme", default="w2g64")
    p.add_argument("--workdir", required=True, help="finished SignRound work folder to replay")
    p.add_argument("--iters", type=int, default=50, help="the iters that work folder was tuned with")
    p.add_argument("--tune-dtype", default="fp32", choices=("fp32", "bf16", "auto"),
                   help="the tuning products that work folder was tuned with (benchmarks.ptq's w2g64: fp32)")
    p.add_argument("--calib-nsamples", type=int, default=NSAMPLES, help="calibration rows of that work folder")
    p.add_argument("--calib-seqlen", type=int, default=SEQLEN, help="calibration row length of that work folder")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--eval-seqlen", type=int, default=256)
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/qat_init.json)")
    return p


def train_config(args):
    from lowbit.train import TrainConfig

    return TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=1, seed=0, progress=True)


def check(args) -> None:
    """Refuse settings a run would fail on (scheme, training schedule) before the model loads."""
    from lowbit.errors import LowbitError
    from lowbit.formats import Scheme
    from lowbit.qat import resolve

    try:
        Scheme.parse(args.scheme)
        resolve(args.scheme)
        train_config(args)
    except LowbitError as e:
        raise SystemExit(f"error: {e}") from None


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    out_file = out_path(args.out, "qat_init.json")
    check(args)

    from lowbit.data import eval_tokens
    from lowbit.data.batches import training_windows
    from lowbit.eval import perplexity
    from lowbit.qat import STE, WinQCallback, resolve, to_qat, to_quant_linear
    from lowbit.train import train

    lm = bundled_model(threads=1)
    calib = calibration(lm.tokenizer, args.calib_nsamples, args.calib_seqlen)  # as benchmarks.ptq
    rows = training_windows(lm.tokenizer, None, args.seqlen, "calib")
    ev = eval_tokens(lm.tokenizer, None)
    ppl = lambda m: perplexity(m, ev, seqlen=args.eval_seqlen, windows=args.windows, progress=False).ppl  # noqa: E731
    out = {"settings": {**vars(args), "out": str(out_file)}, "ppl_fp": ppl(lm.model), "starts": []}
    for kind in STARTS:
        t0 = time.perf_counter()
        m = start_model(lm.model, kind, args.scheme, calib, args.workdir, args.iters, args.tune_dtype)
        ppl_ptq = ppl(m)
        to_qat(m, resolve(args.scheme))
        r = train(m, rows, train_config(args), callbacks=[WinQCallback(STE)])
        to_quant_linear(m)
        row = {"start": kind, "ppl_start": ppl_ptq, "initial_loss": r.losses[0], "losses": r.losses,
               "final_loss": r.final_loss, "ppl_after": ppl(m), "seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
        out["starts"].append(row)
    save_results(out_file, out)


if __name__ == "__main__":
    main()
