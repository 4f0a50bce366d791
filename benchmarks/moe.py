"""lowbit on the float MoE organism: the experts quantized whole (RTN today), beside the peers' rows.

The organism is the Qwen3-MoE of ``python -m benchmarks.organism --arch qwen3moe`` (16 experts,
top-2, 81 % of its matmul weights in the experts). Each row quantizes a fresh copy of it with
lowbit's uniform plan, which covers the fused experts tensors (every expert's matrix grouped
along its input like a Linear), the attention Linears, and leaves routers, embeddings and the
tied head in 16 bits, then measures perplexity on the same 40 x 512 evaluation tokens and with
the same 32 x 256 calibration windows (seed 0) as ``benchmarks/moe_peers.py`` (its
``organism_data``), so the peers' rows in ``results/moe_peers.json`` compare directly.

Rows: ``rtn`` = plain round-to-nearest (``--method rtn --no-search``, what auto-round's
``disable_opt_rtn`` row is); ``rtn-search`` = lowbit's default RTN (scales by the
importance-weighted search on calibration activations for the Linears, by the weight-only
search for the experts). GPTQ / SignRound on experts are refused today (issue 34, later
rows). One seed: W4 g128 barely moves this organism; rank methods on W3 / W2 and on means of
seeds.

    python -m benchmarks.moe --schemes w4g128,w3g128,w2g64
    python -m benchmarks.moe --table
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
ROWS = {"rtn": False, "rtn-search": True}  # row -> RTN's search


def row(name: str, scheme: str, organism: Path) -> dict:
    """Quantize a fresh copy of the organism with ``scheme`` and RTN (``name``'s search); perplexity before/after."""
    import torch
    from transformers import AutoModelForCausalLM

    from lowbit.eval import perplexity
    from lowbit.models.accounting import account_model
    from lowbit.plans.source import build_plan
    from lowbit.ptq import quantize_model

    folder, calib, ev = organism_data(organism)
    fp = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ppl_fp = perplexity(fp, ev, seqlen=EVAL_SEQLEN, windows=EVAL_WINDOWS, progress=False).ppl
    model = copy.deepcopy(fp)
    t0 = time.perf_counter()
    plan = quantize_model(model, build_plan(model, scheme), "rtn", {"search": ROWS[name]}, calib=calib,
                          progress=False)
    seconds = time.perf_counter() - t0
    ppl = perplexity(model, ev, seqlen=EVAL_SEQLEN, windows=EVAL_WINDOWS, progress=False).ppl
    return {"tool": f"lowbit-{name}", "scheme": scheme, "seconds": round(seconds, 2), "peak_rss_mib": peak_rss_mib(),
            "ppl_fp": ppl_fp, "ppl": ppl, "plan": plan.describe(), "matmul_weights": account_model(model).to_dict(),
            "machine": machine()}


def table() -> str:
    """lowbit's rows beside the peers' (moe_peers.json) at the same scheme."""
    ours = json.loads(result_path(RESULTS).read_text())["rows"] if result_path(RESULTS).exists() else []
    peers_file = result_path("moe_peers")
    peers = json.loads(peers_file.read_text())["rows"] if peers_file.exists() else []
    rows = [(r["scheme"], r["tool"], f"{r['ppl']:.3f}", f"{r['ppl_fp']:.3f}", r["seconds"],
             f"{100 * r['matmul_weights']['quantized_share']:.1f}%") for r in ours]
    rows += [(r["scheme"], r["tool"], f"{r['ppl_in_memory']:.3f}", f"{r['ppl_fp']:.3f}", r["seconds"], "")
             for r in peers if r.get("ppl_in_memory") is not None]
    rows.sort(key=lambda r: (r[0], r[1]))
    return markdown_table(("scheme", "tool", "ppl", "ppl fp", "seconds", "lowbit: matmul weights quantized"), rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default="w4g128,w3g128,w2g64", help="comma-separated uniform schemes")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows among {', '.join(ROWS)}")
    p.add_argument("--organism", default=str(ORGANISM), help="the MoE organism's folder")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: timings unaffected by a busy machine)")
    p.add_argument("--table", action="store_true", help="print the table of the recorded rows and exit")
    a = p.parse_args()
    if a.table:
        print(table())
        return
    organism = Path(a.organism).expanduser()
    if not (organism / "model" / "config.json").is_file():
        p.error(f"{organism} has no model/; build it first: python -m benchmarks.organism --arch qwen3moe")
    import torch

    torch.set_num_threads(a.threads)
    for scheme in a.schemes.split(","):
        for name in a.rows.split(","):
            r = row(name, scheme, organism)
            merge_row(RESULTS, r, ("tool", "scheme"))
            print(f"{r['tool']} {scheme}: ppl {r['ppl']:.3f} (fp {r['ppl_fp']:.3f}) in {r['seconds']} s", flush=True)
    print(table())


if __name__ == "__main__":
    main()
