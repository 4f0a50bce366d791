"""LoRA baseline: ``Delta_W = (alpha / r) * B A`` with B zero-initialised.

The same low-rank form serves LoftQ (`lowbit.peft.loftq` only changes the init), so
both baselines train, merge and save exactly like QWHA through the `Adapter` base.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lowbit.errors import ConfigError
from lowbit.peft.base import Adapter


class LoRAAdapter(Adapter):
    """Rank-r update; ``forward`` uses the two thin matmuls, never the dense product."""

    kind = "lora"

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float | None = None,
                 seed: int = 0) -> None:
        super().__init__(out_features, in_features)
        if rank < 1 or rank > min(out_features, in_features):
            raise ConfigError(f"LoRA rank {rank} must be between 1 and min(out, in) = "
                              f"{min(out_features, in_features)}; use a smaller --rank")
        self.rank = rank
        self.alpha = float(rank if alpha is None else alpha)
        gen = torch.Generator().manual_seed(seed)
        bound = 1.0 / math.sqrt(in_features)  # kaiming-uniform(a=sqrt(5)) bound, as in nn.Linear
        self.lora_a = nn.Parameter((torch.rand(rank, in_features, generator=gen) * 2 - 1) * bound)
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def config(self) -> dict[str, Any]:
        return {**super().config(), "rank": self.rank, "alpha": self.alpha}

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_b @ self.lora_a) * self.scaling

    def folds(self, x: torch.Tensor) -> bool:
        return False  # two thin matmuls are cheaper than the dense product

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.lora_a.to(x.dtype).T) @ (self.lora_b.to(x.dtype) * self.scaling).T
