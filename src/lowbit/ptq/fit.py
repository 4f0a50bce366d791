"""The plan a model's weights allow: each layer's scheme checked against its float weight first.

See `lowbit.formats.ranges`: a layer whose weights need larger group scales than fp16
holds keeps fp32 scales, and one its format cannot hold at all stays in 16 bits. This
runs after the float pre-steps (a rotation or AWQ changes the weights' range) and before
any method, so every method quantizes only what its scales can hold; each change is
warned about here and reported by the job (``range_fallbacks``).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from lowbit.formats import Recipe
from lowbit.formats.ranges import Fit, fit
from lowbit.models.experts import ExpertTensor, expert_tensors, expert_weight
from lowbit.models.lazy import SOURCE_ATTR, is_lazy
from lowbit.plans.plan import Plan


def fit_plan(model: nn.Module, plan: Plan, warn: bool = True) -> tuple[Plan, dict[str, str]]:
    """(the plan with every layer's scheme fitted to its weights, layer -> what changed and why)."""
    layers: dict[str, Recipe] = {}
    changed: dict[str, str] = {}
    experts = expert_tensors(model)
    for name, recipe in plan.items():
        f = _fit_experts(model, experts[name], recipe) if name in experts else fit(float_weight(model, name),
                                                                                  recipe.weight)
        if f.reason is None:
            layers[name] = recipe
            continue
        changed[name] = f.reason
        if f.scheme is not None:
            layers[name] = Recipe(f.scheme, recipe.input, recipe.rotation)
        if warn:
            warnings.warn(f"layer {name}: {f.reason}", stacklevel=2)
    return (plan if not changed else Plan(layers)), changed


def _fit_experts(model: nn.Module, t: ExpertTensor, recipe: Recipe) -> Fit:
    """The fit of a fused experts tensor: one scheme for all its experts, so the first expert that needs more decides."""
    w = expert_weight(model, t)
    if w.device.type == "meta" and is_lazy(model):  # a block still in the checkpoint: read the stack from there
        key = f"{t.module}.{t.param}"
        w = getattr(model, SOURCE_ATTR).read([key])[key]
        w = w.transpose(1, 2) if t.transposed else w
    for e in range(t.count):
        f = fit(w[e], recipe.weight)
        if f.reason is not None:
            return Fit(f.scheme, f"expert {e}: {f.reason}")
    return Fit(recipe.weight)


def float_weight(model: nn.Module, name: str) -> torch.Tensor:
    """The float weight of Linear ``name``, read from the checkpoint when the model is loaded lazily."""
    w = model.get_submodule(name).weight
    if w.device.type != "meta" or not is_lazy(model):
        return w.detach()
    return getattr(model, SOURCE_ATTR).read([f"{name}.weight"])[f"{name}.weight"]
