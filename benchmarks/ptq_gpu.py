"""PTQ tuning speed on a GPU: lowbit SignRoundV2 vs auto-round 0.16.x, each tool's defaults.

The CPU benchmarks (``ptq.py``, ``ptq_speed.py``) follow the issue's one-thread fp32
protocol; most users tune on a GPU, where both tools default to bf16 products (lowbit
``tune_dtype="auto"``, which keeps 2-bit blocks in fp32; auto-round ``amp=True``). This
script times the whole quantization call of each tool on the same model and the same
calibration tokens, each run in a fresh process (its own CUDA context and peak memory),
tools alternating, medians over ``--repeats``.

The GPU machine this runs on reaches no model hub and takes no large files, so the
models are built from their configs with random weights: the bundled SmolLM2-135M's
architecture and a 1.1B Llama (TinyLlama's shape). Tuning time does not depend on the
weights' values (both tools run every iteration; neither stops early), so the timings
hold for the trained models; the perplexities are measured on the CPU by ``ptq.py``.

    python benchmarks/ptq_gpu.py prepare .gpu            # here: tokenizer + calibration tokens of the bundled model
    python benchmarks/ptq_gpu.py run .gpu --out results.json --repeats 2 --budget 420   # on the GPU machine
    python benchmarks/ptq_gpu.py table results.json      # merge into results/ptq_gpu.json and print the table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
RESULTS = ROOT / "benchmarks" / "results" / "ptq_gpu.json"
NSAMPLES, SEQLEN, BATCH, ITERS = 32, 256, 8, 50

# architectures (random weights); vocab and rope follow the bundled tokenizer / model
MODELS = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, tie_word_embeddings=True),
    "llama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                       num_key_value_heads=4, head_dim=64, tie_word_embeddings=False),
}
# config -> (lowbit scheme, auto-round kwargs); each tool at its defaults otherwise
CONFIGS = {
    "w4g128": ("w4g128", {"bits": 4, "group_size": 128, "sym": True}),
    "w2g64": ("w2g64", {"bits": 2, "group_size": 64, "sym": True, "enable_alg_ext": True}),
}


def prepare(folder: Path) -> None:
    """Tokenizer files and the 32 x 256 calibration tokens of the bundled model, for the GPU machine."""
    import torch

    from lowbit.data import calibration_batches
    from lowbit.models import load_model

    lm = load_model(None)
    folder.mkdir(parents=True, exist_ok=True)
    lm.tokenizer.save_pretrained(folder / "tokenizer")
    calib = calibration_batches(lm.tokenizer, None, nsamples=NSAMPLES, seqlen=SEQLEN, seed=0)
    torch.save(calib, folder / "calib.pt")
    print(f"wrote {folder}: tokenizer, calib.pt {tuple(calib.shape)}")


def build_model(name: str, vocab: int):
    """The architecture ``name`` with seeded random weights, fp32 on the CPU (as both tools expect)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=8192, rms_norm_eps=1e-5, **MODELS[name])
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init is slow on the CPU
        model = LlamaForCausalLM(cfg)
    return model.float().cpu().eval()


def block_plan(model, scheme: str):
    """``scheme`` on every decoder-block Linear (lm_head and embeddings stay float, as in auto-round)."""
    from lowbit.formats.plan import Plan
    from lowbit.models import linear_layers

    return Plan.uniform({n: m for n, m in linear_layers(model).items() if ".layers." in n}, scheme)


def child(folder: Path, tool: str, model_name: str, config: str, iters: int) -> dict:
    import torch
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder / "tokenizer")
    calib = torch.load(folder / "calib.pt")
    model = build_model(model_name, len(tok))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scheme, ar_kw = CONFIGS[config]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    info: dict = {}
    if tool == "lowbit":
        from lowbit.ptq import quantize_model

        quantize_model(model, block_plan(model, scheme), "signround2", calib=calib, tokenizer=tok, progress=False,
                       batch_size=BATCH, iters=iters, device=device)
    else:
        from auto_round import AutoRound

        ar = AutoRound(model, tok, dataset=[row.unsqueeze(0) for row in calib], nsamples=NSAMPLES, seqlen=SEQLEN,
                       batch_size=BATCH, device_map=device, seed=0, iters=iters, **ar_kw)
        ar.quantize()
    if device == "cuda":
        torch.cuda.synchronize()
        info["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        info["gpu"] = torch.cuda.get_device_name()
    info.update(tool=tool, model=model_name, config=config, iters=iters, seconds=time.perf_counter() - t0,
                torch=torch.__version__, transformers=transformers.__version__)
    return info


def profile(folder: Path, blocks: int, config: str, rows: int) -> None:
    """Where lowbit's tuning time goes on this device: the first ``blocks`` blocks under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity
    from transformers import AutoTokenizer

    from lowbit.models.layers import decoder_blocks
    from lowbit.ptq import quantize_model

    tok = AutoTokenizer.from_pretrained(folder / "tokenizer")
    model = build_model("smollm2-135m", len(tok))
    del decoder_blocks(model)[blocks:]
    model.config.num_hidden_layers = blocks
    plan = block_plan(model, CONFIGS[config][0])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        quantize_model(model, plan, "signround2", calib=torch.load(folder / "calib.pt"), progress=False,
                       batch_size=BATCH, iters=ITERS, device=device)
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=rows))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def run(folder: Path, out: Path, pairs: list[tuple[str, str]], repeats: int, budget: float,
        timeout: float) -> None:
    """Every (model, config) pair, tools alternating, repeats outermost, until ``budget`` seconds are spent."""
    start, rows = time.perf_counter(), []
    jobs = [(rep, m, c) for rep in range(repeats) for m, c in pairs]
    for rep, m, c in jobs:
        tools = ("lowbit", "autoround") if rep % 2 == 0 else ("autoround", "lowbit")
        for tool in tools:
            if time.perf_counter() - start > budget:
                print(f"budget of {budget:.0f} s spent; stopping", flush=True)
                return
            cmd = [sys.executable, __file__, "child", str(folder), "--tool", tool, "--model", m, "--config", c]
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
            except subprocess.TimeoutExpired:
                row = {"tool": tool, "model": m, "config": c, "repeat": rep, "error": f"timeout {timeout:.0f} s"}
            else:
                lines = res.stdout.strip().splitlines()
                if res.returncode == 0 and lines:
                    row = {**json.loads(lines[-1]), "repeat": rep}
                else:
                    row = {"tool": tool, "model": m, "config": c, "repeat": rep,
                           "error": (res.stderr or res.stdout)[-3000:]}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "error"}), row.get("error", "")[-600:], flush=True)
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps({"rows": rows}, indent=1))
            tmp.replace(out)


def summarise(rows: list[dict]) -> list[dict]:
    """Median seconds per (model, config, tool) and the lowbit / auto-round ratio."""
    out = []
    for m in MODELS:
        for c in CONFIGS:
            med = {}
            for tool in ("lowbit", "autoround"):
                secs = [r["seconds"] for r in rows if (r["model"], r["config"], r["tool"]) == (m, c, tool)
                        and "seconds" in r]
                if secs:
                    med[tool] = (statistics.median(secs), len(secs))
            if not med:
                continue
            row = {"model": m, "config": c, **{f"{t}_seconds": round(s, 1) for t, (s, _) in med.items()},
                   **{f"{t}_runs": n for t, (_, n) in med.items()}}
            for tool in ("lowbit", "autoround"):  # runs past --timeout: only known to be slower than it
                cut = [r for r in rows if (r["model"], r["config"], r["tool"]) == (m, c, tool) and "error" in r]
                if cut:
                    row[f"{tool}_unfinished"] = [r["error"][:80] for r in cut]
            if len(med) == 2:
                row["lowbit_over_autoround"] = round(med["lowbit"][0] / med["autoround"][0], 3)
            out.append(row)
    return out


def table(paths: list[Path]) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from lowbit.io import atomic_write_text

    rows = [r for p in paths for r in json.loads(p.read_text())["rows"]]
    summary = summarise(rows)
    meta = next((r for r in rows if "gpu" in r), {})
    data = {"protocol": f"{NSAMPLES} x {SEQLEN} calibration tokens, batch {BATCH}, {ITERS} iters, random weights, "
                        "each tool's defaults on the GPU (lowbit tune_dtype auto, auto-round amp); medians",
            "gpu": meta.get("gpu"), "torch": meta.get("torch"), "transformers": meta.get("transformers"),
            "summary": summary, "rows": rows}
    atomic_write_text(RESULTS, json.dumps(data, indent=1))
    print("| model | config | lowbit s | auto-round s | lowbit / auto-round |")
    print("| --- | --- | --- | --- | --- |")
    for r in summary:
        print(f"| {r['model']} | {r['config']} | {r.get('lowbit_seconds', '-')} | {r.get('autoround_seconds', '-')} "
              f"| {r.get('lowbit_over_autoround', '-')} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare").add_argument("folder", type=Path)
    r = sub.add_parser("run")
    r.add_argument("folder", type=Path)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--pairs", default="smollm2-135m:w4g128,smollm2-135m:w2g64,llama-1.1b:w4g128",
                   help="model:config pairs, in the order they run")
    r.add_argument("--repeats", type=int, default=2)
    r.add_argument("--budget", type=float, default=420.0, help="stop launching runs after this many seconds")
    r.add_argument("--timeout", type=float, default=240.0, help="seconds before one run is abandoned")
    c = sub.add_parser("child")
    c.add_argument("folder", type=Path)
    c.add_argument("--tool", choices=("lowbit", "autoround"), required=True)
    c.add_argument("--model", choices=sorted(MODELS), required=True)
    c.add_argument("--config", choices=sorted(CONFIGS), required=True)
    c.add_argument("--iters", type=int, default=ITERS)
    f = sub.add_parser("profile")
    f.add_argument("folder", type=Path)
    f.add_argument("--blocks", type=int, default=2)
    f.add_argument("--config", choices=sorted(CONFIGS), default="w4g128")
    f.add_argument("--rows", type=int, default=25)
    t = sub.add_parser("table")
    t.add_argument("paths", type=Path, nargs="+")
    a = p.parse_args()
    if a.cmd == "prepare":
        prepare(a.folder)
    elif a.cmd == "run":
        pairs = [tuple(x.split(":")) for x in a.pairs.split(",")]
        bad = [x for x in pairs if len(x) != 2 or x[0] not in MODELS or x[1] not in CONFIGS]
        if bad:
            p.error(f"--pairs: unknown {bad}; models {sorted(MODELS)}, configs {sorted(CONFIGS)}")
        run(a.folder, a.out, pairs, a.repeats, a.budget, a.timeout)
    elif a.cmd == "profile":
        profile(a.folder, a.blocks, a.config, a.rows)
    elif a.cmd == "child":
        print(json.dumps(child(a.folder, a.tool, a.model, a.config, a.iters)))
    else:
        table(a.paths)


if __name__ == "__main__":
    main()
