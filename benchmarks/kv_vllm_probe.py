"""Probes of why vLLM CPU's FP8 KV cache costs more than lowbit's emulation (engines.md, ct-w8a8-int8-kv-fp8).

    python -m benchmarks.kv_vllm_probe --modes q,rne,trunc            # lowbit's forward with hooks
    .venv-vllm/bin/python -m benchmarks.kv_vllm_probe --modes vllm-unit  # vLLM, fp8_e4m3 cache, unit scales

Reads the checkpoints and the 8 x 512 windows `benchmarks.engines` keeps under ``--keep``. Modes:
``q``: the FP8-KV checkpoint with each query projection's output also cast to E4M3 (unit scale);
``rne`` / ``trunc``: the W8A8 checkpoint without KV, keys and values cast to E4M3 with the export's
k/v scales at the k/v projections (before RoPE), rounding to nearest / toward zero;
``vllm-unit``: the W8A8 export without KV scales served by vLLM with ``kv_cache_dtype="fp8_e4m3"``.
Rows go to benchmarks/results/kv_vllm_probe.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from benchmarks.common import machine, merge_row

RESULT = "kv_vllm_probe"


def e4m3(x, s, toward_zero: bool):
    """``x`` cast to E4M3 at scale ``s`` (from bf16, as vLLM's cache write sees it) and back."""
    import torch

    y = x.to(torch.bfloat16).float() / s
    q = y.to(torch.float8_e4m3fn)
    if toward_zero:  # one code down in magnitude where rounding went up (sign-magnitude bytes)
        b = q.view(torch.uint8)
        over = (q.float().abs() > y.abs()) & ((b & 0x7F) > 0)
        q = torch.where(over, b - 1, b).view(torch.float8_e4m3fn)
    return (q.float() * s).to(x.dtype)


def lowbit_row(mode: str, keep: Path, win) -> float:
    import torch
    from safetensors import safe_open

    import lowbit
    from lowbit.eval import perplexity

    if mode == "q":
        model, _ = lowbit.load(keep / "ckpt-w8a8-int8-kv-fp8")
        for n, m in model.named_modules():
            if n.endswith("self_attn.q_proj"):
                m.register_forward_hook(lambda _m, _i, out: e4m3(out, 1.0, False))
    else:
        model, _ = lowbit.load(keep / "ckpt-w8a8-int8")
        with safe_open(str(keep / "ct-w8a8-int8-kv-fp8" / "model.safetensors"), "pt") as f:
            scales = {k: f.get_tensor(k).float().max().item() for k in f.keys() if k.endswith(("k_scale", "v_scale"))}
        for n, m in model.named_modules():
            for proj, key in (("k_proj", "k_scale"), ("v_proj", "v_scale")):
                if n.endswith("self_attn." + proj):
                    s = scales[n.rsplit(".", 1)[0] + "." + key]
                    m.register_forward_hook(lambda _m, _i, out, s=s: e4m3(out, s, mode == "trunc"))
    torch.set_num_threads(1)
    return perplexity(model, win, win.shape[1], win.shape[0], batch_size=1, progress=False).ppl


def vllm_row(keep: Path, windows: list[list[int]]) -> float:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(keep / "ct-w8a8-int8"), dtype="bfloat16", max_model_len=len(windows[0]) + 8,
              enforce_eager=True, enable_prefix_caching=False, seed=0, kv_cache_dtype="fp8_e4m3")
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0), use_tqdm=False)
    nll = sum(-lp[t].logprob for w, o in zip(windows, outs, strict=True)
              for t, lp in zip(w[1:], o.prompt_logprobs[1:], strict=True))
    return math.exp(nll / sum(len(w) - 1 for w in windows))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_vllm_probe", description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="q,rne,trunc", help="comma-separated: q, rne, trunc, vllm-unit")
    p.add_argument("--keep", default="/tmp/lowbit-engines", help="benchmarks.engines' --keep folder")
    a = p.parse_args(argv)
    keep = Path(a.keep)
    data = json.loads((keep / "windows-8x512.json").read_text())
    for mode in a.modes.split(","):
        if mode == "vllm-unit":
            ppl = vllm_row(keep, data["windows"])
        else:
            import torch

            ppl = lowbit_row(mode, keep, torch.tensor(data["windows"]))
        merge_row(RESULT, {"mode": mode, "ppl": ppl, "windows": 8, "seqlen": 512, "machine": machine()}, ("mode",))
        print(f"{mode:10s} {ppl:.3f}", flush=True)


if __name__ == "__main__":
    main()
