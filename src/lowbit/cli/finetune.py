"""`lowbit finetune`: adapters (QWHA, LoRA, LoftQ, FourierFT) on a quantized checkpoint."""

from __future__ import annotations

import argparse
import time

from lowbit.cli import common


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
    p.add_argument("--k-min", type=int, default=1, help="QWHA: coefficients every output row gets at least (1)")
    p.add_argument("--scale", type=float, default=None,
                   help="QWHA: learning-rate multiplier of the values (default: PeftConfig's, 10)")
    p.add_argument("--no-refine", action="store_true", help="QWHA: skip the least-squares refinement")
    p.add_argument("--base-model", default=None,
                   help="full-precision model the checkpoint came from (default: the source recorded in it)")
    p.add_argument("--merge", action="store_true",
                   help="merge the adapters and re-quantize: --out becomes a plain lowbit checkpoint")
    p.add_argument("--seed", type=int, default=0)
    common.add_data(p)
    p.add_argument("--eval-data", default=None, help="text for perplexity (default: the bundled corpus' eval split)")
    p.add_argument("--eval-seqlen", type=int, default=512, metavar="N", help="tokens per eval window (512)")
    p.add_argument("--windows", type=int, default=40, metavar="N",
                   help="eval windows (40); 0 = the whole text; -1 = no evaluation")
    common.add_out(p)
    common.add_json(p)
    p.set_defaults(func=run)


DEFAULT_LR = {"qwha": 2e-4, "lora": 2e-4, "loftq": 2e-4, "fourierft": 1e-3}


def run(args: argparse.Namespace) -> dict:
    from lowbit.peft.apply import PeftConfig
    from lowbit.peft.pipeline import DataConfig, finetune_pipeline
    from lowbit.train import TrainConfig

    scale = {} if args.scale is None else {"scale": args.scale}
    cfg = PeftConfig(args.adapter, rank=args.rank, k_min=args.k_min, refine=not args.no_refine, seed=args.seed,
                     **scale)
    warmup = args.warmup if args.warmup is not None else int(0.06 * args.steps)
    train_cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum,
                            lr=args.lr or DEFAULT_LR[cfg.adapter], warmup=warmup, seed=args.seed)
    data = DataConfig(args.data, nsamples=args.nsamples, seqlen=args.seqlen, seed=args.seed)
    t0 = time.perf_counter()
    r = finetune_pipeline(args.quantized_dir, cfg, train_cfg, args.out, data=data, base_model=args.base_model,
                          eval_data=args.eval_data, eval_seqlen=args.eval_seqlen, windows=args.windows,
                          merge=args.merge, force=args.force)
    r["seconds"] = round(time.perf_counter() - t0, 2)
    return r
