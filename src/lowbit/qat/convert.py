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
from lowbit.formats import quantize
from lowbit.models import linear_layers
from lowbit.models.fused import shared_tensor_scales
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
    """Replace every `QATLinear` with the exact `QuantLinear` of its trained weight.

    Schemes with a per-tensor scale (NVFP4, fake quantization) take one shared by each
    group of Linears an engine fuses (`lowbit.models.fused`), from the trained weights:
    the file then serves in vLLM as lowbit evaluates it. Training computed that scale per
    layer, so for those layers the saved model can differ slightly from the last training
    forward; the evaluation after QAT is of the saved model.
    """
    layers = qat_layers(model)
    fake = {n: m.quantizer.scheme for n, m in layers.items() if isinstance(m.quantizer, SchemeFakeQuant)}
    scales = shared_tensor_scales({n: layers[n].weight for n in fake}, fake)
    for name, layer in layers.items():
        qt = layer.to_qtensor() if name not in scales else quantize(layer.weight.detach().float(), fake[name],
                                                                     tensor_scale=scales[name])
        q = QuantLinear(qt, layer.bias)
        set_module(model, name, q.to(layer.weight.device))
    return list(layers)
