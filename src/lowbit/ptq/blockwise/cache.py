"""The block-wise engine's activation caches: one tensor per chain, ``[nsamples, seqlen, hidden]``.

A cache lives on the compute device, in host memory (page-locked on a GPU machine, so
each mini-batch copies asynchronously) or in a memory-mapped file on disk (`disk_caches`), in fp32 or bf16; a block always computes in its
own dtype, each chunk is cast on the way in. ``map_block`` pushes a cache through a block
in place, so the walk keeps as few caches as its chains need.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowbit.ptq.blockwise.shards import SOLO, Shard

CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CACHE_DEVICES = ("device", "cpu", "disk")
_DISK: contextvars.ContextVar[Path | None] = contextvars.ContextVar("lowbit_disk_caches", default=None)
_count = itertools.count()


@contextlib.contextmanager
def disk_caches(folder: str | Path | None) -> Iterator[None]:
    """Inside the body, host caches are memory-mapped files in ``folder`` (None: in memory as usual).

    For calibration sets whose activations do not fit in memory (``--cache-device disk``): the
    kernel writes the pages back to the file and drops them when memory runs short, so the
    caches cost disk, not memory. Each file is unlinked as soon as it is mapped, so nothing is
    left behind however the run ends.
    """
    token = _DISK.set(None if folder is None else Path(folder))
    try:
        yield
    finally:
        _DISK.reset(token)


def new_cache(shape: tuple[int, ...], dtype: torch.dtype, where: torch.device, device: torch.device
              ) -> torch.Tensor:
    """An empty activation cache on ``where``; page-locked when it sits on the host of a GPU ``device``; a
    memory-mapped file inside `disk_caches`.

    Page-locked memory lets each mini-batch copy to the GPU asynchronously (``non_blocking``).
    """
    folder = _DISK.get()
    if folder is not None and where.type == "cpu":
        return _file_tensor(folder, shape, dtype)
    pin = where.type == "cpu" and device.type == "cuda"
    return torch.empty(shape, dtype=dtype, device=where, pin_memory=pin)


def _file_tensor(folder: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor backed by a shared mapping of a new file in ``folder`` (unlinked once mapped)."""
    folder.mkdir(parents=True, exist_ok=True)
    numel = math.prod(shape)
    path = folder / f"cache_{os.getpid()}_{next(_count)}.bin"
    with open(path, "wb") as f:
        f.truncate(numel * torch.empty((), dtype=dtype).element_size())
    try:
        t = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
    finally:
        path.unlink()
    return t.view(shape)


def gather_rows(cache: torch.Tensor, idx: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``cache[idx]`` on ``device`` in ``dtype``, without synchronising the host.

    ``idx`` lives with the cache. A host cache is gathered into page-locked memory from
    torch's caching host allocator (which does not hand a buffer out again before its
    copy has finished), then copied asynchronously.
    """
    if cache.device == device or cache.device.type == device.type == "cpu":
        return cache[idx].to(dtype)
    buf = torch.empty((len(idx), *cache.shape[1:]), dtype=cache.dtype, pin_memory=device.type == "cuda")
    torch.index_select(cache, 0, idx, out=buf)
    return buf.to(device, non_blocking=True).to(dtype)


def map_block(block: nn.Module, src: torch.Tensor, dst: torch.Tensor, kwargs: Mapping[str, Any], chunk: int,
              device: torch.device, dtype: torch.dtype, shard: Shard = SOLO) -> None:
    """``dst = block(src)`` in chunks of samples, computed on ``device`` in ``dtype``; ``dst`` may be ``src``.

    Writing in place keeps one cache instead of two: a chunk is read before its output
    overwrites it, and samples never mix. Under torch.distributed each rank runs its own
    share of the samples and the outputs are all-gathered chunk by chunk, so every rank
    ends with the whole ``dst``; chunks are cut as in one process, so outputs are the same.
    """
    rows = shard.rows(src.shape[0])
    for start in range(rows.start, rows.stop, chunk):
        stop = min(start + chunk, rows.stop)
        part = src[start:stop].to(device, non_blocking=True).to(dtype)
        y = block(part, **kwargs)
        y = (y[0] if isinstance(y, tuple) else y).to(dst.dtype)
        if shard.world == 1:
            dst[start:stop].copy_(y, non_blocking=True)
            continue
        import torch.distributed as dist

        parts = [torch.empty_like(y) for _ in range(shard.world)]
        dist.all_gather(parts, y.contiguous())
        k = src.shape[0] // shard.world
        for r, got in enumerate(parts):
            dst[r * k + start - rows.start: r * k + stop - rows.start].copy_(got, non_blocking=True)
    if dst.device.type == "cpu" and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the host reads dst next (once per pass, not per step)
