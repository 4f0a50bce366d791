"""--avg-bits block by block against the whole-model path, on the first blocks of a big random checkpoint.

Mixed precision (DeltaLoss over the candidate options, then the exact knapsack) on a lazily loaded model
scores one block at a time (`lowbit.ptq.streamed_deltaloss`); without ``--offload-dir`` it back-propagates the
whole float model. At the 1.1B shape the whole-model path holds the fp32 model, a copy of every planned weight
and their gradients (~11 GiB): more than a helper's share of this machine. So the side-by-side runs on a
checkpoint cut to the first ``--layers`` blocks of the cached random-weight checkpoint (the full width: the same
blocks, embeddings and head as the 1.1B shape, fewer of them), both paths on the same calibration tokens, each in
a child process whose peak RSS comes from the kernel (``wait4``), with its CPU seconds. **Random weights measure
time and memory, not quality.** The two checkpoints written are compared tensor by tensor, and their plans.

    python -m benchmarks.bigmodel_mixed --layers 4 --nsamples 8 --seqlen 256 --threads 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from benchmarks.bigmodel import CACHE, child
from benchmarks.bigmodel_calib import WORK, _commit, prepare, save_row

FLAGS = ["--method", "rtn", "--avg-bits", "3", "--options", "w2g128,w4g128"]


def truncated(shape: str, layers: int) -> Path:
    """The cached checkpoint of ``shape`` cut to its first ``layers`` blocks (bf16 as stored), with the tokenizer
    `bigmodel_calib.prepare` trains; made once."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    full = prepare(shape)
    dst = WORK / "ckpt" / f"{shape}-{layers}L"
    if (dst / "model.safetensors").is_file():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((CACHE / shape / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=1))
    index = json.loads((CACHE / shape / "model.safetensors.index.json").read_text())["weight_map"]
    keep = [n for n in index if not n.startswith("model.layers.") or int(n.split(".")[2]) < layers]
    tensors = {}
    for fname in sorted({index[n] for n in keep}):
        with safe_open(str(CACHE / shape / fname), framework="pt") as f:
            tensors |= {n: f.get_tensor(n) for n in keep if index[n] == fname}
    save_file(tensors, str(dst / "model.safetensors.tmp"), metadata={"format": "pt"})
    (dst / "model.safetensors.tmp").rename(dst / "model.safetensors")
    for p in full.iterdir():
        if p.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(p, dst / p.name)
    return dst


def run(src: Path, lazy: bool, a: argparse.Namespace, tag: str) -> tuple[dict, Path]:
    out, off = WORK / "out" / tag, WORK / "offload" / tag
    for p in (out, off):
        shutil.rmtree(p, ignore_errors=True)
    log = WORK / "logs" / f"{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lowbit", "quantize", str(src), *FLAGS, "--nsamples", str(a.nsamples), "--seqlen",
           str(a.seqlen), "--no-eval", "--out", str(out), "--json", "--threads", str(a.threads),
           *(["--offload-dir", str(off)] if lazy else [])]
    code, wall, cpu, peak = child(cmd, log)
    last = [x for x in log.read_text().splitlines() if x.startswith("{")]
    result = json.loads(last[-1]) if last else {}
    shutil.rmtree(off, ignore_errors=True)
    row = {"shape": a.shape, "method": "mixed", "tool": "lowbit", "variant": f"{'lazy' if lazy else 'whole'}-"
           f"{a.layers}L", "layers": a.layers, "nsamples": a.nsamples, "seqlen": a.seqlen, "stopped_after": None,
           "flags": FLAGS + (["--offload-dir"] if lazy else []), "ok": code == 0, "exit": code, "s": round(wall, 1),
           "cpu_s": round(cpu, 1), "peak_rss": peak, "time_s": result.get("time_s"),
           "memory_estimate": result.get("memory_estimate"), "threads": a.threads, "commit": _commit()}
    return row, out


def same_checkpoints(a: Path, b: Path) -> dict:
    """Whether the two outputs hold the same plan and the same tensors (the lazy one spreads them over its
    per-block files)."""
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict:
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out |= load_file(str(f))
        return out

    ta, tb = tensors(a), tensors(b)
    same = ta.keys() == tb.keys() and all(ta[k].dtype == tb[k].dtype and bool((ta[k] == tb[k]).all()) for k in ta)
    plan_a, plan_b = (json.loads((f / "plan.json").read_text()) for f in (a, b))
    return {"same_plan": plan_a == plan_b, "same_tensors": bool(same), "tensors": len(ta)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="tinyllama-1.1b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--nsamples", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    src = truncated(a.shape, a.layers)
    rows, outs = [], []
    for lazy in (False, True):
        row, out = run(src, lazy, a, f"{a.shape}-{a.layers}L-mixed-{'lazy' if lazy else 'whole'}")
        rows.append(row)
        outs.append(out)
    if all(r["ok"] for r in rows):
        match = same_checkpoints(*outs)
        for r in rows:
            r.update(match)
    for r in rows:
        save_row(r)
        print(json.dumps(r), flush=True)
    for out in outs:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
