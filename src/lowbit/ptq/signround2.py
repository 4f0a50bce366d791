"""SignRoundV2: SignRound with a searched initial scale, a learned scale multiplier,
loss filtering, and (optionally) DeltaLoss mixed precision.

Differences from V1 (all implemented in `signround.IntRounder` / `SignRoundTuner`):
the group scale starts from the importance-weighted grid search (importance = summed
squared inputs of each Linear, collected by hooks while the pipeline computes the FP
targets), and only a multiplier on it is learned, bounded to [0, 2]; the largest 0.1%
of output errors are dropped from the MSE by default (at every width; the reference
does it below 4 bits only, but on the bundled model it also helps at W4).

With ``avg_bits`` and ``options`` the plan is chosen first: DeltaLoss scores every
layer under every option (RTN), an exact knapsack picks one option per layer within
the budget, the plan is saved (JSON + PNG) and then tuned.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowbit.errors import ConfigError
from lowbit.formats import Scheme
from lowbit.formats.plan import Plan
from lowbit.models.placement import on_device
from lowbit.nn.precision import resolve_dtype
from lowbit.ptq import register
from lowbit.ptq.allocate import Allocation, allocate, save_allocation, tie_qkv
from lowbit.ptq.sensitivity import delta_loss
from lowbit.ptq.signround import SignRoundConfig, method_config, signround_quantize


def parse_options(options: str | Sequence[str | Scheme]) -> list[Scheme]:
    """``"w2g64,w4g128"`` -> schemes; any non-scheme is a SchemeError listing valid names."""
    items = options.split(",") if isinstance(options, str) else list(options)
    schemes = [Scheme.parse(o) for o in items if not isinstance(o, str) or o.strip()]
    if len(schemes) < 1:
        raise ConfigError("--options needs at least one scheme, e.g. --options w2g64,w4g128")
    return list(dict.fromkeys(schemes))


def mixed_plan(model: nn.Module, plan: Plan, options: str | Sequence[str | Scheme], avg_bits: float,
               calib: torch.Tensor, nsamples: int = 16, mode: str = "abs", tie: bool = False,
               count_scales: bool = True, lm_head_min_bits: int = 6, beam: int | None = None,
               progress: bool = True, dtype: str = "fp32") -> Allocation:
    """DeltaLoss-scored, knapsack-allocated plan over the layers of ``plan``.

    dtype: precision of the DeltaLoss passes ("fp32" | "bf16", see `sensitivity`).
    """
    opts = parse_options(options)
    sizes = {n: _shape(model, n) for n in plan}
    for n, (_, cols) in sizes.items():
        for o in opts:
            o.check_width(cols, n)
    scores = delta_loss(model, list(plan), opts, calib[:nsamples], mode=mode, progress=progress, dtype=dtype)
    ties = tie_qkv(list(plan)) if tie else ()
    return allocate(scores, sizes, opts, avg_bits, ties=ties, count_scales=count_scales,
                    lm_head_min_bits=lm_head_min_bits, beam=beam)


def _shape(model: nn.Module, name: str) -> tuple[int, int]:
    m = model.get_submodule(name)
    return (m.out_features, m.in_features)


def signround2_quantize(model: nn.Module, tokenizer: Any, plan: Plan, config: SignRoundConfig,
                        calib_batches: torch.Tensor, workdir: str | None = None, progress: bool = True
                        ) -> list[dict[str, float]]:
    """SignRoundV2 tuning of ``plan`` (``config.v2`` is forced on)."""
    if not config.v2:
        config = SignRoundConfig(**{**config.to_dict(), "v2": True})
    return signround_quantize(model, tokenizer, plan, config, calib_batches, workdir=workdir, progress=progress)


def _method(model: nn.Module, plan: Plan, *, calib: torch.Tensor | None = None, tokenizer: Any = None,
            progress: bool = True, preset: str | None = None, workdir: str | None = None,
            avg_bits: float | None = None, options: str | None = None, plan_out: str | None = None,
            delta_mode: str = "abs", tie_qkv_layers: bool = False, count_scales: bool = True,
            config: SignRoundConfig | None = None, **kw: Any) -> Plan:
    if calib is None:
        raise ConfigError("signround2 needs calibration data")
    if (avg_bits is None) != (options is None):
        raise ConfigError("mixed precision needs both --avg-bits and --options (e.g. --avg-bits 3 --options w2g64,w4g128)")
    cfg = config or method_config(preset, True, **kw)
    if avg_bits is not None:
        with on_device(model, cfg.device):  # DeltaLoss is whole-model forward/backward passes
            alloc = mixed_plan(model, plan, options, avg_bits, calib, mode=delta_mode, tie=tie_qkv_layers,
                               count_scales=count_scales, progress=progress,
                               dtype=resolve_dtype(cfg.tune_dtype, cfg.device))
        plan = alloc.plan
        out = plan_out or workdir
        if out is not None:
            sizes = {n: _shape(model, n) for n in plan}
            Path(out).mkdir(parents=True, exist_ok=True)
            save_allocation(alloc, sizes, Path(out) / "plan.json", Path(out) / "plan.png")
    signround2_quantize(model, tokenizer, plan, cfg, calib, workdir=workdir, progress=progress)
    return plan


register("signround2", _method)
