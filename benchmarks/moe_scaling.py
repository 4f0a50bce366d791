"""Seconds and peak memory of quantizing one mixture-of-experts block as the expert count grows (issue 34).

Issue 34's target: quantization time per block grows at most linearly in the number of
experts. The shape is fixed (a random one-block Qwen3-MoE: hidden 128, 4 heads, experts of
64 rows, top-2, vocab 256, the same model ``benchmarks/moe_tuned.py --rows scaling`` tunes
with SignRoundV2) and only the expert count changes: 8, 32, 128 experts, so the expert
weights grow 16x. Calibration: 8 x 128 random tokens (seed 0), the plan quantizes the experts
alone at W4 g32, one torch thread.

Methods (each run in a fresh child process, so its peak RSS is its own):

- ``rtn``: RTN with the importance search weighted by each expert's own statistics,
  gathered with all-experts calibration (every token's statistics reach every expert; the
  path with the most per-expert work: ``search=True, expert_importance=True, all_experts=True``; the plain
  importance its rows were measured with, ``expert_affinity=False``: the router-weighted one adds one weighted
  sum per expert over its routed tokens);
- ``gptq``: GPTQ with its defaults (per-expert Hessians from all-experts calibration);
- ``signround2``: SignRoundV2, 10 iterations, mini-batch 4 (``moe_tuned.py --rows scaling``'s
  settings; recorded as ``lowbit-signround2-median-block-E*`` beside that script's one-run rows).

Per row: the median of ``--runs`` runs of the ``quantize_model`` call's wall seconds and its
process CPU seconds (one thread: on a machine shared with other jobs the CPU time is the stable
measure, wall time waits on the others), the child's peak RSS and its RSS before quantizing
(the model and the data: that part grows with the expert weights by construction), and time
per million expert parameters relative to the 8-expert row (at most 1 = at most linear).
SignRoundV2's rows are ``moe_tuned.py``'s (wall seconds only), in the same file.

    nice -n 10 python -m benchmarks.moe_scaling --methods rtn,gptq --experts 8,32,128 --runs 3
    python -m benchmarks.moe_scaling --table
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from benchmarks.common import machine, markdown_table, merge_row, peak_rss_mib, result_path

RESULTS = "moe_scaling"
METHODS = ("rtn", "gptq", "signround2")
EXPERTS = (8, 32, 128)
SCHEME = "w4g32"
SETTINGS = {"rtn": {"search": True, "expert_importance": True, "all_experts": True, "expert_affinity": False},
            "gptq": {"all_experts": True},
            "signround2": {"iters": 10, "batch_size": 4}}  # moe_tuned.py's scaling rows' settings
# moe_tuned.py records its one-run SignRoundV2 rows as lowbit-signround2-block-E*: these are medians of runs
TOOL = {"signround2": "signround2-median"}


def _rss_mib() -> float:
    """Current resident memory of this process (``/proc/self/statm``'s second field, in pages)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one_run(method: str, experts: int) -> dict:
    """Build the block, quantize its experts with ``method``; seconds and memory of this process."""
    import torch
    import transformers as tf

    from lowbit.models.accounting import account_model
    from lowbit.models.experts import expert_tensors
    from lowbit.plans.plan import Plan
    from lowbit.plans.source import build_plan
    from lowbit.ptq import quantize_model

    def block(e: int) -> tuple[torch.nn.Module, Plan]:
        torch.manual_seed(0)
        cfg = tf.Qwen3MoeConfig(vocab_size=256, hidden_size=128, num_hidden_layers=1, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=64,
                                num_experts=e, num_experts_per_tok=2)
        m = tf.Qwen3MoeForCausalLM(cfg).eval()
        full = build_plan(m, SCHEME)
        return m, Plan({n: full[n] for n in expert_tensors(m)})

    torch.set_num_threads(1)
    calib = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0))
    warm, warm_plan = block(2)  # first-call costs (lazy imports, allocator) are not the expert count's
    quantize_model(warm, warm_plan, method, SETTINGS[method], calib=calib[:1, :16], progress=False, keep16=False)
    del warm
    model, plan = block(experts)
    params = sum(t.numel for t in expert_tensors(model).values())
    before = _rss_mib()
    t0, c0 = time.perf_counter(), time.process_time()
    quantize_model(model, plan, method, SETTINGS[method], calib=calib, progress=False, keep16=False)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    acc = account_model(model).by_kind()
    if acc["experts"] != (params, 0):  # every expert weight quantized, or the row means nothing
        raise SystemExit(f"experts not all quantized: {acc['experts']}")
    return {"seconds": seconds, "cpu_seconds": cpu, "rss_before_mib": before, "peak_rss_mib": peak_rss_mib(), "expert_params": params}


def measure(method: str, experts: int, runs: int) -> dict:
    """Median of ``runs`` child processes of `one_run`."""
    got = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-m", "benchmarks.moe_scaling", "--one", method, str(experts)],
                             check=True, capture_output=True, text=True).stdout
        got.append(json.loads(out.strip().splitlines()[-1]))
    sec = [g["seconds"] for g in got]
    cpu = [g["cpu_seconds"] for g in got]
    med, cmed = statistics.median(sec), statistics.median(cpu)
    params = got[0]["expert_params"]
    return {"tool": f"lowbit-{TOOL.get(method, method)}-block-E{experts}", "scheme": SCHEME, "seed": 0, "experts": experts,
            "method": method, "settings": SETTINGS[method], "seconds": round(med, 3),
            "runs_seconds": [round(s, 3) for s in sec], "cpu_seconds": round(cmed, 3),
            "runs_cpu_seconds": [round(c, 3) for c in cpu], "expert_params": params,
            "seconds_per_mparam": round(med / params * 1e6, 3), "cpu_seconds_per_mparam": round(cmed / params * 1e6, 3),
            "peak_rss_mib": round(statistics.median(g["peak_rss_mib"] for g in got), 1),
            "rss_before_mib": round(statistics.median(g["rss_before_mib"] for g in got), 1),
            "machine": {**machine(), "threads": 1}}


def _key(r: dict) -> tuple:
    return (r["scheme"], r["tool"], r.get("seed", 0))


def table() -> str:
    """Per method and expert count: seconds, seconds per M expert params vs the 8-expert row, memory."""
    p = result_path(RESULTS)
    rows = json.loads(p.read_text())["rows"] if p.exists() else []
    out, base, cbase = [], {}, {}
    for r in sorted(rows, key=lambda r: (r["tool"].rsplit("-E", 1)[0], r["experts"])):
        method = r["tool"].rsplit("-block-E", 1)[0].removeprefix("lowbit-")
        sec = r.get("block_seconds", r["seconds"])
        per = sec / r["expert_params"] * 1e6
        base.setdefault(method, per)
        grow = "" if r.get("rss_before_mib") is None else f"{r['peak_rss_mib'] - r['rss_before_mib']:.1f}"
        cpu = r.get("cpu_seconds")
        cper = None if cpu is None else cpu / r["expert_params"] * 1e6
        if cper is not None:
            cbase.setdefault(method, cper)
        out.append((method, r["experts"], f"{r['expert_params'] / 1e6:.3f}", f"{sec:.2f}", f"{per / base[method]:.2f}",
                    "" if cpu is None else f"{cpu:.2f}", "" if cper is None else f"{cper / cbase[method]:.2f}",
                    f"{r['peak_rss_mib']:.0f}", grow))
    return markdown_table(("method", "experts", "expert M params", "wall s / block", "wall s per param vs 8",
                           "CPU s / block", "CPU s per param vs 8", "peak RSS MiB", "peak - before MiB"), out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated among {', '.join(METHODS)}")
    p.add_argument("--experts", default=",".join(map(str, EXPERTS)), help="comma-separated expert counts")
    p.add_argument("--runs", type=int, default=3, help="runs per row (the median is recorded)")
    p.add_argument("--table", action="store_true", help="print the recorded rows and exit")
    p.add_argument("--one", nargs=2, metavar=("METHOD", "EXPERTS"), help=argparse.SUPPRESS)  # the child's entry
    a = p.parse_args()
    if a.one:
        print(json.dumps(one_run(a.one[0], int(a.one[1]))))
        return
    if a.table:
        print(table())
        return
    methods = a.methods.split(",")
    if bad := [m for m in methods if m not in METHODS]:
        p.error(f"unknown methods {bad}; choose among {', '.join(METHODS)}")
    for method in methods:
        for e in (int(x) for x in a.experts.split(",")):
            r = measure(method, e, a.runs)
            merge_row(RESULTS, r, _key)
            print(f"{r['tool']}: {r['seconds']} s (runs {r['runs_seconds']}), peak RSS {r['peak_rss_mib']} MiB",
                  flush=True)
    print(table())


if __name__ == "__main__":
    main()
