"""Data-free RTN on the block-wise walk: a lazily loaded model rotated and rounded one block at a time.

Round-to-nearest without calibration data (``--method rtn --no-search``, a scheme's own
``rule=search`` on the weights alone included) reads no activations, and a model bigger
than memory already has a path for it that never builds the model (``--stream``). What
``--stream`` does not do is the rotation (``--rotate``, ``--rotate-online``,
``--rotate-keep``), and until this pass such a run loaded the whole float model. The
rotation is data-free too and needs one block at a time (`lowbit.ptq.block_prep`), so this
pass puts plain rounding on the same walk the calibrated methods run on: each block is read
from the checkpoint, turned and folded (`block_prep.LazyRotation`, the functions
`rotate_model` runs), checked against its planned scales' range, rounded (the same
`lowbit.formats.quantize` call, with the same fused-group tensor scales, that the
whole-model path's `replace_linears` makes), written out and released; the tables are
turned before block 0 and the lm_head after the last block, as for the calibrated methods.

Why the walk and not the streaming engine: the rotation is written over modules (a block's
layout names the norms folded into their readers; ``--rotate-keep`` ranks channels by every
block's norms; ``--rotate-online`` attaches a run-time Hadamard that the saved layer keeps;
the rotation is checked by running a block), while the streaming engine sees tensor names
and never builds a module. Taking rotation into it would mean a second implementation of
the rotation per tensor, kept bit-identical by hand; the walk reuses the one there is and
brings resume (``--workdir``), released blocks and the checkpoint writer with it. The cost
against ``--stream``: the tables are held through the walk (the embedding in float32 since
it is turned before block 0, the lm_head in the checkpoint's dtype), one block in float32
instead of one tensor (`lowbit.ptq.memory`).

No calibration data, and so no captures: the walk is handed the whole-model path's
rotation probe (`lowbit.ptq.rotation.probe_ids`: 16 seeded token ids, one sample) in their
place. Its states entering block 0 are what block 0's rotation is checked on (the
whole-model path checks the logits of the same ids) and give the blocks' kwargs; nothing
is pushed through the blocks after that. The work folder records that probe as its
tokens, so a resume is the same run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lowbit.errors import ConfigError
from lowbit.formats import QTensor, quantize
from lowbit.models.experts import expert_tensors
from lowbit.plans.plan import Plan
from lowbit.ptq.blockwise.access import (
    block_linears,
    block_tensor_scales,
    input_quantizers,
    install,
    quantize_rest,
)
from lowbit.ptq.blockwise.loop import Walk, walk_blocks
from lowbit.ptq.blockwise.options import PipelineOptions
from lowbit.ptq.blockwise.release import give_back_free_memory
from lowbit.ptq.blockwise.store import work_settings
from lowbit.ptq.blockwise.tune import PlannedBlockPass
from lowbit.ptq.methods import RunContext
from lowbit.ptq.rotation import probe_ids

OPTIONS = PipelineOptions(chunk=1)  # what the work folder records of the walk (one probe sample, never chunked)


def round_blockwise(model: nn.Module, plan: Plan, settings: Mapping[str, Any], ctx: RunContext,
                    on_block: Callable[[int], None] | None = None) -> list[dict[str, float]]:
    """Round ``plan``'s layers of a lazily loaded ``model`` to nearest, block by block, without data; per-block info.

    settings: the method's record (what the work folder keeps beside the plan). ctx: the run's context without
    calibration tokens; its ``pre`` (the rotation, `lowbit.ptq.block_prep.PreSteps`) runs on each block as it is
    read. Fused experts tensors are refused (the data-free MoE path is ``--stream``, or the whole model).
    """
    if ctx.calib is not None:
        raise ConfigError("data-free rounding block by block reads no calibration data; with data, RTN runs "
                          "`lowbit.ptq.rtn.rtn_blockwise` (its importance and static input scales)")
    if ctx.pre is not None and ctx.pre.awq is not None:
        raise ConfigError("AWQ searches its scales on calibration data: pass calibration batches")
    fused = expert_tensors(model)
    experts = [n for n in plan if n in fused]
    if experts:
        raise ConfigError(f"RTN block by block does not round fused experts tensors ({experts[0]}); quantize this "
                          "model without --offload-dir (the whole model), or without --rotate and with --stream")
    probe = probe_ids(model)
    record = work_settings(settings, plan, OPTIONS, model, probe)
    ctx = dataclasses.replace(ctx, calib=probe)
    infos = walk_blocks(model, RoundPass(plan), record, ctx, OPTIONS.chunk, on_block)
    if ctx.pre is not None and "rotation" in ctx.pre.info:
        ctx.pre.info["rotation"]["probe"] = ("block 0: its output before and after the rotation, on the whole-model "
                                             "path's probe (16 seeded token ids; no calibration data)")
    return infos


class RoundPass(PlannedBlockPass):
    """The `lowbit.ptq.blockwise.BlockPass` of data-free RTN (see the module doc): each block's planned Linears
    rounded to nearest, installed as QuantLinears, nothing propagated."""

    desc = "rtn blocks"
    changes_float = False
    cache_dtype = None

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def begin(self, walk: Walk, x: torch.Tensor) -> None:
        self.walk = walk  # ``x``: the probe's states, read by the rotation's check (PrepPass) and dropped

    def step(self, i: int, block: nn.Module, saved: dict[str, QTensor] | None
             ) -> tuple[dict[str, QTensor], dict[str, float]]:
        if saved is not None:
            return saved, {"resumed": 1.0}
        layers = self.layers(i)
        scales = block_tensor_scales(block, layers)  # a fused group's parts share one, as the whole model's do
        out: dict[str, QTensor] = {}
        with torch.no_grad():
            for name, (rel, scheme) in layers.items():
                out[name] = quantize(block.get_submodule(rel).weight.detach(), scheme, None, scales.get(name))
                give_back_free_memory()  # a search rule's candidates: freed chunks glibc would keep (release.py)
        return out, {}

    def finish(self, i: int, block: nn.Module, result: Mapping[str, QTensor]) -> None:
        layers = self.layers(i)
        inputs = input_quantizers(self.plan, block_linears(block, layers), {}, self.walk.device)  # dynamic ones only
        install(block, layers, result, self.walk.device, inputs)

    def end(self) -> None:
        quantize_rest(self.walk.model, self.plan, self.walk.names, self.walk.blocks)
