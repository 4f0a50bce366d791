"""Does QAT start lower from a SignRound-initialised model than from RTN? (issue 6)

All starts (plain RTN, importance-searched RTN, SignRoundV2) use the same scheme (default w2g64, fake-quantized through the lowbit
scheme, so the QAT model's first forward *is* the PTQ model) and the same training rows
(training split). For each start: the training loss before any step, the loss curve of
``--steps`` STE steps, and the eval perplexity before and after. The SignRound start is
rebuilt from a finished SignRound work folder (``--workdir`` of `benchmarks/ptq.py`,
e.g. DIR/w2g64): every block is replayed from disk, nothing is re-tuned; its settings
must match (iters, calibration), or the pipeline refuses.

    OMP_NUM_THREADS=1 python benchmarks/qat_init.py --workdir /tmp/ptq/w2g64 --steps 8

Writes benchmarks/results/qat_init.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "qat_init.json"


def start_model(base, kind: str, scheme: str, calib, workdir: str | None, iters: int):
    from lowbit.formats.plan import Plan
    from lowbit.models import linear_layers
    from lowbit.ptq import quantize_model

    m = copy.deepcopy(base)
    plan = Plan.uniform(linear_layers(m), scheme)
    if kind == "rtn":
        quantize_model(m, plan, "rtn", search=False)
    elif kind == "rtn-search":
        quantize_model(m, plan, "rtn", search=True, calib=calib)
    else:
        quantize_model(m, plan, "signround2", calib=calib, iters=iters, batch_size=8, workdir=workdir, progress=True)
    return m


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheme", default="w2g64")
    p.add_argument("--workdir", required=True, help="finished SignRound work folder to replay")
    p.add_argument("--iters", type=int, default=50, help="the iters that work folder was tuned with")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--eval-seqlen", type=int, default=256)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()

    import torch

    from lowbit.data import calibration_batches, eval_tokens
    from lowbit.data.batches import training_windows
    from lowbit.eval import perplexity
    from lowbit.io import atomic_write_text
    from lowbit.models import load_model
    from lowbit.qat import STE, WinQCallback, resolve, to_qat, to_quant_linear
    from lowbit.train import TrainConfig, train

    torch.set_num_threads(1)
    torch.manual_seed(0)
    lm = load_model(None)
    calib = calibration_batches(lm.tokenizer, None, nsamples=32, seqlen=256, seed=0)  # as benchmarks/ptq.py
    rows = training_windows(lm.tokenizer, None, args.seqlen, "calib")
    ev = eval_tokens(lm.tokenizer, None)
    ppl = lambda m: perplexity(m, ev, seqlen=args.eval_seqlen, windows=args.windows, progress=False).ppl  # noqa: E731
    out = {"settings": vars(args), "ppl_fp": ppl(lm.model), "starts": []}
    for kind in ("rtn", "rtn-search", "signround2"):
        t0 = time.perf_counter()
        m = start_model(lm.model, kind, args.scheme, calib, args.workdir, args.iters)
        ppl_ptq = ppl(m)
        to_qat(m, resolve(args.scheme))
        cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=1, seed=0, progress=True)
        r = train(m, rows, cfg, callbacks=[WinQCallback(STE)])
        to_quant_linear(m)
        row = {"start": kind, "ppl_start": ppl_ptq, "initial_loss": r.losses[0], "losses": r.losses,
               "final_loss": r.final_loss, "ppl_after": ppl(m), "seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
        out["starts"].append(row)
    atomic_write_text(Path(args.out), json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
