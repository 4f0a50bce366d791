"""Input-channel importance of Linear layers: the sum of squared activations per column.

``imp[j] = sum over calibration tokens of x_j^2`` is the diagonal of ``X^T X``, the weight
that makes ``sum_j imp_j (w_j - q(w_j))^2`` track the layer's output error. The
importance-weighted scale search (RTN "search" rule, SignRoundV2 init) needs it, so the
hooks live here, usable on a whole model or on one block inside the PTQ pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from lowbit.errors import ConfigError


class ImportanceHooks:
    """Forward pre-hooks that add ``x^2`` summed over tokens into one ``[in]`` float64 vector per layer.

    float64 accumulation keeps the sum exact enough over millions of tokens; the result
    is returned as float32.
    """

    def __init__(self, layers: Mapping[str, nn.Module]) -> None:
        self.layers = dict(layers)
        self.sums: dict[str, torch.Tensor] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0].detach()
            sq = x.reshape(-1, x.shape[-1]).double().pow(2).sum(0)
            prev = self.sums.get(name)
            self.sums[name] = sq if prev is None else prev + sq.to(prev.device)

        return hook

    def __enter__(self) -> ImportanceHooks:
        for name, layer in self.layers.items():
            self._handles.append(layer.register_forward_pre_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def result(self) -> dict[str, torch.Tensor]:
        missing = [n for n in self.layers if n not in self.sums]
        if missing:
            raise ConfigError(f"layers {missing[:3]} never ran during importance collection; "
                              "check that the calibration batches reach them")
        return {n: self.sums[n].float().cpu() for n in self.layers}


@contextlib.contextmanager
def importance_hooks(layers: Mapping[str, nn.Module]) -> Iterator[ImportanceHooks]:
    with ImportanceHooks(layers) as h:
        yield h


def collect_importance(model: nn.Module, batches: torch.Tensor, layers: Iterable[str],
                       batch_size: int = 8) -> dict[str, torch.Tensor]:
    """Run ``batches`` (LongTensor ``[n, seqlen]``) through ``model``; return ``name -> imp[in]``.

    layers: names of the Linear modules to measure (e.g. the keys of a `Plan`).
    """
    mods = {n: model.get_submodule(n) for n in layers}
    device = next(model.parameters()).device
    with torch.no_grad(), importance_hooks(mods) as h:
        for chunk in batches.split(batch_size):
            model(input_ids=chunk.to(device), use_cache=False)
    return h.result()
