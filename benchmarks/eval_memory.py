"""Peak memory and speed of evaluating a lowbit W4 checkpoint against its float model (issue 22).

A random Llama of the 1.1B shape (hidden 2048, MLP 5632, 32 heads / 4 KV heads, vocab
32000; ``--layers`` blocks, 22 = the whole 1.1B model) is saved twice: as a float HF
folder and, after plain RTN W4 g128 on every block Linear, as a lowbit checkpoint. Each
is then loaded and evaluated (perplexity on ``--windows`` x ``--seqlen`` random tokens,
batch 4) in a fresh process, which reports its peak memory: RSS on the CPU, and
``torch.cuda.max_memory_allocated`` with ``--device cuda`` (the model is loaded on the CPU
and moved to the GPU for the pass, as ``lowbit eval --device cuda`` does). Weight values do
not matter for memory or time.

    python -m benchmarks.eval_memory --layers 22             # CPU
    python -m benchmarks.eval_memory --layers 22 --device cuda

Rows go to benchmarks/results/eval_memory.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import machine, merge_row, peak_gpu_mib, peak_rss_mib, run_child

NAME = "eval_memory.json"
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
             vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=4096)


def build(folder: Path, layers: int) -> None:
    """Save the float model (HF folder) and its RTN W4 g128 lowbit checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowbit.files.native import save
    from lowbit.models import linear_layers
    from lowbit.nn import replace_linears
    from lowbit.plans.plan import Plan

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **SHAPE)).float().eval()
    model.save_pretrained(folder / "float")
    replace_linears(model, Plan.uniform(linear_layers(model), "w4g128"))
    save(model, None, folder / "w4g128", meta={"source": "random 1.1B-shaped Llama"})


def measure(path: Path, device: str, seqlen: int, windows: int) -> dict:
    """Load ``path`` the way `lowbit eval` does, run the perplexity pass; peak memory and seconds."""
    import torch

    from lowbit.eval import perplexity
    from lowbit.models.placement import on_device

    if (path / "config.json").exists() and not (path / "lowbit.json").exists():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    else:
        from lowbit.files.native import load

        model, _ = load(path)
    tensors = [*model.parameters(), *model.buffers()]
    resident = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, seqlen * windows), generator=torch.Generator().manual_seed(0))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with on_device(model, device):
        r = perplexity(model, tokens, seqlen=seqlen, windows=windows, progress=False)
        if device == "cuda":
            torch.cuda.synchronize()
    row = {"model_tensors_mib": round(resident), "eval_seconds": round(time.perf_counter() - t0, 2),
           "ppl": r.ppl, "peak_rss_mib": round(peak_rss_mib())}
    if device == "cuda":
        row["peak_gpu_mib"] = round(peak_gpu_mib())
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--folder", type=Path, default=None, help="reuse (or keep) the saved models here")
    p.add_argument("--child", nargs=2, metavar=("WHAT", "PATH"), help=argparse.SUPPRESS)
    p.add_argument("--no-save", action="store_true", help="print the rows only")
    a = p.parse_args()
    if a.child:
        what, path = a.child
        if what == "build":
            build(Path(path), a.layers)
            print(json.dumps({"built": path}))
        else:
            print(json.dumps(measure(Path(path), a.device, a.seqlen, a.windows)))
        return
    tmp = None if a.folder else tempfile.TemporaryDirectory()
    folder = a.folder or Path(tmp.name)
    common = ["--layers", str(a.layers), "--device", a.device, "--seqlen", str(a.seqlen), "--windows", str(a.windows)]
    if not (folder / "w4g128").exists():
        run_child("eval_memory", [*common, "--child", "build", str(folder)])
    rows = {}
    for kind in ("float", "w4g128"):
        rows[kind] = {"model": kind, "layers": a.layers, "device": a.device, "seqlen": a.seqlen,
                      "windows": a.windows, **run_child("eval_memory", [*common, "--child", "measure",
                                                                           str(folder / kind)]), **machine()}
    key = "peak_gpu_mib" if a.device == "cuda" else "peak_rss_mib"
    rows["w4g128"]["peak_over_float"] = round(rows["w4g128"][key] / rows["float"][key], 3)
    rows["w4g128"]["seconds_over_float"] = round(rows["w4g128"]["eval_seconds"] / rows["float"]["eval_seconds"], 3)
    for row in rows.values():
        print(json.dumps(row), flush=True)
        if not a.no_save:
            merge_row(NAME, row, ("model", "layers", "device"),
                      protocol="random 1.1B-shaped Llama (vocab 32000, untied), float HF folder vs RTN w4g128 "
                               "lowbit checkpoint, perplexity on random tokens (batch 4), fresh process each")
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
