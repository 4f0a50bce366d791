"""What every lowbit adapter is: a module that adds ``x @ delta_weight()^T`` to a layer.

Adapters live in a `QuantLinear`'s ``adapters`` ModuleDict (the base never changes), so
merge, unmerge, re-quantization, saving and counting work the same for QWHA, LoRA,
LoftQ and FourierFT: each only has to say how to build its ``delta_weight`` and how to
describe itself (``kind``, ``config()``) for saving.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Adapter(nn.Module):
    """Base of lowbit adapters: ``forward(x) = x @ delta_weight()^T`` unless merged."""

    kind = "adapter"

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.out_features = out_features
        self.in_features = in_features
        self.merged = False  # True while delta_weight() has been folded into the base

    def delta_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        """JSON-able constructor arguments (tensors go to the state dict)."""
        return {"out_features": self.out_features, "in_features": self.in_features}

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def folds(self, x: torch.Tensor) -> bool:
        """Whether the host layer should add ``delta_weight()`` to its weight for input ``x``.

        True for adapters whose delta is a dense matrix anyway: folding saves the second
        GEMM in the forward and in the input gradient. Low-rank / sparse paths say False.
        """
        return True

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution to the layer output (default: the dense path)."""
        return torch.nn.functional.linear(x, self.delta_weight().to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return x.new_zeros(*x.shape[:-1], self.out_features)
        return self.delta(x)
