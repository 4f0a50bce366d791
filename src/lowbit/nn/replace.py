"""Swap a model's Linear layers for `QuantLinear` according to a plan (weights and inputs).

A plan here is any layer name -> recipe (or weight scheme) mapping, a `lowbit.plans.Plan`
included: nn/ sits below plans/, so it reads the mapping and never names the class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from lowbit.errors import ConfigError, SchemeError
from lowbit.formats import Recipe, Scheme
from lowbit.formats.recipe import as_recipe
from lowbit.nn.input_quant import InputQuantizer
from lowbit.nn.input_rotation import rotation_of
from lowbit.nn.quant_linear import QuantLinear

LayerFactory = Callable[[str, nn.Linear, Scheme], nn.Module]


def get_module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name)


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def replace_linears(model: nn.Module, plan: Mapping[str, Scheme | Recipe],
                    imp: Mapping[str, torch.Tensor] | None = None, factory: LayerFactory | None = None,
                    progress: bool = False, amax: Mapping[str, torch.Tensor] | None = None,
                    tensor_scales: Mapping[str, torch.Tensor] | None = None) -> list[str]:
    """Replace every planned ``nn.Linear`` in place; returns the replaced names.

    imp: optional per-layer input importance (``[in]``) for the ``search`` scale rule.
    factory: builds the replacement (default: round-to-nearest `QuantLinear`); the
    recipe's input quantizer, and the layer's online input rotation if it has one, are
    attached to a `QuantLinear` it returns.
    amax: per-layer calibrated input abs-max, for input schemes with static scales.
    tensor_scales: per-layer weight tensor scale to quantize with (the default factory
    only; a fused group's shared one), for schemes that have one.
    Every planned name is checked (present, a Linear, widths fit, static scales
    calibrated) before the first layer is replaced, so a bad plan changes nothing.
    """
    items = [(n, as_recipe(r)) for n, r in plan.items()]
    layers = {name: _planned_linear(model, name, recipe, amax) for name, recipe in items}
    done = []
    for name, recipe in tqdm(items, desc="quantize", disable=not progress, unit="layer"):
        layer = layers[name]
        if factory is not None:
            new = factory(name, layer, recipe.weight)
        else:
            new = QuantLinear.from_linear(layer, recipe.weight, None if imp is None else imp.get(name),
                                          None if tensor_scales is None else tensor_scales.get(name))
        if recipe.input is not None and isinstance(new, QuantLinear):
            new.set_input_quant(InputQuantizer(recipe.input, None if amax is None else amax.get(name)))
        if isinstance(new, QuantLinear):  # an online rotation stays with the (rotated) weight
            new.set_input_rotation(rotation_of(layer))
        set_module(model, name, new.to(layer.weight.device))
        done.append(name)
    return done


def _planned_linear(model: nn.Module, name: str, recipe: Recipe,
                    amax: Mapping[str, torch.Tensor] | None) -> nn.Linear:
    """The Linear a plan entry names, checked against its recipe."""
    try:
        layer = get_module(model, name)
    except AttributeError:
        raise SchemeError(f"plan names layer {name!r}, which the model does not have") from None
    if not isinstance(layer, nn.Linear):
        raise SchemeError(f"plan layer {name!r} is a {type(layer).__name__}, not a Linear")
    recipe.check_width(layer.in_features, name)
    if recipe.needs_calibration and (amax is None or name not in amax):
        raise ConfigError(f"layer {name}: input scheme {recipe.input.name} has static scales, which come from "
                          "calibration data; calibrate the inputs first (pass calibration batches)")
    return layer


def quant_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """All `QuantLinear` modules of a model, by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
