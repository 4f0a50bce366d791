"""Lazy loading: a model whose decoder blocks stay in their safetensors files until needed.

Block-wise PTQ only ever needs one block's float weights at a time, so a model far larger
than memory can be quantized if nothing loads it whole. ``load_lazy`` builds the model's
skeleton with every parameter on the meta device (buffers stay real: rotary tables are
computed at construction and are never in the checkpoint), loads the tensors outside the
decoder blocks (embeddings, final norm, lm_head), and leaves each block on meta. A
``ShardSource`` then fills one block from the checkpoint's own shards when the pipeline
reaches it; nothing is copied to an offload folder first. The embedding tables and the
lm_head stay in the checkpoint's dtype when it is narrower than the compute dtype (a bf16
checkpoint: half the bytes), widened where they are used (`lowbit.models.narrow_tables`).

Finite weights: every tensor is checked for NaN / inf as it is read, by name
(`ShardSource.read`), so a lazily loaded model is checked block by block when the walk
reaches each block rather than by reading the whole checkpoint once before block 0 (at the
8B shape that pass read 16 GB and took ~100 CPU seconds before any work). Nothing is
written from a non-finite source: the walk stops at the block that holds it, before its
result is stored, and the output is only renamed into place after the last block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowbit.errors import ModelError
from lowbit.formats.finite import require_finite
from lowbit.models.finite import FINITE_FIX
from lowbit.models.layers import block_path
from lowbit.models.narrow_tables import keep_narrow, narrower, table_modules, widen
from lowbit.nn.meta import params_on_meta

SOURCE_ATTR = "_lowbit_lazy_source"  # set on a lazily loaded model: its ShardSource


def _weight_map(index: Path) -> dict[str, str]:
    """``weight_map`` of a sharded checkpoint's index: tensor name -> file name."""
    from lowbit.io import read_json

    fix = "re-download the model or drop --offload-dir"
    d = read_json(index, ModelError, fix)
    files = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise ModelError(f"{index} has no 'weight_map' of tensor names to files; {fix}")
    return dict(files)


@dataclass(frozen=True)
class ShardSource:
    """Where every tensor of a safetensors checkpoint lives: name -> file."""

    folder: Path
    files: dict[str, str] = field(repr=False)
    dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, folder: Path, dtype: torch.dtype = torch.float32) -> ShardSource:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = _weight_map(index)
        elif (folder / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
                files = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise ModelError(f"{folder} has no model.safetensors (or index); lazy loading reads safetensors "
                             "checkpoints only: drop --offload-dir, or convert the weights to safetensors")
        return cls(folder, files, dtype)

    def read(self, names: list[str], device: str | torch.device = "cpu", stored: frozenset[str] = frozenset()
             ) -> dict[str, torch.Tensor]:
        """Tensors ``names``, each in memory of its own (never a view of a file map), cast to dtype (those in
        ``stored`` keep the checkpoint's dtype where it is a narrower float), each checked finite as it is read
        (`ModelError` naming the first tensor that holds NaN or inf)."""
        from safetensors import safe_open

        missing = [n for n in names if n not in self.files]
        if missing:
            raise ModelError(f"checkpoint {self.folder} has no tensor {missing[0]!r} (and {len(missing) - 1} more); "
                             "its names differ from the model's, so it cannot be loaded lazily: drop --offload-dir")
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.files[n], []).append(n)
        out = {}
        for fname, group in by_file.items():
            with safe_open(str(self.folder / fname), framework="pt") as f:
                for n in group:
                    t = f.get_tensor(n)
                    keep = n in stored and narrower(t.dtype, self.dtype)
                    out[n] = (t.to(self.dtype) if t.dtype != self.dtype and t.is_floating_point() and not keep
                              else t.clone())
                    require_finite([(n, out[n])], f"model {self.folder}", FINITE_FIX, ModelError)
        return {n: t.to(device) for n, t in out.items()}


def load_lazy(folder: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The model of HF folder ``folder`` with its decoder blocks still on meta (see module doc)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = ShardSource.of(folder, dtype)
    config = AutoConfig.from_pretrained(folder)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    prefix = block_path(model) + "."
    outside = [n for n, t in state_tensors(model).items() if t.device.type == "meta" and not n.startswith(prefix)]
    tied = _tied_names(model)
    tables = frozenset(f"{n}.weight" for n in table_modules(model))
    fill(model, source.read([n for n in outside if n not in tied or n in source.files], stored=tables))
    if tied:
        model.tie_weights()
    keep_narrow(model, dtype)
    still = [n for n, t in state_tensors(model).items() if t.device.type == "meta" and not n.startswith(prefix)]
    if still:
        raise ModelError(f"checkpoint {folder} leaves {still[0]!r} unset; it cannot be loaded lazily: drop --offload-dir")
    setattr(model, SOURCE_ATTR, source)
    return model.eval()


def is_lazy(model: nn.Module) -> bool:
    return isinstance(getattr(model, SOURCE_ATTR, None), ShardSource)


def fill(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Put ``tensors`` (names relative to ``module``) in place of its meta parameters / buffers."""
    for name, t in tensors.items():
        parent, _, leaf = name.rpartition(".")
        mod = module.get_submodule(parent) if parent else module
        if leaf in mod._parameters:
            mod._parameters[leaf] = nn.Parameter(t, requires_grad=mod._parameters[leaf].requires_grad)
        else:
            mod._buffers[leaf] = t


def load_block(model: nn.Module, prefix: str, block: nn.Module, device: str | torch.device = "cpu") -> None:
    """Fill ``block`` (full name ``prefix``) from the model's checkpoint, when it is still on meta."""
    source: ShardSource = getattr(model, SOURCE_ATTR)
    names = [n for n, t in state_tensors(block).items() if t.device.type == "meta"]
    if names:
        got = source.read([f"{prefix}.{n}" for n in names], device)
        fill(block, {n: got[f"{prefix}.{n}"] for n in names})


def materialize(model: nn.Module, widen_tables: bool = True) -> None:
    """Load every block still on meta: for methods that need the whole model at once.

    widen_tables: the narrow float tables too, to the compute dtype (a method that needs the whole model may
    rewrite them); False where every block is loaded already and only the marker goes (the end of a walk)."""
    if not is_lazy(model):
        return
    if widen_tables:
        widen(model)
    path = block_path(model)
    for i, block in enumerate(model.get_submodule(path)):
        load_block(model, f"{path}.{i}", block)
    delattr(model, SOURCE_ATTR)


def forget_source(model: nn.Module) -> None:
    """Drop the checkpoint marker without loading anything (blocks written out and released stay on meta)."""
    if is_lazy(model):
        delattr(model, SOURCE_ATTR)


def state_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by name, shared ones under each of their names (what a checkpoint
    and a meta skeleton are compared by)."""
    d: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    d.update(dict(module.named_buffers(remove_duplicate=False)))
    return d


def _tied_names(model: nn.Module) -> set[str]:
    """The output embedding's weight name when the config ties it to the input embedding."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {f"{n}.weight" for n, m in model.named_modules() if m is head}
