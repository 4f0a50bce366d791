"""Capture: the hidden states entering decoder block 0 for every calibration sample, and its kwargs.

A forward pre-hook on block 0 records what the model hands it and stops the forward
there, so only the embeddings run. The states go into one activation cache
(`lowbit.ptq.blockwise.cache`), the block's kwargs (mask, position embeddings) onto the
compute device for every later block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowbit.errors import ConfigError
from lowbit.ptq.blockwise.cache import new_cache
from lowbit.ptq.blockwise.shards import SOLO, Shard, all_gather_rows

_DROP_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


class _StopForward(Exception):
    """Raised by the capture hook once block 0's inputs are recorded."""


def capture_inputs(model: nn.Module, block0: nn.Module, calib: torch.Tensor, device: torch.device,
                   dtype: torch.dtype | None = None, where: torch.device | None = None,
                   shard: Shard = SOLO) -> tuple[torch.Tensor, dict[str, Any]]:
    """Hidden states entering block 0 for every sample, and the kwargs the block gets.

    Samples go one at a time (only embeddings run before the hook stops the model), so
    every captured kwarg has batch dimension 1 and broadcasts over any mini-batch. The
    embeddings run where the model's input embedding lives (the model stays off the
    compute device; only one block at a time goes there). The hidden states are written
    into one cache on ``where`` (default ``device``) in ``dtype`` (default the model's);
    the kwargs go to ``device``. Under torch.distributed each rank embeds its own share
    of the samples and the rows are all-gathered (embedding is a lookup: no arithmetic
    to differ).
    """
    if len(calib) == 0:
        raise ConfigError("no calibration samples; pass nsamples >= 1")
    store: list[tuple[tuple, dict]] = []
    src = input_device(model)

    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        store.append((args, kwargs))
        raise _StopForward

    handle = block0.register_forward_pre_hook(hook, with_kwargs=True)
    cache, first = None, {}
    rows = shard.rows(len(calib))
    try:
        with torch.no_grad():
            for i in range(rows.start, rows.stop):
                try:
                    model(input_ids=calib[i].unsqueeze(0).to(src), use_cache=False)
                except _StopForward:
                    pass
                args, kw = store.pop()
                h = (args[0] if args else kw["hidden_states"]).detach()
                if cache is None:
                    first = kw
                    cache = new_cache((len(calib), *h.shape[1:]), dtype or h.dtype, where or device, device)
                cache[i].copy_(h[0])
    finally:
        handle.remove()
    kwargs = {k: v for k, v in first.items() if k not in _DROP_KWARGS and k != "hidden_states"}
    kwargs["use_cache"] = False
    if shard.world > 1:
        all_gather_rows(cache, rows, shard, device)
    return cache, _to(kwargs, device)


def input_device(model: nn.Module) -> torch.device:
    """Where the token ids must go: the input embedding's device (CPU for a lazy model's meta stub)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(emb, "weight", None)
    if weight is None or weight.device.type == "meta":
        return torch.device("cpu")
    return weight.device


def _to(kwargs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    def mv(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.to(device)
        if isinstance(v, tuple):
            return tuple(mv(t) for t in v)
        return v

    return {k: mv(v) for k, v in kwargs.items()}
