"""Quantizing fused mixture-of-experts experts, and refusing what cannot quantize them yet.

A plan entry for a fused experts parameter (``...mlp.experts.gate_up_proj``,
`lowbit.models.experts`) gives one recipe to every expert's ``[out, in]`` matrix. RTN
rounds each matrix exactly as it rounds a Linear's weight (`lowbit.nn.quant_experts`); its
importance-weighted scale search runs on each expert's weights (uniform importance) by default,
or, with ``expert_importance``, uses each expert's own input statistics
(`lowbit.ptq.expert_calib`: all-experts calibration by default, uniform importance for an
expert below the token threshold, with a warning), and input-quantized recipes get one
static input abs-max per expert. GPTQ quantizes each expert's matrix under its own Hessian
on the block-wise engine (`lowbit.ptq.gptq_experts`).

SignRound and SignRoundV2 tune a rounder per expert matrix inside the block, the router
frozen (`lowbit.ptq.expert_rounding`).

Input-quantized recipes (W4A4, W8A8) work with every method above: the block-wise engine
calibrates one static input abs-max per expert on the float inputs, as RTN does (all-experts
calibration, the layer's range for a starved expert), and GPTQ's Hessians and SignRound's
tuned forward see each expert's quantized inputs, as a Linear's do behind its input quantizer.

What does not quantize experts yet is refused before any work, with one line naming
what works today: the float pre-steps: rotation
rewrites Linears and would leave the experts' inputs unmatched; AWQ's channel scales are
defined per group of Linears reading one input and folded into what produces it, and for
``gate_up_proj`` that group is every expert of the layer plus the router (all read the
post-attention norm's output), so one scale per layer would have to serve all experts and be
absorbed by the router too -- not the per-Linear groups AWQ searches (``down_proj``'s
per-expert group, folded into the expert's ``up`` rows, would be well defined, but is not
built). Never silently float, never another method than the one asked for.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lowbit.errors import ConfigError
from lowbit.formats import Scheme
from lowbit.models.experts import ExpertTensor, expert_tensors
from lowbit.nn import set_module
from lowbit.nn.quant_experts import QuantExperts
from lowbit.plans.plan import Plan
from lowbit.ptq.expert_calib import (
    MIN_TOKENS,
    ExpertStats,
    check_stat_experts,
    input_amax,
    warn_starved,
    warn_unrouted,
)

STAT_METHODS = ("gptq",)  # methods that always read per-expert statistics (RTN only with its search)
EXPERT_METHODS = (  # methods that quantize experts today, one a line
    "rtn",  # per-expert importance search (lowbit.ptq.expert_calib)
    "gptq",  # per-expert Hessians (lowbit.ptq.gptq_experts)
    "signround",  # per-expert rounders tuned in the block (lowbit.ptq.expert_rounding)
    "signround2",
)


def planned_experts(model: nn.Module, plan: Plan) -> dict[str, ExpertTensor]:
    """The plan's fused experts entries (name -> tensor)."""
    tensors = expert_tensors(model)
    return {n: tensors[n] for n in plan if n in tensors}


def split(model: nn.Module, plan: Plan) -> tuple[Plan, Plan]:
    """(the plan's Linears, its fused experts tensors)."""
    experts = planned_experts(model, plan)
    return (Plan({n: r for n, r in plan.items() if n not in experts}),
            Plan({n: r for n, r in plan.items() if n in experts}))


def check_experts(model: nn.Module, plan: Plan, method: str, pre_steps: tuple[str, ...] = ()) -> None:
    """Refuse, in one line, a run that plans experts but cannot quantize them as asked (or whose widths do not fit)."""
    experts = planned_experts(model, plan)
    if not experts:
        return
    first = next(iter(experts))
    keep = "or pass --keep experts to keep them in float"
    if method not in EXPERT_METHODS:
        raise ConfigError(f"--method {method} does not quantize mixture-of-experts experts yet ({first}, ...); "
                          f"{' and '.join(f'--method {m}' for m in EXPERT_METHODS)} do today, {keep}")
    inputs = [n for n in experts if plan[n].input is not None]  # every expert method calibrates their input scales
    if inputs:
        for module in {experts[n].module for n in inputs}:
            check_stat_experts(model.get_submodule(module), module)
    if pre_steps:
        raise ConfigError(f"{' and '.join(pre_steps)} do not handle mixture-of-experts experts yet ({first}, ...); "
                          f"drop {' / '.join(pre_steps)}, {keep}")
    for name, t in experts.items():
        plan[name].check_width(t.in_features, name)
    if method in STAT_METHODS:
        for module in {t.module for t in experts.values()}:
            check_stat_experts(model.get_submodule(module), module)


def planned_modules(model: nn.Module, plan: Plan) -> dict[str, dict[str, Scheme]]:
    """Experts module name -> {its planned parameter -> weight scheme}."""
    by_module: dict[str, dict[str, Scheme]] = {}
    for name, t in planned_experts(model, plan).items():
        by_module.setdefault(t.module, {})[t.param] = plan.weight(name)
    return by_module


def quantize_experts(model: nn.Module, plan: Plan, stats: Mapping[str, ExpertStats] | None = None,
                     min_tokens: int = MIN_TOKENS, affinity: float | None = None) -> list[str]:
    """Replace each planned experts module by a `QuantExperts` (RTN per expert matrix); returns the quantized names.

    stats: experts module -> its per-expert calibration statistics (`lowbit.ptq.expert_calib`):
    each expert's scales are searched with the ``sumsq`` importance of its own input columns;
    an expert with statistics from fewer than ``min_tokens`` tokens gets uniform importance
    (the search on its weights alone), named in one warning. Without stats every expert
    gets uniform importance, and so does every expert when the stats hold no ``sumsq`` (they
    then serve the token counts and input scales only). affinity: None = the plain ``sumsq``; a float = the
    router-weighted one with that floor (`ExpertStats.weighted`; the stats must have been taken with affinity).
    """
    stats = stats or {}
    names = list(planned_experts(model, plan))
    for module, schemes in planned_modules(model, plan).items():
        st = stats.get(module)
        imp, calibration = None, None
        if st is not None:
            cov = st.coverage()
            low = set(cov.starved(min_tokens))
            if "sumsq" in st.kinds:
                sums = {p: st.result("sumsq", p) if affinity is None else st.weighted("sumsq", p, affinity, min_tokens)
                        for p in schemes}
                imp = {p: [None if e in low else v.float() for e, v in enumerate(sums[p])] for p in schemes}
            calibration = cov.to_dict()
        q = quantized(model.get_submodule(module), schemes, imp)
        q.calibration = calibration
        for p, stack in q.stacks().items():
            recipe = plan[f"{module}.{p}"]
            if recipe.input is not None:
                if recipe.needs_calibration and st is None:
                    raise ConfigError(f"{module}.{p}: recipe {recipe.name} needs calibrated per-expert input scales; "
                                      "pass calibration batches")
                amax = input_amax(st, p, min_tokens) if recipe.needs_calibration else None  # type: ignore[arg-type]
                stack.with_input(recipe.input, amax)
        set_module(model, module, q)
    if stats:
        coverage = [s.coverage() for s in stats.values()]
        warn_starved(coverage, min_tokens, "RTN's scale search on their weights alone (uniform importance)")
        warn_unrouted(coverage, min_tokens)
    return names


def quantized(module: nn.Module, schemes: Mapping[str, Scheme],
              imp: Mapping[str, list[torch.Tensor | None]] | None = None) -> QuantExperts:
    """``module`` (float fused experts) as a `QuantExperts`, on the device it was on."""
    device = next(p.device for p in module.parameters())
    return QuantExperts.from_float(module, schemes, imp).to(device)
