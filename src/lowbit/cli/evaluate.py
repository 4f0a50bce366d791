"""`lowbit eval`: perplexity (and zero-shot tasks) of any model or checkpoint."""

from __future__ import annotations

import argparse
import time

from lowbit.cli import common


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="perplexity and zero-shot tasks",
                       description="Perplexity = exp(mean token NLL) over non-overlapping windows of the "
                                   "evaluation split.")
    common.add_model(p)
    common.add_data(p)
    p.add_argument("--seqlen", type=common.positive("--seqlen"), default=512, help="tokens per window (512)")
    p.add_argument("--windows", type=int, default=40, help="windows from the start (40); 0 = the whole text")
    p.add_argument("--tasks", default=None, help="comma-separated lm-eval tasks (needs lm-eval, local data)")
    p.add_argument("--limit", type=int, default=None, help="zero-shot: examples per task")
    p.add_argument("--device", default=None, help="run the evaluation on this device (cpu, cuda, cuda:N)")
    common.add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from lowbit import api

    t0 = time.perf_counter()
    r = api.evaluate_pipeline(args.model, data=args.data, seqlen=args.seqlen, windows=args.windows,
                              tasks=args.tasks.split(",") if args.tasks else None, limit=args.limit,
                              device=args.device)
    r["seconds"] = round(time.perf_counter() - t0, 2)
    return r
