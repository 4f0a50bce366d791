"""PTQ tuning speed, each tool alone on the machine: lowbit SignRoundV2 vs auto-round 0.16.x.

The full-model rows of ``benchmarks.ptq`` run both tools at once on the two cores (and
sometimes beside other jobs), so their seconds mix in the neighbours' load. This script
times the tuning only, one tool at a time, on the bundled model cut to its first
``--blocks`` decoder blocks (the work per block is the same in every block), one thread,
the same 32 x 256 calibration tokens, batch 8, 50 iterations, fp32; ``--repeats`` runs of
each tool, alternating so drifts in machine speed hit both, reported as medians.

The physical reference measured in the same run: the tuning loop's GEMM work (forward,
input and weight gradients of every block Linear on 8 x 256 tokens per iteration, the q/k/v
input gradients excluded because nothing upstream is trained) at this thread's median
fp32 GEMM rate.

    python -m benchmarks.ptq_speed --blocks 4 --repeats 3 --scheme w4g128
    python -m benchmarks.ptq_speed --blocks 4 --repeats 3 --scheme w4g128 --tune-dtype bf16
    python -m benchmarks.ptq_speed --table
    python -m benchmarks.ptq_speed --blocks 1 --repeats 1 --iters 2 --tools lowbit --out /tmp/ptq_speed_smoke.json  # smoke

``--tune-dtype bf16`` runs lowbit's tuned products in bf16 (``SignRoundSettings.tune_dtype``)
against auto-round's fp32 (the issue's protocol); ``--amp`` gives auto-round its own mixed
precision instead (``amp=True``). The bf16 GEMM rate is measured beside the fp32 one, so the
row also shows the bf16 floor. The ``autoround`` tool needs auto-round (``make bench-setup``).
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.common import (
    BATCH,
    NSAMPLES,
    SEQLEN,
    alternating,
    bundled_model,
    calibration,
    emit,
    gemm_gflops,
    load_results,
    machine,
    median,
    merge_row,
    out_path,
    require_peer,
    run_child,
    tuning_gflop,
)

SCHEMES = {"w4g128": (4, 128), "w3g128": (3, 128), "w2g64": (2, 64)}
TOOLS = ("lowbit", "autoround")


def truncated_model(blocks: int):
    """The bundled model with only its first ``blocks`` decoder blocks (same weights), and the calibration tokens."""
    from lowbit.models import decoder_blocks

    lm = bundled_model(threads=1)
    layers = decoder_blocks(lm.model)
    del layers[blocks:]
    lm.model.config.num_hidden_layers = blocks
    if getattr(lm.model.config, "layer_types", None):
        lm.model.config.layer_types = lm.model.config.layer_types[:blocks]
    return lm, calibration(lm.tokenizer, NSAMPLES, SEQLEN)


def child(tool: str, blocks: int, scheme: str, iters: int, v2: bool, tune_dtype: str, amp: bool) -> dict:
    lm, calib = truncated_model(blocks)
    bits, group = SCHEMES[scheme]
    gflops, bf16_gflops = gemm_gflops(), gemm_gflops(dtype="bf16")
    work = tuning_gflop(lm.model, iters, BATCH * SEQLEN)
    t0 = time.perf_counter()
    if tool == "lowbit":
        from lowbit.models import linear_layers
        from lowbit.plans.plan import Plan
        from lowbit.ptq import quantize_model

        plan = Plan.uniform(linear_layers(lm.model), scheme)
        quantize_model(lm.model, plan, "signround2" if v2 else "signround", calib=calib, progress=False,
                       settings={"batch_size": BATCH, "iters": iters, "tune_dtype": tune_dtype})
    else:
        from auto_round import AutoRound

        ar = AutoRound(lm.model, lm.tokenizer, dataset=[row.unsqueeze(0) for row in calib], nsamples=NSAMPLES,
                       seqlen=SEQLEN, batch_size=BATCH, amp=amp, device_map="cpu", seed=0, bits=bits,
                       group_size=group, sym=True, iters=iters, enable_alg_ext=v2)
        ar.quantize()
    seconds = time.perf_counter() - t0
    return {"tool": tool, "seconds": seconds, "gemm_gflops": gflops, "bf16_gemm_gflops": bf16_gflops,
            "tuning_gemm_gflop": work}


def child_args(tool: str, a: argparse.Namespace) -> list[str]:
    return (["--child", tool, "--blocks", str(a.blocks), "--scheme", a.scheme, "--iters", str(a.iters),
             "--tune-dtype", a.tune_dtype] + (["--v2"] if a.v2 else []) + (["--amp"] if a.amp else []))


def summarise(runs: list[dict], a: argparse.Namespace) -> dict:
    by = {t: [r for r in runs if r["tool"] == t] for t in TOOLS}
    med = {t: median(r["seconds"] for r in rs) for t, rs in by.items() if rs}
    rate = median(r["gemm_gflops"] for r in runs)
    work = by["lowbit"][0]["tuning_gemm_gflop"] if by["lowbit"] else runs[0]["tuning_gemm_gflop"]
    bf16 = median(r["bf16_gemm_gflops"] for r in runs)
    out = {"scheme": a.scheme, "blocks": a.blocks, "iters": a.iters, "v2": a.v2, "repeats": a.repeats,
           "cpu": machine()["cpu"],
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


def key(r: dict) -> tuple:
    """A row's identity; rows from before the dtype switches existed ran fp32 against auto-round fp32."""
    return (r["scheme"], r["v2"], r["blocks"], r["iters"], r.get("lowbit_tune_dtype", "fp32"),
            r.get("autoround_amp", False))


def table(rows: list[dict]) -> str:
    """One line per (row, tool): median seconds, per block and against the fp32 GEMM limit."""
    lines = ["| scheme | blocks | iters | lowbit dtype | auto-round amp | tool | median s | s / block "
             "| vs GEMM limit | lowbit / auto-round | cpu |", "|" + "---|" * 11]
    for r in rows:
        for t, s in r["median_seconds"].items():
            lines.append(f"| {r['scheme']} | {r['blocks']} | {r['iters']} | {r.get('lowbit_tune_dtype', 'fp32')} | "
                         f"{r.get('autoround_amp', False)} | {t} | {s} | {r['seconds_per_block'][t]} | "
                         f"{s / r['gemm_limit_seconds']:.2f}x | {r.get('lowbit_over_autoround', '')} | "
                         f"{r.get('cpu', '')} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ptq_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scheme", default="w4g128", choices=sorted(SCHEMES))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--v2", action="store_true", help="auto-round enable_alg_ext vs lowbit signround2 "
                   "(default: auto-round V1 vs lowbit signround2, the issue's pairing)")
    p.add_argument("--tools", default="lowbit,autoround")
    p.add_argument("--tune-dtype", default="fp32", choices=("fp32", "bf16", "auto"), help="lowbit's tuning products")
    p.add_argument("--amp", action="store_true", help="auto-round amp=True (its bf16 autocast)")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/ptq_speed.json)")
    p.add_argument("--table", action="store_true", help="print every row of the results file and exit")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    out = out_path(a.out, "ptq_speed.json")
    if a.table:
        print(table(load_results(out)["rows"]))
        return
    if a.child:
        emit(child(a.child, a.blocks, a.scheme, a.iters, a.child == "lowbit" or a.v2, a.tune_dtype, a.amp))
        return
    tools = a.tools.split(",")
    if not tools or any(t not in TOOLS for t in tools):
        raise SystemExit(f"error: --tools takes a comma-separated subset of {', '.join(TOOLS)}; got {a.tools!r}")
    if "autoround" in tools:
        require_peer("auto_round", "pass --tools lowbit")
    runs = []
    for rep, tool in alternating(tools, a.repeats):
        r = run_child("ptq_speed", child_args(tool, a), threads=1)
        runs.append({**r, "repeat": rep})
        print(f"repeat {rep} {tool:9s} {r['seconds']:7.1f} s  (GEMM {r['gemm_gflops']:.1f} GFLOP/s)",
              file=sys.stderr, flush=True)
    result = summarise(runs, a)
    merge_row(out, result, key)
    print("| tool | median s | s / block | vs GEMM limit |")
    print("|---|---|---|---|")
    for t, s in result["median_seconds"].items():
        print(f"| {t} | {s} | {result['seconds_per_block'][t]} | {s / result['gemm_limit_seconds']:.2f}x |")
    print(f"GEMM limit {result['gemm_limit_seconds']} s ({result['tuning_gemm_gflop']} GFLOP at "
          f"{result['gemm_gflops']} GFLOP/s fp32; {result['bf16_gemm_limit_seconds']} s at "
          f"{result['bf16_gemm_gflops']} GFLOP/s bf16); lowbit / auto-round {result.get('lowbit_over_autoround')}")


if __name__ == "__main__":
    main()
