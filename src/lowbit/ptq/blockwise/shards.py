"""Data-parallel shards of the block-wise engine under torch.distributed (torchrun).

Every rank holds the whole model and the whole activation caches; the forward passes
split the calibration samples into one contiguous share per rank and all-gather the
outputs, statistics are summed (or maxed) over the ranks, and rank 0 alone writes the
work folder. Chunks are cut as in one process, so the numbers do not depend on the
world size. In one process every helper here is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from lowbit.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world`` processes (torch.distributed) tuning one model together."""

    rank: int = 0
    world: int = 1

    def rows(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` samples (``n`` divisible by ``world``)."""
        k = n // self.world
        return slice(self.rank * k, (self.rank + 1) * k)


SOLO = Shard()  # one process: the default everywhere a shard is optional


def current_shard() -> Shard:
    """The torch.distributed rank and world size (rank 0 of 1 without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return Shard(dist.get_rank(), dist.get_world_size())
    return Shard()


def check_world(nsamples: int, shard: Shard) -> None:
    """Under torch.distributed the calibration samples split evenly over the ranks, or it is an error."""
    if nsamples % shard.world:
        raise ConfigError(f"{nsamples} calibration samples do not split over {shard.world} processes; pass "
                          f"--nsamples a multiple of {shard.world} (or launch a world size that divides it)")


def reduce_tensor(x: torch.Tensor, shard: Shard, op: str = "sum") -> torch.Tensor:
    """``x`` summed (or, ``op="max"``, maxed) over the ranks, as a new tensor (``x`` itself in one process).

    NCCL reduces only GPU tensors: a host tensor (statistics are gathered on the CPU) goes
    through this rank's GPU and comes back.
    """
    if shard.world == 1:
        return x
    import torch.distributed as dist

    comm = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else x.device
    y = x.to(comm, copy=True)
    dist.all_reduce(y, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return y.to(x.device)


def reduce_across(stats: Mapping[str, torch.Tensor], shard: Shard, op: str = "sum") -> dict[str, torch.Tensor]:
    """Per-rank activation statistics reduced over the ranks (`reduce_tensor` on each)."""
    return {name: reduce_tensor(t, shard, op) for name, t in stats.items()}


def all_gather_rows(cache: torch.Tensor, rows: slice, shard: Shard, device: torch.device) -> None:
    """Every rank's rows ``rows`` of ``cache`` into every rank's cache (sample by sample, through ``device``)."""
    import torch.distributed as dist

    comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
    for j in range(rows.stop - rows.start):
        mine = cache[rows.start + j].to(comm)
        parts = [torch.empty_like(mine) for _ in range(shard.world)]
        dist.all_gather(parts, mine)
        for r, got in enumerate(parts):
            cache[r * (rows.stop - rows.start) + j].copy_(got)


def rank0_first(shard: Shard, fn: Callable[[], T]) -> T:
    """``fn()`` on rank 0, then (after a barrier) on every other rank: rank 0 creates or prunes what they read."""
    if shard.world == 1:
        return fn()
    import torch.distributed as dist

    got = fn() if shard.rank == 0 else None
    dist.barrier()
    return got if shard.rank == 0 else fn()  # type: ignore[return-value]


def rank_folder(folder: str | None, shard: Shard) -> str | None:
    """Each rank offloads into a folder of its own (ranks on one machine must not share the files)."""
    if folder is None or shard.world == 1:
        return folder
    return str(Path(folder) / f"rank{shard.rank}")
