"""PTQ benchmark: lowbit SignRound(V2) vs auto-round 0.16.x on the bundled model.

Protocol (issue 4): the bundled SmolLM2-135M, calibration 32 x 256 tokens from the
calibration split (the *same* token tensor is handed to both tools), evaluation = the
default perplexity protocol (40 windows x 512 tokens of the eval split), fp32, one
thread each. Every (config, tool) row runs in its own subprocess so wall time and peak
RSS are its own; rows are merged into ``benchmarks/results/ptq.json`` as they finish
(atomically), so an interrupted sweep keeps what it measured.

    python benchmarks/ptq.py --configs w4g128 --tools lowbit,autoround
    python benchmarks/ptq.py --list

auto-round settings: ``amp=False``, ``device_map='cpu'``, same iters / nsamples / seqlen
/ batch size; its iters=0 default is an importance-searched RTN, plain RTN is
``disable_opt_rtn=True``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# this folder holds scripts named like packages (benchmarks/peft.py); never import them as such
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
RESULTS = ROOT / "benchmarks" / "results" / "ptq.json"
BATCH = 8  # tuning mini-batch of both tools (and of AutoScheme's scoring)

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
    "w4g128-bf16-seed1": {"lowbit": {"method": "signround2", "scheme": "w4g128", "iters": 50, "tune_dtype": "bf16",
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


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def setup(nsamples: int, seqlen: int):
    import torch

    from lowbit.data import calibration_batches, eval_tokens
    from lowbit.models import load_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    lm = load_model(None)
    calib = calibration_batches(lm.tokenizer, None, nsamples=nsamples, seqlen=seqlen, seed=0)
    return lm, calib, eval_tokens(lm.tokenizer, None)


def run_lowbit(spec: dict, lm, calib, workdir: str | None) -> dict:
    from lowbit.formats.plan import Plan
    from lowbit.models import linear_layers
    from lowbit.ptq import quantize_model

    plan = Plan.uniform(linear_layers(lm.model), spec["scheme"])
    kw = {k: spec[k] for k in ("iters", "avg_bits", "options", "loss_filter", "seed", "tune_dtype") if k in spec}
    if "positional" in spec:
        from lowbit.ptq.allocate import positional_plan

        layers = linear_layers(lm.model)
        sizes = {n: (m.out_features, m.in_features) for n, m in layers.items()}
        low, high = spec["options"].split(",")
        plan = positional_plan(sizes, low, high, spec["avg_bits"], from_end=spec["positional"] == "last").plan
        kw = {"iters": spec["iters"]}
    if workdir and spec["method"] != "rtn":
        kw["workdir"] = workdir
    plan = quantize_model(lm.model, plan, spec["method"], calib=calib, tokenizer=lm.tokenizer, progress=True,
                          batch_size=BATCH, **kw)
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


def cpu_model() -> str:
    """This CPU, recorded in every row: this project's machines have been a Zen 4 and an AMX
    Xeon (435 vs 1383 GFLOP/s bf16 per core), so rates and ratios only compare within one."""
    from lowbit.nn.precision import cpu_description

    return cpu_description()


def gemm_gflops(repeats: int = 30, dtype: str = "fp32") -> float:
    """Median GEMM throughput of this thread on the block's biggest shape (the physical limit)."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a, b = torch.randn(2048, 576, dtype=dt), torch.randn(576, 1536, dtype=dt)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * 2048 * 576 * 1536 / sorted(times)[len(times) // 2] / 1e9


def tuning_gflop(model, spec: dict, nsamples: int, seqlen: int, batch: int = BATCH) -> float:
    """GEMM work of the tuning loop: per iteration a forward and a backward (dX and dW) of every
    block Linear on ``batch * seqlen`` tokens, i.e. 3 x 2 x params x tokens; attention excluded."""
    from lowbit.models import linear_layers

    params = sum(m.weight.numel() for m in linear_layers(model).values())
    return 3 * 2 * params * min(batch, nsamples) * seqlen * spec.get("iters", 0) / 1e9


def child(tool: str, name: str, nsamples: int, seqlen: int, workdir: str | None) -> dict:
    from lowbit.eval import perplexity

    t0 = time.perf_counter()
    lm, calib, ev = setup(nsamples, seqlen)
    load_s = time.perf_counter() - t0
    rss_loaded = peak_rss_mib()
    spec = CONFIGS[name][tool]
    work = tuning_gflop(lm.model, spec, nsamples, seqlen)
    gflops, bf16_gflops = gemm_gflops(), gemm_gflops(dtype="bf16")
    t1 = time.perf_counter()
    extra = run_lowbit(spec, lm, calib, workdir) if tool == "lowbit" else run_autoround(spec, lm, calib)
    seconds = time.perf_counter() - t1
    rss_quant = peak_rss_mib()
    r = perplexity(lm.model, ev, seqlen=512, windows=40)
    return {"config": name, "tool": tool, "ppl": r.ppl, "eval_tokens": r.tokens, "seconds": round(seconds, 1),
            "load_seconds": round(load_s, 1), "peak_rss_mib_after_load": round(rss_loaded),
            "peak_rss_mib": round(rss_quant), "nsamples": nsamples, "seqlen": seqlen, "threads": 1,
            "tuning_gemm_gflop": round(work, 1), "gemm_gflops": round(gflops, 1),
            "gemm_limit_seconds": round(work / gflops, 1), "bf16_gemm_gflops": round(bf16_gflops, 1),
            "cpu": cpu_model(), **{k: v for k, v in spec.items()}, **extra}


def merge(row: dict) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from lowbit.io import atomic_write_text

    # two sweeps (one per tool, one core each) may finish rows at once: serialise the read-modify-write
    with open(RESULTS.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": []}
        data["rows"] = [r for r in data["rows"] if (r["config"], r["tool"]) != (row["config"], row["tool"])] + [row]
        data["protocol"] = ("bundled SmolLM2-135M fp32, calibration 32x256 tokens (calib split, seed 0, same tokens "
                            "for both tools), eval 40x512 tokens of the eval split, 1 thread each, "
                            f"batch {BATCH}")
        atomic_write_text(RESULTS, json.dumps(data, indent=1))


def table(rows: list[dict]) -> str:
    """Markdown: one line per config, lowbit and auto-round side by side, speed as a ratio."""
    by = {}
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="w4g128", help="comma-separated config names (see --list)")
    p.add_argument("--tools", default="lowbit,autoround")
    p.add_argument("--nsamples", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--list", action="store_true")
    p.add_argument("--child", nargs=2, metavar=("TOOL", "CONFIG"), help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None,
                   help="folder for per-block results (one subfolder per lowbit row): an interrupted row resumes; "
                        "its seconds then cover only the resumed part")
    p.add_argument("--table", action="store_true", help="print the results as a markdown table and exit")
    a = p.parse_args()
    if a.table:
        print(table(json.loads(RESULTS.read_text())["rows"]))
        return
    if a.list:
        for k, v in CONFIGS.items():
            print(k, json.dumps(v))
        return
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.nsamples, a.seqlen, a.workdir)), flush=True)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    for name in a.configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"unknown config {name!r}; --list shows them")
        for tool in a.tools.split(","):
            if tool not in CONFIGS[name]:
                continue
            cmd = [sys.executable, __file__, "--child", tool, name, "--nsamples", str(a.nsamples),
                   "--seqlen", str(a.seqlen)]
            if a.workdir and tool == "lowbit":
                cmd += ["--workdir", str(Path(a.workdir) / name)]
            print(f"== {name} / {tool}", file=sys.stderr, flush=True)
            out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
            if out.returncode != 0:
                print(f"   failed (exit {out.returncode})", file=sys.stderr)
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            merge(row)
            print(f"   ppl {row['ppl']:.3f}  {row['seconds']} s  peak {row['peak_rss_mib']} MiB", file=sys.stderr)


if __name__ == "__main__":
    main()
