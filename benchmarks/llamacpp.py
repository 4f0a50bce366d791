"""Perplexity of a lowbit GGUF export in llama.cpp (llama-cpp-python, CPU) next to lowbit's own.

    python -m benchmarks.llamacpp [--scheme w4g32] [--windows 4] [--seqlen 512] [--json]
    python -m benchmarks.llamacpp --windows 1 --seqlen 64 --skip-llamacpp     # smoke, without llama.cpp

Quantizes the bundled SmolLM2-135M with RTN, evaluates it in lowbit, exports it to GGUF
(exact Q4_0/Q8_0/MXFP4 blocks), then evaluates the same token windows (lowbit's token ids,
so only the model differs) in transformers' GGUF loader and in llama.cpp. lowbit and
transformers agree to float rounding; llama.cpp computes with its own kernels (its CPU
matmuls quantize activations to 8 bits for Q4_0/Q8_0 weights), so a small gap is expected.
It needs llama-cpp-python (``pip install -e '.[llamacpp]'``) unless ``--skip-llamacpp``;
it prints its result (``--json``: one line) and writes no file.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import bundled_model, require_peer


def open_llama(gguf_path: Path, n_ctx: int, threads: int):
    """A ``llama_cpp.Llama`` on ``gguf_path`` with logits for every position, on ggml's plain CPU buffers.

    llama.cpp repacks weights into "extra" CPU buffer types where the CPU has the
    instructions (AMX tiles, AVX512 interleaved layouts); with llama-cpp-python 0.3.36 on
    an AMX Xeon, ``decode`` then segfaults on this model's Q4_K_M files (bundled and
    off-grid alike; the F32 file runs). llama-cpp-python does not expose llama.cpp's
    ``--no-repack`` (``use_extra_bufts``), so the default model parameters are wrapped while
    the model loads; the plain path runs the same quantized dot products in another layout.
    """
    import llama_cpp
    from llama_cpp import llama_cpp as lib

    default = lib.llama_model_default_params

    def plain_buffers():
        params = default()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = plain_buffers
    try:
        return llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True,
                               n_threads=threads, verbose=False)
    finally:
        lib.llama_model_default_params = default


def llamacpp_nll(gguf_path: Path, windows: torch.Tensor, threads: int) -> tuple[float, int]:
    """Summed NLL and token count over ``windows`` ([n, L] token ids), one llama.cpp context per window."""
    L = windows.shape[1]
    return _nll(open_llama(gguf_path, L, threads), windows)


def _nll(llm, windows: torch.Tensor) -> tuple[float, int]:
    L = windows.shape[1]
    total, count = 0.0, 0
    for row in windows.tolist():
        llm.reset()
        llm.eval(row)
        logits = np.asarray(llm.scores[: L - 1], dtype=np.float64)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        total -= float(logp[np.arange(L - 1), row[1:]].sum())
        count += L - 1
    return total, count


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llamacpp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheme", default="w4g32", help="a scheme with an exact GGUF type: w4g32, w8g32, mxfp4")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--skip-llamacpp", action="store_true",
                   help="lowbit and transformers' GGUF loader only (when llama-cpp-python is not installed)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if not args.skip_llamacpp:
        require_peer("llama_cpp", "pass --skip-llamacpp (lowbit and transformers only)")

    from transformers import AutoModelForCausalLM

    from lowbit.api import build_plan
    from lowbit.data import eval_tokens
    from lowbit.eval import perplexity
    from lowbit.eval.perplexity import eval_windows
    from lowbit.files import gguf_export
    from lowbit.models import bundled_gguf
    from lowbit.ptq import quantize_model

    lm = bundled_model(threads=args.threads)
    tokens = eval_tokens(lm.tokenizer)
    plan = build_plan(lm.model, args.scheme, None)
    # plain RTN through the library's entry point, as `lowbit quantize --method rtn --no-search`:
    # it also rounds the embeddings to fp16 values, so the GGUF stores them in F16 exactly
    quantize_model(lm.model, plan, "rtn", {"search": False}, progress=False)
    res: dict = {"scheme": args.scheme, "windows": args.windows, "seqlen": args.seqlen}
    res["ppl_lowbit"] = perplexity(lm.model, tokens, args.seqlen, args.windows, progress=False).ppl
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model.gguf"
        res["export"] = gguf_export.export(lm.model, lm.tokenizer, out, source_gguf=bundled_gguf())["types"]
        res["gguf_mb"] = round(out.stat().st_size / 2**20, 1)
        hf = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=out.name, dtype=torch.float32).eval()
        res["ppl_transformers_gguf"] = perplexity(hf, tokens, args.seqlen, args.windows, progress=False).ppl
        del hf
        if not args.skip_llamacpp:
            t0 = time.perf_counter()
            win = eval_windows(tokens, args.seqlen, args.windows)
            llm = open_llama(out, args.seqlen, args.threads)
            sample = lm.tokenizer.decode(win[0].tolist())
            res["llamacpp_tokenizer_agrees"] = llm.tokenize(sample.encode(), add_bos=False, special=True) == \
                lm.tokenizer(sample, add_special_tokens=False)["input_ids"]
            nll, n = _nll(llm, win)
            res["ppl_llamacpp"] = math.exp(nll / n)
            res["llamacpp_seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res) if args.json else "\n".join(f"{k}: {v}" for k, v in res.items()))
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
