"""Is lowbit's SignRound step slower on the CPU than before issue 22? Old and new code, alternating.

One decoder block of the bundled model's shape (hidden 576, MLP 1536, 9 heads / 3 KV heads,
random weights), signround2 W4 g128, fp32 products, 32 x 256 calibration tokens, batch 8;
the tuning time of the block (its ``seconds`` minus a 0-iteration run's, i.e. the
iterations alone) per run, in fresh processes, one thread, the two code trees alternating.

    python -m benchmarks.ptq_cpu_step --old /path/to/old/src --runs 3

Rows go to benchmarks/results/ptq_cpu_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.common import ROOT, machine, median, merge_row

NAME = "ptq_cpu_step.json"


def child(iters: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowbit.models import linear_layers
    from lowbit.plans.plan import Plan
    from lowbit.ptq.blockwise import PipelineOptions, quantize_blockwise
    from lowbit.ptq.methods import RunContext
    from lowbit.ptq.signround import SignRoundSettings, SignRoundTuner

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=1000)
    model = LlamaForCausalLM(cfg).eval()
    calib = torch.randint(0, 1000, (32, 256), generator=torch.Generator().manual_seed(0))
    plan = Plan.uniform({n: m for n, m in linear_layers(model).items() if ".layers." in n}, "w4g128")
    s = SignRoundSettings(iters=iters, v2=True, tune_dtype="fp32")
    infos = quantize_blockwise(model, plan, SignRoundTuner(s), {}, RunContext(calib=calib, progress=False),
                               PipelineOptions(chunk=8))
    return {"seconds": infos[0]["seconds"], "iters": iters}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=False, help="src folder of the code before (e.g. a checkout of main)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.child)))
        return
    trees = {"old": a.old, "new": str(ROOT / "src")}
    got: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(a.runs):
        for label, src in trees.items():
            env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            per = []
            for iters in (0, a.iters):
                r = subprocess.run([sys.executable, "-m", "benchmarks.ptq_cpu_step", "--child", str(iters)],
                                   cwd=ROOT, env=env, capture_output=True, text=True, check=True)
                per.append(json.loads(r.stdout.strip().splitlines()[-1])["seconds"])
            got[label].append((per[1] - per[0]) / a.iters)
            print(label, got[label][-1], flush=True)
    row = {"what": "seconds per SignRound step, one 576-wide block, 8 x 256 tokens, fp32, 1 thread",
           "old_step_s": round(median(got["old"]), 4), "new_step_s": round(median(got["new"]), 4),
           "new_over_old": round(median(got["new"]) / median(got["old"]), 3), "runs": got, **machine()}
    merge_row(NAME, row, ("what",))
    print(json.dumps(row))


if __name__ == "__main__":
    main()
