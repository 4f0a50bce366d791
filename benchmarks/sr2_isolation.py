"""Where SignRoundV2 loses to searched RTN on the GGUF Q2_K mix: one part of the mix at a time.

    python -m benchmarks.sr2_isolation [--scheme w4g32] [--nsamples 32]

The bundled model's gguf:q2_k mix is 180 tensors of the Q4_0 fallback (lowbit ``w4g32``) and
30 Q3_K ``ffn_down``; SignRoundV2 on the whole mix came out worse than searched RTN
(benchmarks/results/gguf.md). This quantizes every Linear to one ``--scheme`` with both
methods (the same calibration tokens, seed 0, 50 iterations, one thread) and reports lowbit's
perplexity on 4 x 512 evaluation tokens (the gguf benchmark's windows); rows are merged into
benchmarks/results/sr2_isolation.json.
"""

from __future__ import annotations

import argparse
import copy
import time

from benchmarks import common

NAME = "sr2_isolation"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scheme", default="w4g32")
    p.add_argument("--nsamples", type=int, default=32)
    args = p.parse_args(argv)

    import torch

    from lowbit.data import calibration_batches, eval_tokens
    from lowbit.eval import perplexity
    from lowbit.models import linear_layers, load_model
    from lowbit.plans.plan import Plan
    from lowbit.ptq.rtn import rtn_quantize
    from lowbit.ptq.signround import make_config, signround_quantize

    torch.set_num_threads(1)
    lm = load_model(None)
    tokens = eval_tokens(lm.tokenizer)
    calib = calibration_batches(lm.tokenizer, nsamples=args.nsamples, seqlen=256)
    for method in ("rtn", "signround2"):
        model = copy.deepcopy(lm.model)
        plan = Plan.uniform(list(linear_layers(model)), args.scheme)
        t0 = time.perf_counter()
        if method == "rtn":
            rtn_quantize(model, plan, calib, search=True, progress=False)
        else:
            signround_quantize(model, plan, make_config(iters=50, v2=True, seed=0), calib, progress=False)
        row = {"scheme": args.scheme, "method": method, "nsamples": args.nsamples, "iters": 50 if method != "rtn" else 0,
               "seconds": round(time.perf_counter() - t0, 1),
               "ppl_4x512": perplexity(model, tokens, 512, 4, progress=False).ppl, "machine": common.machine()}
        common.merge_row(NAME, row, ("scheme", "method", "nsamples"))
        print(row, flush=True)


if __name__ == "__main__":
    main()
