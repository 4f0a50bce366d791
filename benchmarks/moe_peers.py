"""Peers on the float MoE organism: auto-round (RTN and tuned) and llm-compressor (GPTQ) quantize it whole.

Groundwork for issue 34's ``benchmarks/moe.py``: the peer half of its rows, on the Qwen3-MoE
organism of ``python -m benchmarks.organism --arch qwen3moe`` (16 experts, top-2; its saved token
ids skip the minutes of tokenization). Every row runs in a fresh process with one thread (wall
time and peak RSS are its own) and records:

- the quantization seconds and the process's peak RSS;
- perplexity of the quantized model in memory right after the peer finishes (its fake-quantized
  weights), and of the folder it wrote reloaded through transformers with compressed-tensors
  installed (the path a user takes; an error is recorded, not hidden), both on 40 x 512 tokens of
  the evaluation split, with the float model's perplexity on the same windows;
- what the peer wrote: the expert tensors' names collapsed over expert indices
  (``...mlp.experts.{e}.gate_proj.weight_packed``) with dtypes and shapes, and whether every
  expert of every layer has a packed weight;
- expert coverage: the calibration tokens the float router sends to each expert (the peer's
  own calibration reaches every expert only if it forces all experts, as llm-compressor does
  by default).

Protocol: calibration 32 x 256 tokens of the calibration split (seed 0, the windows
``lowbit.data.calibration_batches`` draws); symmetric INT weights, groups along the input,
the router, embeddings and head left in 16 bits; auto-round ``iters=0`` is its RTN,
``--iters`` (default 50) its SignRound; llm-compressor's GPTQ with ``actorder="static"``,
dampening 0.01, block 128, and its default all-experts calibration (``llmc-rtn``: its
QuantizationModifier, min-max scales). ``w4a4-nvfp4`` is each peer's own ``NVFP4`` preset (weights
and inputs in NVFP4, the inputs' global scale calibrated); there auto-round's tuning seed is the
row's seed too.

The peers need an environment of their own: llm-compressor 0.14.0.1 pins transformers <= 5.17,
auto-round <= 0.15.1 and compressed-tensors 0.19, which clash with auto-round 0.16 and
transformers 5.25. The combination recorded in ``results/moe_peers.json`` installs llm-compressor
with ``--no-deps`` beside them::

    python3 -m venv .venv-peers && .venv-peers/bin/pip install torch==2.13.0
    .venv-peers/bin/pip install transformers==5.25.0 auto-round==0.16.1 compressed-tensors==0.20.1 -e . \\
        loguru pyyaml 'datasets>=4.8.4' 'accelerate>=1.15' nvidia-ml-py pillow
    .venv-peers/bin/pip install --no-deps llmcompressor==0.14.0.1
    .venv-peers/bin/python -m benchmarks.moe_peers --tools autoround-rtn,autoround,llmc-gptq
    python -m benchmarks.moe_peers --table
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, machine, markdown_table, merge_row, peak_rss_mib, result_path

RESULTS = "moe_peers"
ORGANISM = Path.home() / ".cache" / "lowbit" / "organism-moe"
NSAMPLES, SEQLEN, BATCH = 32, 256, 8
EVAL_WINDOWS, EVAL_SEQLEN = 40, 512
# autoround-rtn: plain RTN (iters=0, disable_opt_rtn, as benchmarks/ptq.py); autoround-optrtn: its default for
# iters=0 (RTN with its scale search); autoround: SignRound, torch.compile off (its C++ builds cost minutes on a
# CPU, more than the tuning of a model this small)
AUTOROUND = {"autoround-rtn": (0, {"disable_opt_rtn": True}), "autoround-optrtn": (0, {}),
             "autoround": (None, {"enable_torch_compile": False})}
TOOLS = (*AUTOROUND, "llmc-gptq", "llmc-rtn")
SCHEMES = {"w4g128": (4, 128), "w3g128": (3, 128), "w2g64": (2, 64), "w4a4-nvfp4": (4, 16)}
# W4A4 NVFP4 (weights and inputs in NVFP4: 16-element E2M1 blocks, E4M3 scales, a per-tensor FP32 scale; the inputs'
# per-tensor scale calibrated) is each peer's own preset of that name
PRESETS = {"w4a4-nvfp4": "NVFP4"}
SEED_KIND = "calibration windows' draw (organism_data)"


# ------------------------------------------------------------------ data
def organism_data(organism: Path, seed: int = 0):
    """(model folder, [NSAMPLES, SEQLEN] calibration windows, [1, T] eval ids) of the MoE organism, from the
    token ids it saved (the windows are the ones `lowbit.data.calibration_batches` draws; ``seed`` = the draw)."""
    import torch

    from benchmarks.organism import load_tokens

    cached = load_tokens(organism, organism / "corpus.jsonl")
    if cached is None:
        raise SystemExit(f"error: {organism} has no saved token ids for its corpus; build the organism first: "
                         "python -m benchmarks.organism --arch qwen3moe")
    train, ev = cached
    ids = train[0]
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - SEQLEN + 1, (NSAMPLES,), generator=g)
    return organism / "model", torch.stack([ids[s:s + SEQLEN] for s in starts.tolist()]), ev


def organism_digest(folder: Path) -> str:
    """sha256 of the organism's model.safetensors: rows from two builds (another CPU's GEMM rounding gives other
    weights from the same recipe) must not be averaged together."""
    import hashlib

    return hashlib.sha256((Path(folder) / "model.safetensors").read_bytes()).hexdigest()


def routed_tokens(model, calib) -> list[list[int]]:
    """Calibration tokens the float router sends to each expert, per MoE layer (top-k of its logits)."""
    import torch

    counts = None
    k, n = model.config.num_experts_per_tok, model.config.num_experts
    with torch.no_grad():
        for rows in calib.split(BATCH):
            logits = model(input_ids=rows, output_router_logits=True).router_logits
            c = torch.stack([torch.bincount(g.topk(k, dim=-1).indices.reshape(-1), minlength=n) for g in logits])
            counts = c if counts is None else counts + c
    return counts.tolist()


# ------------------------------------------------------------------ peers
def run_autoround(model, tokenizer, calib, scheme: str, iters: int, out: Path, seed: int = 0, **settings: Any) -> dict:
    """auto-round on the organism; ``seed`` is its tuning seed (0 for the weight-only rows, whose second seed was
    the tuning order; the W4A4 rows draw windows and tuning order from the same seed)."""
    from auto_round import AutoRound

    fmt = {"scheme": PRESETS[scheme]} if scheme in PRESETS else \
        {"bits": SCHEMES[scheme][0], "group_size": SCHEMES[scheme][1], "sym": True}
    ar = AutoRound(model, tokenizer, iters=iters, dataset=[r.unsqueeze(0) for r in calib], nsamples=len(calib),
                   seqlen=calib.shape[1], batch_size=BATCH, device_map="cpu", seed=seed, **fmt, **settings)
    ar.quantize()  # quantize_and_save's immediate saving frees the weights: evaluate first, then save
    import auto_round

    def save() -> Path:
        ar.save_quantized(str(out), format="llm_compressor")
        return out

    return {"auto_round": auto_round.__version__, "iters": iters, "settings": settings, "model": ar.model,
            "save": save}


def run_llmc(model, tokenizer, calib, scheme: str, out: Path, gptq: bool = True) -> dict:
    """llm-compressor's GPTQ (or, ``gptq=False``, its QuantizationModifier: min-max RTN, calibrated input scales)."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from torch.utils.data import DataLoader

    if scheme in PRESETS:
        fmt: dict[str, Any] = {"scheme": PRESETS[scheme], "targets": ["Linear"]}
    else:
        bits, group = SCHEMES[scheme]
        fmt = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}}}}
    recipe = [GPTQModifier(ignore=["lm_head"], block_size=128, dampening_frac=0.01, actorder="static", **fmt)
              if gptq else QuantizationModifier(ignore=["lm_head"], **fmt)]
    rows = [{"input_ids": r.unsqueeze(0), "attention_mask": torch.ones(1, r.numel(), dtype=torch.long)} for r in calib]
    model = oneshot(model=model, tokenizer=tokenizer, dataset=DataLoader(rows, batch_size=None), recipe=recipe,
                    num_calibration_samples=len(calib), max_seq_length=calib.shape[1])
    import llmcompressor

    def save() -> Path:
        model.save_pretrained(str(out), save_compressed=True)
        tokenizer.save_pretrained(str(out))
        return out

    return {"llmcompressor": llmcompressor.__version__, "model": model, "save": save}


# ------------------------------------------------------------------ what was written
def layout(folder: Path, layers: int, experts: int) -> dict:
    """Tensor names of ``folder``'s safetensors collapsed over layer and expert indices, with dtype and shape
    (of layer 0 / expert 0), and whether every expert of every layer has a packed (or float) weight."""
    from safetensors import safe_open

    names: dict[str, dict] = {}
    have: set[tuple[int, int]] = set()
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                m = re.search(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.", k)
                if m and k.endswith(("weight_packed", "weight")):
                    have.add((int(m.group(1)), int(m.group(2))))
                key = re.sub(r"experts\.\d+\.", "experts.{e}.", re.sub(r"layers\.\d+\.", "layers.{l}.", k))
                if key not in names:
                    sl = st.get_slice(k)
                    names[key] = {"dtype": str(sl.get_dtype()), "shape": list(sl.get_shape())}
    config = json.loads((folder / "config.json").read_text())
    return {"tensors": names, "experts_with_weights": len(have), "experts_expected": layers * experts,
            "bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors")),
            "quantization_config": config.get("quantization_config")}


def reload_ppl(folder: Path, ev) -> dict:
    """Perplexity of ``folder`` loaded through transformers (compressed-tensors decompresses it)."""
    try:
        from transformers import AutoModelForCausalLM

        from lowbit.eval import perplexity

        m = AutoModelForCausalLM.from_pretrained(str(folder), dtype="float32").eval()
        kinds = sorted({type(mod).__name__ for name, mod in m.named_modules() if name.endswith("mlp.experts")})
        return {"ppl": perplexity(m, ev, seqlen=EVAL_SEQLEN, windows=EVAL_WINDOWS, progress=False).ppl,
                "experts_module": kinds}
    except Exception as e:  # noqa: BLE001 - the error itself is the finding
        return {"error": f"{type(e).__name__}: {str(e)[:400]}"}


# ------------------------------------------------------------------ one row
def seed_of(row: dict) -> int:
    """A row's calibration-window seed (rows recorded before seeds were drawn used seed 0)."""
    return int(row.get("seed", 0))


def row_key(row: dict) -> tuple:
    """Rows are keyed by (tool, scheme, seed)."""
    return row["tool"], row["scheme"], seed_of(row)


def child(tool: str, scheme: str, iters: int, organism: Path, keep: Path | None, seed: int = 0) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowbit.eval import perplexity

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    folder, calib, ev = organism_data(organism, seed)
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="float32").eval()
    cfg = model.config
    ppl_fp = perplexity(model, ev, seqlen=EVAL_SEQLEN, windows=EVAL_WINDOWS, progress=False).ppl
    coverage = routed_tokens(model, calib)
    out = keep / f"{tool}-{scheme}-s{seed}" if keep else Path(tempfile.mkdtemp(prefix=f"moe-{tool}-"))
    t0 = time.perf_counter()
    if tool in AUTOROUND:
        steps, settings = AUTOROUND[tool]
        extra = run_autoround(model, tok, calib, scheme, iters if steps is None else steps, out,
                              seed if scheme in PRESETS else 0, **settings)
    else:
        extra = run_llmc(model, tok, calib, scheme, out, gptq=tool == "llmc-gptq")
    seconds = time.perf_counter() - t0
    rss = peak_rss_mib()
    quantized, save = extra.pop("model"), extra.pop("save")
    in_memory = perplexity(quantized, ev, seqlen=EVAL_SEQLEN, windows=EVAL_WINDOWS, progress=False).ppl
    t1 = time.perf_counter()
    out = _folder_with_config(save())
    save_s = time.perf_counter() - t1
    del quantized, model
    return {"tool": tool, "scheme": scheme, "seed": seed, "seconds": round(seconds, 1), "save_seconds": round(save_s, 1),
            "peak_rss_mib": round(rss),
            "ppl_fp": ppl_fp, "ppl_in_memory": in_memory, "reloaded": reload_ppl(out, ev),
            "layout": layout(out, cfg.num_hidden_layers, cfg.num_experts), "out": str(out),
            "calib_tokens_per_expert": coverage,
            "experts_without_calib_tokens": sum(c == 0 for layer in coverage for c in layer),
            "versions": _versions(), "machine": machine(), "seed_kind": SEED_KIND,
            "organism_sha256": organism_digest(folder), **extra}


def _folder_with_config(path: Path) -> Path:
    """The folder a peer actually wrote (auto-round may add a sub-folder named after the scheme)."""
    if (path / "config.json").is_file():
        return path
    found = sorted(path.rglob("config.json"))
    return found[0].parent if found else path


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "compressed-tensors", "auto-round", "llmcompressor", "accelerate"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


# ------------------------------------------------------------------ driver
def table(rows: list[dict]) -> str:
    def row(r: dict) -> list:
        lay, rel = r.get("layout", {}), r.get("reloaded", {})
        return [r["tool"], r["scheme"], seed_of(r), r["seconds"], r["peak_rss_mib"], f"{r['ppl_fp']:.3f}", f"{r['ppl_in_memory']:.3f}",
                f"{rel['ppl']:.3f}" if "ppl" in rel else "error", f"{lay.get('experts_with_weights')}/"
                f"{lay.get('experts_expected')}", r["experts_without_calib_tokens"]]

    return markdown_table(["tool", "scheme", "seed", "s", "peak MiB", "ppl fp", "ppl (in memory)", "ppl (reloaded)",
                           "experts written", "experts w/o calib tokens"], [row(r) for r in rows])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated: {', '.join(TOOLS)}")
    p.add_argument("--schemes", default="w4g128", help=f"comma-separated: {', '.join(SCHEMES)}")
    p.add_argument("--iters", type=int, default=50, help="auto-round's tuning steps for the 'autoround' rows")
    p.add_argument("--organism", default=str(ORGANISM), help="the MoE organism's folder")
    p.add_argument("--seeds", default="0", help="comma-separated calibration-window seeds (one row per seed)")
    p.add_argument("--keep", default=None, help="keep each peer's output folder under this folder")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/moe_peers.json)")
    p.add_argument("--table", action="store_true", help="print the results table and exit")
    p.add_argument("--child", nargs=3, metavar=("TOOL", "SCHEME", "SEED"), help=argparse.SUPPRESS)
    a = p.parse_args()
    out = Path(a.out).absolute() if a.out else result_path(RESULTS)
    if a.table:
        print(table(json.loads(out.read_text())["rows"]) if out.exists() else "no results yet")
        return
    tools, schemes = a.tools.split(","), a.schemes.split(",")
    bad = [t for t in tools if t not in TOOLS] + [s for s in schemes if s not in SCHEMES]
    if bad:
        p.error(f"unknown {', '.join(bad)}; tools are {', '.join(TOOLS)}, schemes {', '.join(SCHEMES)}")
    organism = Path(a.organism).expanduser()
    keep = Path(a.keep).absolute() if a.keep else None
    if a.child:
        print("ROW " + json.dumps(child(a.child[0], a.child[1], a.iters, organism, keep, int(a.child[2])), default=str))
        return
    if not (organism / "model" / "config.json").is_file():
        p.error(f"{organism} has no model/; build it first: python -m benchmarks.organism --arch qwen3moe")
    for seed, scheme, tool in ((int(x), s, t) for x in a.seeds.split(",") for s in schemes for t in tools):
        cmd = [sys.executable, "-m", "benchmarks.moe_peers", "--child", tool, scheme, str(seed), "--iters", str(a.iters),
               "--organism", str(organism)] + (["--keep", str(keep)] if keep else [])
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        lines = [x for x in r.stdout.splitlines() if x.startswith("ROW ")]
        if r.returncode or not lines:
            print(f"{tool} {scheme} seed {seed}: failed (exit {r.returncode})\n{r.stderr[-3000:]}", file=sys.stderr)
            continue
        row: dict[str, Any] = json.loads(lines[-1][4:])
        merge_row(out, row, row_key)
        print(table([row]).splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
