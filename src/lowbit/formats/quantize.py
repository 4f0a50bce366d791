"""Entry points: ``quantize(w, scheme) -> QTensor`` and ``qdq(w, scheme) -> Tensor``.

The scheme's family (`lowbit.formats.families`) does the work, so a new format is a
change to its family's module and nothing here.
"""

from __future__ import annotations

import torch

from lowbit.errors import SchemeError
from lowbit.formats.qtensor import QTensor
from lowbit.formats.scheme import Scheme


def quantize(w: torch.Tensor, scheme: Scheme | str, imp: torch.Tensor | None = None,
             tensor_scale: torch.Tensor | None = None) -> QTensor:
    """Quantize a 2-D weight ``[out, in]`` with ``scheme``.

    imp: optional ``[in]`` importance (sum of squared input activations) used by the
    ``search`` rule; None means plain MSE.
    tensor_scale: the per-tensor scale ``enc`` to use for a scheme that has one (the one
    an engine's fused matmul shares, `lowbit.models.fused`); None = computed from ``w``.
    """
    scheme = Scheme.parse(scheme)
    if w.dim() != 2:
        raise SchemeError(f"can quantize 2-D weights only, got shape {tuple(w.shape)}")
    scheme.check_width(w.shape[1])
    if tensor_scale is not None and not scheme.tensor_scale:
        raise SchemeError(f"scheme {scheme.name} has no tensor scale; quantize it without one")
    return scheme.family.quantize(w, scheme, imp, tensor_scale)


def qdq(w: torch.Tensor, scheme: Scheme | str, imp: torch.Tensor | None = None,
        tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize then dequantize (same dtype as ``w``): the weight a quantized model sees."""
    return quantize(w, scheme, imp, tensor_scale).dequantize(w.dtype)


def relative_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Sum of squared error over sum of squares: the weight-error metric of the studies."""
    w = w.double()
    return float(((w_hat.double() - w) ** 2).sum() / (w**2).sum().clamp_min(1e-300))
