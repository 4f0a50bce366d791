"""Where each block's float weights come from while the engine walks the model.

With an offload folder the FP weights of every block are written to disk first
(``fp_NNNN.safetensors``) and the blocks emptied, so memory holds one block at a time; a
lazily loaded model (`lowbit.models.lazy`) is read from its own checkpoint instead, with
nothing copied. Without either the blocks simply stay in memory. A pass that changes the
float weights (AWQ) writes each block back after it and, at the end, loads every block
into memory again for the steps after it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save
from torch import nn

from lowbit.io import atomic_write_bytes
from lowbit.models.layers import block_path
from lowbit.models.lazy import is_lazy, load_block


class DiskOffload:
    """FP weights of every block in ``dir/fp_NNNN.safetensors``; at most one block in memory."""

    def __init__(self, path: str | Path, blocks: nn.ModuleList) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        for i, b in enumerate(blocks):  # always rewritten: files of another model must never be reused
            self.store(i, b)

    def store(self, i: int, block: nn.Module) -> None:
        """Write block ``i``'s tensors as they are now to its file, then free them (the block goes to meta).

        A pass that changes float weights (AWQ's scales) stores each block back after it, so
        the folder always holds the model as the pass has left it.
        """
        tensors = {k: v.detach().contiguous().cpu() for k, v in _tensors(block).items()}
        atomic_write_bytes(self.path / f"fp_{i:04d}.safetensors", save(tensors))
        block.to_empty(device="meta")

    def load(self, i: int, block: nn.Module, device: torch.device) -> None:
        """Put block ``i``'s FP tensors back, each in memory of its own.

        ``load_file`` hands out views of one memory map of the whole file, so the block's
        norm weights, which outlive the tuning, would keep every page of its replaced
        Linear weights resident: RSS grew by one FP block per tuned block. Copying each
        tensor out (one at a time) lets the map go when the Linears are swapped out.
        """
        for name, t in load_file(str(self.path / f"fp_{i:04d}.safetensors"), device=str(device)).items():
            t = t.clone() if t.device.type == "cpu" else t
            parent, _, leaf = name.rpartition(".")
            mod = block.get_submodule(parent) if parent else block
            if leaf in mod._parameters:
                mod._parameters[leaf] = nn.Parameter(t, requires_grad=False)
            else:
                mod._buffers[leaf] = t


class ShardBlocks:
    """Blocks of a lazily loaded model (``lowbit.models.lazy``), read from its own checkpoint."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.prefix = model, block_path(model)

    def load(self, i: int, block: nn.Module, device: torch.device) -> None:
        load_block(self.model, f"{self.prefix}.{i}", block, device)


def block_loader(model: nn.Module, blocks: nn.ModuleList, offload_dir: str | None) -> ShardBlocks | DiskOffload | None:
    """Where each block's FP weights come from: the checkpoint (lazy model), an offload folder, or memory."""
    if is_lazy(model):
        return ShardBlocks(model)  # already on disk in the checkpoint: nothing to write
    return DiskOffload(offload_dir, blocks) if offload_dir else None


def _tensors(block: nn.Module) -> dict[str, torch.Tensor]:
    d = dict(block.named_parameters())
    d.update(dict(block.named_buffers()))
    return d
