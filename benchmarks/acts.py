"""Activation quantization benchmark: W4A4 / W8A8 / mixed MXFP4-MXFP8 on the bundled model.

Rows, side by side on the same calibration tokens (32 x 256 from the calibration split,
seed 0, the *same* token tensor for every tool) and the same evaluation (40 x 512 tokens
of the evaluation split), one thread per row, each row in a fresh process (wall time and
peak RSS are its own):

* W4A4 NVFP4 RTN: lowbit abs-max, 4-over-6, span (plain RTN, the rules alone) vs
  fouroversix's own W4A4 4/6 PTQ (its PyTorch reference path, ``scale_rule=mse``);
* W4A4 MXFP4 and NVFP4: lowbit RTN and SignRoundV2 vs auto-round 0.16 (same iterations,
  batch 8, fp32), >= 2 seeds for tuned rows;
* W8A8 FP8 (per-token dynamic) and INT8 (per-token dynamic);
* mixed {w4a4-mxfp4, w8a8-mxfp8} at 4.5 / 5 / 6 average bits (element bits only, as
  ``--ignore-scale-bits``): DeltaLoss vs auto-round's AutoScheme vs the first-layers /
  last-layers-at-8-bit heuristics, all RTN;
* tuning memory: SignRoundV2 NVFP4 weight-only vs W4A4 with the same settings.

    nice -n 10 python -m benchmarks.acts --rows fp,nvfp4-rtn-absmax,...   # --list shows the rows
    python -m benchmarks.acts --table      # the markdown tables of benchmarks/results/acts.md
    nice -n 10 python -m benchmarks.acts --rows fp,nvfp4-rtn-46 --model offgrid   # the off-grid copy (--table too)

Results merge into benchmarks/results/acts.json as rows finish.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common

NAME = "acts"
BATCH = 8
ITERS = 50

ROWS: dict[str, dict[str, Any]] = {
    "fp": {"tool": "lowbit", "fp": True},
    # --- W4A4 NVFP4 RTN: the scale rules alone (no importance search) vs fouroversix
    "nvfp4-rtn-absmax": {"tool": "lowbit", "method": "rtn", "scheme": "w4a4-nvfp4", "search": False},
    "nvfp4-rtn-46": {"tool": "lowbit", "method": "rtn", "scheme": "w4a4-nvfp4-46", "search": False},
    "nvfp4-rtn-span": {"tool": "lowbit", "method": "rtn", "scheme": "w4a4-nvfp4-span", "search": False},
    "nvfp4-rtn-spanw-46a": {"tool": "lowbit", "method": "rtn", "scheme": "nvfp4-46:rule=span@nvfp4-46",
                            "search": False},  # span on the weights, 4-over-6 on the inputs
    # the peers' convention (diagnostic, not a deployable file): the FP32 tensor scale of each input taken from
    # that input's own abs-max at every call, as fouroversix does and as auto-round's in-memory model does
    # (its act_max is collected but not passed to the NVFP4 quantizer), instead of lowbit's calibrated one
    "nvfp4-rtn-absmax-percall": {"tool": "lowbit", "method": "rtn", "scheme": "w4a4-nvfp4", "search": False,
                                 "input_tensor_scale": "per-call"},
    "nvfp4-rtn-46-percall": {"tool": "lowbit", "method": "rtn", "scheme": "w4a4-nvfp4-46", "search": False,
                             "input_tensor_scale": "per-call"},
    # ... and each Linear's own weight tensor scale instead of its fused q/k/v or gate/up group's shared one
    # (vLLM keeps one per fused matmul; fouroversix computes one per weight): both peer conventions at once
    "nvfp4-rtn-46-percall-own": {"tool": "lowbit", "method": "rtn", "scheme": "w4a4-nvfp4-46", "search": False,
                                 "input_tensor_scale": "per-call", "weight_tensor_scale": "own"},
    "nvfp4-fouroversix-46": {"tool": "fouroversix", "dtype": "nvfp4", "scale_rule": "mse"},
    "nvfp4-fouroversix-6": {"tool": "fouroversix", "dtype": "nvfp4", "scale_rule": "static_6"},
    # --- W4A4 RTN (importance-searched weights) and SignRoundV2 vs auto-round
    "nvfp4-rtn-search": {"tool": "lowbit", "method": "rtn", "scheme": "w4a4-nvfp4"},
    "nvfp4-rtn-46-search": {"tool": "lowbit", "method": "rtn", "scheme": "w4a4-nvfp4-46"},  # 4-over-6 + search
    "mxfp4-rtn-search": {"tool": "lowbit", "method": "rtn", "scheme": "w4a4-mxfp4"},
    "mxfp4-rtn": {"tool": "lowbit", "method": "rtn", "scheme": "w4a4-mxfp4", "search": False},
    "nvfp4-ar-rtn": {"tool": "autoround", "scheme": "NVFP4", "iters": 0, "disable_opt_rtn": True},
    "mxfp4-ar-rtn": {"tool": "autoround", "scheme": "MXFP4", "iters": 0, "disable_opt_rtn": True},
    "nvfp4-sr2-s0": {"tool": "lowbit", "method": "signround2", "scheme": "w4a4-nvfp4", "iters": ITERS, "seed": 0},
    "nvfp4-sr2-s1": {"tool": "lowbit", "method": "signround2", "scheme": "w4a4-nvfp4", "iters": ITERS, "seed": 1},
    "mxfp4-sr2-s0": {"tool": "lowbit", "method": "signround2", "scheme": "w4a4-mxfp4", "iters": ITERS, "seed": 0},
    "mxfp4-sr2-s1": {"tool": "lowbit", "method": "signround2", "scheme": "w4a4-mxfp4", "iters": ITERS, "seed": 1},
    "nvfp4-ar-s0": {"tool": "autoround", "scheme": "NVFP4", "iters": ITERS, "seed": 0},
    "nvfp4-ar-s1": {"tool": "autoround", "scheme": "NVFP4", "iters": ITERS, "seed": 1},
    "mxfp4-ar-s0": {"tool": "autoround", "scheme": "MXFP4", "iters": ITERS, "seed": 0},
    "mxfp4-ar-s1": {"tool": "autoround", "scheme": "MXFP4", "iters": ITERS, "seed": 1},
    # --- W8A8
    "fp8-rtn": {"tool": "lowbit", "method": "rtn", "scheme": "w8a8-fp8", "search": False},
    "int8-rtn": {"tool": "lowbit", "method": "rtn", "scheme": "w8a8-int8", "search": False},
    "mxfp8-rtn": {"tool": "lowbit", "method": "rtn", "scheme": "w8a8-mxfp8", "search": False},
    # --- tuning memory: the same SignRoundV2 run with and without quantized inputs (10 iterations)
    "mem-w4a16-nvfp4": {"tool": "lowbit", "method": "signround2", "scheme": "nvfp4", "iters": 10, "seed": 0},
    "mem-w4a4-nvfp4": {"tool": "lowbit", "method": "signround2", "scheme": "w4a4-nvfp4", "iters": 10, "seed": 0},
    # the same on the first 2 blocks only, no evaluation: the peak of a tuning run is reached in
    # its first blocks (model + cached activations + one block's graph), at a fraction of the CPU time
    "mem2-w4a16-nvfp4": {"tool": "lowbit", "method": "signround2", "scheme": "nvfp4", "iters": 10, "seed": 0,
                         "blocks": 2, "no_eval": True},
    "mem2-w4a4-nvfp4": {"tool": "lowbit", "method": "signround2", "scheme": "w4a4-nvfp4", "iters": 10, "seed": 0,
                        "blocks": 2, "no_eval": True},
}
MIXED_OPTIONS = ("w4a4-mxfp4", "w8a8-mxfp8")
for _bits in (4.5, 5.0, 6.0):
    _b = f"{_bits:g}"
    ROWS[f"mixed{_b}-deltaloss"] = {"tool": "lowbit", "method": "rtn", "search": False, "avg_bits": _bits}
    ROWS[f"mixed{_b}-first"] = {"tool": "lowbit", "method": "rtn", "search": False, "avg_bits": _bits,
                                "positional": "first"}
    ROWS[f"mixed{_b}-last"] = {"tool": "lowbit", "method": "rtn", "search": False, "avg_bits": _bits,
                               "positional": "last"}
    ROWS[f"mixed{_b}-autoscheme"] = {"tool": "autoround", "iters": 0, "disable_opt_rtn": True,
                                     "autoscheme": {"avg_bits": _bits, "options": "MXFP4,MXFP8"}}


def setup(nsamples: int, seqlen: int, model: str = "bundled"):
    from lowbit.data import calibration_batches, eval_tokens

    lm = common.bundled_model(threads=1, seed=0, model=model)
    calib = calibration_batches(lm.tokenizer, None, nsamples=nsamples, seqlen=seqlen, seed=0)
    return lm, calib, eval_tokens(lm.tokenizer, None)


def run_lowbit(spec: dict, lm, calib) -> dict:
    from lowbit.models import linear_layers
    from lowbit.plans.plan import Plan
    from lowbit.ptq import MixedSettings, quantize_model

    layers = linear_layers(lm.model)
    settings: dict[str, Any] = {}
    if spec["method"] == "rtn":
        settings["search"] = spec.get("search", True)
    else:
        settings.update(iters=spec["iters"], seed=spec.get("seed", 0), batch_size=BATCH, tune_dtype="fp32")
    mixed, plan = None, None
    if "avg_bits" in spec and "positional" in spec:
        from lowbit.ptq.allocate import positional_plan

        sizes = {n: (m.out_features, m.in_features) for n, m in layers.items()}
        plan = positional_plan(sizes, *MIXED_OPTIONS, spec["avg_bits"], from_end=spec["positional"] == "last",
                               count_scales=False).plan
    elif "avg_bits" in spec:
        mixed = MixedSettings(avg_bits=spec["avg_bits"], options=MIXED_OPTIONS, count_scales=False, dtype="fp32")
        plan = Plan.uniform(layers, MIXED_OPTIONS[0])
    else:
        names = [n for n in layers if "blocks" not in spec or int(n.split(".layers.")[1].split(".")[0]) < spec["blocks"]]
        plan = Plan.uniform(names, spec["scheme"])
    with own_weight_tensor_scales(spec.get("weight_tensor_scale") == "own"):
        applied = quantize_model(lm.model, plan, spec["method"], settings, calib=calib, mixed=mixed, progress=False)
    if spec.get("input_tensor_scale") == "per-call":
        per_call_input_scales(lm.model)
    sizes = {n: (m.out_features, m.in_features) for n, m in layers.items()}
    out = {"plan": applied.describe(), "avg_bits": round(applied.average_bits(sizes, count_scales=False), 4)}
    if "avg_bits" in spec:
        out["high_layers"] = sum(1 for r in applied.layers.values() if r.weight.bits == 8)
    return out


@contextlib.contextmanager
def own_weight_tensor_scales(on: bool):
    """While ``on``: RTN gives every Linear its own NVFP4 weight tensor scale, not its fused group's (diagnostic).

    lowbit shares one tensor scale across the q/k/v and gate/up parts an engine fuses,
    because vLLM keeps only one per fused matmul; fouroversix's in-memory model computes one
    per weight. Swapping RTN's sharing step for the identity measures what that costs; the
    resulting model is not one vLLM could load as is.
    """
    if not on:
        yield
        return
    from lowbit.models import fused
    from lowbit.ptq import rtn

    def own(weights, schemes):
        return {n: e for n, w in weights.items() if (e := fused.own_tensor_scale(w, schemes[n])) is not None}

    shared, rtn.shared_tensor_scales = rtn.shared_tensor_scales, own
    try:
        yield
    finally:
        rtn.shared_tensor_scales = shared


def per_call_input_scales(model) -> int:
    """Make every static input quantizer take its input's own abs-max at each call (the peers' convention).

    A forward pre-hook overwrites the calibrated ``amax`` with the current input's, so the
    NVFP4 tensor scale follows each evaluation window as fouroversix's and auto-round's
    in-memory models do; lowbit's files keep the calibrated scale (what vLLM reads).
    Returns the number of quantizers changed (a row with none would measure nothing new).
    """
    from lowbit.nn.input_quant import InputQuantizer

    def hook(mod, args):
        mod.amax = args[0].detach().abs().amax().float().reshape(())

    quantizers = [m for m in model.modules() if isinstance(m, InputQuantizer) and m.amax is not None]
    if not quantizers:
        raise RuntimeError("no static input quantizer to switch to per-call scales")
    for m in quantizers:
        m.register_forward_pre_hook(hook)
    return len(quantizers)


def run_fouroversix(spec: dict, lm, calib) -> dict:
    from fouroversix import ModelQuantizationConfig, quantize_model

    cfg = ModelQuantizationConfig(dtype=spec["dtype"], scale_rule=spec["scale_rule"], keep_master_weights=True,
                                  quantize_backend="pytorch", matmul_backend="pytorch", output_dtype="float32",
                                  modules_to_not_convert=["lm_head"])
    quantize_model(lm.model, cfg)
    return {"fouroversix": {k: v for k, v in spec.items() if k != "tool"}}


def run_autoround(spec: dict, lm, calib) -> dict:
    import tempfile

    from auto_round import AutoRound

    kw = {k: v for k, v in spec.items() if k not in ("tool", "autoscheme", "seed")}
    if "autoscheme" in spec:
        from auto_round import AutoScheme

        a = spec["autoscheme"]
        texts = Path(tempfile.mkdtemp()) / "calib.json"  # AutoScheme reads texts, not token tensors
        texts.write_text(json.dumps([lm.tokenizer.decode(row) for row in calib]))
        data, seqlen = str(texts), calib.shape[1] - 16
        kw["scheme"] = AutoScheme(avg_bits=a["avg_bits"], options=a["options"], nsamples=len(calib), seqlen=seqlen,
                                  batch_size=BATCH, dataset=data, ignore_scale_zp_bits=True)
    else:
        data, seqlen = [row.unsqueeze(0) for row in calib], calib.shape[1]
    ar = AutoRound(lm.model, lm.tokenizer, dataset=data, nsamples=len(calib), seqlen=seqlen, batch_size=BATCH,
                   amp=False, device_map="cpu", seed=spec.get("seed", 0), **kw)
    ar.quantize()
    out: dict[str, Any] = {"autoround": {k: v for k, v in spec.items() if k != "tool"}}
    layer_config = getattr(ar, "layer_config", None)
    if "autoscheme" in spec and isinstance(layer_config, dict):
        bits = {k: v.get("bits") for k, v in layer_config.items() if isinstance(v, dict)}
        out["high_layers"] = sum(1 for b in bits.values() if b == 8)
    return out


def child(name: str, nsamples: int, seqlen: int, model: str = "bundled") -> dict:
    from lowbit.eval import perplexity

    spec = ROWS[name]
    t0 = time.perf_counter()
    lm, calib, ev = setup(nsamples, seqlen, model)
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    extra: dict[str, Any] = {}
    if not spec.get("fp"):
        runner = {"lowbit": run_lowbit, "fouroversix": run_fouroversix, "autoround": run_autoround}[spec["tool"]]
        extra = runner(spec, lm, calib)
    seconds = time.perf_counter() - t1
    rss = common.peak_rss_mib()
    t2 = time.perf_counter()
    r = None if spec.get("no_eval") else perplexity(lm.model, ev, seqlen=512, windows=40, progress=False)
    return {"row": name, "tool": spec["tool"], "ppl": None if r is None else r.ppl,
            "eval_tokens": None if r is None else r.tokens, "seconds": round(seconds, 1),
            "eval_seconds": round(time.perf_counter() - t2, 1), "load_seconds": round(load_s, 1),
            "peak_rss_mib": round(rss), "nsamples": nsamples, "seqlen": seqlen, "threads": 1,
            "machine": common.machine(), **{k: v for k, v in spec.items() if k not in ("tool",)}, **extra,
            **common.model_fields(model)}


def key(row: dict) -> tuple:
    """A row's identity: its name and model (rows before the off-grid model were all on the bundled one)."""
    return row["row"], row.get("model", "bundled")


PROTOCOL = ("bundled SmolLM2-135M (a Q4_1 GGUF dequantized: its 'float' weights are a 4-bit model; rows with "
            "model=offgrid: its off-grid copy, benchmarks/results/offgrid.md), fp32; "
            "calibration 32x256 tokens of the calibration split (seed 0, the same tokens for every tool); "
            f"eval 40x512 tokens of the eval split; 1 thread per row, a fresh process per row; batch {BATCH}; "
            "tuned rows 50 iterations")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="fp", help="comma-separated row names (see --list)")
    p.add_argument("--nsamples", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--model", choices=common.MODELS, default="bundled", help=common.MODEL_HELP)
    p.add_argument("--list", action="store_true")
    p.add_argument("--table", action="store_true", help="print the markdown tables and exit")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.list:
        for k, v in ROWS.items():
            print(k, json.dumps(v))
        return
    if a.table:
        print(tables(common.load_results(NAME)["rows"], a.model))
        return
    if a.child:
        print(json.dumps(child(a.child, a.nsamples, a.seqlen, a.model)), flush=True)
        return
    unknown = [n for n in a.rows.split(",") if n not in ROWS]
    if unknown:
        raise SystemExit(f"unknown row(s) {unknown}; --list shows them")
    if a.model == "offgrid":
        common.offgrid_folder()  # made (once) here, not by the first child
    for name in a.rows.split(","):
        print(f"== {name} / {a.model}", file=sys.stderr, flush=True)
        try:
            row = common.run_child("acts", ["--child", name, "--nsamples", str(a.nsamples), "--seqlen", str(a.seqlen),
                                            "--model", a.model], threads=1)
        except RuntimeError as e:
            print(f"   failed: {str(e)[-1500:]}", file=sys.stderr, flush=True)
            continue
        common.merge_row(NAME, row, key, protocol=PROTOCOL)
        print(f"   ppl {row['ppl']}  {row['seconds']} s  peak {row['peak_rss_mib']} MiB", file=sys.stderr, flush=True)


def _cell(rows: dict, name: str, key: str, fmt: str) -> str:
    r = rows.get(name)
    return "" if r is None or r.get(key) is None else fmt.format(r[key])


def tables(rows: list[dict], model: str = "bundled") -> str:
    by = {r["row"]: r for r in rows if r.get("model", "bundled") == model}
    fp = by.get("fp", {}).get("ppl")
    out = [f"FP perplexity: {fp:.3f}" if fp else "FP perplexity: (not run)", ""]
    head = ["row", "tool", "recipe / setting", "ppl", "vs FP", "seconds", "peak RSS MiB"]
    body = []
    for name, spec in ROWS.items():
        r = by.get(name)
        if r is None or name == "fp":
            continue
        what = spec.get("scheme") or (f"avg {spec['avg_bits']:g} bits" if "avg_bits" in spec else "") or \
            (f"autoscheme {spec['autoscheme']['avg_bits']:g}" if "autoscheme" in spec else "")
        if spec["tool"] == "fouroversix":
            what = f"W4A4 {spec['dtype']} scale_rule={spec['scale_rule']}"
        if "method" in spec:
            what += f" / {spec['method']}" + ("" if spec.get("search", True) else " (no search)")
        if "iters" in spec and spec.get("iters"):
            what += f" / {spec['iters']} it, seed {spec.get('seed', 0)}"
        gap = f"{100 * (r['ppl'] / fp - 1):+.1f}%" if fp and r.get("ppl") else ""
        ppl = "" if r.get("ppl") is None else f"{r['ppl']:.3f}"
        body.append([name, spec["tool"], what, ppl, gap, f"{r['seconds']:.0f}", r["peak_rss_mib"]])
    out.append(common.markdown_table(head, body))
    return "\n".join(out)


if __name__ == "__main__":
    main()
