"""llm-compressor's FP8 KV-cache calibration beside lowbit's, on the same tokens (issue 36).

llm-compressor calibrates ``kv_cache_scheme`` (FP8 E4M3, static, per tensor) with its
``QuantizationModifier`` in ``oneshot`` over the calibration rows; its default observer for
keys and values is ``minmax``, a moving average (constant 0.01) of each forward's abs-max, so
the first rows weigh most. This script runs it on the float model, takes the ``k_scale`` /
``v_scale`` it registers on every attention, installs them as lowbit's FP8 scales on a copy
of the same float model, and measures perplexity in lowbit's forward on the evaluation
windows `benchmarks.kv` uses: the same cache quantization (E4M3 of ``x / scale``), only the
scales differ. The row lands in ``kv.json`` as KV ``fp8-llmc``.

llm-compressor needs an environment of its own (see `benchmarks.moe_peers` for the recipe: it
pins transformers <= 5.17 and is installed there with --no-deps); run it with this worktree first
on the path::

    PYTHONPATH=src:. .venv-peers/bin/python -m benchmarks.kv_peers --seqlen 2048 --windows 3 --nsamples 8
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.kv import RESULTS


def llmc_scales(model: Any, tokenizer: Any, calib: Any) -> dict[str, tuple[Any, Any]]:
    """Attention name -> (k_scale, v_scale) llm-compressor's oneshot calibrates (FP8, static, per tensor)."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from torch.utils.data import DataLoader

    path = str(model.config.name_or_path or "")
    if not path or not Path(path).is_dir():  # oneshot re-reads the config from there
        folder = tempfile.mkdtemp(prefix="kv_peers_")
        model.config.save_pretrained(folder)
        model.config.name_or_path = folder
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    recipe = [QuantizationModifier(kv_cache_scheme=kv, ignore=["lm_head"])]
    rows = [{"input_ids": r.unsqueeze(0), "attention_mask": torch.ones(1, r.numel(), dtype=torch.long)} for r in calib]
    model = oneshot(model=model, tokenizer=tokenizer, dataset=DataLoader(rows, batch_size=None), recipe=recipe,
                    num_calibration_samples=len(calib), max_seq_length=calib.shape[1], pipeline="basic")
    out = {n: (m.k_scale.detach().float().clone(), m.v_scale.detach().float().clone())
           for n, m in model.named_modules() if hasattr(m, "k_scale") and hasattr(m, "v_scale")}
    if not out:
        raise SystemExit("error: llm-compressor registered no k_scale / v_scale on any attention")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import llmcompressor

    from lowbit.data import eval_tokens
    from lowbit.eval import perplexity
    from lowbit.formats.kv import KVScheme
    from lowbit.nn.kv_quant import attention_modules, cache_shape, install_kv, set_scales

    lm = common.bundled_model(args.threads, model=args.model)
    tokens = eval_tokens(lm.tokenizer)
    calib = common.calibration(lm.tokenizer, args.nsamples, args.calib_seqlen)
    ours = copy.deepcopy(lm.model)
    t0 = time.perf_counter()
    scales = llmc_scales(lm.model, lm.tokenizer, calib)
    calibrate_s = time.perf_counter() - t0
    scheme = KVScheme.parse("fp8")
    attns = install_kv(ours, scheme)
    missing = sorted(set(attns) - set(scales))
    if missing:
        raise SystemExit(f"error: llm-compressor left {missing[0]} without k_scale / v_scale")
    for name, attn in attention_modules(ours).items():
        set_scales(attn, *scales[name])
    r = perplexity(ours, tokens, seqlen=args.seqlen, windows=args.windows, progress=False)
    layers, heads, dim = cache_shape(ours)
    row = {"kv": "fp8-llmc", "weights": "float", "values_rotated": False, "seqlen": args.seqlen,
           "windows": args.windows, "calib": f"{args.nsamples}x{args.calib_seqlen}", "ppl": r.ppl,
           "eval_tokens": r.tokens, "eval_s": r.seconds, "calibrate_s": round(calibrate_s, 1),
           "kv_bytes_per_token": scheme.bytes_per_token(layers, heads, dim),
           "kv_bytes_per_token_16bit": 2 * layers * heads * dim * 2,
           "scales_from": f"llmcompressor {llmcompressor.__version__} QuantizationModifier kv_cache_scheme "
                          "(fp8, tensor, static; observer minmax)",
           "k_scale": {n: float(k.reshape(-1)[0]) for n, (k, _) in sorted(scales.items())},
           **common.model_fields(args.model), "machine": common.machine()}
    common.merge_row(args.out, row, ("model", "weights", "kv", "values_rotated", "seqlen", "windows"))
    print(f"float fp8-llmc ppl {r.ppl:.4f} [{r.seconds:.0f} s]", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_peers", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="bundled", choices=common.MODELS, help=common.MODEL_HELP)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--nsamples", type=int, default=8)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    if not common.has_peer("llmcompressor"):
        raise SystemExit("error: this run needs llm-compressor, which is not installed here: run it with the "
                         "Python of a venv that has it (recipe in benchmarks/moe_peers.py), PYTHONPATH=src:.")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
