"""GPTQ's choice between searched and abs-max group scales, by the loss on calibration windows GPTQ did not see.

The importance-weighted scale search (`lowbit.formats`, importance ``diag(H)``) is GPTQ's
default and wins on most models (the dense off-grid SmolLM2 copy: W4 g128 16.05 vs 16.17
with abs-max scales), but not on every one: on the float MoE organism (`benchmarks/moe.py`)
abs-max scales give the lower perplexity at W4 g128 and W2 g64 on every calibration seed.
No measure on the calibration windows GPTQ fitted sees that: there the searched scales have
the lower error for nearly every matrix by GPTQ's own objective ``tr(D H D^T)``, by the same
error weighted by each output channel's squared loss gradient (diagonal Fisher), by the
block's output error, and even by the whole model's next-token loss (at W4 g128 seed 1 the
searched model's loss on its own calibration windows is below the float model's: GPTQ with
searched scales fits the windows it saw more closely, and that does not carry over). A
per-matrix choice by the block error made the model worse (W4 g128 63.24 vs 63.18, means of
three seeds), the in-sample model loss chose wrongly at W4 g128 seed 1 (`results/moe.md`).
The next-token loss on windows GPTQ did not see is the one measure left that can rank them.

So `choose_rule` cross-validates on the calibration windows in two folds: GPTQ with each
rule on a copy of the model from one half of the windows, its mean next-token cross-entropy
on the other half, and the same with the halves swapped; the rule with the lower total loss
over all held-out tokens is kept, and the model itself is then quantized with it from all
the windows (nothing of an evaluation split is read). Two folds, not one held-out quarter,
because the two rules differ by a few thousandths of a nat per token at W4: a quarter of 32
windows of 256 tokens picked the wrong rule at W4 g128 seed 0; both folds together rank on
every calibration token. Measured on the organism (three seeds x W4 / W3 / W2) it kept the
rule the evaluation prefers on 7 of 9, missing at W4 g128 where the two are closest; on the
dense off-grid copy it kept the search. It costs four GPTQ runs on half the windows (about
two full runs) before the real one, a second copy of the model in memory at a time, and
forwards over the windows; that is why it is asked for (``--choose-rule``), not the default.
The returned plan records the rule kept.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.errors import ConfigError
from lowbit.plans.plan import Plan

# (model, calibration windows, searched?) -> (plan, block infos): GPTQ in place
Run = Callable[[nn.Module, torch.Tensor, bool], tuple[Plan, list[dict[str, float]]]]


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
    """Quantize ``model`` in place by ``run`` with the rule of the lower two-fold held-out loss (module doc).

    ``run(model, calib, searched)`` quantizes a model in place from calibration windows.
    Each block's info gets both rules' held-out losses (mean per token over both folds) and
    ``rule_absmax`` (1 when abs-max was kept).
    """
    if calib.shape[0] < 2:
        raise ConfigError("--choose-rule compares the two rules on calibration windows held out from trial runs; it "
                          f"needs at least 2 (--nsamples), got {calib.shape[0]}")
    half = calib.shape[0] // 2
    folds = ((calib[:half], calib[half:]), (calib[half:], calib[:half]))
    losses = {}
    for searched in (True, False):
        total = 0.0
        for fit, test in folds:
            trial = copy.deepcopy(model)
            run(trial, fit, searched)
            total += calibration_loss(trial, test, device) * test[:, 1:].numel()
            del trial
        losses[searched] = total / (calib.shape[0] * (calib.shape[1] - 1))
    keep_search = losses[True] <= losses[False]
    plan, infos = run(model, calib, keep_search)
    extra: dict[str, Any] = {"rule_loss_search": losses[True], "rule_loss_absmax": losses[False],
                             "rule_absmax": float(not keep_search)}
    return plan, [{**i, **extra} for i in infos]
