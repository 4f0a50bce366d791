"""LoftQ-style initialisation: start LoRA at the best rank-r fit of the quantization error.

With the quantized base held fixed (so every adapter compares on the same base), the
LoftQ step reduces to ``B A = SVD_r(W_fp - dequant(W_q))``, split symmetrically
(``B = U sqrt(S)``, ``A = sqrt(S) V^T``) so both factors start at the same scale.
"""

from __future__ import annotations

import torch

from lowbit.peft.lora import LoRAAdapter


class LoftQAdapter(LoRAAdapter):
    kind = "loftq"


def svd_factors(err: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B [out, r], A [r, in])`` with ``B @ A`` the best rank-r approximation of ``err``."""
    u, s, vh = torch.linalg.svd(err.float(), full_matrices=False)
    root = s[:rank].sqrt()
    return u[:, :rank] * root, root[:, None] * vh[:rank]


def loftq_adapter(err: torch.Tensor, rank: int, alpha: float | None = None) -> LoftQAdapter:
    """A LoRA adapter whose initial ``delta_weight()`` is ``SVD_r(err)``."""
    out_features, in_features = err.shape
    adapter = LoftQAdapter(out_features, in_features, rank, alpha)
    b, a = svd_factors(err, rank)
    with torch.no_grad():
        adapter.lora_b.copy_(b / adapter.scaling)
        adapter.lora_a.copy_(a)
    return adapter
