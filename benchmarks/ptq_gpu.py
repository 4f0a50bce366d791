"""PTQ tuning on a GPU at the scale users run: lowbit SignRoundV2 vs auto-round 0.16.x (issue 22).

Shapes (random weights: the GPU machine reaches no hub, and tuning time does not depend
on the values, since both tools run every iteration):
  ``1.1b``: TinyLlama's shape (hidden 2048, MLP 5632, 32 heads / 4 KV heads), its first 4 blocks;
  ``8b``: Llama-3-8B-shaped blocks (hidden 4096, MLP 14336, 32 heads / 8 KV heads), 2 blocks by
  default (4 with ``--blocks-8b 4``; a 4-block auto-round run takes minutes on an H200).
Both use vocabulary 32000 (the embeddings are not tuned). Calibration: 128 x 2048 random token
ids, batch 8, the same tensor for both tools. Each tool at its GPU defaults otherwise: lowbit
``signround2`` with ``tune_dtype="auto"`` (bf16 products above 2 bits, fp32 in 2-bit
blocks) and bf16 caches on the device; auto-round with ``device_map="cuda"`` and its bf16
``amp``, ``enable_alg_ext`` (its V2) at W2. Every run is a fresh process (its own CUDA
context and peak memory) that times the whole quantize call; rows are written as they
finish. Reported per row: seconds, peak GPU memory (``max_memory_allocated``), and for
lowbit the achieved fraction of the GPU's bf16 GEMM rate measured in the same process
(model FLOPs of the tuning and of the target / propagation passes over the seconds).

    python -m benchmarks.ptq_gpu run --out OUT.json --budget 330      # the GPU session (gpu_session.sh)
    python -m benchmarks.ptq_gpu run --cpu-check --out /tmp/x.json     # tiny shapes on the CPU: the logic
    python -m benchmarks.ptq_gpu table OUT.json [--save]               # medians; --save merges into results

Rows (``--rows`` picks by name; the default order is the priority order under a time budget):
see ROWS. A row whose run fails or passes ``--timeout`` records the error and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import ROOT, load_results, markdown_table, save_results

NAME = "ptq_gpu.json"
NSAMPLES, SEQLEN, BATCH, VOCAB = 128, 2048, 8, 32000
PROTOCOL = (f"{NSAMPLES} x {SEQLEN} random calibration tokens, batch {BATCH}, random-weight Llama blocks (1.1b: "
            "first 4 blocks of TinyLlama's shape; 8b: 2 Llama-3-8B-shaped blocks), each tool's GPU defaults, "
            "fresh process per run, medians")

SHAPES = {
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
                 head_dim=64, blocks=4),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, blocks=2),
    # --cpu-check: the same code paths at a size a CPU runs in seconds
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, blocks=2),
}
SCHEMES = {
    "w4g128": ("w4g128", {"bits": 4, "group_size": 128, "sym": True}),
    "w2g64": ("w2g64", {"bits": 2, "group_size": 64, "sym": True, "enable_alg_ext": True}),
}


@dataclass(frozen=True)
class Row:
    """One measured configuration: shape, scheme, iterations, tool, and lowbit options."""

    shape: str
    scheme: str
    iters: int
    tool: str
    variant: str = "default"  # lowbit: default | cache-cpu | compile | fp32-cache

    @property
    def name(self) -> str:
        v = "" if self.variant == "default" else f"-{self.variant}"
        return f"{self.shape}-{self.scheme}-{self.iters}-{self.tool}{v}"


def _pair(shape: str, scheme: str, iters: int) -> list[Row]:
    return [Row(shape, scheme, iters, "lowbit"), Row(shape, scheme, iters, "autoround")]


# priority order: what the targets need first, variants and the long rows last
ROWS = [*_pair("1.1b", "w4g128", 50), *_pair("1.1b", "w2g64", 50), *_pair("8b", "w4g128", 50),
        *_pair("8b", "w2g64", 50), Row("1.1b", "w4g128", 50, "lowbit", "cache-cpu"),
        Row("1.1b", "w4g128", 50, "lowbit", "compile"), *_pair("1.1b", "w4g128", 200)]


# ------------------------------------------------------------------ the child
def build_model(shape: str, device: str):
    """The shape's first blocks with seeded random weights, fp32 on the CPU (as both tools expect)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(SHAPES[shape])
    blocks = spec.pop("blocks")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, num_hidden_layers=blocks, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, **spec)
    with torch.device(device):  # random init is slow on the CPU
        model = LlamaForCausalLM(cfg)
    return model.float().cpu().eval()


def calibration(nsamples: int, seqlen: int):
    import torch

    return torch.randint(0, VOCAB, (nsamples, seqlen), generator=torch.Generator().manual_seed(0))


def word_tokenizer():
    """A tokenizer over the ids ``t0 .. t{VOCAB-1}`` (auto-round wants one; the calibration is ids already)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")


def block_plan(model, scheme: str):
    """``scheme`` on every decoder-block Linear (lm_head and embeddings stay float, as in auto-round)."""
    from lowbit.models import linear_layers
    from lowbit.plans.plan import Plan

    return Plan.uniform({n: m for n, m in linear_layers(model).items() if ".layers." in n}, scheme)


def model_flops(shape: str, iters: int, nsamples: int, seqlen: int, batch: int) -> float:
    """FLOPs lowbit's SignRound does per run: per block, 2 forward passes over every sample (targets,
    propagation) and ``iters`` forward + backward steps (3x a forward) over a mini-batch; Linear
    GEMMs (2 per weight per token) and causal attention (2 x 2 x T/2 x head_dim per head per token)."""
    s = SHAPES[shape]
    h, m, heads, kv, d = (s["hidden_size"], s["intermediate_size"], s["num_attention_heads"],
                          s["num_key_value_heads"], s["head_dim"])
    weights = h * heads * d * 2 + h * kv * d * 2 + 3 * h * m
    per_token = 2 * weights + 2 * heads * d * seqlen  # causal: half of 4 * T * d per head
    tokens_passes, tokens_steps = 2 * nsamples * seqlen, iters * batch * seqlen
    return s["blocks"] * per_token * (tokens_passes + 3 * tokens_steps)


def child(row: Row, cpu_check: bool) -> dict:
    import torch
    import transformers

    device = "cpu" if cpu_check else "cuda"
    shape = "tiny" if cpu_check else row.shape
    nsamples, seqlen = (8, 64) if cpu_check else (NSAMPLES, SEQLEN)
    model = build_model(shape, device)
    calib = calibration(nsamples, seqlen)
    scheme, ar_kw = SCHEMES[row.scheme]
    info: dict = {}
    if device == "cuda":
        from benchmarks.common import gemm_gflops

        info["bf16_peak_tflops"] = round(gemm_gflops(8192, 8192, 8192, "bf16", repeats=10, device="cuda") / 1e3, 1)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if row.tool == "lowbit":
        from lowbit.ptq import quantize_model

        settings = {"iters": row.iters, "batch_size": BATCH, "compile": row.variant == "compile",
                    **({"cache_dtype": "fp32"} if row.variant == "fp32-cache" else {})}
        quantize_model(model, block_plan(model, scheme), "signround2", settings, calib=calib, device=device,
                       progress=False, cache_device="cpu" if row.variant == "cache-cpu" else "device")
    else:
        from auto_round import AutoRound

        ar = AutoRound(model, word_tokenizer(), dataset=[r.unsqueeze(0) for r in calib], nsamples=nsamples, seqlen=seqlen,
                       batch_size=BATCH, device_map=device, seed=0, iters=row.iters, **ar_kw,
                       **({"enable_torch_compile": False} if cpu_check else {}))  # no C++ builds on a CPU check
        ar.quantize()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if device == "cuda":
        info["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        info["gpu"] = torch.cuda.get_device_name()
        if row.tool == "lowbit":
            rate = model_flops(shape, row.iters, nsamples, seqlen, BATCH) / seconds / 1e12
            info["model_tflops"] = round(rate, 1)
            info["fraction_of_bf16_peak"] = round(rate / info["bf16_peak_tflops"], 3)
    info.update(row=row.name, shape=row.shape, scheme=row.scheme, iters=row.iters, tool=row.tool,
                variant=row.variant, seconds=round(seconds, 2), torch=torch.__version__,
                transformers=transformers.__version__, cpu_check=cpu_check)
    return info


# -------------------------------------------------------------------- the run
def run(rows: list[Row], out: Path, repeats: int, budget: float, timeout: float, cpu_check: bool) -> list[dict]:
    """Every row once (priority order), then again up to ``repeats``, while the budget lasts; written as they finish."""
    start, results = time.perf_counter(), []
    for rep in range(repeats):
        for row in rows:
            left = budget - (time.perf_counter() - start)
            if left < 20:
                print(f"budget of {budget:.0f} s spent; skipping the remaining rows", flush=True)
                return results
            cmd = [sys.executable, "-m", "benchmarks.ptq_gpu", "child", row.shape, row.scheme, str(row.iters),
                   row.tool, row.variant, *(["--cpu-check"] if cpu_check else [])]
            try:
                r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=min(timeout, left),
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
                lines = r.stdout.strip().splitlines()
                res = json.loads(lines[-1]) if r.returncode == 0 and lines else {
                    "row": row.name, "error": (r.stderr or r.stdout)[-2000:]}
            except subprocess.TimeoutExpired:
                res = {"row": row.name, "error": f"timeout after {min(timeout, left):.0f} s"}
            res["repeat"] = rep
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "error"}), res.get("error", "")[-400:],
                  flush=True)
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps({"rows": results}, indent=1))
            tmp.replace(out)
    return results


def summarise(results: list[dict]) -> list[dict]:
    """Median seconds / peak memory per row name; lowbit over auto-round for the same shape, scheme, iters."""
    by: dict[str, list[dict]] = {}
    for r in results:
        if "seconds" in r:
            by.setdefault(r["row"], []).append(r)
    out = []
    for name, rs in by.items():
        s = {"row": name, **{k: rs[0][k] for k in ("shape", "scheme", "iters", "tool", "variant")},
             "seconds": round(statistics.median(r["seconds"] for r in rs), 2), "runs": len(rs)}
        if "peak_gpu_mib" in rs[0]:
            s["peak_gpu_mib"] = round(statistics.median(r["peak_gpu_mib"] for r in rs), 1)
        if "fraction_of_bf16_peak" in rs[0]:
            s["fraction_of_bf16_peak"] = round(statistics.median(r["fraction_of_bf16_peak"] for r in rs), 3)
        out.append(s)
    peers = {(s["shape"], s["scheme"], s["iters"]): s for s in out if s["tool"] == "autoround"}
    for s in out:
        ar = peers.get((s["shape"], s["scheme"], s["iters"]))
        if s["tool"] == "lowbit" and ar:
            s["time_over_autoround"] = round(s["seconds"] / ar["seconds"], 3)
            if "peak_gpu_mib" in s and "peak_gpu_mib" in ar:
                s["memory_over_autoround"] = round(s["peak_gpu_mib"] / ar["peak_gpu_mib"], 3)
    return out


def table(results: list[dict]) -> str:
    cols = ("row", "seconds", "runs", "peak_gpu_mib", "time_over_autoround", "memory_over_autoround",
            "fraction_of_bf16_peak")
    return markdown_table(cols, [[s.get(c, "") for c in cols] for s in summarise(results)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--rows", default=None, help="comma-separated row names (default: all, in priority order)")
    r.add_argument("--repeats", type=int, default=2)
    r.add_argument("--budget", type=float, default=330.0, help="seconds; rows not started by then are skipped")
    r.add_argument("--timeout", type=float, default=240.0, help="seconds before one run is abandoned")
    r.add_argument("--cpu-check", action="store_true", help="tiny shapes on the CPU (checks the logic)")
    c = sub.add_parser("child")
    c.add_argument("shape", choices=sorted(SHAPES))
    c.add_argument("scheme", choices=sorted(SCHEMES))
    c.add_argument("iters", type=int)
    c.add_argument("tool", choices=("lowbit", "autoround"))
    c.add_argument("variant")
    c.add_argument("--cpu-check", action="store_true")
    t = sub.add_parser("table")
    t.add_argument("paths", type=Path, nargs="+")
    t.add_argument("--save", action="store_true", help="merge the rows and the summary into results/ptq_gpu.json")
    a = p.parse_args()
    if a.cmd == "child":
        print(json.dumps(child(Row(a.shape, a.scheme, a.iters, a.tool, a.variant), a.cpu_check)))
    elif a.cmd == "run":
        rows = ROWS
        if a.rows:
            known = {row.name: row for row in ROWS}
            bad = [n for n in a.rows.split(",") if n not in known]
            if bad:
                p.error(f"--rows: unknown {bad}; known: {sorted(known)}")
            rows = [known[n] for n in a.rows.split(",")]
        results = run(rows, a.out, a.repeats, a.budget, a.timeout, a.cpu_check)
        print(table(results))
    else:
        results = [row for path in a.paths for row in json.loads(path.read_text())["rows"]]
        print(table(results))
        if a.save:  # beside the 135M-shape rows of the earlier protocol, which stay as they were
            data = load_results(NAME)
            data["issue22"] = {"protocol": PROTOCOL, "summary": summarise(results), "rows": results}
            save_results(NAME, data)


if __name__ == "__main__":
    main()
