"""`lowbit eval`: perplexity (and zero-shot tasks) of any model or checkpoint."""

from __future__ import annotations

import argparse

from lowbit.cli import common
from lowbit.cli.common import UNSET


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="perplexity and zero-shot tasks",
                       description="Perplexity = exp(mean token NLL) over non-overlapping windows of the "
                                   "evaluation split; optionally lm-eval tasks.")
    common.add_model(p)
    common.add_data(p)
    p.add_argument("--eval-seqlen", dest="eval_seqlen", type=common.positive("--eval-seqlen"), default=512,
                   metavar="N", help="tokens per window (512); the same flag as in quantize, qat and finetune")
    # the old name: --seqlen means calibration / training sample length in every other command
    p.add_argument("--seqlen", dest="eval_seqlen", type=common.positive("--seqlen"), action=common.OldName,
                   new="--eval-seqlen", help=argparse.SUPPRESS)
    p.add_argument("--windows", type=common.nonnegative("--windows"), default=40,
                   help="windows from the start (40); 0 = the whole text")
    p.add_argument("--tasks", default=None,
                   help="comma-separated lm-eval tasks: registered names, task YAML files or task folders "
                        "(needs lm-eval; task data must be local). A task file that runs Python (!function) is "
                        "refused, and templates render sandboxed, unless --trust-task-code")
    p.add_argument("--trust-task-code", action="store_true",
                   help="with --tasks: let task files run their Python (lm-eval's !function, unsandboxed "
                        "templates); read that code first")
    p.add_argument("--limit", type=common.positive("--limit"), default=UNSET,
                   help="with --tasks: examples per task")
    common.add_device(p, "the evaluation")
    common.add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from lowbit import api

    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip()) if args.tasks else ()
    job = api.EvalJob(model=args.model, evaluation=api.Evaluation(args.data, args.eval_seqlen, args.windows),
                      tasks=tasks, limit=vars(args).get("limit"), device=args.device, progress=not args.json,
                      trust_task_code=args.trust_task_code)
    return api.evaluate(job)
