"""lowbit's tuned and mixed-precision rows on the float MoE organism (issue 34): SignRoundV2 and DeltaLoss on experts.

Rows go into ``results/moe.json`` beside ``benchmarks/moe.py``'s RTN rows, keyed by
(scheme, tool, seed), on the same organism, 40 x 512 evaluation tokens and 32 x 256
calibration windows (seed 0) as ``benchmarks/moe_peers.py`` (``organism_data``):

- ``lowbit-signround2``: SignRoundV2 at the uniform scheme, 50 iterations, mini-batch 8 (the
  peers' ``autoround`` rows: its SignRound, 50 iterations, batch 8, same windows), the
  experts tuned per expert inside each block, router frozen. ``seed`` is the tuning
  mini-batch order (auto-round's ``seed``); the calibration windows are the same for every
  seed. Rank on the mean of seeds.
- ``lowbit-mixed-signround2``: that DeltaLoss plan tuned by SignRoundV2 (as its row above).
- ``lowbit-mixed-rtn`` / ``lowbit-uniform-rtn``: the same size two ways: DeltaLoss +
  knapsack (``--avg-bits`` = the uniform scheme's bits per weight, options w2g64, w3g128,
  w4g128; fused experts tensors are knapsack items) against the uniform scheme, both RTN
  with lowbit's default search, so the rows differ by the allocation alone. Deterministic:
  one seed.
- ``lowbit-signround2-block-E{8,32,128}`` (in ``results/moe_scaling.json``): seconds of one tuned
  block as the expert count grows at a fixed expert shape (`scaling_rows`).

    python -m benchmarks.moe_tuned --rows signround2 --schemes w4g128,w3g128,w2g64 --seeds 0,1
    python -m benchmarks.moe_tuned --rows mixed --schemes w3g128,w2g32
    python -m benchmarks.moe_tuned --rows mixed-signround2 --schemes w3g128,w2g32 --seeds 0
    python -m benchmarks.moe_tuned --rows scaling --schemes ''
    python -m benchmarks.moe_tuned --table
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

from benchmarks.common import machine, markdown_table, merge_row, peak_rss_mib, result_path
from benchmarks.moe_peers import EVAL_SEQLEN, EVAL_WINDOWS, ORGANISM, organism_data

RESULTS = "moe"
SCALING = "moe_scaling"
ITERS, BATCH = 50, 8  # the peers' autoround rows
MIX_OPTIONS = ("w2g64", "w3g128", "w4g128")
ROWS = ("signround2", "mixed", "mixed-signround2", "scaling")
SCALING_EXPERTS = (8, 32, 128)


def _key(r: dict) -> tuple:
    return (r["scheme"], r["tool"], r.get("seed", 0))


def _setup(organism: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from lowbit.eval import perplexity

    folder, calib, ev = organism_data(organism)
    fp = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ppl_fp = perplexity(fp, ev, seqlen=EVAL_SEQLEN, windows=EVAL_WINDOWS, progress=False).ppl
    return fp, calib, ev, ppl_fp


def _finish(tool: str, scheme: str, seed: int, model, plan, seconds: float, ev, ppl_fp: float, **extra) -> dict:
    from lowbit.eval import perplexity
    from lowbit.models.accounting import account_model
    from lowbit.models.experts import planned_shape

    ppl = perplexity(model, ev, seqlen=EVAL_SEQLEN, windows=EVAL_WINDOWS, progress=False).ppl
    sizes = {n: planned_shape(model, n) for n in plan}
    return {"tool": tool, "scheme": scheme, "seed": seed, "seconds": round(seconds, 2), "peak_rss_mib": peak_rss_mib(),
            "ppl_fp": ppl_fp, "ppl": ppl, "plan": plan.describe(), "plan_avg_bits": round(plan.average_bits(sizes), 4),
            "matmul_weights": account_model(model).to_dict(), "machine": machine(), **extra}


def signround_row(scheme: str, seed: int, organism: Path) -> dict:
    from lowbit.plans.source import build_plan
    from lowbit.ptq import quantize_model

    fp, calib, ev, ppl_fp = _setup(organism)
    model = copy.deepcopy(fp)
    settings = {"iters": ITERS, "batch_size": BATCH, "seed": seed}
    t0 = time.perf_counter()
    plan = quantize_model(model, build_plan(model, scheme), "signround2", settings, calib=calib, progress=False)
    return _finish("lowbit-signround2", scheme, seed, model, plan, time.perf_counter() - t0, ev, ppl_fp,
                   settings=settings)


def _allocate(model, scheme: str, calib):
    """(DeltaLoss + knapsack allocation over `MIX_OPTIONS` at the bits per weight of ``scheme`` uniform, those bits)."""
    from lowbit.models.experts import planned_shape
    from lowbit.plans.source import build_plan
    from lowbit.ptq.mixed import MixedSettings, mixed_plan

    uniform = build_plan(model, scheme)
    budget = uniform.average_bits({n: planned_shape(model, n) for n in uniform})
    settings = MixedSettings(avg_bits=budget, options=MIX_OPTIONS, dtype="fp32")
    return mixed_plan(model, uniform, settings, calib, progress=False), budget


def mixed_rows(scheme: str, organism: Path) -> list[dict]:
    """DeltaLoss-allocated plan at the bits of ``scheme`` vs ``scheme`` uniform; both RTN with lowbit's search."""
    from lowbit.formats import Scheme
    from lowbit.plans.source import build_plan
    from lowbit.ptq import quantize_model

    fp, calib, ev, ppl_fp = _setup(organism)
    uniform = build_plan(fp, scheme)
    rows = []
    model = copy.deepcopy(fp)
    t0 = time.perf_counter()
    plan = quantize_model(model, uniform, "rtn", {}, calib=calib, progress=False)
    rows.append(_finish("lowbit-uniform-rtn", scheme, 0, model, plan, time.perf_counter() - t0, ev, ppl_fp))
    model = copy.deepcopy(fp)
    t0 = time.perf_counter()
    alloc, budget = _allocate(model, scheme, calib)
    t_alloc = time.perf_counter() - t0
    plan = quantize_model(model, alloc.plan, "rtn", {}, calib=calib, progress=False)
    rows.append(_finish("lowbit-mixed-rtn", scheme, 0, model, plan, time.perf_counter() - t0, ev, ppl_fp,
                        budget_bits=round(budget, 4), options=list(MIX_OPTIONS), allocation_seconds=round(t_alloc, 2),
                        allocation=_names(alloc.plan), uniform_scheme=Scheme.parse(scheme).name))
    return rows


def mixed_signround_row(scheme: str, seed: int, organism: Path) -> dict:
    """The DeltaLoss plan at the bits of ``scheme`` (as `mixed_rows`), then tuned by SignRoundV2 (``seed``)."""
    from lowbit.ptq import quantize_model

    fp, calib, ev, ppl_fp = _setup(organism)
    model = copy.deepcopy(fp)
    t0 = time.perf_counter()
    alloc, budget = _allocate(model, scheme, calib)
    settings = {"iters": ITERS, "batch_size": BATCH, "seed": seed}
    plan = quantize_model(model, alloc.plan, "signround2", settings, calib=calib, progress=False)
    return _finish("lowbit-mixed-signround2", scheme, seed, model, plan, time.perf_counter() - t0, ev, ppl_fp,
                   budget_bits=round(budget, 4), options=list(MIX_OPTIONS), allocation=_names(alloc.plan),
                   settings=settings)


def _names(plan) -> dict[str, str]:
    """plan entry -> the scheme the knapsack picked (what DeltaLoss gave attention vs experts)."""
    return {n: r.name for n, r in plan.items()}


def scaling_rows() -> list[dict]:
    """Seconds of one SignRoundV2 block (10 iterations, experts only) as the expert count grows at a fixed expert shape.

    A random one-block Qwen3-MoE (hidden 128, experts of 64, top-2), 8 x 128 calibration tokens:
    the expert weights grow with E, the routed tokens per expert shrink as 1/E.
    """
    import torch
    import transformers as tf

    from lowbit.models.experts import expert_tensors
    from lowbit.plans.plan import Plan
    from lowbit.plans.source import build_plan
    from lowbit.ptq.signround import make_config, signround_quantize

    rows = []
    for e in SCALING_EXPERTS:
        torch.manual_seed(0)
        cfg = tf.Qwen3MoeConfig(vocab_size=256, hidden_size=128, num_hidden_layers=1, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=64,
                                num_experts=e, num_experts_per_tok=2)
        model = tf.Qwen3MoeForCausalLM(cfg).eval()
        plan = build_plan(model, "w4g32")
        plan = Plan({n: plan[n] for n in expert_tensors(model)})
        params = sum(t.numel for t in expert_tensors(model).values())
        calib = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0))
        t0 = time.perf_counter()
        info = signround_quantize(model, plan, make_config(iters=10, batch_size=4, v2=True), calib, progress=False)
        rows.append({"tool": f"lowbit-signround2-block-E{e}", "scheme": "w4g32", "seed": 0, "experts": e,
                     "seconds": round(time.perf_counter() - t0, 2), "block_seconds": round(info[0]["seconds"], 2),
                     "expert_params": params, "peak_rss_mib": peak_rss_mib(), "machine": machine()})
        print(f"{e} experts: {rows[-1]['block_seconds']} s per block", flush=True)
    return rows


def table() -> str:
    """Per (scheme, tool): the mean over seeds, with the peers' rows (moe_peers.json) at the same scheme."""
    ours = json.loads(result_path(RESULTS).read_text())["rows"] if result_path(RESULTS).exists() else []
    peers_file = result_path("moe_peers")
    peers = json.loads(peers_file.read_text())["rows"] if peers_file.exists() else []
    groups: dict[tuple, list] = {}
    for r in ours:
        if r["tool"].startswith(("lowbit-signround2", "lowbit-mixed", "lowbit-uniform")) and "ppl" in r:
            groups.setdefault((r["scheme"], r["tool"]), []).append((r.get("seed", 0), r["ppl"], r.get("plan_avg_bits")))
    for r in peers:
        if r["tool"] == "autoround" and r.get("ppl_in_memory") is not None:
            groups.setdefault((r["scheme"], r["tool"]), []).append((r.get("seed", 0), r["ppl_in_memory"], None))
    rows = []
    for (scheme, tool), vals in sorted(groups.items()):
        vals.sort()
        mean = sum(v[1] for v in vals) / len(vals)
        bits = vals[0][2]
        rows.append((scheme, tool, f"{mean:.3f}", " / ".join(f"{v[1]:.3f}" for v in vals),
                     ",".join(str(v[0]) for v in vals), "" if bits is None else f"{bits:.3f}"))
    return markdown_table(("scheme", "tool", "mean ppl", "per seed", "seeds", "plan bits"), rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated among {', '.join(ROWS)}")
    p.add_argument("--schemes", default="w4g128,w3g128,w2g64", help="comma-separated uniform schemes")
    p.add_argument("--seeds", default="0,1", help="SignRoundV2 tuning seeds (comma-separated)")
    p.add_argument("--organism", default=str(ORGANISM), help="the MoE organism's folder")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: timings unaffected by a busy machine)")
    p.add_argument("--table", action="store_true", help="print the table of the recorded rows and exit")
    a = p.parse_args()
    if a.table:
        print(table())
        return
    rows = a.rows.split(",")
    if bad := [r for r in rows if r not in ROWS]:
        p.error(f"unknown rows {bad}; choose among {', '.join(ROWS)}")
    organism = Path(a.organism).expanduser()
    if not (organism / "model" / "config.json").is_file():
        p.error(f"{organism} has no model/; build it first: python -m benchmarks.organism --arch qwen3moe")
    import torch

    torch.set_num_threads(a.threads)
    if "scaling" in rows:  # one sweep, not per scheme; a file of its own (its rows have no perplexity)
        for r in scaling_rows():
            merge_row(SCALING, r, _key)
    for scheme in a.schemes.split(","):
        if "signround2" in rows:
            for seed in a.seeds.split(","):
                _record(signround_row(scheme, int(seed), organism))
        if "mixed" in rows:
            for r in mixed_rows(scheme, organism):
                _record(r)
        if "mixed-signround2" in rows:
            for seed in a.seeds.split(","):
                _record(mixed_signround_row(scheme, int(seed), organism))
    print(table())


def _record(r: dict) -> None:
    merge_row(RESULTS, r, _key)
    print(f"{r['tool']} {r['scheme']} seed {r['seed']}: ppl {r['ppl']:.3f} (fp {r['ppl_fp']:.3f}) "
          f"plan {r['plan_avg_bits']} bits, {r['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
