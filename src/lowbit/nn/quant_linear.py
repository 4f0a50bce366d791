"""`QuantLinear`: a Linear layer whose weight is a `QTensor`.

The codes, scales, zeros and tensor scale are registered buffers, so ``state_dict``,
``.to(device)`` and checkpointing work as for any module, and the layer rebuilds its
`QTensor` on demand. In evaluation the weight is dequantized in each forward and
dropped after it, so a loaded 2-bit model takes its packed size plus one layer's float
weight, not the float model's memory (issue 22; the dequantization is elementwise, a
small cost next to the GEMM over a window of tokens). While training (``module.train()``:
adapters or QAT on the frozen base) the dequantized weight is kept between steps, because
every step reuses it and the float copy is what training holds anyway; ``cache=True`` /
``False`` forces either behaviour. The cache is dropped whenever the quantized weight is
replaced, the module moves, or it goes back to evaluation. Adapters (QWHA, LoRA) plug in through ``self.adapters``: each is called on
the layer input and its output is added, so the frozen quantized base never changes.
An adapter whose ``folds(x)`` is true (a dense ``delta_weight``: QWHA's dense path,
FourierFT) is instead added to the dequantized weight before the single GEMM: the
forward and the input gradient then cost one GEMM each instead of two.

A layer whose recipe quantizes its input holds an `InputQuantizer` in ``input_quant``;
``prepare_input`` applies it first, so the product sees the input the target format
would (adapters see it too: they run on the same input an engine would give them). A
layer whose input is rotated online (`lowbit.nn.input_rotation`, its weight stored
rotated) holds the `InputRotation` in ``input_rotation``, applied before the quantizer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.errors import SchemeError
from lowbit.formats import QTensor, Scheme, quantize
from lowbit.nn.input_quant import InputQuantizer
from lowbit.nn.input_rotation import InputRotation


class QuantLinear(nn.Module):
    """y = x @ dequant(Q)^T + b + sum(adapter(x) for adapter in adapters)."""

    def __init__(self, qweight: QTensor, bias: torch.Tensor | None = None, cache: bool | None = None,
                 input_quant: InputQuantizer | None = None, input_rotation: InputRotation | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.cache = cache
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.adapters = nn.ModuleDict()
        self.set_qweight(qweight)
        self.set_input_quant(input_quant)
        self.set_input_rotation(input_rotation)

    def set_input_quant(self, input_quant: InputQuantizer | None) -> None:
        """Quantize this layer's input with ``input_quant`` (None = leave it in the compute dtype)."""
        if input_quant is not None:
            input_quant.scheme.check_width(self.in_features, "this layer")
        self.input_quant = input_quant

    def set_input_rotation(self, rotation: InputRotation | None) -> None:
        """Rotate this layer's input online (its stored weight must be the rotated one); None = no rotation."""
        if rotation is not None and rotation.width != self.in_features:
            raise SchemeError(f"an online rotation of width {rotation.width} cannot rotate the {self.in_features} "
                              "inputs of this layer")
        self.input_rotation = rotation

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input the product sees: rotated online and quantized when the layer says so."""
        if self.input_rotation is not None:
            x = self.input_rotation(x)
        return x if self.input_quant is None else self.input_quant(x)

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: Scheme | str, imp: torch.Tensor | None = None,
                    tensor_scale: torch.Tensor | None = None) -> QuantLinear:
        """Round-to-nearest of ``linear``'s weight; ``tensor_scale``: a fused group's shared one."""
        q = quantize(linear.weight.detach(), Scheme.parse(scheme), imp, tensor_scale)
        return cls(q, linear.bias)

    # --------------------------------------------------------------- weight
    def set_qweight(self, q: QTensor) -> None:
        """Replace the quantized weight (e.g. after tuning); buffers keep their names."""
        if q.shape != (self.out_features, self.in_features):
            raise SchemeError(f"a quantized weight of shape {q.shape} cannot replace the weight of this "
                              f"{(self.out_features, self.in_features)} layer; quantize a weight of the layer's shape")
        self.scheme = q.scheme
        self.register_buffer("codes", q.codes)
        self.register_buffer("scales", q.scales)
        self.register_buffer("zeros", q.zeros)
        self.register_buffer("tensor_scale", q.tensor_scale)
        self._cached: torch.Tensor | None = None

    @property
    def qweight(self) -> QTensor:
        return QTensor(self.codes, self.scales, self.zeros, self.tensor_scale,
                       (self.out_features, self.in_features), self.scheme)

    @property
    def weight(self) -> torch.Tensor:
        """Dequantized weight (float32 unless the buffers were moved to another dtype)."""
        c = self._cached
        # a copy cached under inference_mode cannot enter autograd: rebuild it outside that mode
        if c is not None and c.device == self.codes.device and (
                not c.is_inference() or torch.is_inference_mode_enabled()):
            return c
        w = self.qweight.dequantize()
        if self.keeps_weight:  # the base is frozen (buffers only), so training may reuse it
            self._cached = w
        return w

    @property
    def keeps_weight(self) -> bool:
        """Whether the dequantized weight is kept between forwards (while training, unless forced)."""
        return self.training if self.cache is None else self.cache

    def train(self, mode: bool = True) -> QuantLinear:
        if not mode and self.cache is None:
            self._cached = None  # evaluation keeps weights packed
        return super().train(mode)

    def _apply(self, fn, recurse=True):  # .to()/.cuda() must drop the cache
        self._cached = None
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.prepare_input(x)
        w, rest = self.weight, []
        for adapter in self.adapters.values():
            if getattr(adapter, "merged", False):
                continue
            if getattr(adapter, "folds", None) is not None and adapter.folds(x):
                w = w + adapter.delta_weight().to(w.dtype)  # one GEMM for base + delta, not two
            else:
                rest.append(adapter)
        y = F.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        for adapter in rest:
            y = y + adapter(x)
        return y

    def extra_repr(self) -> str:
        inp = "" if self.input_quant is None else f", input={self.input_quant.scheme.name}"
        inp += "" if self.input_rotation is None else f", input_rotation={self.input_rotation.kind}"
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}{inp}"
