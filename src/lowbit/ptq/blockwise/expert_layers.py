"""Fused experts tensors among a block's planned layers: telling them apart, their shapes, saving and freezing them.

A plan entry such as ``model.layers.3.mlp.experts.gate_up_proj`` names a 3-D parameter of
a fused experts module, not a Linear (`lowbit.models.experts`). The tuning pass hands it to
the tuner with the Linears (relative name ``mlp.experts.gate_up_proj``); the tuner returns
a `QuantStack` for it (E per-expert `QTensor` s, stored as ``name::part`` with the expert
axis first, like a Linear's parts), and the engine freezes each experts module into one
`QuantExperts` holding the stacks of its planned parameters. Statistics hooks, tensor
scales and input quantizers of the pass concern the Linears only (``linear_layers``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from lowbit.errors import CheckpointError, ConfigError
from lowbit.formats import Scheme
from lowbit.models.experts import ExpertTensor, expert_tensors
from lowbit.nn import set_module
from lowbit.nn.quant_experts import QuantExperts, QuantStack

Layers = Mapping[str, tuple[str, Scheme]]


def block_experts(block: nn.Module, layers: Layers) -> dict[str, ExpertTensor]:
    """The entries of ``layers`` (full name -> (relative name, scheme)) that are fused experts tensors of ``block``.

    ``ExpertTensor.module`` is relative to the block. Read from the shapes, so a block whose
    weights are on the meta device (offloaded) answers too.
    """
    tensors = expert_tensors(block)
    return {n: tensors[rel] for n, (rel, _) in layers.items() if rel in tensors}


def linear_layers(block: nn.Module, layers: Layers) -> dict[str, tuple[str, Scheme]]:
    """``layers`` without the fused experts tensors: the Linears hooks, tensor scales and QuantLinears concern."""
    experts = block_experts(block, layers)
    return {n: v for n, v in layers.items() if n not in experts}


def unpack_stacks(raw: Mapping[str, torch.Tensor], path: Path, experts: Mapping[str, ExpertTensor],
                  layers: Layers) -> dict[str, QuantStack]:
    """The saved ``name::part`` tensors of each experts entry as its `QuantStack` (an error naming ``path`` if not)."""
    out = {}
    for name, t in experts.items():
        d = {k.split("::", 1)[1]: v for k, v in raw.items() if k.split("::", 1)[0] == name}
        if not d:
            raise ConfigError(f"{path} lacks experts tensor {name}; delete the work folder and rerun")
        try:
            out[name] = QuantStack.from_packed(d, t.count, (t.out_features, t.in_features), layers[name][1])
        except CheckpointError as e:
            raise CheckpointError(f"{path}, experts tensor {name}: {e}; delete the work folder and rerun") from None
    return out


def install_experts(block: nn.Module, experts: Mapping[str, ExpertTensor], stacks: Mapping[str, QuantStack],
                    device: torch.device) -> None:
    """Replace each float experts module of the block by a `QuantExperts` holding its tuned stacks, on ``device``."""
    by_module: dict[str, dict[str, QuantStack]] = {}
    for name, t in experts.items():
        by_module.setdefault(t.module, {})[t.param] = stacks[name]
    for module, parts in by_module.items():
        float_module = block.get_submodule(module)
        set_module(block, module, QuantExperts(float_module, {p: s.to(device) for p, s in parts.items()}).to(device))
