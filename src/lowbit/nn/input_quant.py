"""`InputQuantizer`: the fake quantization of a Linear's input, as its `InputScheme` defines it.

One module serves every layer that quantizes its input: the frozen `QuantLinear` of a
finished model and the `TunedLinear` SignRound trains, so tuning sees exactly the inputs
the finished model will. The forward returns the dequantized values in the input's
dtype; the backward passes the gradient straight through (identity STE), so earlier
layers of a block still receive gradients while it is tuned.

Static formats hold the calibrated abs-max of the input in the ``amax`` buffer (saved
with the model). The rotation methods put an online rotation in front of the quantizer
(``QuantLinear.prepare_input``), never inside it.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.errors import ConfigError
from lowbit.formats.inputs import InputScheme, qdq_input


class InputQuantizer(nn.Module):
    """x -> qdq(x) forward, identity gradient backward."""

    def __init__(self, scheme: InputScheme, amax: torch.Tensor | float | None = None) -> None:
        super().__init__()
        self.scheme = scheme
        if scheme.needs_calibration and amax is None:
            raise ConfigError(f"input scheme {scheme.name} has static scales: calibrate them on calibration data "
                              "(pass the calibration batches, e.g. run `lowbit quantize` with the default data)")
        a = None if amax is None or not scheme.needs_calibration else torch.as_tensor(amax, dtype=torch.float32)
        self.register_buffer("amax", None if a is None else a.detach().clone().reshape(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = qdq_input(x, self.scheme, self.amax)
        if not x.requires_grad:
            return q
        return x + (q - x).detach()

    def extra_repr(self) -> str:
        return f"scheme={self.scheme.name}" + ("" if self.amax is None else f", amax={float(self.amax):.4g}")
