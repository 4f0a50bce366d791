"""Second moments ``XtX = sum x x^T`` of every target layer's input on calibration data.

QWHA's refinement fits the layer *output* error, which only needs XtX per layer. The
batches must come from the calibration/training split (`lowbit.data.calibration_batches`),
never the evaluation text, or the reported perplexity would be fitted to the test set.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from tqdm.auto import tqdm


@torch.no_grad()
def collect_xtx(model: nn.Module, names: Iterable[str], batches: torch.Tensor, batch_size: int = 4,
                progress: bool = False) -> dict[str, torch.Tensor]:
    """Run ``batches`` (``[n, seqlen]`` token ids) through the model; float64 XtX per layer."""
    names = list(names)
    sums: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def fn(mod: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.T @ x
        return fn

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    device = next(model.parameters()).device
    try:
        chunks = torch.split(batches, batch_size)
        for chunk in tqdm(chunks, desc="calibration XtX", disable=not progress, unit="batch"):
            model(chunk.to(device))
    finally:
        for h in handles:
            h.remove()
    return sums
