"""Finished blocks written out and released, so a lazily loaded run does not pile up quantized blocks.

A lazily loaded model (`lowbit.models.lazy`) holds one block's float weights at a time,
but each tuned block used to stay in memory as QuantLinears (a byte per weight of codes)
until the checkpoint was written, so memory grew with every block: 7 GB of codes for an
8B model by the last block. When nothing after the walk needs the quantized blocks in
memory (no perplexity pass), each finished block's stored tensors, exactly as the
checkpoint will hold them, go to ``OFFLOAD_DIR/q_NNNN.safetensors`` and the block is
emptied to the meta device; the checkpoint writer (`lowbit.files.native.save`) moves
those files into the output instead of packing the blocks again. The packed sizes are
kept (``storage``) so the run's bits-per-weight summary reads the same as before.

Freed is not given back: glibc's allocator keeps the pages of freed chunks below its
arenas' tops (each block's float weights, Hessians and packed codes leave ~55 MiB of them
at the 1.1B shape, the resident set grew by that per block while the bytes in use stayed
flat; benchmarks/results/bigmodel_calib.md). `give_back_free_memory` asks it to return them
after every block (``malloc_trim``), which keeps a block-by-block run flat in depth.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import save
from torch import nn

from lowbit.formats.finite import require_finite
from lowbit.io import atomic_write_bytes

ATTR = "_lowbit_released"  # set on a model whose finished blocks were written out: its `Released`


@dataclass
class Released:
    """The blocks written out so far: files in block order, each quantized layer's packed bytes."""

    folder: Path
    files: dict[int, Path] = field(default_factory=dict)  # block index -> its file
    storage: dict[str, int] = field(default_factory=dict)  # full layer name -> packed bytes (bits_summary)


def released(model: nn.Module) -> Released | None:
    return getattr(model, ATTR, None)


def release_block(model: nn.Module, prefix: str, i: int, block: nn.Module, folder: str | Path) -> bool:
    """Write block ``i`` (full name ``prefix``) as the checkpoint stores it to ``folder``, then empty it to meta.

    Returns False, writing nothing, for a block whose tensors share storage (the checkpoint
    records such pairs as aliases, which cannot point across files): it stays in memory and
    is saved with the rest.
    """
    from lowbit.files.native import WRITE_FIX, module_tensors
    from lowbit.nn import quant_layers
    from lowbit.nn.quant_experts import quant_stacks

    tensors, aliases = module_tensors(block)
    if aliases:
        return False
    rel = released(model)
    if rel is None:
        rel = Released(Path(folder))
        setattr(model, ATTR, rel)
    named = {f"{prefix}.{k}": t for k, t in tensors.items()}
    path = rel.folder / f"q_{i:05d}.safetensors"
    require_finite(named.items(), f"cannot write {path}", WRITE_FIX)
    atomic_write_bytes(path, save(named, metadata={"format": "pt"}))
    rel.files[i] = path
    rel.storage |= {f"{prefix}.{n}": m.qweight.storage_bytes() for n, m in quant_layers(block).items()}
    rel.storage |= {f"{prefix}.{n}": sum(t.numel() * t.element_size() for t in s.pack().values())
                    for n, s in quant_stacks(block).items()}
    block.to_empty(device="meta")
    return True


@functools.cache
def _libc(symbol: str):
    """glibc's function ``symbol`` (``malloc_trim``, ``mallopt``), or None where the C library has none (musl,
    macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), symbol, None) if name else None
    except OSError:
        return None


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
STEADY_MMAP_THRESHOLD = 4 << 20


def steady_allocator() -> bool:
    """Fix glibc's mmap threshold at 4 MiB for the rest of the process; False where it cannot.

    glibc raises the threshold to the size of each mapped chunk that is freed (up to 32 MiB), so
    after the first blocks a block's 4-32 MiB tensors come from the heap, placed around the holes
    earlier blocks left: the trim after each block hands the pages back, but each block's peak
    sits on a more fragmented heap than the last (GPTQ over the 22 blocks of the 1.1B shape: the
    high-water mark climbed 1.49 -> 1.89 GiB). Fixed, such tensors are mapped and unmapped whole
    and the peak stays near block 1's (1.53 -> 1.55 GiB over blocks 1-21, for ~10 % more CPU
    seconds: fresh mappings are zeroed; bigmodel_calib.md, session 7). Setting it also turns
    glibc's adjustment off. Called once when a released walk starts.
    """
    opt = _libc("mallopt")
    return bool(opt is not None and opt(M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD))


def give_back_free_memory() -> bool:
    """Return the allocator's free pages to the kernel (glibc ``malloc_trim(0)``); False where it cannot.

    Called after each block of a walk: without it the resident set grows by the block's
    freed-but-kept chunks, block after block, although nothing is alive in them.
    """
    trim = _libc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True
