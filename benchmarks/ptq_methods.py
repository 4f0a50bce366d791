"""PTQ methods side by side on the bundled model: RTN, GPTQ, AWQ + RTN, SignRoundV2, each with and without the
Hadamard rotation, against llm-compressor's GPTQ and AWQ (issue 24).

Protocol: the bundled SmolLM2-135M-Instruct (a Q4_1 GGUF dequantized to fp32: its "float" weights are
already a 4-bit model's), calibration 32 x 256 tokens of the calibration split (seed 0; the *same* token
tensor for every row and both tools), evaluation 40 x 512 tokens of the eval split. Every row runs in a
fresh process with one thread (wall time and peak RSS are its own); ``--jobs 2`` runs two rows at once
(one per core), and a lowbit row and the peer's row of the same method and scheme are queued together so
their times are taken under the same load. Rows are merged into ``benchmarks/results/ptq_methods.json``
as they finish.

    python -m benchmarks.ptq_methods --list
    python -m benchmarks.ptq_methods --rows 'w4g128/*' --jobs 2 --peer-python /tmp/h4-venv/bin/python
    python -m benchmarks.ptq_methods --table
    python -m benchmarks.ptq_methods --rows 'w4g64/*' --model offgrid --peer-python ...   # the off-grid copy

The peer runs in its own environment (llm-compressor pins transformers <= 5.17 and compressed-tensors
0.19): a venv with torch 2.13 CPU, ``llmcompressor==0.14.0.1`` and lowbit installed ``--no-deps`` (for the
model loader, the calibration tokens and the perplexity, so both tools are measured by the same code).
Its settings are lowbit's defaults: symmetric INT groups, ``actorder="static"``, dampening 0.01, block
128; AWQ ``n_grid=20``, duo scaling, then its QuantizationModifier (min-max scales).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.common import (
    MODEL_HELP,
    MODELS,
    ROOT,
    bundled_model,
    machine,
    markdown_table,
    merge_row,
    model_fields,
    offgrid_folder,
    peak_rss_mib,
    result_path,
)

RESULTS = "ptq_methods"
NSAMPLES, SEQLEN = 32, 256
SCHEMES = ("w4g128", "w3g128", "w2g64")
PEER_SCHEMES = ("w4g64", "w3g64")
ACT_SCHEMES = ("w4a4-nvfp4", "w4a4-mxfp4")  # weights and inputs in FP4 (issue 21's recipes)
SR_ITERS = 50
# W4A4 rotations: QuaRot's = the residual stream fused into the weights + an online Hadamard before
# down_proj (whose input, SwiGLU's product, nothing upstream can absorb a rotation into)
ONLINE = {"online": ["down_proj"]}
ACT_ROTATIONS = {"/rot": {"kind": "random", **ONLINE}, "/rot-online": {"residual": False, **ONLINE},
                 "/rot-keep": {"kind": "random", "keep": None, **ONLINE}}


def _rows() -> dict[str, dict[str, Any]]:
    """Row name -> spec. ``tool`` lowbit: method, settings, rotate, awq; ``llmcompressor``: algo."""
    rows: dict[str, dict[str, Any]] = {"fp": {"tool": "lowbit", "method": None}}
    for scheme in SCHEMES:
        for rot in ("", "/rot"):
            base = {"tool": "lowbit", "scheme": scheme, "rotate": "random" if rot else None}
            rows[f"{scheme}/rtn{rot}"] = {**base, "method": "rtn"}
            rows[f"{scheme}/gptq{rot}"] = {**base, "method": "gptq"}
            rows[f"{scheme}/awq-rtn{rot}"] = {**base, "method": "rtn", "awq": {}}
            seeds = (0, 1) if scheme == "w2g64" else (0,)
            for seed in seeds:
                tag = f"/seed{seed}" if seed else ""
                rows[f"{scheme}/signround2{rot}{tag}"] = {**base, "method": "signround2",
                                                          "settings": {"iters": SR_ITERS, "seed": seed}}
        rows[f"{scheme}/llmc-gptq"] = {"tool": "llmcompressor", "scheme": scheme, "algo": "gptq"}
        rows[f"{scheme}/llmc-awq-rtn"] = {"tool": "llmcompressor", "scheme": scheme, "algo": "awq"}
        # ablations behind the defaults (named here so the lab note's numbers can be rerun)
        first = len(rows)
        rows[f"{scheme}/rtn-plain"] = {"tool": "lowbit", "scheme": scheme, "method": "rtn",
                                       "settings": {"search": False}}
        rows[f"{scheme}/rtn/rot-hadamard"] = {"tool": "lowbit", "scheme": scheme, "method": "rtn",
                                              "rotate": "hadamard"}
        # the rotation that leaves the channels an RMSNorm switches off where they are (RotationSettings.keep)
        keep = {"kind": "random", "keep": None}
        rows[f"{scheme}/rtn/rot-keep"] = {"tool": "lowbit", "scheme": scheme, "method": "rtn", "rotate": keep}
        rows[f"{scheme}/gptq/rot-keep"] = {"tool": "lowbit", "scheme": scheme, "method": "gptq", "rotate": keep}
        rows[f"{scheme}/signround2/rot-keep"] = {"tool": "lowbit", "scheme": scheme, "method": "signround2",
                                                 "rotate": keep, "settings": {"iters": SR_ITERS, "seed": 0}}
        rows[f"{scheme}/awq-rtn-qinputs"] = {"tool": "lowbit", "scheme": scheme, "method": "rtn",
                                             "awq": {"inputs": "quantized"}}
        rows[f"{scheme}/awq-gptq"] = {"tool": "lowbit", "scheme": scheme, "method": "gptq", "awq": {}}
        rows[f"{scheme}/gptq-noact"] = {"tool": "lowbit", "scheme": scheme, "method": "gptq",
                                        "settings": {"act_order": False, "static_groups": False}}
        rows[f"{scheme}/gptq-nosearch"] = {"tool": "lowbit", "scheme": scheme, "method": "gptq",
                                           "settings": {"search": False}}
        # GPTQ choosing searched or abs-max scales by the calibration loss (issue 34, lowbit.ptq.gptq_choice)
        rows[f"{scheme}/gptq-choose"] = {"tool": "lowbit", "scheme": scheme, "method": "gptq",
                                         "settings": {"choose_rule": True}}
        # act-order over whole groups, each group's scale from the error-updated weights (issue 34)
        rows[f"{scheme}/gptq-gar"] = {"tool": "lowbit", "scheme": scheme, "method": "gptq",
                                      "settings": {"group_aware": True, "static_groups": False}}
        rows[f"{scheme}/gptq-noclip"] = {"tool": "lowbit", "scheme": scheme, "method": "gptq",
                                         "settings": {"clip": False}}
        # q_proj / k_proj without clipping (or on abs-max scales), the other matrices searched (issue 34)
        for rule in ("noclip", "absmax"):
            rows[f"{scheme}/gptq-score-{rule}"] = {"tool": "lowbit", "scheme": scheme, "method": "gptq",
                                                   "settings": {"score_rule": rule}}
        for name in list(rows)[first:]:
            rows[name]["ablation"] = True
    # llm-compressor refuses groups that do not divide a row (SmolLM2's 576 columns at g128; lowbit
    # closes such rows with a shorter group), so its W4 / W3 rows run where both tools agree: g64
    for scheme in PEER_SCHEMES:
        base = {"tool": "lowbit", "scheme": scheme, "rotate": None}
        rows[f"{scheme}/rtn"] = {**base, "method": "rtn"}
        rows[f"{scheme}/gptq"] = {**base, "method": "gptq"}
        rows[f"{scheme}/awq-rtn"] = {**base, "method": "rtn", "awq": {}}
        rows[f"{scheme}/llmc-gptq"] = {"tool": "llmcompressor", "scheme": scheme, "algo": "gptq"}
        rows[f"{scheme}/llmc-awq-rtn"] = {"tool": "llmcompressor", "scheme": scheme, "algo": "awq"}
        # like for like with llm-compressor's min-max scales: GPTQ without the importance search
        rows[f"{scheme}/gptq-nosearch"] = {"tool": "lowbit", "scheme": scheme, "method": "gptq",
                                           "settings": {"search": False}, "ablation": True}
        rows[f"{scheme}/gptq-choose"] = {"tool": "lowbit", "scheme": scheme, "method": "gptq",
                                         "settings": {"choose_rule": True}, "ablation": True}
        rows[f"{scheme}/gptq-gar"] = {"tool": "lowbit", "scheme": scheme, "method": "gptq",
                                      "settings": {"group_aware": True, "static_groups": False}, "ablation": True}
        rows[f"{scheme}/gptq-noclip"] = {"tool": "lowbit", "scheme": scheme, "method": "gptq",
                                         "settings": {"clip": False}, "ablation": True}
        for rule in ("noclip", "absmax"):
            rows[f"{scheme}/gptq-score-{rule}"] = {"tool": "lowbit", "scheme": scheme, "method": "gptq",
                                                   "settings": {"score_rule": rule}, "ablation": True}
    for scheme in ACT_SCHEMES:
        for rot, r in {"": None, **ACT_ROTATIONS}.items():
            base = {"tool": "lowbit", "scheme": scheme, "rotate": r}
            extra = {"ablation": True} if rot == "/rot-keep" else {}
            rows[f"{scheme}/rtn{rot}"] = {**base, "method": "rtn", **extra}
            rows[f"{scheme}/gptq{rot}"] = {**base, "method": "gptq", **extra}
            rows[f"{scheme}/awq-rtn{rot}"] = {**base, "method": "rtn", "awq": {}, **extra}
            rows[f"{scheme}/signround2{rot}"] = {**base, "method": "signround2",
                                                 "settings": {"iters": SR_ITERS, "seed": 0}, **extra}
    return rows


ROWS = _rows()
DEFAULT = [n for n, spec in ROWS.items() if not spec.get("ablation")]


# ------------------------------------------------------------------ children
def setup(model: str = "bundled"):
    from lowbit.data import calibration_batches, eval_tokens

    lm = bundled_model(threads=1, seed=0, model=model)
    calib = calibration_batches(lm.tokenizer, None, nsamples=NSAMPLES, seqlen=SEQLEN, seed=0)
    return lm, calib, eval_tokens(lm.tokenizer, None)


def run_lowbit(spec: dict, lm: Any, calib: Any) -> dict:
    from lowbit.models import linear_layers
    from lowbit.plans.plan import Plan
    from lowbit.ptq import AWQSettings, RotationSettings, quantize_model

    if spec["method"] is None:
        return {}
    plan = Plan.uniform(linear_layers(lm.model), spec["scheme"])
    r = spec.get("rotate")
    rotate = None if not r else RotationSettings(**r) if isinstance(r, dict) else RotationSettings(kind=r)
    awq = AWQSettings(**spec["awq"]) if spec.get("awq") is not None else None
    plan = quantize_model(lm.model, plan, spec["method"], spec.get("settings"), calib=calib, rotate=rotate, awq=awq,
                          progress=False)
    return {"plan": plan.describe()}


def _llmc_scheme(scheme: str) -> dict:
    from lowbit.formats import Scheme

    s = Scheme.parse(scheme)
    return {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": s.bits, "type": "int", "symmetric": s.sym, "strategy": "group", "group_size": s.group_size}}}


def run_llmcompressor(spec: dict, lm: Any, calib: Any) -> dict:
    """llm-compressor's oneshot on the same model object and the same calibration tokens (a DataLoader)."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from torch.utils.data import DataLoader

    if not torch.cuda.is_available():
        # llm-compressor 0.14's AWQ pins its activation cache (Tensor.pin_memory), which a CPU-only torch
        # refuses ("Cannot access accelerator device"); page-locking only speeds host-to-GPU copies, so
        # on a CPU the unpinned tensor is the same data
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    groups = _llmc_scheme(spec["scheme"])
    if spec["algo"] == "gptq":
        recipe = [GPTQModifier(config_groups=groups, ignore=["lm_head"], block_size=128, dampening_frac=0.01,
                               actorder="static")]
    else:
        recipe = [AWQModifier(duo_scaling=True, n_grid=20),
                  QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    rows = [{"input_ids": r.unsqueeze(0), "attention_mask": torch.ones(1, r.numel(), dtype=torch.long)}
            for r in calib]
    loader = DataLoader(rows, batch_size=None)
    # oneshot re-reads the model's config from model.config.name_or_path (a GGUF-loaded model has no such folder)
    folder = tempfile.mkdtemp(prefix="llmc-config-")
    lm.model.config.save_pretrained(folder)
    lm.model.config.name_or_path = folder
    oneshot(model=lm.model, tokenizer=lm.tokenizer, dataset=loader, recipe=recipe, num_calibration_samples=len(calib),
            max_seq_length=calib.shape[1])
    import llmcompressor

    return {"llmcompressor": llmcompressor.__version__}


def child(name: str, model: str = "bundled") -> dict:
    from lowbit.eval import perplexity

    spec = ROWS[name]
    t0 = time.perf_counter()
    lm, calib, ev = setup(model)
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    extra = run_lowbit(spec, lm, calib) if spec["tool"] == "lowbit" else run_llmcompressor(spec, lm, calib)
    seconds = time.perf_counter() - t1
    rss = peak_rss_mib()
    r = perplexity(lm.model, ev, seqlen=512, windows=40, progress=False)
    return {"row": name, **spec, "ppl": r.ppl, "eval_tokens": r.tokens, "seconds": round(seconds, 1),
            "load_seconds": round(load_s, 1), "peak_rss_mib_quantize": round(rss), "peak_rss_mib": round(peak_rss_mib()),
            "nsamples": NSAMPLES, "seqlen": SEQLEN, "machine": machine(), **extra, **model_fields(model)}


def key(row: dict) -> tuple:
    """A row's identity: its name and model (rows before the off-grid model were all on the bundled one)."""
    return row["row"], row.get("model", "bundled")


# ------------------------------------------------------------------- driver
def _interpreter(spec: dict, peer_python: str | None) -> str | None:
    return sys.executable if spec["tool"] == "lowbit" else peer_python


def run_row(name: str, peer_python: str | None, model: str = "bundled", results: str = RESULTS) -> dict | None:
    python = _interpreter(ROWS[name], peer_python)
    if python is None:
        print(f"== {name}: skipped (no --peer-python)", file=sys.stderr, flush=True)
        return None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    print(f"== {name} / {model} started", file=sys.stderr, flush=True)
    out = subprocess.run(["nice", "-n", "10", python, "-m", "benchmarks.ptq_methods", "--child", name, "--model", model],
                         cwd=ROOT,
                         env=env, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"== {name} failed ({out.returncode}):\n{out.stderr[-3000:]}", file=sys.stderr, flush=True)
        return None
    row = json.loads(out.stdout.strip().splitlines()[-1])
    merge_row(results, row, key, protocol=__doc__.split("\n\n")[1].replace("\n", " "))
    print(f"== {name}: ppl {row['ppl']:.3f}  {row['seconds']} s  peak {row['peak_rss_mib']} MiB", file=sys.stderr,
          flush=True)
    return row


def select(patterns: str) -> list[str]:
    names = DEFAULT if patterns == "default" else [
        n for n in ROWS if any(fnmatch.fnmatch(n, p) for p in patterns.split(","))]
    if not names:
        raise SystemExit(f"no row matches {patterns!r}; --list shows them")
    # a lowbit row next to the peer's row of the same scheme and method: timed under the same load
    peer_of = {"gptq": "llmc-gptq", "awq-rtn": "llmc-awq-rtn"}
    ordered: list[str] = []
    for n in names:
        if n in ordered:
            continue
        ordered.append(n)
        scheme, _, rest = n.partition("/")
        twin = f"{scheme}/{peer_of.get(rest, '')}"
        if twin in names and twin not in ordered:
            ordered.append(twin)
    return ordered


def table(rows: list[dict], model: str = "bundled") -> str:
    """One line per scheme and method on ``model``: ppl (mean over seeds), seconds, peak RSS; without and with
    rotation."""
    by: dict[tuple[str, str, bool], list[dict]] = {}
    rows = [r for r in rows if r.get("model", "bundled") == model]
    for r in rows:
        if r["row"] == "fp":
            continue
        scheme, _, rest = r["row"].partition("/")
        parts = rest.split("/")
        method = parts[0]
        rot = "rot" in parts
        if any(p.startswith("rot-") for p in parts):  # a variant of the rotation: its own line
            method += "/" + next(p for p in parts if p.startswith("rot-"))
        by.setdefault((scheme, method, rot), []).append(r)

    def cell(rs: list[dict] | None, key: str, fmt: str) -> str:
        if not rs:
            return ""
        vals = [r[key] for r in rs]
        mean = sum(vals) / len(vals)
        return fmt.format(mean) + (f" ({len(vals)} seeds: " + ", ".join(fmt.format(v) for v in vals) + ")"
                                   if len(vals) > 1 else "")

    lines = []
    order = (*SCHEMES, *PEER_SCHEMES, *ACT_SCHEMES)
    for (scheme, method, rot), rs in sorted(by.items(), key=lambda kv: (order.index(kv[0][0]) if kv[0][0] in order
                                                                         else 99, kv[0][1], kv[0][2])):
        if rot:
            continue
        r_rot = by.get((scheme, method, True))
        lines.append([scheme, method, cell(rs, "ppl", "{:.2f}"), cell(r_rot, "ppl", "{:.2f}"),
                      cell(rs, "seconds", "{:.0f}"), cell(r_rot, "seconds", "{:.0f}"),
                      cell(rs, "peak_rss_mib", "{:.0f}"), cell(r_rot, "peak_rss_mib", "{:.0f}")])
    fp = next((r for r in rows if r["row"] == "fp"), None)
    head = f"float ppl {fp['ppl']:.2f}\n\n" if fp else ""
    return head + markdown_table(["scheme", "method", "ppl", "ppl rotated", "s", "s rotated", "peak RSS MiB",
                                  "peak RSS MiB rotated"], lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="default", help="'default' or comma-separated globs over row names (--list)")
    p.add_argument("--jobs", type=int, default=1, help="rows run at once (one thread each)")
    p.add_argument("--peer-python", default=None, help="python of the llm-compressor venv (peer rows skipped without)")
    p.add_argument("--model", choices=MODELS, default="bundled", help=MODEL_HELP)
    p.add_argument("--list", action="store_true")
    p.add_argument("--table", action="store_true", help="print the results as a markdown table")
    p.add_argument("--results", default=RESULTS, help=f"results file under benchmarks/results (default {RESULTS}; "
                                                       "another machine's rows go to a file of their own)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.model)), flush=True)
        return
    if a.list:
        for n in ROWS:
            print(("* " if n in DEFAULT else "  ") + n, json.dumps(ROWS[n]))
        return
    if a.table:
        print(table(json.loads(result_path(a.results).read_text())["rows"], a.model))
        return
    names = select(a.rows)
    if a.model == "offgrid":
        offgrid_folder()  # made (once) here, not by two children at once
    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        list(pool.map(lambda n: run_row(n, a.peer_python, a.model, a.results), names))


if __name__ == "__main__":
    main()
