"""FourierFT baseline, lowbit's own (HF peft's FourierFT only wraps nn.Linear/Conv1D).

``Delta_W = scaling * Re(ifft2(S))`` with S the ``[out, in]`` spectrum, non-zero at n
random positions drawn exactly as peft draws them (``randperm(out*in)`` from
``random_loc_seed``), so a lowbit FourierFT and a peft FourierFT with the same seed and
values produce the same Delta_W (the tests check this on a float Linear). It needs a
2-D FFT with complex multiplications per step: the cost QWHA avoids.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowbit.errors import ConfigError
from lowbit.peft.base import Adapter


def fourier_positions(out_features: int, in_features: int, n_frequency: int, seed: int) -> torch.Tensor:
    """``[2, n]`` (row, col) positions, the same draw as peft's FourierFT layer."""
    flat = torch.randperm(out_features * in_features, generator=torch.Generator().manual_seed(seed))[:n_frequency]
    return torch.stack((flat // in_features, flat % in_features))


class FourierFTAdapter(Adapter):
    kind = "fourierft"

    def __init__(self, out_features: int, in_features: int, n_frequency: int, scaling: float = 150.0,
                 seed: int = 777) -> None:
        super().__init__(out_features, in_features)
        if not 0 < n_frequency <= out_features * in_features:
            raise ConfigError(f"FourierFT n_frequency {n_frequency} must be in 1..{out_features * in_features} "
                              "(out*in); use a smaller --rank")
        self.n_frequency, self.scaling, self.seed = n_frequency, float(scaling), seed
        self.register_buffer("indices", fourier_positions(out_features, in_features, n_frequency, seed))
        self.spectrum = nn.Parameter(torch.zeros(n_frequency))

    def config(self) -> dict[str, Any]:
        return {**super().config(), "n_frequency": self.n_frequency, "scaling": self.scaling, "seed": self.seed}

    def delta_weight(self) -> torch.Tensor:
        dense = self.spectrum.new_zeros(self.out_features, self.in_features)
        dense = dense.index_put((self.indices[0], self.indices[1]), self.spectrum.float())
        return torch.fft.ifft2(dense).real * self.scaling
