"""`QATLinear`: latent full-precision weight + per-row scale, forward through Q_b.

Noise injection lives here because it must be fresh per forward yet identical on every
rank and every micro-batch of one optimizer step (one perturbation per step, as in the
reference): the WinQ callback sets ``noise_seed`` at each step start, and the forward
regenerates the same draw from that seed instead of storing a weight-sized tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.formats import QTensor
from lowbit.qat.quantizers import Quantizer


@dataclass(frozen=True)
class Noise:
    """sigma_w / sigma_a: absolute std of weight / scale noise, or multiples of the row scale."""

    sigma_w: float = 0.0
    sigma_a: float = 0.0
    relative: bool = False


class QATLinear(nn.Module):
    """y = x @ Q_b(W + eps_w; alpha + eps_a)^T + b, gradients to the clean W and alpha."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantizer: Quantizer) -> None:
        super().__init__()
        self.quantizer = quantizer
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach().clone().float())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone().float(), requires_grad=False)
        scale = quantizer.init_scale(self.weight.detach())
        if quantizer.learnable:
            self.alpha = nn.Parameter(scale)
        else:
            self.register_buffer("alpha", scale, persistent=False)
        self.noise = Noise()
        self.noise_seed: int | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, quantizer: Quantizer) -> QATLinear:
        return cls(linear.weight, linear.bias, quantizer).to(linear.weight.device)

    def row_scale(self) -> torch.Tensor:
        """Per-row scale ``[out, 1]`` that relative noise is measured in."""
        if self.quantizer.learnable:
            return self.alpha.detach().abs()
        return self.quantizer.init_scale(self.weight.detach())

    def noisy(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W~, alpha~) for this step; the clean tensors when noise is off or in eval mode."""
        w, a = self.weight, self.alpha
        n = self.noise
        if not self.training or self.noise_seed is None or (n.sigma_w == 0 and n.sigma_a == 0):
            return w, a
        g = torch.Generator(device=w.device).manual_seed(self.noise_seed)
        unit = self.row_scale() if n.relative else torch.ones((), device=w.device)
        if n.sigma_w:
            w = w + (n.sigma_w * unit) * torch.randn(w.shape, generator=g, device=w.device, dtype=w.dtype)
        if n.sigma_a and self.quantizer.learnable:
            a = a + (n.sigma_a * unit) * torch.randn(a.shape, generator=g, device=a.device, dtype=a.dtype)
            a = a.clamp_min(1e-8)
        return w, a

    def quantized_weight(self) -> torch.Tensor:
        w, a = self.noisy()
        return self.quantizer.fake(w, a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.quantized_weight()
        return F.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    @torch.no_grad()
    def clean_quantized(self) -> torch.Tensor:
        """Q_b(W; alpha) without noise, detached: what re-init pulls W towards."""
        return self.quantizer.fake(self.weight.detach(), self.alpha.detach())

    @torch.no_grad()
    def to_qtensor(self) -> QTensor:
        return self.quantizer.to_qtensor(self.weight.detach().float(), self.alpha.detach().float())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, quantizer={self.quantizer.name}"
