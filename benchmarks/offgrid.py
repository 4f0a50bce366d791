"""The off-grid model: the bundled SmolLM2 with a seeded Haar-random rotation of its residual stream folded in.

The bundled SmolLM2-135M is a Q4_1 GGUF: its "float" weights lie exactly on an asymmetric
4-bit group-32 grid, which gives any method whose grid aligns with it a head start (and
makes every rotation look harmful). ``benchmarks.common.offgrid_folder`` makes, once, a copy
with a dense random orthogonal rotation of the residual stream folded into the weights
(lowbit's own rotation, ``RotationSettings(kind="haar")``): the same function, weights on
no grid. The other scripts run on it with ``--model offgrid``. This script records the
check on the real model (the test suite checks the same on a tiny one):

- perplexity of the bundled model and of its off-grid copy on the full protocol (40 x 512
  tokens of the evaluation split), and their relative difference (target: below 1e-3);
- for every decoder Linear, the share of 32-column groups holding at most 16 distinct
  values: a 4-bit quantizer with groups of 32, 64 or 128 columns (symmetric or not, any
  scale) reproduces a weight exactly only if every such group does, so a share of 0 means
  none can; and the relative error of lowbit's plain RTN at w4 g32 / g64 / g128, symmetric
  and asymmetric (its smallest value over the Linears). RTN does not find the bundled
  model's grid either: Q4_1 stores a float minimum per group, lowbit's asymmetric INT
  grids an integer zero point, so the count of values is what shows the grid;
- the copy's digest (sha256 of its safetensors file), its seed and source digest.

    python -m benchmarks.offgrid                                   # writes benchmarks/results/offgrid.json
    python -m benchmarks.offgrid --windows 2 --out /tmp/offgrid.json  # smoke
    python -m benchmarks.offgrid --source PATH --windows 2 --out /tmp/x.json  # another model's copy
    python -m benchmarks.offgrid --headline   # the README's headline rows on both models, from the other results
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

from benchmarks import common

GROUP = 32  # the smallest group any of the checked quantizers uses: a coarser grid is on this one too
LEVELS = 16  # values a 4-bit code can take
RTN_SCHEMES = ("w4g32", "w4g32a", "w4g64", "w4g64a", "w4g128", "w4g128a")


def grid_stats(model: Any, schemes: tuple[str, ...] = RTN_SCHEMES) -> dict[str, Any]:
    """How close the decoder Linears' weights are to any 4-bit group grid (see the module doc)."""
    import torch

    from lowbit.formats import Scheme, quantize
    from lowbit.models import linear_layers

    on_grid = groups = 0
    worst = {s: math.inf for s in schemes}
    for m in linear_layers(model).values():
        w = m.weight.detach().float()
        cols = w.shape[1] // GROUP * GROUP
        g = w[:, :cols].reshape(w.shape[0], -1, GROUP).sort(dim=-1).values
        distinct = (g.diff(dim=-1) != 0).sum(-1) + 1
        on_grid += int((distinct <= LEVELS).sum())
        groups += distinct.numel()
        norm = float(torch.linalg.norm(w))
        for s in schemes:
            if Scheme.parse(s).group_size > w.shape[1]:  # a group wider than the row: no such quantizer
                continue
            err = float(torch.linalg.norm(quantize(w, s).dequantize() - w)) / max(norm, 1e-30)
            worst[s] = min(worst[s], err)
    return {"groups": groups, "groups_at_most_16_values": on_grid, "share_on_a_4bit_grid": on_grid / max(groups, 1),
            "min_rtn_rel_error": worst}


def measure(source: str | None, windows: int, seqlen: int) -> dict[str, Any]:
    import torch

    from lowbit.data import eval_tokens
    from lowbit.eval import perplexity
    from lowbit.models import load_model

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    folder = common.offgrid_folder(source)
    made_s = round(time.perf_counter() - t0, 1)
    out: dict[str, Any] = {"copy": common.offgrid_info(folder), "folder": str(folder), "seconds_to_make_or_check":
                           made_s, "windows": windows, "seqlen": seqlen, "machine": common.machine()}
    for name, src in (("source", source), ("offgrid", str(folder))):
        lm = load_model(src)
        tokens = eval_tokens(lm.tokenizer)
        r = perplexity(lm.model, tokens, seqlen=seqlen, windows=windows, progress=False)
        out[name] = {"ppl": r.ppl, "eval_tokens": r.tokens, **grid_stats(lm.model)}
        del lm
    out["ppl_rel_diff"] = abs(out["offgrid"]["ppl"] / out["source"]["ppl"] - 1)
    return out


# The README's headline rows, each on both models: (what, [(results file, row match)] for lowbit, the same for
# the peer, the peer's name). A row matches when every field equals (a list: any of them); rows of other
# models never match; several matching rows (seeds) give their mean.
_W2_LOWBIT = ["w2g64", "w2g64-seed1", "w2g64-seed2", "w2g64-seed3"]
_W2_AR = ["w2g64-v2", "w2g64-v2-seed1", "w2g64-v2-seed2"]
HEADLINE: list[tuple[str, list, list, str]] = [
    ("float (40 x 512)", [("ptq_methods", {"row": "fp"})], [], ""),
    ("RTN W4 g128 (plain)", [("ptq", {"config": "rtn-w4g128", "tool": "lowbit"})],
     [("ptq", {"config": "rtn-w4g128", "tool": "autoround"})], "auto-round"),
    # (the bundled model's lowbit W4 row is "w4g128-filter": the loss filter, since then on by default)
    ("SignRoundV2 W4 g128, 50 iters, fp32", [("ptq", {"config": ["w4g128", "w4g128-filter"], "tool": "lowbit"})],
     [("ptq", {"config": "w4g128", "tool": "autoround"})], "auto-round"),
    ("SignRoundV2 W3 g128, fp32", [("ptq", {"config": "w3g128", "tool": "lowbit"})],
     [("ptq", {"config": "w3g128", "tool": "autoround"})], "auto-round"),
    ("SignRoundV2 W2 g64, fp32, mean of seeds", [("ptq", {"config": _W2_LOWBIT, "tool": "lowbit"})],
     [("ptq", {"config": _W2_AR, "tool": "autoround"})], "auto-round V2"),
    # bf16 tuning (auto-round: amp): a fifth of the fp32 rows' CPU time, the off-grid rows' setting
    ("SignRoundV2 W4 g128, bf16", [("ptq", {"config": ["w4g128-bf16", "w4g128-bf16-seed1"], "tool": "lowbit"})],
     [("ptq", {"config": ["w4g128-bf16", "w4g128-bf16-seed1"], "tool": "autoround"})], "auto-round amp"),
    ("SignRoundV2 W3 g128, bf16", [("ptq", {"config": ["w3g128-bf16", "w3g128-bf16-seed1"], "tool": "lowbit"})],
     [("ptq", {"config": ["w3g128-bf16", "w3g128-bf16-seed1"], "tool": "autoround"})], "auto-round amp"),
    ("SignRoundV2 W2 g64, bf16, mean of seeds",
     [("ptq", {"config": ["w2g64-bf16", "w2g64-bf16-seed1", "w2g64-bf16-seed2"], "tool": "lowbit"})],
     [("ptq", {"config": ["w2g64-bf16", "w2g64-v2-amp-seed1"], "tool": "autoround"})], "auto-round V2 amp"),
    ("GPTQ W4 g64", [("ptq_methods", {"row": "w4g64/gptq"})], [("ptq_methods", {"row": "w4g64/llmc-gptq"})],
     "llm-compressor"),
    ("GPTQ W2 g64", [("ptq_methods", {"row": "w2g64/gptq"})], [("ptq_methods", {"row": "w2g64/llmc-gptq"})],
     "llm-compressor"),
    ("AWQ + RTN W4 g64", [("ptq_methods", {"row": "w4g64/awq-rtn"})],
     [("ptq_methods", {"row": "w4g64/llmc-awq-rtn"})], "llm-compressor"),
    ("W4A4 NVFP4 4-over-6 RTN, no search", [("acts", {"row": "nvfp4-rtn-46"})],
     [("acts", {"row": "nvfp4-fouroversix-46"})], "fouroversix"),
    ("W4A4 NVFP4 4-over-6 RTN, lowbit's search", [("acts", {"row": "nvfp4-rtn-46-search"})],
     [("acts", {"row": "nvfp4-fouroversix-46"})], "fouroversix"),
    ("W4A4 NVFP4 RTN abs-max", [("acts", {"row": "nvfp4-rtn-absmax"})], [("acts", {"row": "nvfp4-ar-rtn"})],
     "auto-round"),
    # the peers' input convention (each input's own tensor scale at every call): a diagnostic of the rows above
    ("W4A4 NVFP4 4-over-6 RTN, no search, per-call input scale", [("acts", {"row": "nvfp4-rtn-46-percall"})],
     [("acts", {"row": "nvfp4-fouroversix-46"})], "fouroversix"),
    # ... and each weight's own tensor scale instead of its fused group's shared one: fouroversix's model exactly
    ("W4A4 NVFP4 4-over-6 RTN, no search, per-call input scale, own weight tensor scales",
     [("acts", {"row": "nvfp4-rtn-46-percall-own"})], [("acts", {"row": "nvfp4-fouroversix-46"})], "fouroversix"),
    ("W4A4 NVFP4 RTN abs-max, per-call input scale", [("acts", {"row": "nvfp4-rtn-absmax-percall"})],
     [("acts", {"row": "nvfp4-ar-rtn"})], "auto-round"),
    ("W4A4 MXFP4 RTN", [("acts", {"row": "mxfp4-rtn"})], [("acts", {"row": "mxfp4-ar-rtn"})], "auto-round"),
    ("SignRoundV2 W4A4 NVFP4, mean of seeds", [("acts", {"row": ["nvfp4-sr2-s0", "nvfp4-sr2-s1"]})],
     [("acts", {"row": ["nvfp4-ar-s0", "nvfp4-ar-s1"]})], "auto-round"),
    ("SignRoundV2 W4A4 MXFP4, mean of seeds", [("acts", {"row": ["mxfp4-sr2-s0", "mxfp4-sr2-s1"]})],
     [("acts", {"row": ["mxfp4-ar-s0", "mxfp4-ar-s1"]})], "auto-round"),
    ("GGUF float through llama.cpp (4 x 512)", [("gguf", {"mix": "f32", "method": "float"})], [], ""),
    ("GGUF Q4_K_M, GPTQ (llama.cpp, 4 x 512)", [("gguf", {"mix": "q4_k_m", "method": "gptq", "nsamples": 16, "embeddings": "f16"})],
     [("gguf", {"mix": "q4_k_m", "method": "llamacpp-imatrix", "nsamples": 16, "embeddings": "f16"})], "llama.cpp + imatrix"),
    ("GGUF Q3_K_M, GPTQ (llama.cpp, 4 x 512)",
     [("gguf", {"mix": "q3_k_m", "method": "gptq", "nsamples": 16, "embeddings": "f16"})],
     [("gguf", {"mix": "q3_k_m", "method": "llamacpp-imatrix", "nsamples": 16, "embeddings": "f16"})],
     "llama.cpp + imatrix"),
    ("GGUF Q2_K, GPTQ (llama.cpp, 4 x 512)", [("gguf", {"mix": "gguf:q2_k", "method": "gptq", "nsamples": 16, "embeddings": "f16"})],
     [("gguf", {"mix": "gguf:q2_k", "method": "llamacpp-imatrix", "nsamples": 16, "embeddings": "f16"})], "llama.cpp + imatrix"),
    ("GGUF Q4_K_M, RTN (searched)", [("gguf", {"mix": "q4_k_m", "method": "rtn", "nsamples": 16, "embeddings": "f16"})],
     [("gguf", {"mix": "q4_k_m", "method": "llamacpp", "nsamples": 16, "embeddings": "f16"})], "llama.cpp, no imatrix"),
    ("GGUF Q2_K, RTN (searched)", [("gguf", {"mix": "gguf:q2_k", "method": "rtn", "nsamples": 16, "embeddings": "f16"})],
     [("gguf", {"mix": "gguf:q2_k", "method": "llamacpp", "nsamples": 16, "embeddings": "f16"})], "llama.cpp, no imatrix"),
]
for _scheme in ("w4g128", "w3g128", "w2g64", "w4a4-nvfp4", "w4a4-mxfp4"):
    for _method in ("rtn", "gptq"):
        HEADLINE.append((f"{_scheme} {_method}: unrotated / + Hadamard rotation (issue 24)",
                         [("ptq_methods", {"row": f"{_scheme}/{_method}"})],
                         [("ptq_methods", {"row": f"{_scheme}/{_method}/rot"})], "(rotated)"))
        if _scheme.startswith("w4a4"):
            HEADLINE.append((f"{_scheme} {_method}: unrotated / online rotation before down_proj only",
                             [("ptq_methods", {"row": f"{_scheme}/{_method}"})],
                             [("ptq_methods", {"row": f"{_scheme}/{_method}/rot-online"})], "(rotated)"))


def _ppl(row: dict) -> float | None:
    return row.get("ppl", row.get("ppl_llamacpp"))


def _matches(row: dict, match: dict, model: str) -> bool:
    if row.get("model", "bundled") != model:
        return False
    for k, want in match.items():
        # gguf rows before per-row sizes were 16 x 256, before issue 39's `embeddings` field all F16 tables
        have = row.get(k, {"nsamples": 16, "embeddings": "f16"}.get(k))
        if have not in (want if isinstance(want, list) else [want]):
            return False
    return True


def headline_values(results: dict[str, list[dict]], picks: list, model: str) -> list[float]:
    """Perplexities of the rows ``picks`` selects on ``model``, from ``results`` (file name -> rows)."""
    return [v for name, match in picks for r in results.get(name, [])
            if _matches(r, match, model) and (v := _ppl(r)) is not None]


SEED_KIND = "tuning"  # every averaged ptq / acts row: the tuning seed (mini-batch order) on the seed-0 calibration


def headline_rows(results: dict[str, list[dict]] | None = None) -> list[dict[str, Any]]:
    """The headline rows on both models, as data: each cell's mean over its matching runs (seeds) and their count.

    Recorded in offgrid.json (``headline``) so the README's off-grid column traces to one file;
    a cell with several runs averages seeds of one kind (`SEED_KIND`) on both sides.
    """
    if results is None:
        results = {n: common.load_results(n)["rows"] for n in ("ptq", "ptq_methods", "acts", "gguf")}

    def cell(picks: list, model: str) -> dict[str, Any] | None:
        v = headline_values(results, picks, model)
        return {"ppl": round(sum(v) / len(v), 4), "runs": len(v)} if v else None

    rows = []
    for what, lb, peer, name in HEADLINE:
        row = {"what": what, "peer": name, **{f"{m}_{side}": cell(picks, m) for m in ("bundled", "offgrid")
                                               for side, picks in (("lowbit", lb), ("peer", peer))}}
        if any(c and c["runs"] > 1 for k, c in row.items() if k not in ("what", "peer")):
            row["seed_kind"] = SEED_KIND
        rows.append(row)
    return rows


def headline(results: dict[str, list[dict]] | None = None) -> str:
    """The headline rows on the bundled model and on its off-grid copy, side by side (means over seeds)."""
    def fmt(c: dict[str, Any] | None) -> str:
        return "" if c is None else f"{c['ppl']:.2f}" + (f" ({c['runs']} runs)" if c["runs"] > 1 else "")

    rows = [[r["what"], *(fmt(r[f"{m}_{side}"]) for m in ("bundled", "offgrid") for side in ("lowbit", "peer")),
             r["peer"]] for r in headline_rows(results)]
    return common.markdown_table(["what", "bundled: lowbit", "bundled: peer", "off-grid: lowbit", "off-grid: peer",
                                  "peer"], rows)


def table(data: dict) -> str:
    rows = []
    for name in ("source", "offgrid"):
        d = data[name]
        rows.append([name, f"{d['ppl']:.4f}", f"{d['groups_at_most_16_values']} / {d['groups']}",
                     *(f"{d['min_rtn_rel_error'][s]:.2e}" for s in RTN_SCHEMES)])
    head = ["model", "ppl", "32-col groups with <= 16 values", *(f"RTN {s} min rel err" for s in RTN_SCHEMES)]
    return (common.markdown_table(head, rows) + f"\n\nppl relative difference {data['ppl_rel_diff']:.2e}; "
            f"off-grid copy's sha256 {data['copy']['sha256']}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.offgrid", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default=None, help="model to copy (default: the bundled SmolLM2-135M)")
    p.add_argument("--windows", type=int, default=common.EVAL_WINDOWS)
    p.add_argument("--seqlen", type=int, default=common.EVAL_SEQLEN)
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/offgrid.json)")
    p.add_argument("--table", action="store_true", help="print the recorded results and exit")
    p.add_argument("--headline", action="store_true",
                   help="print the headline rows of ptq / ptq_methods / acts / gguf .json on both models, record "
                        "them in the results file (headline) and exit")
    return p


def main(argv: list[str] | None = None) -> None:
    from lowbit.errors import LowbitError

    a = parser().parse_args(argv)
    out = common.out_path(a.out, "offgrid.json")
    if a.table:
        print(table(common.load_results(out, empty={})))
        return
    if a.headline:  # printed, and recorded in the results file beside the copy's own measurements
        data = common.load_results(out, empty={})
        data["headline"] = headline_rows()
        common.save_results(out, data)
        print(headline())
        return
    try:
        data = measure(a.source, a.windows, a.seqlen)
    except LowbitError as e:  # e.g. an architecture whose residual stream lowbit cannot rotate
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    previous = common.load_results(out, empty={})
    if "headline" in previous:  # re-measuring the copy keeps the recorded rows
        data["headline"] = previous["headline"]
    common.save_results(out, data)
    print(table(data))
    print(json.dumps({"out": str(out)}))


if __name__ == "__main__":
    main()
