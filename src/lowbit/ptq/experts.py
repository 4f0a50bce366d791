"""Quantizing fused mixture-of-experts experts, and refusing what cannot quantize them yet.

A plan entry for a fused experts parameter (``...mlp.experts.gate_up_proj``,
`lowbit.models.experts`) gives one recipe to every expert's ``[out, in]`` matrix. RTN
rounds each matrix exactly as it rounds a Linear's weight (`lowbit.nn.quant_experts`); its
importance-weighted scale search runs on the weights alone for experts (each group's
scale picked by its own squared error: no calibration statistics per expert yet), which
is the search with uniform importance.

SignRound and SignRoundV2 tune a rounder per expert matrix inside the block, the router
frozen (`lowbit.ptq.expert_rounding`).

What does not quantize experts yet is refused before any work, with one line naming
what works today: the other tuning methods (GPTQ), input-quantized recipes (static
per-expert input scales are not calibrated) and the float pre-steps (rotation, AWQ: they
rewrite Linears and would leave the experts' inputs unmatched). Never silently float, never
another method than the one asked for.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from lowbit.errors import ConfigError
from lowbit.formats import Scheme
from lowbit.models.experts import ExpertTensor, expert_tensors
from lowbit.nn import set_module
from lowbit.nn.quant_experts import QuantExperts
from lowbit.plans.plan import Plan

EXPERT_METHODS = (  # methods that quantize experts today, one a line
    "rtn",
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
                          f"--method {' / '.join(EXPERT_METHODS)} do today, {keep}")
    inputs = [n for n in experts if plan[n].input is not None]
    if inputs:
        raise ConfigError(f"experts {inputs[0]}: recipe {plan[inputs[0]].name} quantizes inputs, and lowbit does not "
                          f"calibrate per-expert input scales yet; give the experts a weight-only scheme (a --plan), "
                          f"{keep}")
    if pre_steps:
        raise ConfigError(f"{' and '.join(pre_steps)} do not handle mixture-of-experts experts yet ({first}, ...); "
                          f"drop {' / '.join(pre_steps)}, {keep}")
    for name, t in experts.items():
        plan[name].check_width(t.in_features, name)


def quantize_experts(model: nn.Module, plan: Plan) -> list[str]:
    """Replace each planned experts module by a `QuantExperts` (RTN per expert matrix); returns the quantized names."""
    tensors = planned_experts(model, plan)
    by_module: dict[str, dict[str, Scheme]] = {}
    for name, t in tensors.items():
        by_module.setdefault(t.module, {})[t.param] = plan.weight(name)
    for module, schemes in by_module.items():
        float_module = model.get_submodule(module)
        set_module(model, module, quantized(float_module, schemes))
    return list(tensors)


def quantized(module: nn.Module, schemes: Mapping[str, Scheme]) -> QuantExperts:
    """``module`` (float fused experts) as a `QuantExperts`, on the device it was on."""
    device = next(p.device for p in module.parameters())
    return QuantExperts.from_float(module, schemes).to(device)
