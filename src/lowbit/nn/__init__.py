"""Quantized layers: `QuantLinear`, fake quantization, layer replacement."""

from lowbit.nn.fake_quant import fake_quant, round_ste
from lowbit.nn.quant_linear import QuantLinear
from lowbit.nn.replace import get_module, quant_layers, replace_linears, set_module

__all__ = ["QuantLinear", "fake_quant", "get_module", "quant_layers", "replace_linears", "round_ste", "set_module"]
