"""Quantization-aware training: quantizers with learnable scales, WinQ, model conversion."""

from lowbit.qat.convert import qat_layers, to_qat, to_quant_linear
from lowbit.qat.layer import Noise, QATLinear
from lowbit.qat.quantizers import LSQ, SchemeFakeQuant, Sign, StretchedElastic, resolve
from lowbit.qat.winq import STE, WinQCallback, WinQConfig, reinit_

__all__ = ["LSQ", "STE", "Noise", "QATLinear", "SchemeFakeQuant", "Sign", "StretchedElastic", "WinQCallback",
           "WinQConfig", "qat_layers", "reinit_", "resolve", "to_qat", "to_quant_linear"]
