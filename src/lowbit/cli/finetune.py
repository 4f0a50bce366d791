"""`lowbit finetune`: adapters (QWHA, LoRA, LoftQ, FourierFT) on a quantized checkpoint."""

from __future__ import annotations

import argparse

from lowbit.cli import common
from lowbit.cli.common import UNSET

ADAPTER_FLAGS = ("k_min", "scale", "refine")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("finetune", help="train small adapters on a quantized model",
                       description="Add adapters with a rank-r LoRA's parameter budget to every quantized layer "
                                   "of QUANTIZED_DIR, train them on the training split of --data (a .jsonl of "
                                   "instructions trains on answer tokens only), and save the adapter (or, with "
                                   "--merge, a re-quantized checkpoint) to --out.")
    p.add_argument("quantized_dir", metavar="QUANTIZED_DIR", help="a checkpoint written by `lowbit quantize`")
    p.add_argument("--adapter", default="qwha", help="qwha | lora | loftq | fourierft (default qwha)")
    p.add_argument("--rank", type=common.positive("--rank"), default=8,
                   help="budget in LoRA terms: rank*(in+out) trainable values per layer (8)")
    p.add_argument("--steps", type=common.positive("--steps"), default=100, help="optimizer steps (100)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: 2e-4, FourierFT 1e-3)")
    p.add_argument("--batch-size", type=common.positive("--batch-size"), default=8, help="sequences per step (8)")
    p.add_argument("--grad-accum", type=common.positive("--grad-accum"), default=1)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 6%% of --steps)")
    p.add_argument("--nsamples", type=common.positive("--nsamples"), default=64, help="training rows (64)")
    p.add_argument("--seqlen", type=common.positive("--seqlen"), default=256, help="tokens per row (256)")
    g = p.add_argument_group("QWHA settings (--adapter qwha only)")
    g.add_argument("--k-min", type=common.nonnegative("--k-min"), default=UNSET,
                   help="coefficients every output row gets at least (1)")
    g.add_argument("--scale", type=float, default=UNSET,
                   help="learning-rate multiplier of the values (default: PeftConfig's, 10)")
    g.add_argument("--no-refine", dest="refine", action="store_false", default=UNSET,
                   help="skip the least-squares refinement")
    p.add_argument("--base-model", default=None,
                   help="qwha, loftq: the float model the checkpoint came from (default: the one it recorded, "
                        "verified by its weight digest)")
    p.add_argument("--merge", action="store_true",
                   help="merge the adapters and re-quantize: --out becomes a plain lowbit checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parallel", default="ddp", help="under torchrun: ddp (replicas) | fsdp (sharded, GPUs)")
    p.add_argument("--checkpoint-every", type=common.nonnegative("--checkpoint-every"), default=0,
                   help="checkpoint period in steps (0 = none); a killed run resumes from the last one")
    p.add_argument("--workdir", default=None, help="metrics/checkpoints folder (default OUT.train)")
    p.add_argument("--no-resume", action="store_true", help="ignore a checkpoint in the work folder")
    common.add_device(p, "initialisation, training and evaluation")
    common.add_data(p)
    p.add_argument("--eval-data", default=None, help="text for perplexity (default: the bundled corpus' eval split)")
    common.add_eval(p)
    common.add_out(p)
    common.add_json(p)
    p.set_defaults(func=run)


def build_job(args: argparse.Namespace):
    from lowbit.api.finetune import (
        DEFAULT_LR,
        FinetuneJob,
        TrainConfig,
        TrainingData,
        peft_config,
        work_folder,
    )

    cfg = peft_config(args.adapter, rank=args.rank, seed=args.seed, **common.given(args, *ADAPTER_FLAGS))
    warmup = args.warmup if args.warmup is not None else int(0.06 * args.steps)
    train = TrainConfig(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum,
                        lr=args.lr or DEFAULT_LR[cfg.adapter], warmup=warmup, seed=args.seed, progress=not args.json,
                        parallel=args.parallel, checkpoint_every=args.checkpoint_every,
                        out_dir=str(work_folder(args.out, args.workdir)))
    data = TrainingData(args.data, nsamples=args.nsamples, seqlen=args.seqlen, seed=args.seed)
    return FinetuneJob(args.quantized_dir, args.out, cfg, train, data=data, base_model=args.base_model,
                       evaluation=common.evaluation(args, args.eval_data), merge=args.merge, device=args.device,
                       force=args.force, progress=not args.json, workdir=args.workdir, resume=not args.no_resume)


def run(args: argparse.Namespace) -> dict:
    from lowbit import api

    return api.finetune(build_job(args))
