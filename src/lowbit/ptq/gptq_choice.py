"""GPTQ's choice between searched and abs-max group scales, by the quantized model's loss on the calibration windows.

The importance-weighted scale search (`lowbit.formats`, importance ``diag(H)``) is GPTQ's
default and wins on most models (the dense off-grid SmolLM2 copy: W4 g128 16.05 vs 16.17
with abs-max scales), but not on every one: on the float MoE organism (`benchmarks/moe.py`)
abs-max scales give the lower perplexity at W4 g128 and W2 g64 on every calibration seed.
No local measure sees that: on the organism the searched scales have the lower error for
nearly every matrix by GPTQ's own objective ``tr(D H D^T)`` (on the calibration tokens
and on held-out ones), by the same error weighted by each output channel's squared loss
gradient (diagonal Fisher), and by the block's output error on the calibration samples; a
per-matrix choice by that block error made the model worse, not better (W4 g128 63.24 vs
63.18, means of three seeds: `results/moe.md`). What ranks the two rules the way the
evaluation does is the quantized model's next-token loss on the calibration windows (in
each measured case: W4 seed 0 abs-max lower, W3 seed 1 search lower, on the windows GPTQ
saw and on two other draws of the training split).

So `choose_rule` quantizes two copies of the model, one per rule, and keeps the one with
the lower mean next-token cross-entropy on the calibration windows (nothing of an
evaluation split is read). It costs a second GPTQ run, a second copy of the model in memory
and two forwards over the calibration windows; that is why it is asked for
(``--choose-rule``), not the default. The returned plan records the rule kept.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.plans.plan import Plan

Run = Callable[[nn.Module, bool], tuple[Plan, list[dict[str, float]]]]  # (model, searched?) -> (plan, block infos)


def calibration_loss(model: nn.Module, calib: torch.Tensor, device: torch.device | None = None, chunk: int = 4
                     ) -> float:
    """Mean next-token cross-entropy of ``model`` on the calibration windows ``calib [n, seqlen]``."""
    dev = device or next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for part in calib.split(chunk):
            ids = part.to(dev)
            out = model(input_ids=ids, use_cache=False)
            logits = (out.logits if hasattr(out, "logits") else out[0])[:, :-1].float()
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                           reduction="sum"))
            count += ids[:, 1:].numel()
    return total / max(count, 1)


def choose_rule(model: nn.Module, run: Run, calib: torch.Tensor, device: torch.device | None = None
                ) -> tuple[Plan, list[dict[str, float]]]:
    """Quantize ``model`` in place by ``run`` with searched scales and a copy with abs-max ones; keep the better.

    Each block's info gets both losses and ``rule_absmax`` (1 when the abs-max model was kept).
    """
    alt = copy.deepcopy(model)
    searched = run(model, True)
    loss_search = calibration_loss(model, calib, device)
    plain = run(alt, False)
    loss_absmax = calibration_loss(alt, calib, device)
    keep_plain = loss_absmax < loss_search
    if keep_plain:
        _transplant(alt, model)
    plan, infos = plain if keep_plain else searched
    extra: dict[str, Any] = {"rule_loss_search": loss_search, "rule_loss_absmax": loss_absmax,
                             "rule_absmax": float(keep_plain)}
    return plan, [{**i, **extra} for i in infos]


def _transplant(src: nn.Module, dst: nn.Module) -> None:
    """Make ``dst`` compute what ``src`` does: its top-level children become ``src``'s (ties between them kept)."""
    for name, child in list(src.named_children()):
        setattr(dst, name, child)
