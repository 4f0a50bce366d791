"""Model access for the block-wise engine: which planned layers a decoder block holds, and swapping them in.

Everything here reads or rewrites one block of a model; nothing keeps state between
blocks. The walk itself (`lowbit.ptq.blockwise.loop`) decides when each is called.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lowbit.errors import ConfigError
from lowbit.formats import QTensor, Scheme
from lowbit.models.experts import ExpertTensor, expert_tensors
from lowbit.models.fused import shared_tensor_scales
from lowbit.models.narrow_tables import widen
from lowbit.nn import QuantLinear, replace_linears, set_module
from lowbit.nn.input_quant import InputQuantizer
from lowbit.nn.input_rotation import rotation_of
from lowbit.nn.quant_experts import QuantExperts, QuantStack
from lowbit.plans.plan import Plan

# one block's planned layers (full name -> (relative name, scheme)) and their (out, in) shapes
BlockLayout = tuple[Mapping[str, tuple[str, Scheme]], Mapping[str, tuple[int, int]]]


def module_names(model: nn.Module) -> dict[int, str]:
    return {id(m): n for n, m in model.named_modules()}


def block_layers(plan: Plan, block_name: str) -> dict[str, tuple[str, Scheme]]:
    """Plan entries inside one block: full name -> (relative name, weight scheme)."""
    pre = block_name + "."
    return {n: (n[len(pre):], r.weight) for n, r in plan.items() if n.startswith(pre)}


def block_experts(block: nn.Module, layers: Mapping[str, tuple[str, Scheme]]) -> dict[str, ExpertTensor]:
    """The planned layers that are fused experts tensors (full name -> the tensor, named relative to the block)."""
    tensors = expert_tensors(block)
    return {n: tensors[rel] for n, (rel, _) in layers.items() if rel in tensors}


def block_linears(block: nn.Module, layers: Mapping[str, tuple[str, Scheme]]) -> dict[str, tuple[str, Scheme]]:
    """The planned layers that are Linears (every entry but the fused experts tensors)."""
    experts = block_experts(block, layers)
    return {n: v for n, v in layers.items() if n not in experts}


def block_tensor_scales(block: nn.Module, layers: Mapping[str, tuple[str, Scheme]]) -> dict[str, torch.Tensor]:
    """Weight tensor scales of a block's planned layers from their float weights: a fused group's parts share one."""
    layers = block_linears(block, layers)  # experts take one per expert matrix, as RTN gives them
    weights = {n: block.get_submodule(rel).weight for n, (rel, _) in layers.items()}
    return shared_tensor_scales(weights, {n: s for n, (_, s) in layers.items()})


def input_quantizers(plan: Plan, layers: Mapping[str, Any], amax: Mapping[str, torch.Tensor],
                     device: torch.device) -> dict[str, InputQuantizer]:
    """An `InputQuantizer` per layer of ``layers`` whose recipe quantizes its input, on ``device``."""
    return {n: InputQuantizer(plan[n].input, amax.get(n)).to(device)  # type: ignore[arg-type]
            for n in layers if plan[n].input is not None}


def run_block(block: nn.Module, x: torch.Tensor, kwargs: Mapping[str, Any], chunk: int) -> torch.Tensor:
    """``block(x)`` in chunks of samples (outputs of tuple-returning blocks unwrapped)."""
    outs = []
    for part in x.split(chunk):
        y = block(part, **kwargs)
        outs.append(y[0] if isinstance(y, tuple) else y)
    return torch.cat(outs)


def block_dtype(block: nn.Module) -> torch.dtype:
    """The dtype the block computes in (its first floating parameter's)."""
    for t in [*block.parameters(), *block.buffers()]:
        if t.is_floating_point() and t.device.type != "meta":
            return t.dtype
    return torch.float32


def layer_shapes(block: nn.Module, layers: Mapping[str, tuple[str, Scheme]]) -> dict[str, tuple[int, ...]]:
    """(out, in) of each planned Linear, (experts, out, in) of each experts tensor, of the block (read from the
    modules, so a block on meta answers too)."""
    experts = block_experts(block, layers)
    out: dict[str, tuple[int, ...]] = {n: (t.count, t.out_features, t.in_features) for n, t in experts.items()}
    for n, (rel, _) in layers.items():
        if n not in experts:
            m = block.get_submodule(rel)
            out[n] = (m.out_features, m.in_features)
    return out


def install(block: nn.Module, layers: Mapping[str, tuple[str, Scheme]], qts: Mapping[str, QTensor],
            device: torch.device, inputs: Mapping[str, InputQuantizer] | None = None) -> None:
    """Swap the block's Linears for frozen QuantLinears holding the tuned weights, on ``device``; its planned
    fused experts modules for `QuantExperts` holding the tuned `QuantStack` s (``qts`` holds those for them).

    A resumed block's codes were read onto the CPU; tuned ones are already on ``device``.
    inputs: the layers' input quantizers (the ones the tuning used).
    """
    experts = block_experts(block, layers)
    by_module: dict[str, dict[str, QuantStack]] = {}
    for name, t in experts.items():
        by_module.setdefault(t.module, {})[t.param] = qts[name]  # type: ignore[assignment]
    for rel, stacks in by_module.items():
        set_module(block, rel, QuantExperts(block.get_submodule(rel), {p: s.to(device) for p, s in stacks.items()}))
    for name, (rel, _) in layers.items():
        if name in experts:
            continue
        old = block.get_submodule(rel)
        bias = getattr(old, "bias", None)
        new = QuantLinear(qts[name], None if bias is None else bias.detach(),
                          input_quant=(inputs or {}).get(name), input_rotation=rotation_of(old))
        set_module(block, rel, new.to(device))


def quantize_rest(model: nn.Module, plan: Plan, names: Mapping[int, str], blocks: nn.ModuleList) -> None:
    """Planned layers outside the decoder blocks (e.g. lm_head) get plain RTN."""
    prefixes = tuple(names[id(b)] + "." for b in blocks)
    rest = {n: r for n, r in plan.items() if not n.startswith(prefixes)}
    if rest:
        static = [n for n in rest if plan[n].needs_calibration]
        if static:
            raise ConfigError(f"{static[0]} lies outside the decoder blocks, where the block-wise pipeline cannot "
                              "calibrate static input scales; give it a dynamic input scheme (e.g. fp8, mxfp4) "
                              "or none")
        for n in rest:  # a table kept in the checkpoint's dtype is rounded from its float32 values
            widen(model.get_submodule(n))
        weights = {n: model.get_submodule(n).weight for n in rest}
        replace_linears(model, rest, tensor_scales=shared_tensor_scales(weights, {n: r.weight for n, r in rest.items()}))
