"""The `lowbit finetune` job: quantized checkpoint -> adapters -> trained adapters on disk.

Steps: validate everything cheap first; load the quantized checkpoint; (QWHA, LoftQ)
load the full-precision source it was made from to get the quantization error; build
training rows from the *training* split (instruction .jsonl with answer-only loss, or
plain text); (QWHA) calibration XtX from the same training rows; initialise; measure
eval perplexity after init; train with the shared loop; measure again; save the adapter
alone (with the base fingerprint) or, with ``merge``, a re-quantized native checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lowbit.errors import ConfigError, LowbitError
from lowbit.peft.apply import (
    NEEDS_ERROR,
    PeftConfig,
    apply_adapters,
    check_shapes,
    count_trainable,
    merge_and_requantize,
)
from lowbit.peft.calib import collect_xtx
from lowbit.peft.finetune import instruction_rows, is_instruction_file, lm_rows, train_adapters
from lowbit.peft.store import save_adapters


@dataclass(frozen=True)
class DataConfig:
    """Where training rows come from (never the evaluation split)."""

    source: str | None = None  # .jsonl instructions, .txt, HF dataset folder; None = bundled corpus
    nsamples: int = 64
    seqlen: int = 256
    seed: int = 0
    calib_samples: int = 32  # rows used for QWHA's XtX


def full_precision_weights(source: str | None, names: list[str]) -> dict[str, torch.Tensor]:
    """The named Linear weights of the model a checkpoint was quantized from."""
    from lowbit.models import BUNDLED_NAME, load_model

    fp = load_model(None if source in (None, BUNDLED_NAME) else source).model
    try:
        return {n: fp.get_submodule(n).weight.detach().float().clone() for n in names}
    except AttributeError as e:
        raise ConfigError(f"the source model {source!r} lacks a quantized layer ({e}); pass the model the "
                          "checkpoint was quantized from with --base-model") from None


def training_rows(tokenizer: Any, data: DataConfig) -> torch.Tensor:
    """``[N, 2, T]`` ids+labels from the training split."""
    if is_instruction_file(data.source):
        return instruction_rows(tokenizer, data.source, data.seqlen, limit=data.nsamples)
    from lowbit.data import calibration_batches

    return lm_rows(calibration_batches(tokenizer, data.source, nsamples=data.nsamples, seqlen=data.seqlen,
                                       seed=data.seed))


def make_eval(tokenizer: Any, eval_data: str | None, seqlen: int, windows: int):
    """``model -> {"ppl": ...}`` on the evaluation split, or None when windows < 0 (no eval)."""
    if windows < 0:
        return None
    from lowbit.data import eval_tokens
    from lowbit.eval import perplexity

    tokens = eval_tokens(tokenizer, eval_data)

    def fn(model) -> dict[str, float]:
        return {"ppl": perplexity(model, tokens, seqlen=seqlen, windows=windows).ppl}

    return fn


def finetune_pipeline(quantized_dir: str | Path, cfg: PeftConfig, train_cfg, out: str | Path,
                      data: DataConfig = DataConfig(), base_model: str | None = None, eval_data: str | None = None,
                      eval_seqlen: int = 512, windows: int = 40, merge: bool = False, force: bool = False,
                      progress: bool = True) -> dict[str, Any]:
    """Run the whole job; returns the JSON summary the CLI prints."""
    from lowbit.export.native import load, read_manifest, save

    manifest = read_manifest(quantized_dir)
    check_shapes(cfg, {n: tuple(spec["shape"]) for n, spec in manifest["layers"].items()})
    if Path(out).exists() and not force:
        raise LowbitError(f"{out} already exists; choose another --out or pass --force to replace it")
    model, tokenizer = load(quantized_dir)
    if tokenizer is None:
        raise ConfigError(f"{quantized_dir} has no tokenizer files; re-create it with `lowbit quantize`")
    names = list(manifest["layers"])
    source = base_model or manifest.get("meta", {}).get("source")
    fp_weights = full_precision_weights(source, names) if cfg.adapter in NEEDS_ERROR else None
    rows = training_rows(tokenizer, data)
    evaluate = make_eval(tokenizer, eval_data, eval_seqlen, windows)
    result: dict[str, Any] = {"base": str(quantized_dir), "adapter": cfg.adapter, "rank": cfg.rank,
                              "train_rows": len(rows)}
    if evaluate:
        result["ppl_base"] = evaluate(model)["ppl"]
    t0 = time.perf_counter()
    xtx = None
    if cfg.adapter == "qwha" and cfg.refine:
        xtx = collect_xtx(model, names, rows[: data.calib_samples, 0], progress=progress)
    made = apply_adapters(model, cfg, fp_weights, xtx, progress=progress)
    padded = {n: [a.plan.width, a.plan.n] for n, a in made.items() if getattr(a, "plan", None) and a.plan.padded}
    if padded:
        result["padded_widths"] = padded  # no Hadamard construction: zero-padded (see lowbit.peft.wht)
    result["init_seconds"] = round(time.perf_counter() - t0, 2)
    result["trainable_params"] = count_trainable(model)
    if evaluate:
        result["ppl_init"] = evaluate(model)["ppl"]
    train_result, timer = train_adapters(model, rows, train_cfg)
    result.update(steps=train_result.steps, loss_first=train_result.losses[0], loss_last=train_result.final_loss,
                  step_seconds=round(timer.median(), 4))
    if evaluate:
        result["ppl_final"] = evaluate(model)["ppl"]
    meta = {"base": str(quantized_dir), "train": train_cfg.to_dict(), **{k: v for k, v in result.items()
                                                                         if k.startswith("ppl")}}
    if merge:
        errs = merge_and_requantize(model)
        result["merge_rel_error_max"] = max(errs.values())
        save(model, tokenizer, out, meta={**manifest.get("meta", {}), "finetune": meta}, force=force)
    else:
        save_adapters(model, out, cfg, meta=meta, force=force)
    result["out"] = str(out)
    return result
