"""GPTQ's per-matrix choice between searched and abs-max group scales, by the block's output error.

The importance-weighted scale search (`lowbit.formats`, importance ``diag(H)``) lowers each
matrix's own output error ``tr(D H D^T)``, and on most models the model's perplexity with it;
but not on every model. On the float MoE organism (`benchmarks/moe.py`) GPTQ with searched
scales was better matrix by matrix, on the calibration tokens and on held-out ones, yet the
model was worse than with abs-max scales (mostly the attention Linears: clipping the largest
q/k weights moves the attention logits through the softmax by more than their share of the
output MSE says). A matrix-level criterion cannot see that, the block's output can: so GPTQ
runs each planned matrix with both rules and keeps the one whose *block output* on the
calibration samples is closer to the float block's (greedy, in the order GPTQ quantizes:
the matrices before it quantized with their choice, the ones after it still float). Only
calibration inputs are read; nothing of an evaluation split.

`BlockProbe` holds the float block's outputs on the first `CHOICE_SAMPLES` calibration
samples and measures the squared error of the block as it stands; `choose` installs each
candidate in turn, keeps the best, and counts the choices.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lowbit.formats import Scheme

CHOICE_SAMPLES = 32  # calibration samples whose block outputs rank the candidates (float targets held in memory)


def plain(scheme: Scheme) -> Scheme | None:
    """The abs-max alternative to a searched scheme, or None when the scheme has no choice to make."""
    return scheme.replace(rule="absmax") if scheme.rule == "search" else None


class BlockProbe:
    """The block's output error on a few calibration samples, against the float block's output on them.

    Built before any weight of the block changes (its outputs then are the float targets).
    ``x`` holds the samples on the compute device in the block's dtype; ``chunk`` samples run
    at a time, so only the targets (float32) are held in memory.
    """

    def __init__(self, block: nn.Module, x: torch.Tensor, kwargs: Mapping[str, Any], chunk: int) -> None:
        self.block, self.x, self.kwargs, self.chunk = block, x, kwargs, chunk
        self.y = [y.float() for y in self._outputs()]
        self.absmax = 0  # matrices that kept abs-max scales
        self.choices = 0  # matrices chosen for

    def _outputs(self):
        with torch.no_grad():
            for part in self.x.split(self.chunk):
                y = self.block(part, **self.kwargs)
                yield y[0] if isinstance(y, tuple) else y

    def error(self) -> float:
        """Sum of squared differences between the block's output now and the float block's."""
        return float(sum((y.float() - t).pow(2).sum() for y, t in zip(self._outputs(), self.y, strict=True)))

    def choose(self, install: Callable[[int], None], n: int) -> int:
        """Install candidates ``0..n-1`` in turn (``install(i)``), keep the one with the lowest block error.

        Candidate 0 is the searched one, 1 the abs-max one; ties keep the searched scales.
        Returns the index installed last (the best).
        """
        errs = []
        for i in range(n):
            install(i)
            errs.append(self.error())
        best = min(range(n), key=errs.__getitem__)
        if best != n - 1:
            install(best)
        self.choices += 1
        self.absmax += best != 0
        return best

    def info(self) -> dict[str, float]:
        """The block's counts, for the per-block info the pipeline records."""
        return {"scale_choices": float(self.choices), "scale_absmax": float(self.absmax)}
