"""PTQ tuning speed, each tool alone on the machine: lowbit SignRoundV2 vs auto-round 0.16.x.

The full-model rows of ``benchmarks/ptq.py`` run both tools at once on the two cores (and
sometimes beside other jobs), so their seconds mix in the neighbours' load. This script
times the tuning only, one tool at a time, on the bundled model cut to its first
``--blocks`` decoder blocks (the work per block is the same in every block), one thread,
the same 32 x 256 calibration tokens, batch 8, 50 iterations, fp32; ``--repeats`` runs of
each tool, alternating so drifts in machine speed hit both, reported as medians.

The physical reference measured in the same run: the tuning loop's GEMM work (forward,
input and weight gradients of every block Linear on 8 x 256 tokens per iteration, the q/k/v
input gradients excluded because nothing upstream is trained) at this thread's median
fp32 GEMM rate.

    python benchmarks/ptq_speed.py --blocks 4 --repeats 3 --scheme w4g128
    python benchmarks/ptq_speed.py --blocks 4 --repeats 3 --scheme w4g128 --tune-dtype bf16

``--tune-dtype bf16`` runs lowbit's tuned products in bf16 (``SignRoundConfig.tune_dtype``)
against auto-round's fp32 (the issue's protocol); ``--amp`` gives auto-round its own mixed
precision instead (``amp=True``). The bf16 GEMM rate is measured beside the fp32 one, so the
row also shows the bf16 floor.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
RESULTS = ROOT / "benchmarks" / "results" / "ptq_speed.json"
BATCH, NSAMPLES, SEQLEN = 8, 32, 256

SCHEMES = {"w4g128": (4, 128), "w3g128": (3, 128), "w2g64": (2, 64)}


def truncated_model(blocks: int):
    """The bundled model with only its first ``blocks`` decoder blocks (same weights)."""
    import torch

    from lowbit.data import calibration_batches
    from lowbit.models import load_model
    from lowbit.models.layers import decoder_blocks

    torch.set_num_threads(1)
    torch.manual_seed(0)
    lm = load_model(None)
    layers = decoder_blocks(lm.model)
    del layers[blocks:]
    lm.model.config.num_hidden_layers = blocks
    if getattr(lm.model.config, "layer_types", None):
        lm.model.config.layer_types = lm.model.config.layer_types[:blocks]
    calib = calibration_batches(lm.tokenizer, None, nsamples=NSAMPLES, seqlen=SEQLEN, seed=0)
    return lm, calib


@functools.cache
def ptq_bench():
    """``benchmarks/ptq.py`` as a module (this folder is not a package), loaded once."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ptq_bench", ROOT / "benchmarks" / "ptq.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gemm_gflops(dtype: str = "fp32") -> float:
    """The thread's median GEMM rate in ``dtype``, measured exactly as ``benchmarks/ptq.py`` does."""
    return ptq_bench().gemm_gflops(dtype=dtype)


def tuning_gflop(model, iters: int) -> float:
    """GEMM FLOPs of the tuning loop: 2*params*tokens forward, as much for dW, and dX except q/k/v."""
    from lowbit.models import linear_layers

    tokens = BATCH * SEQLEN
    total = 0.0
    for name, m in linear_layers(model).items():
        if ".layers." not in name:
            continue
        passes = 2 if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj") else 3
        total += passes * 2 * m.weight.numel() * tokens
    return total * iters / 1e9


def child(tool: str, blocks: int, scheme: str, iters: int, v2: bool, tune_dtype: str, amp: bool) -> dict:
    lm, calib = truncated_model(blocks)
    bits, group = SCHEMES[scheme]
    gflops, bf16_gflops = gemm_gflops(), gemm_gflops("bf16")
    work = tuning_gflop(lm.model, iters)
    t0 = time.perf_counter()
    if tool == "lowbit":
        from lowbit.formats.plan import Plan
        from lowbit.models import linear_layers
        from lowbit.ptq import quantize_model

        plan = Plan.uniform({n: m for n, m in linear_layers(lm.model).items() if ".layers." in n}, scheme)
        quantize_model(lm.model, plan, "signround2" if v2 else "signround", calib=calib, tokenizer=lm.tokenizer,
                       progress=False, batch_size=BATCH, iters=iters, tune_dtype=tune_dtype)
    else:
        from auto_round import AutoRound

        ar = AutoRound(lm.model, lm.tokenizer, dataset=[row.unsqueeze(0) for row in calib], nsamples=NSAMPLES,
                       seqlen=SEQLEN, batch_size=BATCH, amp=amp, device_map="cpu", seed=0, bits=bits,
                       group_size=group, sym=True, iters=iters, enable_alg_ext=v2)
        ar.quantize()
    seconds = time.perf_counter() - t0
    return {"tool": tool, "seconds": seconds, "gemm_gflops": gflops, "bf16_gemm_gflops": bf16_gflops,
            "tuning_gemm_gflop": work}


def run_child(tool: str, a: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", tool, "--blocks", str(a.blocks), "--scheme", a.scheme,
           "--iters", str(a.iters), "--tune-dtype", a.tune_dtype] + (["--v2"] if a.v2 else []) + (
               ["--amp"] if a.amp else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict], a: argparse.Namespace) -> dict:
    by = {t: [r for r in runs if r["tool"] == t] for t in ("lowbit", "autoround")}
    med = {t: statistics.median(r["seconds"] for r in rs) for t, rs in by.items() if rs}
    rate = statistics.median(r["gemm_gflops"] for r in runs)
    work = by["lowbit"][0]["tuning_gemm_gflop"] if by["lowbit"] else runs[0]["tuning_gemm_gflop"]
    bf16 = statistics.median(r["bf16_gemm_gflops"] for r in runs)
    out = {"scheme": a.scheme, "blocks": a.blocks, "iters": a.iters, "v2": a.v2, "repeats": a.repeats,
           "cpu": ptq_bench().cpu_model(),
           "lowbit_tune_dtype": a.tune_dtype, "autoround_amp": a.amp,
           "batch": BATCH, "nsamples": NSAMPLES, "seqlen": SEQLEN, "threads": 1,
           "median_seconds": {t: round(s, 1) for t, s in med.items()},
           "seconds_per_block": {t: round(s / a.blocks, 2) for t, s in med.items()},
           "gemm_gflops": round(rate, 1), "tuning_gemm_gflop": round(work, 1),
           "gemm_limit_seconds": round(work / rate, 1), "bf16_gemm_gflops": round(bf16, 1),
           "bf16_gemm_limit_seconds": round(work / bf16, 1), "runs": runs}
    if len(med) == 2:
        out["lowbit_over_autoround"] = round(med["lowbit"] / med["autoround"], 3)
    return out


def save(result: dict) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from lowbit.io import atomic_write_text

    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": []}
    def key(r: dict) -> tuple:
        return (r["scheme"], r["v2"], r["blocks"], r["iters"], r.get("lowbit_tune_dtype", "fp32"),
                r.get("autoround_amp", False))

    data["rows"] = [r for r in data["rows"] if key(r) != key(result)] + [result]
    atomic_write_text(RESULTS, json.dumps(data, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scheme", default="w4g128", choices=sorted(SCHEMES))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--v2", action="store_true", help="auto-round enable_alg_ext vs lowbit signround2 "
                   "(default: auto-round V1 vs lowbit signround2, the issue's pairing)")
    p.add_argument("--tools", default="lowbit,autoround")
    p.add_argument("--tune-dtype", default="fp32", choices=("fp32", "bf16", "auto"), help="lowbit's tuning products")
    p.add_argument("--amp", action="store_true", help="auto-round amp=True (its bf16 autocast)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.blocks, a.scheme, a.iters, a.child == "lowbit" or a.v2, a.tune_dtype,
                               a.amp)))
        return
    tools = a.tools.split(",")
    runs = []
    for rep in range(a.repeats):
        for tool in tools if rep % 2 == 0 else tools[::-1]:
            r = run_child(tool, a)
            runs.append({**r, "repeat": rep})
            print(f"repeat {rep} {tool:9s} {r['seconds']:7.1f} s  (GEMM {r['gemm_gflops']:.1f} GFLOP/s)", flush=True)
    result = summarise(runs, a)
    save(result)
    print("| tool | median s | s / block | vs GEMM limit |")
    print("|---|---|---|---|")
    for t, s in result["median_seconds"].items():
        print(f"| {t} | {s} | {result['seconds_per_block'][t]} | {s / result['gemm_limit_seconds']:.2f}x |")
    print(f"GEMM limit {result['gemm_limit_seconds']} s ({result['tuning_gemm_gflop']} GFLOP at "
          f"{result['gemm_gflops']} GFLOP/s fp32; {result['bf16_gemm_limit_seconds']} s at "
          f"{result['bf16_gemm_gflops']} GFLOP/s bf16); lowbit / auto-round {result.get('lowbit_over_autoround')}")


if __name__ == "__main__":
    main()
