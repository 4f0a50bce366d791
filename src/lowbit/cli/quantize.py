"""`lowbit quantize`: load, (evaluate FP), quantize, evaluate, save."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lowbit.cli import common


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="post-training quantization of a model",
                       description="Quantize MODEL with a scheme (or a mixed plan), report FP vs quantized "
                                   "perplexity, and save a lowbit checkpoint to --out.")
    common.add_model(p)
    p.add_argument("--scheme", default="w4g128", help="scheme name, e.g. w4g128, w2g64, nvfp4-46, mxfp4 "
                   "(see `Scheme.parse`); default w4g128")
    p.add_argument("--method", default="rtn", help="rtn | signround | signround2 (default rtn)")
    p.add_argument("--search", action=argparse.BooleanOptionalAction, default=True,
                   help="RTN: choose scales by the importance-weighted search on calibration activations "
                        "(default on; --no-search = plain round-to-nearest, no data needed)")
    p.add_argument("--plan", metavar="FILE", default=None, help="a plan JSON (layer -> scheme) instead of --scheme")
    p.add_argument("--lm-head", action="store_true", help="also quantize the lm_head (kept 16-bit by default)")
    p.add_argument("--iters", type=int, default=None, help="tuning iterations (signround methods)")
    p.add_argument("--nsamples", type=common.positive("--nsamples"), default=32, help="calibration samples (32)")
    p.add_argument("--seqlen", type=common.positive("--seqlen"), default=256, help="calibration tokens per sample (256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-eval", action="store_true", help="skip the perplexity evaluations")
    common.add_data(p)
    common.add_eval(p)
    common.add_out(p)
    common.add_json(p)
    add_tuning_flags(p)
    p.set_defaults(func=run)


def add_tuning_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the tuning methods (signround, signround2, mixed precision)."""
    p.add_argument("--avg-bits", type=float, default=None, help="mixed precision: average bits budget")
    p.add_argument("--options", default=None, help="mixed precision: comma-separated candidate schemes")
    p.add_argument("--batch-size", type=int, default=8, help="tuning mini-batch (8)")
    p.add_argument("--preset", default=None, help="signround preset: light | default | best")
    p.add_argument("--workdir", default=None, help="folder for per-block results (resume)")
    p.add_argument("--offload-dir", default=None, help="keep blocks on disk, one block's weights in memory")
    p.add_argument("--fp-inputs", action="store_true", help="tune each block on FP inputs instead of quantized")
    p.add_argument("--delta-mode", choices=("abs", "signed"), default=None, help="DeltaLoss score (abs)")
    p.add_argument("--tie-qkv", dest="tie_qkv_layers", action="store_true", default=None,
                   help="mixed precision: q/k/v of a block share one scheme")
    p.add_argument("--ignore-scale-bits", dest="count_scales", action="store_false", default=None,
                   help="mixed precision: budget counts element bits only")
    p.add_argument("--device", default=None, help="compute device (cpu, cuda, cuda:N): block tuning moves one "
                   "block at a time there; evaluation, RTN and DeltaLoss move the whole model there")
    p.add_argument("--tune-dtype", choices=("auto", "bf16", "fp32"), default=None,
                   help="precision of the tuned layers' products and of the DeltaLoss passes: auto "
                        "(default) = bf16 where the CPU/GPU has bf16 dot products (~2x faster "
                        "tuning) except for 2-bit blocks, else fp32")


def run(args: argparse.Namespace) -> dict:
    from lowbit import api

    t0 = time.perf_counter()
    r = api.quantize_pipeline(
        model=args.model, scheme=args.scheme, method=args.method, out=Path(args.out), data=args.data,
        search=args.search, plan_file=args.plan, lm_head=args.lm_head, nsamples=args.nsamples,
        seqlen=args.seqlen, seed=args.seed, evaluate=not args.no_eval, eval_seqlen=args.eval_seqlen,
        windows=args.windows, force=args.force, tuning=_tuning(args),
    )
    r["seconds"] = round(time.perf_counter() - t0, 2)
    return r


def _tuning(args: argparse.Namespace) -> dict:
    keys = ("iters", "avg_bits", "options", "batch_size", "preset", "workdir", "offload_dir", "delta_mode",
            "tie_qkv_layers", "count_scales", "device", "tune_dtype")
    d = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if args.fp_inputs:
        d["fp_inputs"] = True
    return d
