"""A model's float weights must be finite before anything is computed from them.

A NaN or inf weight makes every perplexity NaN and, quantized, NaN or inf scales that a
checkpoint then stores (a run with ``--no-eval`` reported nothing). Sources are checked
once when loaded, by tensor name, with the same scan every writer runs
(`lowbit.formats.finite`). A lazily loaded model's blocks stay in its files: each tensor
is checked as it is read (`lowbit.models.lazy.ShardSource.read`), when the walk reaches its
block, so the check costs no pass over the checkpoint of its own; here only the tensors
already in memory are scanned.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lowbit.errors import ModelError
from lowbit.formats.finite import require_finite

FINITE_FIX = "lowbit quantizes and evaluates finite weights only: repair the model or re-export it from a good copy"


def refuse_nonfinite(model: nn.Module, source: str) -> None:
    """Raise `ModelError` naming the first weight of ``model`` in memory that holds NaN or inf (a lazily loaded
    model's blocks, still on meta, are checked as they are read)."""
    require_finite(_tensors(model), f"model {source}", FINITE_FIX, ModelError)


def _tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in seen or t.device.type == "meta":
            continue
        seen.add(id(t))
        yield name, t
