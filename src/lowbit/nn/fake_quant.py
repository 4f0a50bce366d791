"""Fake quantization with a straight-through estimator.

Forward sees the quantized-dequantized weight; backward passes the gradient through
unchanged (the identity STE), which is what QAT and gradient-based sensitivity need.
Any lowbit `Scheme` works because the forward is just ``formats.qdq``.
"""

from __future__ import annotations

import torch

from lowbit.formats import Scheme, qdq


def fake_quant(w: torch.Tensor, scheme: Scheme | str, imp: torch.Tensor | None = None) -> torch.Tensor:
    """``w + (qdq(w) - w).detach()``: quantized values forward, identity gradient backward."""
    with torch.no_grad():
        delta = qdq(w.detach(), Scheme.parse(scheme), imp) - w.detach()
    return w + delta


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward."""
    return x + (torch.round(x) - x).detach()
