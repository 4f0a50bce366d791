"""Swap a model's Linear layers for `QuantLinear` according to a `Plan`."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from lowbit.errors import SchemeError
from lowbit.formats import Scheme
from lowbit.formats.plan import Plan
from lowbit.nn.quant_linear import QuantLinear

LayerFactory = Callable[[str, nn.Linear, Scheme], nn.Module]


def get_module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name)


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def replace_linears(model: nn.Module, plan: Plan | Mapping[str, Scheme], imp: Mapping[str, torch.Tensor] | None = None,
                    factory: LayerFactory | None = None, progress: bool = False) -> list[str]:
    """Replace every planned ``nn.Linear`` in place; returns the replaced names.

    imp: optional per-layer input importance (``[in]``) for the ``search`` scale rule.
    factory: builds the replacement (default: round-to-nearest `QuantLinear`).
    A planned name that is missing or not a Linear is an error, never skipped.
    """
    items = list(plan.items())
    done = []
    for name, scheme in tqdm(items, desc="quantize", disable=not progress, unit="layer"):
        try:
            layer = get_module(model, name)
        except AttributeError:
            raise SchemeError(f"plan names layer {name!r}, which the model does not have") from None
        if not isinstance(layer, nn.Linear):
            raise SchemeError(f"plan layer {name!r} is a {type(layer).__name__}, not a Linear")
        scheme.check_width(layer.in_features, name)
        if factory is not None:
            new = factory(name, layer, scheme)
        else:
            new = QuantLinear.from_linear(layer, scheme, None if imp is None else imp.get(name))
        set_module(model, name, new.to(layer.weight.device))
        done.append(name)
    return done


def quant_layers(model: nn.Module) -> dict[str, QuantLinear]:
    """All `QuantLinear` modules of a model, by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
