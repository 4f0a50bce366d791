"""AdaAlloc: how many WHT coefficients each output row of a layer gets.

Quantization error is uneven across rows, so a fixed per-row count wastes budget on
rows that are already accurate. AdaAlloc gives row i a share of the layer budget N
proportional to the norm of its error spectrum ``||C_i||``. Unlike the reference (which
can leave rows with nothing), every row first receives ``k_min`` coefficients; the rest
``N - d_out * k_min`` is shared in proportion to ``||C_i||``, capped at the row width,
with capped rows' excess redistributed and the rounding remainder given to the rows
with the largest fractional shares. The result sums to exactly N.
"""

from __future__ import annotations

import torch

from lowbit.errors import ConfigError


def lora_budget(rank: int, out_features: int, in_features: int) -> int:
    """Parameters of a rank-r LoRA on this layer: the budget every adapter gets."""
    return rank * (out_features + in_features)


def check_budget(budget: int, rows: int, width: int, k_min: int, where: str = "layer") -> None:
    if budget > rows * width:
        raise ConfigError(f"{where}: budget {budget} exceeds the layer's {rows}x{width} = {rows * width} "
                          "coefficients; use a smaller --rank")
    if k_min < 0 or rows * k_min > budget:
        raise ConfigError(f"{where}: k_min={k_min} per row needs {rows * k_min} coefficients but the budget is "
                          f"{budget}; lower k_min or raise --rank")
    if k_min > width:
        raise ConfigError(f"{where}: k_min={k_min} exceeds the row width {width}")


def allocate(row_norms: torch.Tensor, budget: int, width: int, k_min: int = 1) -> torch.Tensor:
    """Per-row counts ``k`` (int64, ``[rows]``) with ``k.sum() == budget``, ``k_min <= k <= width``."""
    rows = row_norms.numel()
    check_budget(budget, rows, width, k_min)
    w = row_norms.double().clamp_min(0).flatten()
    if float(w.sum()) == 0.0:
        w = torch.ones_like(w)
    k = torch.full((rows,), k_min, dtype=torch.int64)
    free = torch.ones(rows, dtype=torch.bool)
    left = budget - rows * k_min
    while left > 0:  # water-filling: at most one pass per newly capped group of rows
        share = left * w * free / (w * free).sum().clamp_min(1e-300)
        room = (width - k).double()
        capped = free & (share >= room)
        if capped.any():
            k = torch.where(capped, torch.full_like(k, width), k)
            free &= ~capped
            left = budget - int(k.sum())
            if not free.any() or float((w * free).sum()) == 0.0:
                w = free.double()  # remaining rows have zero error: share evenly
                if not free.any():
                    break
            continue
        base = share.floor().long()
        k = k + base
        left -= int(base.sum())
        frac = torch.where(free, share - base.double(), torch.full_like(share, -1.0))
        k[torch.topk(frac, left).indices] += 1
        left = 0
    return k
