"""Probes of why vLLM CPU's FP8 KV cache costs more than lowbit's emulation (engines.md, ct-w8a8-int8-kv-fp8).

    python -m benchmarks.kv_vllm_probe --modes q,rne,trunc            # lowbit's forward with hooks
    .venv-vllm/bin/python -m benchmarks.kv_vllm_probe --modes vllm-unit  # vLLM, fp8_e4m3 cache, unit scales

Reads the checkpoints and the 8 x 512 windows `benchmarks.engines` keeps under ``--keep``. Modes:
``q``: the FP8-KV checkpoint with each query projection's output also cast to E4M3 (unit scale);
``rne`` / ``trunc``: the W8A8 checkpoint without KV, keys and values cast to E4M3 with the export's
k/v scales at the k/v projections (before RoPE), rounding to nearest / toward zero;
``vllm-unit``: the W8A8 export without KV scales served by vLLM with ``kv_cache_dtype="fp8_e4m3"``;
``none``: the W8A8 checkpoint without KV quantization (the 16-bit cache's baseline);
``cache``: the FP8-KV checkpoint as lowbit evaluates it (the same-run baseline of the next mode);
``trunc-cache``: the FP8-KV checkpoint in lowbit's forward with its cache write done as vLLM CPU's
(``csrc/cpu/cpu_attn_fp8.hpp``, ``float_to_fp8e4m3_scalar``): keys and values (after RoPE, as cached) in
bf16, times ``1 / scale`` in float32, clamped to +-448, then the E4M3 code taken from the float32's
top bits, i.e. rounded toward zero; read back exactly (code x scale).
Rows go to benchmarks/results/kv_vllm_probe.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from pathlib import Path

from benchmarks.common import machine, merge_row

RESULT = "kv_vllm_probe"


def _toward_zero(y):
    """float32 ``y`` (within +-448) as E4M3, rounded toward zero: torch's nearest cast, then one code down
    in magnitude where it went up (the bytes are sign-magnitude)."""
    import torch

    q = y.to(torch.float8_e4m3fn)
    b = q.view(torch.uint8)
    over = (q.float().abs() > y.abs()) & ((b & 0x7F) > 0)
    return torch.where(over, b - 1, b).view(torch.float8_e4m3fn)


def e4m3(x, s, toward_zero: bool):
    """``x`` cast to E4M3 at scale ``s`` (from bf16, as vLLM's cache write sees it) and back."""
    import torch

    y = x.to(torch.bfloat16).float() / s
    q = _toward_zero(y) if toward_zero else y.to(torch.float8_e4m3fn)
    return (q.float() * s).to(x.dtype)


def vllm_cpu_cache_write(x, s):
    """Keys or values as vLLM CPU's FP8 cache holds them, read back (``x``'s dtype).

    Its write multiplies by the inverse scale in float32, clamps to +-448 and keeps the bits of the
    float32 that E4M3 has room for: the mantissa is truncated, so every magnitude rounds down.
    """
    import torch

    y = (x.to(torch.bfloat16).float() * (1.0 / s.float())).clamp(-448.0, 448.0)
    return (_toward_zero(y).float() * s.float()).to(x.dtype)


@contextlib.contextmanager
def vllm_cpu_cache_writes():
    """Within: lowbit's static per-tensor FP8 KV fake-quant replaced by `vllm_cpu_cache_write`."""
    from lowbit.nn import kv_quant

    plain = kv_quant.qdq_kv

    def qdq(x, s, scale=None):
        if s.static and s.elements.elem == "e4m3" and not s.per_head and not s.center:
            return vllm_cpu_cache_write(x, scale.reshape(()).to(x.device))
        return plain(x, s, scale)

    kv_quant.qdq_kv = qdq
    try:
        yield
    finally:
        kv_quant.qdq_kv = plain


def lowbit_row(mode: str, keep: Path, win) -> float:
    import torch
    from safetensors import safe_open

    import lowbit
    from lowbit.eval import perplexity

    if mode == "none":
        model, _ = lowbit.load(keep / "ckpt-w8a8-int8")
    elif mode in ("cache", "trunc-cache"):
        model, _ = lowbit.load(keep / "ckpt-w8a8-int8-kv-fp8")
    elif mode == "q":
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
    patch = vllm_cpu_cache_writes() if mode == "trunc-cache" else contextlib.nullcontext()
    with patch:
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
    p.add_argument("--modes", default="q,rne,trunc", help="comma-separated: q, rne, trunc, none, cache, trunc-cache, vllm-unit")
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
        # one row per mode and CPU: the rows of different machines differ (fp32 rounding, vLLM's ISA build)
        merge_row(RESULT, {"mode": mode, "ppl": ppl, "windows": 8, "seqlen": 512, "machine": machine()},
                  lambda r: (r["mode"], r.get("machine", {}).get("cpu")))
        print(f"{mode:10s} {ppl:.3f}", flush=True)


if __name__ == "__main__":
    main()
