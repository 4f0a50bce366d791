"""A model's float weights must be finite before anything is computed from them.

A NaN or inf weight makes every perplexity NaN and, quantized, NaN or inf scales that a
checkpoint then stores (a run with ``--no-eval`` reported nothing). Sources are checked
once when loaded, by tensor name, with the same scan every writer runs
(`lowbit.formats.finite`); a lazily loaded model's blocks are read from its files one
tensor at a time, so the check never holds more than one tensor in memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lowbit.errors import ModelError
from lowbit.formats.finite import require_finite
from lowbit.models.lazy import SOURCE_ATTR, is_lazy


def refuse_nonfinite(model: nn.Module, source: str) -> None:
    """Raise `ModelError` naming the first weight of ``model`` that holds NaN or inf."""
    require_finite(_tensors(model), f"model {source}", "lowbit quantizes and evaluates finite weights only: "
                   "repair the model or re-export it from a good copy", ModelError)


def _tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    lazy = is_lazy(model)
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        if t.device.type != "meta":
            yield name, t
        elif lazy:
            yield name, getattr(model, SOURCE_ATTR).read([name])[name]
