"""The one block-wise walk every pass runs on: tuning methods (SignRound V1/V2, GPTQ) and AWQ's scale search.

Capture the inputs of decoder block 0 (a forward pre-hook that stops the model there),
then for each block: bring its float weights in (from memory, an offload folder, or a
lazily loaded checkpoint) onto the compute device, let the pass do its work there
(`BlockPass.step`), write the block's result to the work folder, let the pass finish the
block (install it, propagate its caches), and move it back. Only the block being worked
on sits on the compute device; with an offload folder the float weights of all other
blocks live on disk, so peak memory grows with one block plus the cached activations. A lazily
loaded run with nothing after the walk that reads the quantized blocks also writes each finished
block out and frees it (`lowbit.ptq.blockwise.release`), so quantized blocks do not pile up.

Resume: a rerun with the same settings hands each finished block's saved result to the
pass instead of computing it (forward passes only, the same chunking and order, hence
bit-identical activations) and continues with the next one; a rerun with different
settings is refused rather than mixing two runs (`lowbit.ptq.blockwise.store`).

Under torch.distributed (torchrun) every rank computes its share of the samples in the
forward passes, the caches are all-gathered, and only rank 0 writes the work folder
(`lowbit.ptq.blockwise.shards`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from lowbit.errors import ConfigError
from lowbit.models.layers import decoder_blocks
from lowbit.models.lazy import forget_source, is_lazy, materialize
from lowbit.models.placement import check_device
from lowbit.ptq.blockwise import shards
from lowbit.ptq.blockwise.access import block_dtype, module_names
from lowbit.ptq.blockwise.cache import disk_caches
from lowbit.ptq.blockwise.capture import capture_inputs
from lowbit.ptq.blockwise.offload import DiskOffload, block_loader
from lowbit.ptq.blockwise.options import cache_place
from lowbit.ptq.blockwise.release import give_back_free_memory, release_block, steady_allocator
from lowbit.ptq.blockwise.shards import Shard, check_world, rank_folder
from lowbit.ptq.blockwise.store import open_workdir, resume_point
from lowbit.ptq.methods import RunContext


@dataclass(frozen=True)
class Walk:
    """What the engine resolved once for a walk, handed to the pass before its first block.

    kwargs: the extra arguments every block is called with (mask, position embeddings).
    device / dtype: where and in what the blocks compute. chunk: samples per block forward.
    """

    model: nn.Module
    blocks: nn.ModuleList
    names: Mapping[int, str]
    kwargs: dict[str, Any]
    device: torch.device
    dtype: torch.dtype
    shard: Shard
    chunk: int


class BlockPass(Protocol):
    """One pass's work on each block; the engine walks the blocks and calls it.

    desc: the progress bar's label. changes_float: the pass rewrites float weights (AWQ),
    so an offload folder takes each block back after it and the model is whole again at
    the end. cache_dtype: the activation caches' dtype (None: the model's).
    """

    desc: str
    changes_float: bool
    cache_dtype: torch.dtype | None

    def begin(self, walk: Walk, x: torch.Tensor) -> None:
        """The captured inputs of block 0 (the pass keeps the caches it needs)."""

    def home(self, i: int) -> torch.device:
        """Where block ``i`` goes after its turn."""

    def decode(self, i: int, raw: Mapping[str, torch.Tensor], path: Path) -> Any:
        """Block ``i``'s saved tensors as its result (an error when they are not, so it is redone)."""

    def step(self, i: int, block: nn.Module, saved: Any | None) -> tuple[Any, dict[str, float]]:
        """Work on block ``i`` (on the compute device): its result and info; ``saved``: a resumed result."""

    def pack(self, result: Any) -> dict[str, torch.Tensor]:
        """The result as the tensors the work folder stores."""

    def finish(self, i: int, block: nn.Module, result: Any) -> None:
        """After the result is saved: apply it and move the caches on to the next block."""

    def end(self) -> None:
        """After the last block."""


def walk_blocks(model: nn.Module, task: BlockPass, record: Mapping[str, Any], ctx: RunContext, chunk: int,
                on_block: Callable[[int], None] | None = None) -> list[dict[str, float]]:
    """Run ``task`` over every decoder block of ``model`` under ``ctx``; returns per-block info.

    record: everything that determines the result, stored in the work folder
    (``ctx.workdir``) so a resume with other settings is refused. on_block: called with
    the block index after each block is finished (tests interrupt here).
    """
    if ctx.calib is None or ctx.calib.numel() == 0:
        raise ConfigError("the block-wise engine needs calibration batches (LongTensor [nsamples, seqlen])")
    if ctx.pre is not None:  # rotation / AWQ / the range fit on each block as it is read (`lowbit.ptq.block_prep`)
        if not is_lazy(model):
            raise ConfigError("the pre-steps run per block only on a lazily loaded model; run them on the whole "
                              "model first (lowbit.ptq.conductor.prepare_model)")
        task = ctx.pre.wrap(model, task)
        record = {**record, "pre_steps": ctx.pre.record()}
    shard = shards.current_shard()
    check_world(len(ctx.calib), shard)
    device = check_device(ctx.device) or torch.device("cpu")
    where = cache_place(ctx.cache_device, device)
    if task.changes_float:
        materialize(model)  # a lazily loaded model's checkpoint cannot take the changed blocks back
    if ctx.cache_device == "disk" and not ctx.offload_dir:
        raise ConfigError("--cache-device disk keeps the activations in files in --offload-dir; pass --offload-dir")
    with disk_caches(rank_folder(ctx.offload_dir, shard) if ctx.cache_device == "disk" else None):
        return _walk(model, task, record, ctx, chunk, on_block, device, where, shard)


def _walk(model: nn.Module, task: BlockPass, record: Mapping[str, Any], ctx: RunContext, chunk: int,
          on_block: Callable[[int], None] | None, device: torch.device, where: torch.device, shard: Shard
          ) -> list[dict[str, float]]:
    blocks = decoder_blocks(model)
    x, kwargs = capture_inputs(model, blocks[0], ctx.calib, device, task.cache_dtype, where, shard)
    walk = Walk(model, blocks, module_names(model), kwargs, device, block_dtype(blocks[0]), shard, chunk)
    wd = open_workdir(ctx.workdir, dict(record), shard)
    task.begin(walk, x)
    del x
    loader = block_loader(model, blocks, rank_folder(ctx.offload_dir, shard))
    release = rank_folder(ctx.offload_dir, shard) if ctx.release and is_lazy(model) and not task.changes_float \
        else None
    start = resume_point(wd, len(blocks), shard, task.decode)
    if release:
        steady_allocator()  # one block's peak, not a heap fragmented by every block before it (release.py)
    infos: list[dict[str, float]] = []
    bar = tqdm(range(len(blocks)), desc=task.desc, unit="block", disable=not ctx.progress or shard.rank != 0)
    for i in bar:
        block = blocks[i]
        if loader:
            loader.load(i, block, device)
        block.to(device)
        t0 = time.perf_counter()
        saved = wd.load_block(i, task.decode) if wd is not None and i < start else None
        result, info = task.step(i, block, saved)
        if saved is None and wd is not None:
            if i in wd.damaged:
                info["retuned_damaged"] = 1.0
            if shard.rank == 0:
                wd.save_block(i, task.pack(result))
        task.finish(i, block, result)
        if task.changes_float and isinstance(loader, DiskOffload):
            loader.store(i, block)  # the folder holds the block as the pass left it; memory holds none
        elif not (release and release_block(model, walk.names[id(block)], i, block, release)):
            block.to(task.home(i))
        give_back_free_memory()  # the block's freed chunks, kept by the allocator otherwise (release.py)
        info["seconds"] = time.perf_counter() - t0
        infos.append(info)
        bar.set_postfix({k: f"{v:.3g}" for k, v in info.items() if k in ("loss", "rtn_loss")})
        if on_block is not None and i >= start:
            on_block(i)
    if task.changes_float and isinstance(loader, DiskOffload):
        for i, block in enumerate(blocks):  # every step after this pass reads the whole model
            loader.load(i, block, torch.device("cpu"))
            block.to(task.home(i))
    task.end()
    if is_lazy(model) and release:  # every block is written out by now: only the marker goes
        forget_source(model)
    elif is_lazy(model):
        materialize(model, widen_tables=False)  # every block is loaded by now: this only drops the marker
    return infos
