"""lowbit on the float MoE organism: the experts quantized whole (RTN, GPTQ), beside the peers' rows.

The organism is the Qwen3-MoE of ``python -m benchmarks.organism --arch qwen3moe`` (16 experts,
top-2, 81 % of its matmul weights in the experts). Each row quantizes a fresh copy of it, in a
process of its own (its seconds and peak RSS are its own), with lowbit's uniform plan, which covers
the fused experts tensors (every expert's matrix grouped along its input like a Linear), the
attention Linears, and leaves routers, embeddings and the tied head in 16 bits, then measures
perplexity on the same 40 x 512 evaluation tokens and with the same 32 x 256 calibration windows
(per seed: the windows' draw) as ``benchmarks/moe_peers.py`` (its ``organism_data``), so the peers'
rows in ``results/moe_peers.json`` compare directly. Rows are keyed by (scheme, tool, seed); rank
on the means over seeds (``--table`` prints both). Each row records the calibration tokens per
expert (routed / behind its statistics) and their minimum (``coverage``).

Rows (``ROWS``): plain RTN, RTN with the importance search (per-expert statistics, all-experts or
routed-only, or the weights-alone search), GPTQ with per-expert Hessians (all-experts or
routed-only; ``gptq-absmax``: min-max group scales, llm-compressor's rule; these pin the plain Hessians they
were measured with), GPTQ with router-weighted expert Hessians (``gptq-affinity``, the default since branch
i34k, and its floor-0 / floor-1 diagnostics), SignRoundV2 (50
iterations; its tuning seed = the row's seed). ``--stats-cost`` times a calibration forward with and
without per-expert statistics.

    python -m benchmarks.moe --rows gptq,gptq-routed --schemes w4g128,w3g128,w2g64 --seeds 0,1
    python -m benchmarks.moe --rows rtn,rtn-search --schemes w4a4-nvfp4 --seeds 0,1
    python -m benchmarks.moe --stats-cost
    python -m benchmarks.moe --table
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, machine, markdown_table, merge_row, peak_rss_mib, result_path
from benchmarks.moe_peers import EVAL_SEQLEN, EVAL_WINDOWS, ORGANISM, organism_data, organism_digest

RESULTS = "moe"
# row -> (method, settings): rtn = plain round-to-nearest; rtn-search = RTN's search with per-expert importance
# from all-experts calibration (--expert-importance); gptq = GPTQ with per-expert Hessians (all-experts calibration,
# the default); *-routed = the same with each expert's statistics from its routed tokens only (--no-all-experts);
# rtn-search-uniform = lowbit's default RTN: the experts' search on their weights alone (uniform importance; these
# rows were measured with every expert put below the token threshold, which is the same search). Every gptq row but
# the affinity ones pins the plain all-experts Hessians (PLAIN), the default they were measured with: since branch
# i34k GPTQ's default is router-weighted (--expert-affinity), i.e. the gptq-affinity row
PLAIN = {"expert_affinity": False}
# rtn-search-affinity = rtn-search with the importance router-weighted as gptq-affinity's Hessians (their diagonal,
# floor 0.1; branch i34s); the other rtn-search rows pin the plain importance they were measured with
ROWS = {"rtn": ("rtn", {"search": False}), "rtn-search": ("rtn", {"expert_importance": True, "expert_affinity": False}),
        "rtn-search-routed": ("rtn", {"all_experts": False, "expert_importance": True, "expert_affinity": False}),
        "rtn-search-uniform": ("rtn", {}),
        "rtn-search-affinity": ("rtn", {"expert_importance": True, "expert_affinity": True}),
        "gptq": ("gptq", {**PLAIN}), "gptq-routed": ("gptq", {**PLAIN, "all_experts": False}),
        "gptq-absmax": ("gptq", {**PLAIN, "search": False}), "gptq-choose": ("gptq", {**PLAIN, "choose_rule": True}),
        # each group's scale chosen when GPTQ reaches it, from the weights it rounds (issue 34): natural column order
        "gptq-noact": ("gptq", {**PLAIN, "act_order": False, "static_groups": False}),
        "gptq-noact-absmax": ("gptq", {**PLAIN, "act_order": False, "static_groups": False, "search": False}),
        # group-aware act-order (whole groups by their largest diag(H)): scales from the error-updated weights, or
        # (gar-static) from the float weights up front, which isolates the order's share
        "gptq-gar": ("gptq", {**PLAIN, "group_aware": True, "static_groups": False}),
        "gptq-gar-absmax": ("gptq", {**PLAIN, "group_aware": True, "static_groups": False, "search": False}),
        "gptq-gar-static": ("gptq", {**PLAIN, "group_aware": True}),
        # the scale search restricted to scales at or above abs-max (no clipping, no least-squares refit)
        "gptq-noclip": ("gptq", {**PLAIN, "clip": False}),
        # the attention-score projections (q_proj, k_proj) without clipping / on abs-max scales, the rest searched
        "gptq-score-noclip": ("gptq", {**PLAIN, "score_rule": "noclip"}),
        "gptq-score-absmax": ("gptq", {**PLAIN, "score_rule": "absmax"}),
        # router-weighted expert Hessians: g^2 per routed token, a 0.1 floor of the all-experts Hessian
        "gptq-affinity": ("gptq", {"expert_affinity": True}),
        # diagnostics of its parts: no floor (routed tokens, g^2 only), a floor as large as the routed part
        "gptq-affinity-floor0": ("gptq", {"expert_affinity": True, "affinity_floor": 0.0}),
        "gptq-affinity-floor1": ("gptq", {"expert_affinity": True, "affinity_floor": 1.0}),
        "signround2": ("signround2", {"iters": 50, "batch_size": 8})}  # the settings of benchmarks/moe_tuned.py
SEED_KIND = "calibration windows' draw (organism_data)"  # SignRoundV2's tuning seed is the same number


def row_key(r: dict) -> tuple:
    """Rows are keyed by (scheme, tool, seed); rows recorded before seeds were drawn used seed 0."""
    return r["scheme"], r["tool"], int(r.get("seed", 0))


def row(name: str, scheme: str, organism: Path, seed: int = 0) -> dict:
    """Quantize a fresh copy of the organism with ``scheme`` and ``name``'s method; perplexity before/after.

    seed: the calibration windows' draw (`organism_data`); the evaluation tokens never change.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from lowbit.eval import perplexity
    from lowbit.models.accounting import account_model
    from lowbit.nn.quant_experts import QuantExperts
    from lowbit.plans.source import build_plan
    from lowbit.ptq import quantize_model

    folder, calib, ev = organism_data(organism, seed)
    fp = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ppl_fp = perplexity(fp, ev, seqlen=EVAL_SEQLEN, windows=EVAL_WINDOWS, progress=False).ppl
    model = copy.deepcopy(fp)
    method, settings = ROWS[name]
    if method == "signround2":
        settings = {**settings, "seed": seed}
    rss0 = peak_rss_mib()
    t0 = time.perf_counter()
    plan = quantize_model(model, build_plan(model, scheme), method, settings, calib=calib, progress=False)
    seconds = time.perf_counter() - t0
    ppl = perplexity(model, ev, seqlen=EVAL_SEQLEN, windows=EVAL_WINDOWS, progress=False).ppl
    tokens = {n: m.calibration for n, m in model.named_modules() if isinstance(m, QuantExperts) and m.calibration}
    return {"tool": f"lowbit-{name}", "scheme": scheme, "seed": seed, "method": method, "settings": settings,
            "seconds": round(seconds, 2), "peak_rss_mib": peak_rss_mib(), "peak_rss_before_mib": rss0,
            "ppl_fp": ppl_fp, "ppl": ppl, "plan": plan.describe(), "matmul_weights": account_model(model).to_dict(),
            "expert_tokens": tokens, "coverage": coverage(tokens), "seed_kind": SEED_KIND, "machine": machine(),
            "organism_sha256": organism_digest(folder)}


def stats_cost(organism: Path, repeats: int = 5) -> dict:
    """Seconds of a forward over the calibration windows without statistics, with routed-only and with all-experts
    per-expert statistics (X^T X of both matrices' inputs, what GPTQ reads), medians of ``repeats``; and the
    statistics' memory (float64 sums, the same in both modes)."""
    import statistics

    import torch
    from transformers import AutoModelForCausalLM

    from lowbit.models.experts import expert_tensors
    from lowbit.ptq.expert_calib import expert_stats

    folder, calib, _ = organism_data(organism, 0)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    mods = {t.module: model.get_submodule(t.module) for t in expert_tensors(model).values()}
    out: dict = {}
    for mode in ("none", "routed", "all_experts"):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            with torch.no_grad(), expert_stats(mods if mode != "none" else {}, ("xtx",),
                                               all_experts=mode == "all_experts") as st:
                for part in calib.split(8):
                    model(input_ids=part, use_cache=False)
            times.append(time.perf_counter() - t0)
        out[f"seconds_{mode}"] = round(statistics.median(times), 3)
        if mode != "none":
            out["statistics_mib"] = round(sum(t.numel() * 8 for s in st.values() for t in s.sums.values()) / 2**20, 2)
    return {"tool": "lowbit-stats-cost", "scheme": "-", "seed": 0, **out, "calib_tokens": calib.numel(),
            "experts_per_layer": model.config.num_experts, "top_k": model.config.num_experts_per_tok,
            "machine": machine()}


def coverage(tokens: dict) -> dict:
    """The smallest number of calibration tokens any expert got (routed / behind its statistics), and how many
    expert-layer pairs got fewer than 16 (the fallback threshold)."""
    if not tokens:
        return {}
    routed = [n for t in tokens.values() for n in t["routed"]]
    stats = [n for t in tokens.values() for n in t["statistics_tokens"]]
    return {"min_routed": min(routed), "min_statistics_tokens": min(stats),
            "experts_below_16_statistics_tokens": sum(n < 16 for n in stats), "experts": len(stats)}


def _recorded(results: str, peer_results: str) -> dict[tuple[str, str], dict[int, float]]:
    """(scheme, tool) -> {seed: perplexity} of lowbit's rows (``results``) and the peers' (``peer_results``)."""
    ours = json.loads(result_path(results).read_text())["rows"] if result_path(results).exists() else []
    peers_file = result_path(peer_results)
    peers = json.loads(peers_file.read_text())["rows"] if peers_file.exists() else []
    got: dict[tuple[str, str], dict[int, float]] = {}
    for r in (r for r in ours if "ppl" in r):
        got.setdefault((r["scheme"], r["tool"]), {})[int(r.get("seed", 0))] = r["ppl"]
    for r in peers:
        if r.get("ppl_in_memory") is not None:
            got.setdefault((r["scheme"], r["tool"]), {})[int(r.get("seed", 0))] = r["ppl_in_memory"]
    return got


def table(results: str = RESULTS, peer_results: str = "moe_peers") -> str:
    """lowbit's rows beside the peers' (moe_peers.json) at the same scheme."""
    ours = json.loads(result_path(results).read_text())["rows"] if result_path(results).exists() else []
    peers_file = result_path(peer_results)
    peers = json.loads(peers_file.read_text())["rows"] if peers_file.exists() else []
    rows = [(r["scheme"], r["tool"], int(r.get("seed", 0)), f"{r['ppl']:.3f}", f"{r['ppl_fp']:.3f}", r["seconds"],
             f"{100 * r['matmul_weights']['quantized_share']:.1f}%") for r in ours if "ppl" in r]
    rows += [(r["scheme"], r["tool"], int(r.get("seed", 0)), f"{r['ppl_in_memory']:.3f}", f"{r['ppl_fp']:.3f}",
              r["seconds"], "") for r in peers if r.get("ppl_in_memory") is not None]
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    return markdown_table(("scheme", "tool", "seed", "ppl", "ppl fp", "seconds", "lowbit: matmul weights quantized"),
                          rows)


def mean_se(values: list[float]) -> tuple[float, float | None]:
    """Mean and its standard error (sample standard deviation / sqrt(n); None for one value)."""
    n = len(values)
    m = sum(values) / n
    return m, (sum((v - m) ** 2 for v in values) / (n - 1) / n) ** 0.5 if n > 1 else None


def means(results: str = RESULTS, peer_results: str = "moe_peers") -> str:
    """Mean perplexity over seeds per (scheme, tool), lowbit's and the peers' rows, with the seeds behind each and
    the standard error of the mean (a tool's seeds can differ from another's: compare on `ranking`'s common seeds)."""
    rows = []
    for (s, t), v in sorted(_recorded(results, peer_results).items()):
        m, se = mean_se(list(v.values()))
        rows.append((s, t, ",".join(map(str, sorted(v))), f"{m:.3f}", "-" if se is None else f"{se:.3f}"))
    return markdown_table(("scheme", "tool", "seeds", "mean ppl", "s.e."), rows)


def ranking(tools: list[str], results: str = RESULTS, peer_results: str = "moe_peers") -> str:
    """Per scheme, ``tools`` on the seeds all of them have: mean +- s.e., the paired difference to the first tool
    +- its s.e. (the seed's calibration windows are shared, so the pairing removes their common part), and on how
    many seeds each tool has the lowest perplexity of the set."""
    got = _recorded(results, peer_results)
    out = []
    for scheme in sorted({s for s, _ in got}):
        have = [got.get((scheme, t), {}) for t in tools]
        seeds = sorted(set.intersection(*(set(h) for h in have))) if all(have) else []
        if len(seeds) < 2:
            continue
        best = [min(range(len(tools)), key=lambda i, x=x: have[i][x]) for x in seeds]
        for i, t in enumerate(tools):
            m, se = mean_se([have[i][x] for x in seeds])
            d, dse = mean_se([have[i][x] - have[0][x] for x in seeds])
            out.append((scheme, t, len(seeds), f"{m:.3f} +- {se:.3f}",
                        "-" if i == 0 else f"{d:+.3f} +- {dse:.3f}", f"{best.count(i)}/{len(seeds)}"))
    return markdown_table(("scheme", "tool", "seeds", "mean ppl +- s.e.", f"paired diff vs {tools[0]}",
                           "seeds won"), out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default="w4g128,w3g128,w2g64", help="comma-separated uniform schemes")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows among {', '.join(ROWS)}")
    p.add_argument("--seeds", default="0", help="comma-separated calibration-window seeds (one row per seed)")
    p.add_argument("--organism", default=str(ORGANISM), help="the MoE organism's folder")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: timings unaffected by a busy machine)")
    p.add_argument("--table", action="store_true", help="print the table of the recorded rows and exit")
    p.add_argument("--rank", default=None, help="with --table: comma-separated tools to rank on their common seeds "
                                                "(the first is the reference of the paired differences)")
    p.add_argument("--results", default=RESULTS, help="lowbit's results file under benchmarks/results (rows merge)")
    p.add_argument("--peer-results", default="moe_peers", help="the peers' results file read by --table")
    p.add_argument("--stats-cost", action="store_true", help="measure the per-expert statistics' cost and exit")
    p.add_argument("--child", nargs=3, metavar=("ROW", "SCHEME", "SEED"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.table:
        print(table(a.results, a.peer_results))
        print(means(a.results, a.peer_results))
        if a.rank:
            print(ranking(a.rank.split(","), a.results, a.peer_results))
        return
    organism = Path(a.organism).expanduser()
    if not (organism / "model" / "config.json").is_file():
        p.error(f"{organism} has no model/; build it first: python -m benchmarks.organism --arch qwen3moe")
    bad = [r for r in a.rows.split(",") if r not in ROWS]
    if bad:
        p.error(f"unknown rows {bad}; choose from {', '.join(ROWS)}")
    if a.stats_cost:
        import torch

        torch.set_num_threads(a.threads)
        r = stats_cost(organism)
        merge_row(a.results, r, row_key)
        print(json.dumps(r))
        return
    if a.child:
        import torch

        torch.set_num_threads(a.threads)
        print("ROW " + json.dumps(row(a.child[0], a.child[1], organism, int(a.child[2])), default=str))
        return
    # one process per row: its seconds and peak RSS are its own (all-experts calibration's cost vs routed-only)
    for seed, scheme, name in ((int(x), s, r) for x in a.seeds.split(",") for s in a.schemes.split(",")
                               for r in a.rows.split(",")):
        cmd = [sys.executable, "-m", "benchmarks.moe", "--child", name, scheme, str(seed), "--threads", str(a.threads),
               "--organism", str(organism)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        lines = [x for x in done.stdout.splitlines() if x.startswith("ROW ")]
        if done.returncode or not lines:
            print(f"{name} {scheme} seed {seed}: failed (exit {done.returncode})\n{done.stderr[-3000:]}", file=sys.stderr)
            continue
        r = json.loads(lines[-1][4:])
        merge_row(a.results, r, row_key)
        print(f"{r['tool']} {scheme} seed {seed}: ppl {r['ppl']:.3f} (fp {r['ppl_fp']:.3f}) in {r['seconds']} s, "
              f"peak {r['peak_rss_mib']:.0f} MiB, coverage {r['coverage']}", flush=True)
    print(table(a.results, a.peer_results))
    print(means(a.results, a.peer_results))


if __name__ == "__main__":
    main()
