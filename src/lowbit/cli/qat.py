"""`lowbit qat`: quantization-aware training (STE baseline or WinQ) of a model."""

from __future__ import annotations

import argparse
from pathlib import Path

from lowbit.cli import common


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("qat", help="quantization-aware training (ste | winq)",
                       description="Train MODEL with quantized Linear layers on the calibration split of --data "
                                   "and save a lowbit checkpoint. Schemes: w1 (sign), w1.58 / ternary, w2 "
                                   "(stretched elastic), w3 / w4 (LSQ), or any PTQ scheme (w2g64, nvfp4...) "
                                   "as fake quantization.")
    common.add_model(p)
    p.add_argument("--scheme", default="w2", help="QAT scheme (default w2)")
    p.add_argument("--method", default="winq", help="ste | winq (default winq)")
    p.add_argument("--quantizer", default="auto", help="auto | sign | ternary | seq | lsq | fake (default auto)")
    p.add_argument("--steps", type=common.positive("--steps"), default=100, help="optimizer steps (100)")
    p.add_argument("--batch-size", type=common.positive("--batch-size"), default=8, help="sequences per step (8)")
    p.add_argument("--grad-accum", type=common.positive("--grad-accum"), default=1)
    p.add_argument("--seqlen", type=common.positive("--seqlen"), default=256, help="tokens per training row (256)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default 2e-5 for <=2-bit, 1e-5 above: the GPU-scale reference)")
    p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 10%% of --steps)")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dtype", default="fp32", help="fp32 | bf16 autocast")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kd", action="store_true", help="distil from the FP model (KL on logits) instead of CE")
    p.add_argument("--kd-temperature", type=float, default=1.0)
    g = p.add_argument_group("WinQ switches (ignored with --method ste)")
    g.add_argument("--no-reinit", action="store_true", help="turn periodic re-initialisation off")
    g.add_argument("--reinit-a", type=float, default=0.2, help="W <- a*W + (1-a)*Q(W); default 0.2")
    g.add_argument("--reinit-every", type=int, default=None, help="re-init period K (default steps/4)")
    g.add_argument("--no-noise", action="store_true", help="turn noise injection off")
    g.add_argument("--sigma-w", type=float, default=1e-3, help="weight noise std (1e-3)")
    g.add_argument("--sigma-a", type=float, default=1e-3, help="scale noise std (1e-3)")
    g.add_argument("--relative-noise", action="store_true", help="sigmas are multiples of each row's scale")
    p.add_argument("--baseline", default=None,
                   help="a ste run's folder/metrics.jsonl (or a loss value): report steps to reach its final loss")
    p.add_argument("--smooth", type=common.positive("--smooth"), default=10, help="loss smoothing window (10)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint period in steps (0 = none)")
    p.add_argument("--workdir", default=None, help="metrics/checkpoints folder (default OUT.train)")
    p.add_argument("--no-resume", action="store_true", help="ignore a checkpoint in the work folder")
    p.add_argument("--no-eval", action="store_true", help="skip the perplexity evaluations")
    common.add_data(p)
    common.add_eval(p)
    common.add_out(p)
    common.add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from lowbit.qat.pipeline import QatJob, qat_pipeline
    from lowbit.qat.quantizers import resolve
    from lowbit.qat.winq import WinQConfig
    from lowbit.train import TrainConfig

    q = resolve(args.scheme, args.quantizer)
    lr = args.lr if args.lr is not None else (2e-5 if q.bits <= 2 else 1e-5)
    warmup = args.warmup if args.warmup is not None else args.steps // 10
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=lr,
                      min_lr=args.min_lr, warmup=warmup, grad_clip=args.grad_clip, dtype=args.dtype,
                      seed=args.seed, checkpoint_every=args.checkpoint_every,
                      out_dir=args.workdir or str(Path(args.out).with_name(Path(args.out).name + ".train")))
    winq = WinQConfig(reinit=not args.no_reinit, a=args.reinit_a, every=args.reinit_every, noise=not args.no_noise,
                      sigma_w=args.sigma_w, sigma_a=args.sigma_a, relative=args.relative_noise, seed=args.seed)
    job = QatJob(scheme=args.scheme, method=args.method, train=cfg, winq=winq, quantizer=args.quantizer,
                 seqlen=args.seqlen, kd=args.kd, kd_temperature=args.kd_temperature, smooth_window=args.smooth)
    return qat_pipeline(job, Path(args.out), model=args.model, data=args.data, evaluate=not args.no_eval,
                        eval_seqlen=args.eval_seqlen, windows=args.windows, baseline=args.baseline,
                        resume=not args.no_resume, force=args.force)
