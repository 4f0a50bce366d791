"""torch.distributed glue: process group from the torchrun environment, DDP/FSDP wrap.

Launch with ``torchrun --nproc_per_node N script.py``; each process calls
`init_from_env` (a no-op in a single process) and the loop does the rest. CPU runs use
the gloo backend, GPU runs NCCL with one device per local rank.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from lowbit.errors import ConfigError


def init_from_env() -> tuple[int, int]:
    """Join the process group torchrun describes; returns (rank, world size)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return rank_world()


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    if rank_world()[1] > 1:
        dist.barrier()


def mean_across(x: torch.Tensor) -> torch.Tensor:
    """Average a tensor over ranks (identity in one process)."""
    if rank_world()[1] == 1:
        return x
    x = x.detach().clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x / rank_world()[1]


def wrap(model: nn.Module, parallel: str) -> nn.Module:
    """DDP (replicated model) or FSDP (sharded, for models that do not fit one device)."""
    if rank_world()[1] == 1:
        return model
    device_ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=device_ids)
    if parallel == "fsdp":
        if device_ids is None:
            raise ConfigError("FSDP needs GPUs (its CPU/gloo path does not reproduce single-process "
                              "training here); use parallel='ddp' on CPU")
        return _fully_shard(model)
    raise ConfigError(f"unknown parallel mode {parallel!r}; use ddp or fsdp")


def _fully_shard(model: nn.Module) -> nn.Module:
    """FSDP2: shard each decoder block (or each Linear-bearing child), then the root.

    Sharding per block keeps only one block's full weights gathered at a time, which
    is what lets a model that does not fit one device train.
    """
    from torch.distributed.fsdp import fully_shard

    blocks = _blocks(model)
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _blocks(model: nn.Module) -> list[nn.Module]:
    from lowbit.errors import ModelError
    from lowbit.models import decoder_blocks

    try:
        return list(decoder_blocks(model))
    except ModelError:  # not a known decoder (e.g. a test model): shard the root as one unit
        return []


def no_sync(wrapped: nn.Module):
    """Context that skips the gradient all-reduce of a micro-step (DDP and FSDP2)."""
    import contextlib

    if hasattr(wrapped, "no_sync"):
        return wrapped.no_sync()
    if hasattr(wrapped, "set_requires_gradient_sync"):
        @contextlib.contextmanager
        def ctx():
            wrapped.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                wrapped.set_requires_gradient_sync(True)

        return ctx()
    return contextlib.nullcontext()
