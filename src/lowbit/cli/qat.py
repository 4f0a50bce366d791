"""`lowbit qat`: quantization-aware training (STE baseline or WinQ) of a model."""

from __future__ import annotations

import argparse

from lowbit.cli import common
from lowbit.cli.common import UNSET

WINQ_FLAGS = ("no_reinit", "reinit_a", "reinit_every", "no_noise", "sigma_w", "sigma_a", "relative_noise")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("qat", help="quantization-aware training (ste | winq)",
                       description="Train MODEL with quantized Linear layers on the calibration split of --data "
                                   "and save a lowbit checkpoint. Schemes: w1 (sign), w1.58 / ternary, w2 "
                                   "(stretched elastic), w3 / w4 (LSQ), or any PTQ scheme (w2g64, nvfp4...) "
                                   "as fake quantization.")
    common.add_model(p)
    p.add_argument("--scheme", default="w2", help="QAT scheme (default w2)")
    p.add_argument("--method", default="ste",
                   help="ste | winq (default ste: WinQ reached neither STE's loss sooner nor its perplexity in any "
                        "run measured; benchmarks/results/qat_winq.md)")
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
    p.add_argument("--parallel", default="ddp", help="under torchrun: ddp (replicas) | fsdp (sharded, GPUs)")
    p.add_argument("--seed", type=int, default=0)
    common.add_keep(p)
    p.add_argument("--kd", action="store_true", help="distil from the FP model (KL on logits) instead of CE")
    p.add_argument("--kd-temperature", type=float, default=UNSET, help="with --kd: softmax temperature (1)")
    g = p.add_argument_group("WinQ switches (--method winq only)")
    g.add_argument("--no-reinit", action="store_true", default=UNSET, help="turn periodic re-initialisation off")
    g.add_argument("--reinit-a", type=float, default=UNSET, help="W <- a*W + (1-a)*Q(W); default 0.2")
    g.add_argument("--reinit-every", type=int, default=UNSET, help="re-init period K (default steps/4)")
    g.add_argument("--no-noise", action="store_true", default=UNSET, help="turn noise injection off")
    g.add_argument("--sigma-w", type=float, default=UNSET, help="weight noise std (1e-3)")
    g.add_argument("--sigma-a", type=float, default=UNSET, help="scale noise std (1e-3)")
    g.add_argument("--relative-noise", action="store_true", default=UNSET,
                   help="sigmas are multiples of each row's scale")
    p.add_argument("--baseline", default=None,
                   help="a ste run's folder/metrics.jsonl (or a loss value): report steps to reach its final loss")
    p.add_argument("--smooth", type=common.positive("--smooth"), default=10, help="loss smoothing window (10)")
    p.add_argument("--checkpoint-every", type=common.nonnegative("--checkpoint-every"), default=0,
                   help="checkpoint period in steps (0 = none)")
    p.add_argument("--workdir", default=None, help="metrics/checkpoints folder (default OUT.train)")
    p.add_argument("--no-resume", action="store_true", help="ignore a checkpoint in the work folder")
    common.add_device(p, "training and evaluation")
    common.add_data(p)
    common.add_eval(p)
    common.add_out(p)
    common.add_json(p)
    p.set_defaults(func=run)


def build_job(args: argparse.Namespace):
    from lowbit.api.qat import QatJob, TrainConfig, WinQConfig, default_lr, work_folder
    from lowbit.errors import ConfigError

    winq = common.given(args, *WINQ_FLAGS)
    if winq and args.method != "winq":
        raise ConfigError(f"{', '.join(common.flag(k) for k in winq)} switch WinQ parts; --method {args.method} "
                          "has none (use --method winq)")
    kd_t = common.given(args, "kd_temperature")
    if kd_t and not args.kd:
        raise ConfigError("--kd-temperature applies to distillation; add --kd")
    lr = args.lr if args.lr is not None else default_lr(args.scheme, args.quantizer)
    warmup = args.warmup if args.warmup is not None else args.steps // 10
    train = TrainConfig(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=lr,
                        min_lr=args.min_lr, warmup=warmup, grad_clip=args.grad_clip, dtype=args.dtype,
                        seed=args.seed, checkpoint_every=args.checkpoint_every, parallel=args.parallel,
                        progress=not args.json, out_dir=str(work_folder(args.out, args.workdir)))
    cfg = WinQConfig(reinit=not winq.get("no_reinit", False), a=winq.get("reinit_a", 0.2),
                     every=winq.get("reinit_every"), noise=not winq.get("no_noise", False),
                     sigma_w=winq.get("sigma_w", 1e-3), sigma_a=winq.get("sigma_a", 1e-3),
                     relative=winq.get("relative_noise", False), seed=args.seed)
    return QatJob(out=args.out, scheme=args.scheme, train=train, method=args.method, winq=cfg,
                  quantizer=args.quantizer, model=args.model, data=args.data, seqlen=args.seqlen, kd=args.kd,
                  kd_temperature=kd_t.get("kd_temperature", 1.0), smooth_window=args.smooth,
                  evaluation=common.evaluation(args, args.data), baseline=args.baseline, workdir=args.workdir,
                  resume=not args.no_resume, device=args.device, force=args.force,
                  keep=common.keep(args))


def run(args: argparse.Namespace) -> dict:
    from lowbit import api

    return api.qat(build_job(args))
