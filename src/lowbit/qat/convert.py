"""Swap a model's Linear layers for `QATLinear` for training, and back to `QuantLinear`.

Training uses latent float weights; saving needs the exact quantized codes. A model that
is already quantized (a PTQ result, e.g. SignRound) can start QAT too: its QuantLinears
become QATLinears whose latent weights are the dequantized PTQ weights. The second
swap computes each layer's codes from its trained (W, alpha), so the saved model's
outputs equal the trained model's clean (noise-free) quantized forward.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from lowbit.errors import ConfigError
from lowbit.models import linear_layers
from lowbit.nn import QuantLinear, set_module
from lowbit.qat.layer import QATLinear
from lowbit.qat.quantizers import Quantizer, SchemeFakeQuant


def default_targets(model: nn.Module) -> list[str]:
    """Decoder Linear layers (q,k,v,o,gate,up,down), float or already quantized; embeddings
    and lm_head stay float."""
    return list(linear_layers(model, include_lm_head=False))


def to_qat(model: nn.Module, quantizer: Quantizer, names: Iterable[str] | None = None) -> list[str]:
    """Replace the named Linear layers (default: `default_targets`) in place; returns the names."""
    names = list(default_targets(model) if names is None else names)
    if not names:
        raise ConfigError("the model has no Linear layers to train with quantization")
    for name in names:
        layer = model.get_submodule(name)
        if not isinstance(layer, nn.Linear | QuantLinear):
            raise ConfigError(f"layer {name!r} is a {type(layer).__name__}, not a Linear")
        if isinstance(quantizer, SchemeFakeQuant):
            quantizer.scheme.check_width(layer.in_features, name)
        if isinstance(layer, QuantLinear):  # a PTQ result (e.g. SignRound) as the starting point
            if len(layer.adapters):
                raise ConfigError(f"layer {name!r} carries adapters; merge them before QAT")
            if layer.input_quant is not None:  # QATLinear has no input quantizer: refuse rather than drop it
                raise ConfigError(f"layer {name!r} quantizes its inputs ({layer.input_quant.scheme.name}); QAT "
                                  "trains weight-only layers: start from the float model or a weight-only checkpoint")
            new = QATLinear(layer.weight.detach().clone(), layer.bias, quantizer).to(layer.codes.device)
        else:
            new = QATLinear.from_linear(layer, quantizer)
        set_module(model, name, new)
    return names


def qat_layers(model: nn.Module) -> dict[str, QATLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QATLinear)}


def to_quant_linear(model: nn.Module) -> list[str]:
    """Replace every `QATLinear` with the exact `QuantLinear` of its trained weight."""
    layers = qat_layers(model)
    for name, layer in layers.items():
        q = QuantLinear(layer.to_qtensor(), layer.bias)
        set_module(model, name, q.to(layer.weight.device))
    return list(layers)
