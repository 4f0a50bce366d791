"""The one place that sequences a PTQ run: pre-steps -> mixed precision -> fit -> method -> 16-bit rest.

Every caller (the quantize job in `lowbit.api`, `lowbit.ptq.quantize_model` for library
users, the benchmarks) goes through `conduct`, so the order of the steps, and what each
receives, is written once:

1. the method's plan check (before anything changes the model), and whether it can
   quantize the fused experts the plan names (`lowbit.ptq.experts`);
2. the float pre-steps (`prepare_model`: rotation, then AWQ scales), which keep the
   model's function (on a lazily loaded model whose method walks the blocks: done to each
   block as the walk reads it, `lowbit.ptq.block_prep`, and the fit of step 5 with them);
3. the digest of the float weights the method will quantize (what a fine-tune's error
   initialization must match), when asked;
4. mixed precision: the knapsack over DeltaLoss scores picks each layer's recipe (on a lazily
   loaded model scored block by block, `lowbit.ptq.streamed_deltaloss`, then the method walks it);
5. each layer's scales fitted to its weights' range (`lowbit.ptq.fit`);
6. the method, from the registry;
7. embeddings and an unquantized lm_head rounded to fp16 values (what is saved).

The device arrives resolved (a `torch.device` or None = where the model is): it is
checked once, by the caller that parsed it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lowbit.errors import ConfigError
from lowbit.models.experts import expert_tensors
from lowbit.models.lazy import is_lazy, materialize
from lowbit.models.narrow_tables import fits_half
from lowbit.plans.plan import Plan
from lowbit.ptq.allocate import Allocation
from lowbit.ptq.awq import AWQSettings, awq_run
from lowbit.ptq.block_prep import PreSteps
from lowbit.ptq.experts import check_experts
from lowbit.ptq.fit import fit_plan
from lowbit.ptq.methods import RunContext, coerce_settings, get, walks_blocks
from lowbit.ptq.mixed import MixedSettings, check_feasible, mixed_plan
from lowbit.ptq.rotation import RotationSettings, rotate_model

Phase = Callable[[str], contextlib.AbstractContextManager[Any]]
MIXED_PRE_STEPS = ("--avg-bits with --rotate / --awq on a lazily loaded model: DeltaLoss scores the rotated / scaled "
                   "model, but block by block the pre-steps are applied as the method's walk reads each block, after "
                   "the scoring; drop --offload-dir (the whole model in memory) or the pre-step")


@dataclass(frozen=True)
class PtqSpec:
    """What a run does to the model: the method and its settings, the pre-steps, mixed precision.

    settings: the method's settings dataclass, a mapping of its fields, or None = defaults.
    mixed: choose the plan's recipes by DeltaLoss + knapsack (the plan's own are then
    ignored; its layers are the ones allocated). keep16: round the embeddings and an
    unquantized lm_head to fp16 values. fit: give each layer the scales its weights need
    (False = the caller did so already).
    """

    method: str = "rtn"
    settings: Any = None
    mixed: MixedSettings | None = None
    rotate: RotationSettings | None = None
    awq: AWQSettings | None = None
    keep16: bool = True
    fit: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", coerce_settings(self.method, self.settings))

    @property
    def has_pre_steps(self) -> bool:
        return self.rotate is not None or self.awq is not None


@dataclass(frozen=True)
class PtqOutcome:
    """What a run did: the applied plan and each step's record.

    prepared: what the pre-steps did (``rotation`` / ``awq`` keys). allocation: the mixed
    plan's accounting (None without mixed precision). fallbacks: layers whose weights the
    planned scales could not hold -> what they got instead ("16 bits", "fp32 scales": `lowbit.ptq.fit`). float_digest: sha256
    of the planned layers' float weights after the pre-steps (when asked, and the model
    is in memory).
    """

    plan: Plan
    prepared: dict[str, Any] = field(default_factory=dict)
    allocation: Allocation | None = None
    fallbacks: Mapping[str, str] = field(default_factory=dict)
    float_digest: str | None = None


def preflight(model: nn.Module, plan: Plan, spec: PtqSpec) -> None:
    """Refuse what the model and plan alone show cannot run: the method's plan check, an unreachable budget.

    Cheap, and run before any data is read or any weight changes (`conduct` repeats the
    method's check on a plan that mixed precision or a fit changed).
    """
    _check_plan(model, plan, spec)
    if spec.mixed is not None:
        check_feasible(model, plan, spec.mixed)
        _check_lazy_mixed(model, plan, spec)


def _check_lazy_mixed(model: nn.Module, plan: Plan, spec: PtqSpec) -> None:
    """Mixed precision on a lazily loaded model (scored block by block): what it cannot do, refused before the
    DeltaLoss passes."""
    if spec.mixed is None or not is_lazy(model):
        return
    from lowbit.ptq.streamed_deltaloss import check_streamable

    if spec.has_pre_steps:
        raise ConfigError(MIXED_PRE_STEPS)
    check_streamable(model, list(plan))
    experts = [n for n in expert_tensors(model) if n in plan]
    if spec.method == "rtn" and experts:  # `rtn_blockwise` refuses them: say so before the DeltaLoss passes
        raise ConfigError(f"RTN block by block does not calibrate fused experts tensors ({experts[0]}); "
                          "quantize this model without --offload-dir / --workdir, or with --method gptq")


def _check_plan(model: nn.Module, plan: Plan, spec: PtqSpec) -> None:
    """What the method can quantize of this plan: the experts it reaches, then the method's own check."""
    check_experts(model, plan, spec.method, _pre_steps(spec))
    check = get(spec.method).check_plan
    if check is not None:
        check(spec.settings, plan)


def _pre_steps(spec: PtqSpec) -> tuple[str, ...]:
    return tuple(f for f, s in (("--rotate", spec.rotate), ("--awq", spec.awq)) if s is not None)


def _no_phase(_name: str) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


def conduct(model: nn.Module, plan: Plan, spec: PtqSpec, ctx: RunContext, phase: Phase = _no_phase,
            digest: bool = False) -> PtqOutcome:
    """Quantize ``model`` in place from the starting ``plan``; returns what was applied and done.

    phase: wraps each step for timing (``phase("pre_steps")``, ``"mixed_plan"``, ``"quantize"``).
    digest: record the float weights' sha256 after the pre-steps (`PtqOutcome.float_digest`).
    """
    method, first = get(spec.method), plan
    _check_plan(model, plan, spec)
    # mixed precision scores a lazily loaded model block by block too (`lowbit.ptq.streamed_deltaloss`)
    walks = walks_blocks(spec.method, ctx.calib is not None, spec.rotate is not None and is_lazy(model)) \
        and (spec.mixed is None or is_lazy(model))
    if walks:
        _check_lazy_mixed(model, plan, spec)
    pre = None
    if walks and spec.has_pre_steps and is_lazy(model):  # done to each block as the walk reads it (block_prep.py)
        pre = PreSteps(plan, spec.rotate, spec.awq, fit=spec.fit, keep16=spec.keep16)
        ctx = dataclasses.replace(ctx, pre=pre)
        prepared = pre.info  # filled by the walk
    else:
        with phase("pre_steps" if spec.has_pre_steps else "quantize"):
            prepared = prepare_model(model, plan, rotate=spec.rotate, awq=spec.awq, ctx=ctx)
    float_digest = _float_digest(model, list(plan)) if digest else None
    if not walks:
        materialize(model)  # a lazily loaded model, for passes that need all of it at once
    allocation = None
    if spec.mixed is not None:
        with phase("mixed_plan"):
            allocation = mixed_plan(model, plan, spec.mixed, ctx.calib, ctx.device, ctx.progress,
                                    folder=ctx.offload_dir, cache_device=ctx.cache_device)
        plan = allocation.plan
    fallbacks: dict[str, str] = {}
    with phase("quantize"):
        if spec.fit and pre is None:  # layers whose weights the planned scales cannot hold (warned about with the
            # reason); with per-block pre-steps each block is checked once transformed, a fallback there an error
            plan, fell = fit_plan(model, plan)
            fallbacks = {n: "16 bits" if n not in plan else f"{plan.weight(n).scale} scales" for n in fell}
        if method.check_plan is not None and plan is not first:  # mixed precision or a fit changed it
            method.check_plan(spec.settings, plan)
        plan = method.run(model, plan, spec.settings, ctx)
        if spec.keep16:
            round_unquantized_to_half(model)
    return PtqOutcome(plan, prepared, allocation, fallbacks, float_digest)


def prepare_model(model: nn.Module, plan: Plan, calib: torch.Tensor | None = None,
                  rotate: RotationSettings | None = None, awq: AWQSettings | None = None,
                  device: torch.device | None = None, progress: bool = True,
                  ctx: RunContext | None = None) -> dict[str, Any]:
    """The float pre-steps, in this order: rotate the residual stream, then AWQ scales; returns what each did.

    Both keep the float model's function (each checks it); here they run on the whole model, so a
    lazily loaded one is loaded first (`conduct` runs them per block on a lazily loaded model whose
    method walks the blocks: `lowbit.ptq.block_prep`). Nothing is done when neither is asked for.
    ctx: the run's context, whole (AWQ walks the blocks on the block-wise engine with its
    work folder, offload folder and cache placement); None = one from calib, device, progress.
    """
    ctx = ctx or RunContext(calib=calib, device=device, progress=progress)
    done: dict[str, Any] = {}
    if rotate is None and awq is None:
        return done
    materialize(model)
    if rotate is not None:
        done["rotation"] = rotate_model(model, rotate)
    if awq is not None:
        done["awq"] = awq_run(model, plan, awq, ctx)
    return done


def round_unquantized_to_half(model: nn.Module) -> None:
    """Embedding tables and a plain-Linear lm_head take fp16 values (dtype unchanged).

    A table with values beyond fp16's range keeps its values (fp16 would make them inf). A bf16 table (kept in
    a lazily loaded checkpoint's dtype, `lowbit.models.narrow_tables`) takes the same values: a bf16 number
    rounded to fp16 is a bf16 number again, so the result equals that of its float32 copy.
    """
    heads = [model.get_output_embeddings()] if hasattr(model, "get_output_embeddings") else []
    for mod in [m for m in model.modules() if isinstance(m, nn.Embedding)] + heads:
        if (isinstance(mod, (nn.Embedding, nn.Linear)) and mod.weight.dtype in (torch.float32, torch.bfloat16)
                and fits_half(mod.weight)):
            with torch.no_grad():
                mod.weight.copy_(mod.weight.half())


def _float_digest(model: nn.Module, names: list[str]) -> str | None:
    """sha256 of the float weights of ``names`` (None for a lazily loaded model: not in memory)."""
    if is_lazy(model):
        return None
    from lowbit.models.layers import weight_digest

    return weight_digest(model, names)
