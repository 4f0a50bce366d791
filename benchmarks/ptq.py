"""PTQ benchmark: lowbit SignRound(V2) vs auto-round 0.16.x on the bundled model.

Protocol (issue 4): the bundled SmolLM2-135M, calibration 32 x 256 tokens from the
calibration split (the *same* token tensor is handed to both tools), evaluation = the
default perplexity protocol (40 windows x 512 tokens of the eval split), fp32, one
thread each. Every (config, tool) row runs in its own process so wall time and peak
RSS are its own; rows are merged into ``benchmarks/results/ptq.json`` as they finish
(atomically), so an interrupted sweep keeps what it measured.

    python -m benchmarks.ptq --configs w4g128 --tools lowbit,autoround
    python -m benchmarks.ptq --configs w4g128 --tools lowbit,autoround --model offgrid   # the off-grid copy
    python -m benchmarks.ptq --list
    python -m benchmarks.ptq --table
    python -m benchmarks.ptq --configs rtn-w4g128,w4g128 --tools lowbit --nsamples 4 --seqlen 64 \
        --iters 1 --windows 2 --out /tmp/ptq_smoke.json                 # smoke: the same code path in ~1 min

auto-round settings: ``amp=False``, ``device_map='cpu'``, same iters / nsamples / seqlen
/ batch size; its iters=0 default is an importance-searched RTN, plain RTN is
``disable_opt_rtn=True`` (lowbit's ``rtn-*`` rows are plain RTN too: ``search=False``).
The ``autoround`` tool needs auto-round installed (``make bench-setup``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import (
    BATCH,
    EVAL_SEQLEN,
    EVAL_WINDOWS,
    MODEL_HELP,
    MODELS,
    NSAMPLES,
    SEQLEN,
    bundled_model,
    calibration,
    emit,
    gemm_gflops,
    load_results,
    machine,
    merge_row,
    model_fields,
    offgrid_folder,
    out_path,
    peak_rss_mib,
    require_peer,
    run_child,
    tuning_gflop,
)

TOOLS = ("lowbit", "autoround")
SIGNROUND_KEYS = ("iters", "seed", "loss_filter", "tune_dtype")  # config keys that are SignRoundSettings fields

# name -> (lowbit method, lowbit scheme/extra, auto-round kwargs or None)
CONFIGS: dict[str, dict] = {
    "w4g128": {"lowbit": {"method": "signround2", "scheme": "w4g128", "iters": 50, "tune_dtype": "fp32"},
               "autoround": {"bits": 4, "group_size": 128, "sym": True, "iters": 50}},
    "w3g128": {"lowbit": {"method": "signround2", "scheme": "w3g128", "iters": 50, "tune_dtype": "fp32"},
               "autoround": {"bits": 3, "group_size": 128, "sym": True, "iters": 50}},
    "w2g64": {"lowbit": {"method": "signround2", "scheme": "w2g64", "iters": 50, "tune_dtype": "fp32"},
              "autoround": {"bits": 2, "group_size": 64, "sym": True, "iters": 50}},
    # the tuning seed (mini-batch order) only: how much of a W2 gap is seed noise
    "w2g64-seed1": {"lowbit": {"method": "signround2", "scheme": "w2g64", "iters": 50, "tune_dtype": "fp32",
                               "seed": 1}},
    "w2g64-seed2": {"lowbit": {"method": "signround2", "scheme": "w2g64", "iters": 50, "tune_dtype": "fp32",
                               "seed": 2}},
    "w2g64-v2": {"autoround": {"bits": 2, "group_size": 64, "sym": True, "iters": 50, "enable_alg_ext": True}},
    # bf16 products of the tuned Linears (what tune_dtype "auto" picks on CPUs with AVX512-BF16);
    # the rows above pin fp32. auto-round's own mixed precision (amp=True) is the like-for-like peer
    "w4g128-bf16": {"lowbit": {"method": "signround2", "scheme": "w4g128", "iters": 50, "tune_dtype": "bf16"},
                    "autoround": {"bits": 4, "group_size": 128, "sym": True, "iters": 50, "amp": True}},
    "w3g128-bf16": {"lowbit": {"method": "signround2", "scheme": "w3g128", "iters": 50, "tune_dtype": "bf16"},
                    "autoround": {"bits": 3, "group_size": 128, "sym": True, "iters": 50, "amp": True}},
    "w2g64-bf16": {"lowbit": {"method": "signround2", "scheme": "w2g64", "iters": 50, "tune_dtype": "bf16"},
                   "autoround": {"bits": 2, "group_size": 64, "sym": True, "iters": 50, "amp": True,
                                 "enable_alg_ext": True}},
    # W2 g64 moves by ~1 ppl under perturbations that leave the math unchanged (a loss
    # reduction's summation order, the tuning seed), for both tools: compare means over seeds
    "w2g64-bf16-seed2": {"lowbit": {"method": "signround2", "scheme": "w2g64", "iters": 50, "tune_dtype": "bf16",
                                    "seed": 2}},
    "w2g64-v2-seed1": {"autoround": {"bits": 2, "group_size": 64, "sym": True, "iters": 50, "enable_alg_ext": True,
                                     "seed": 1}},
    # a third seed of each tool at W2 g64 fp32 (>= 3 seeds per tool before a W2 claim)
    "w2g64-v2-seed2": {"autoround": {"bits": 2, "group_size": 64, "sym": True, "iters": 50, "enable_alg_ext": True,
                                     "seed": 2}},
    "w2g64-seed3": {"lowbit": {"method": "signround2", "scheme": "w2g64", "iters": 50, "tune_dtype": "fp32",
                               "seed": 3}},
    "w2g64-v2-amp-seed1": {"autoround": {"bits": 2, "group_size": 64, "sym": True, "iters": 50, "amp": True,
                                         "enable_alg_ext": True, "seed": 1}},
    # second seeds of the bf16 / amp pairs, both tools: the tuning seed on the same seed-0 calibration tokens
    "w4g128-bf16-seed1": {"lowbit": {"method": "signround2", "scheme": "w4g128", "iters": 50, "tune_dtype": "bf16",
                                     "seed": 1},
                          "autoround": {"bits": 4, "group_size": 128, "sym": True, "iters": 50, "amp": True,
                                        "seed": 1}},
    "w3g128-bf16-seed1": {"lowbit": {"method": "signround2", "scheme": "w3g128", "iters": 50, "tune_dtype": "bf16",
                                     "seed": 1},
                          "autoround": {"bits": 3, "group_size": 128, "sym": True, "iters": 50, "amp": True,
                                        "seed": 1}},
    "w2g64-bf16-seed1": {"lowbit": {"method": "signround2", "scheme": "w2g64", "iters": 50, "tune_dtype": "bf16",
                                    "seed": 1}},
    "w4g128-v1": {"lowbit": {"method": "signround", "scheme": "w4g128", "iters": 50, "tune_dtype": "fp32"}},
    # the loss filter is on at every width by default; these two pin it either way
    "w4g128-filter": {"lowbit": {"method": "signround2", "scheme": "w4g128", "iters": 50, "tune_dtype": "fp32",
                                 "loss_filter": True}},
    "w4g128-nofilter": {"lowbit": {"method": "signround2", "scheme": "w4g128", "iters": 50, "tune_dtype": "fp32",
                                   "loss_filter": False}},
    "mixed3": {"lowbit": {"method": "signround2", "scheme": "w4g128", "iters": 0, "avg_bits": 3.0,
                          "options": "w2g64,w4g128"},
               "autoround": {"iters": 0, "autoscheme": {"avg_bits": 3.0, "options": "W2A16G64,W4A16"}}},
    # DeltaLoss passes in fp32 (the default follows tune_dtype=auto: bf16 where it is fast)
    "mixed3-fp32": {"lowbit": {"method": "signround2", "scheme": "w4g128", "iters": 0, "avg_bits": 3.0,
                               "options": "w2g64,w4g128", "tune_dtype": "fp32"}},
    # the position heuristics the DeltaLoss plan must beat at equal bits (same quantizer, iters 0)
    "mixed3-first": {"lowbit": {"method": "signround2", "scheme": "w4g128", "iters": 0, "positional": "first",
                                "avg_bits": 3.0, "options": "w2g64,w4g128"}},
    "mixed3-last": {"lowbit": {"method": "signround2", "scheme": "w4g128", "iters": 0, "positional": "last",
                               "avg_bits": 3.0, "options": "w2g64,w4g128"}},
    "rtn-w4g128": {"lowbit": {"method": "rtn", "scheme": "w4g128"},
                   "autoround": {"bits": 4, "group_size": 128, "sym": True, "iters": 0, "disable_opt_rtn": True}},
    "nvfp4": {"lowbit": {"method": "signround2", "scheme": "nvfp4-46", "iters": 50, "tune_dtype": "fp32"}},
    "rtn-nvfp4-46": {"lowbit": {"method": "rtn", "scheme": "nvfp4-46"}},
    "mxfp4": {"lowbit": {"method": "signround2", "scheme": "mxfp4", "iters": 50, "tune_dtype": "fp32"}},
    "rtn-mxfp4": {"lowbit": {"method": "rtn", "scheme": "mxfp4"}},
}


def setup(nsamples: int, seqlen: int, model: str = "bundled"):
    """The bundled model or its off-grid copy (one thread, seed 0), its calibration tokens and the eval split."""
    from lowbit.data import eval_tokens

    lm = bundled_model(threads=1, model=model)
    return lm, calibration(lm.tokenizer, nsamples, seqlen), eval_tokens(lm.tokenizer, None)


def with_iters(spec: dict, iters: int | None) -> dict:
    """``spec`` with its tuning iterations replaced (``--iters``, for smoke runs); configs without iters keep none."""
    return {**spec, "iters": iters} if iters is not None and "iters" in spec else dict(spec)


def lowbit_job(spec: dict, model):
    """(method, plan, settings, mixed) of a lowbit config row."""
    from lowbit.models import linear_layers
    from lowbit.plans.plan import Plan
    from lowbit.ptq import MixedSettings

    layers = linear_layers(model)
    plan = Plan.uniform(layers, spec["scheme"])
    if spec["method"] == "rtn":
        return "rtn", plan, {"search": False}, None  # plain round-to-nearest, auto-round's disable_opt_rtn
    settings = {k: spec[k] for k in SIGNROUND_KEYS if k in spec} | {"batch_size": BATCH}
    if "positional" in spec:  # a position heuristic picks the plan; the quantizer is the same
        from lowbit.ptq.allocate import positional_plan

        sizes = {n: (m.out_features, m.in_features) for n, m in layers.items()}
        low, high = spec["options"].split(",")
        plan = positional_plan(sizes, low, high, spec["avg_bits"], from_end=spec["positional"] == "last").plan
        return spec["method"], plan, {"iters": spec["iters"], "batch_size": BATCH}, None
    mixed = None
    if "avg_bits" in spec:  # DeltaLoss passes in the tuning precision (auto: bf16 where it is fast)
        mixed = MixedSettings(avg_bits=spec["avg_bits"], options=spec["options"],
                              dtype=spec.get("tune_dtype", "auto"))
    return spec["method"], plan, settings, mixed


def run_lowbit(spec: dict, lm, calib, workdir: str | None) -> dict:
    from lowbit.ptq import quantize_model

    method, plan, settings, mixed = lowbit_job(spec, lm.model)
    plan = quantize_model(lm.model, plan, method, settings, calib=calib, mixed=mixed, progress=True,
                          workdir=workdir if method != "rtn" else None)
    return {"plan": plan.describe()}


def run_autoround(spec: dict, lm, calib) -> dict:
    import tempfile

    from auto_round import AutoRound

    kw = dict(spec)
    amp = kw.pop("amp", False)
    if "autoscheme" in kw:
        from auto_round import AutoScheme

        a = kw.pop("autoscheme")
        # AutoScheme scores layers on its own dataloader and only takes a dataset *name*; a local
        # JSON list of texts is the offline way, so it gets the decoded calibration samples
        texts = Path(tempfile.mkdtemp()) / "calib.json"
        texts.write_text(json.dumps([lm.tokenizer.decode(row) for row in calib]))
        # (re-tokenized texts can come out a few tokens short: score on the first seqlen - 16);
        # its scorer reads AutoRound's own dataset argument too, which must then be that same file
        data, seqlen = str(texts), calib.shape[1] - 16
        kw["scheme"] = AutoScheme(avg_bits=a["avg_bits"], options=a["options"], nsamples=len(calib),
                                  seqlen=seqlen, batch_size=BATCH, dataset=data)
    else:
        data, seqlen = [row.unsqueeze(0) for row in calib], calib.shape[1]
    ar = AutoRound(lm.model, lm.tokenizer, dataset=data, nsamples=len(calib), seqlen=seqlen,
                   batch_size=BATCH, amp=amp, device_map="cpu", seed=kw.pop("seed", 0), **kw)
    ar.quantize()
    out = {"autoround": dict(spec)}
    layer_config = getattr(ar, "layer_config", None)
    if "autoscheme" in spec and isinstance(layer_config, dict):
        out["plan_bits"] = {k: v.get("bits") for k, v in layer_config.items() if isinstance(v, dict)}
    return out


def child(tool: str, name: str, nsamples: int, seqlen: int, workdir: str | None, iters: int | None,
          windows: int, model: str = "bundled") -> dict:
    from lowbit.eval import perplexity

    t0 = time.perf_counter()
    lm, calib, ev = setup(nsamples, seqlen, model)
    load_s = time.perf_counter() - t0
    rss_loaded = peak_rss_mib()
    spec = with_iters(CONFIGS[name][tool], iters)
    work = tuning_gflop(lm.model, spec.get("iters", 0), min(BATCH, nsamples) * seqlen, qkv_input_grad=True)
    gflops, bf16_gflops = gemm_gflops(), gemm_gflops(dtype="bf16")
    t1 = time.perf_counter()
    extra = run_lowbit(spec, lm, calib, workdir) if tool == "lowbit" else run_autoround(spec, lm, calib)
    seconds = time.perf_counter() - t1
    rss_quant = peak_rss_mib()
    r = perplexity(lm.model, ev, seqlen=EVAL_SEQLEN, windows=windows)
    return {"config": name, "tool": tool, "ppl": r.ppl, "eval_tokens": r.tokens, "eval_windows": windows,
            "seconds": round(seconds, 1), "load_seconds": round(load_s, 1),
            "peak_rss_mib_after_load": round(rss_loaded), "peak_rss_mib": round(rss_quant), "nsamples": nsamples,
            "seqlen": seqlen, "threads": 1, "tuning_gemm_gflop": round(work, 1), "gemm_gflops": round(gflops, 1),
            "gemm_limit_seconds": round(work / gflops, 1), "bf16_gemm_gflops": round(bf16_gflops, 1),
            "cpu": machine()["cpu"], **spec, **extra, **model_fields(model)}


def key(row: dict) -> tuple:
    """A row's identity: config, tool and model (rows before the off-grid model were all on the bundled one)."""
    return row["config"], row["tool"], row.get("model", "bundled")


def protocol(nsamples: int, seqlen: int, windows: int) -> str:
    return (f"bundled SmolLM2-135M fp32 (rows with model=offgrid: its off-grid copy, benchmarks/results/offgrid.md), "
            f"calibration {nsamples}x{seqlen} tokens (calib split, seed 0, same tokens "
            f"for both tools), eval {windows}x{EVAL_SEQLEN} tokens of the eval split, 1 thread each, batch {BATCH}")


def table(rows: list[dict], model: str = "bundled") -> str:
    """Markdown: one line per config on ``model``, lowbit and auto-round side by side, speed as a ratio."""
    by = {}
    rows = [r for r in rows if r.get("model", "bundled") == model]
    for r in rows:
        by.setdefault(r["config"], {})[r["tool"]] = r
    lines = ["| config | lowbit ppl | auto-round ppl | lowbit s | auto-round s | lowbit / auto-round time "
             "| GEMM limit s | lowbit peak RSS MiB |", "|---|---|---|---|---|---|---|---|"]
    fmt = lambda r, k, f: "" if r is None or r.get(k) is None else f.format(r[k])  # noqa: E731
    # the machine's limit: the fastest GEMM rate any row measured (rows started under different load)
    peak = max((r.get("gemm_gflops") or 0.0 for r in rows), default=0.0)
    for name in CONFIGS:
        if name not in by:
            continue
        lb, ar = by[name].get("lowbit"), by[name].get("autoround")
        ratio = f"{lb['seconds'] / ar['seconds']:.2f}" if lb and ar and ar["seconds"] else ""
        work = (lb or ar).get("tuning_gemm_gflop")
        limit = f"{work / peak:.0f}" if work and peak else ""
        lines.append(f"| {name} | {fmt(lb, 'ppl', '{:.2f}')} | {fmt(ar, 'ppl', '{:.2f}')} | "
                     f"{fmt(lb, 'seconds', '{:.0f}')} | {fmt(ar, 'seconds', '{:.0f}')} | {ratio} | "
                     f"{limit} | {fmt(lb, 'peak_rss_mib', '{}')} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ptq", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="w4g128", help="comma-separated config names (see --list)")
    p.add_argument("--tools", default="lowbit,autoround", help=f"comma-separated, from {', '.join(TOOLS)}")
    p.add_argument("--nsamples", type=int, default=NSAMPLES)
    p.add_argument("--seqlen", type=int, default=SEQLEN)
    p.add_argument("--iters", type=int, default=None,
                   help="replace every tuning config's iterations (smoke runs; default: each config's own)")
    p.add_argument("--windows", type=int, default=EVAL_WINDOWS, help=f"eval windows of {EVAL_SEQLEN} tokens")
    p.add_argument("--model", choices=MODELS, default="bundled", help=MODEL_HELP)
    p.add_argument("--list", action="store_true")
    p.add_argument("--child", nargs=2, metavar=("TOOL", "CONFIG"), help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None,
                   help="folder for per-block results (one subfolder per lowbit row): an interrupted row resumes; "
                        "its seconds then cover only the resumed part")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/ptq.json)")
    p.add_argument("--table", action="store_true", help="print the results as a markdown table and exit")
    return p


def runs(configs: list[str], tools: list[str]) -> list[tuple[str, str]]:
    """(config, tool) pairs to run, validated before any of them starts."""
    unknown = [n for n in configs if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"error: unknown config(s) {unknown}; --list shows them")
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        raise SystemExit(f"error: unknown tool(s) {bad}; choose from {', '.join(TOOLS)}")
    pairs = [(n, t) for n in configs for t in tools if t in CONFIGS[n]]
    if any(t == "autoround" for _, t in pairs):
        require_peer("auto_round", "pass --tools lowbit")
    return pairs


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    out = out_path(a.out, "ptq.json")
    if a.table:
        print(table(load_results(out)["rows"], a.model))
        return
    if a.list:
        for k, v in CONFIGS.items():
            print(k, json.dumps(v))
        return
    if a.child:
        emit(child(a.child[0], a.child[1], a.nsamples, a.seqlen, a.workdir, a.iters, a.windows, a.model))
        return
    failed = []
    pairs = runs(a.configs.split(","), a.tools.split(","))
    if a.model == "offgrid":
        offgrid_folder()  # made (once) here, not by the first child
    for name, tool in pairs:
        args = ["--child", tool, name, "--nsamples", str(a.nsamples), "--seqlen", str(a.seqlen),
                "--windows", str(a.windows), "--model", a.model]
        args += ["--iters", str(a.iters)] if a.iters is not None else []
        sub = name if a.model == "bundled" else f"{a.model}-{name}"  # a row's work never resumes another model's
        args += ["--workdir", str(Path(a.workdir).absolute() / sub)] if a.workdir and tool == "lowbit" else []
        print(f"== {name} / {tool} / {a.model}", file=sys.stderr, flush=True)
        try:
            row = run_child("ptq", args, threads=1, show_stderr=True)
        except RuntimeError as e:
            print(f"   failed: {str(e).splitlines()[0]}", file=sys.stderr)
            failed.append(f"{name}/{tool}")
            continue
        merge_row(out, row, key, protocol=protocol(a.nsamples, a.seqlen, a.windows))
        print(f"   ppl {row['ppl']:.3f}  {row['seconds']} s  peak {row['peak_rss_mib']} MiB", file=sys.stderr)
    if failed:
        raise SystemExit(f"error: {len(failed)} row(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
