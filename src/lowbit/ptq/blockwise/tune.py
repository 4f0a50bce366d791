"""The tuning pass: what SignRound (V1/V2) and GPTQ do on each block, through one `BlockTuner` door.

For each block: FP targets ``Y = block_fp(X_fp)``, tune the block's quantization on
``X_q`` (outputs of the already quantized blocks), freeze (QuantLinears installed),
propagate ``X_q = block_q(X_q)``, ``X_fp = Y``. The caches: the quantized inputs ``X_q``
and one FP buffer that holds ``X_fp`` until the block's targets overwrite it in place
(``Y`` is the next block's ``X_fp``); with ``fp_inputs`` the tuner reads ``X_fp``
itself, so ``Y`` gets a buffer of its own; a tuner that reads neither targets nor
importance (GPTQ) runs the quantized chain alone.

Recipes that quantize inputs: each such Linear gets an `InputQuantizer` before its
block is tuned (``BlockJob.inputs``), so the tuner sees quantized inputs inside the
block, and the installed `QuantLinear` keeps it. Static input scales are the abs-max
of the Linear's FP inputs on the calibration batches, taken by hooks during the pass
that computes the block's FP targets (so a resumed block gets the same scales again).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from lowbit.errors import CheckpointError, ConfigError
from lowbit.formats import QTensor, Scheme
from lowbit.models.activations import activation_stats
from lowbit.models.attention import tuning_attention
from lowbit.models.fused import shared_amax
from lowbit.nn.input_quant import InputQuantizer
from lowbit.nn.kv_quant import kv_paused
from lowbit.nn.quant_experts import QuantStack
from lowbit.plans.plan import Plan
from lowbit.ptq.blockwise.access import (
    block_experts,
    block_layers,
    block_linears,
    block_tensor_scales,
    input_quantizers,
    install,
    layer_shapes,
    quantize_rest,
)
from lowbit.ptq.blockwise.cache import CACHE_DTYPES, gather_rows, map_block, new_cache
from lowbit.ptq.blockwise.loop import Walk, walk_blocks
from lowbit.ptq.blockwise.options import PipelineOptions
from lowbit.ptq.blockwise.shards import Shard, reduce_across, reduce_tensor
from lowbit.ptq.blockwise.store import work_settings
from lowbit.ptq.expert_calib import MIN_TOKENS, ExpertInput, expert_stats, static_input_amax
from lowbit.ptq.methods import RunContext


@dataclass
class BlockJob:
    """Everything a tuner needs for one block.

    layers: full layer name -> (module name relative to the block, scheme); a fused experts
    entry's relative name is its 3-D parameter's (``mlp.experts.gate_up_proj``, see
    `lowbit.ptq.blockwise.access.block_experts`), and the tuner returns a `QuantStack` for it.
    kwargs: the extra arguments the block is called with (mask, position embeddings).
    imp: full layer name -> ``[in]`` importance, when the tuner asked for it.
    inputs: full layer name -> the quantizer of its input (layers whose recipe has one);
    a tuner runs each layer's input through it inside the block.
    """

    index: int
    block: nn.Module
    layers: dict[str, tuple[str, Scheme]]
    x: torch.Tensor
    y: torch.Tensor | None  # FP targets; None for a tuner that does not ask for them
    kwargs: dict[str, Any]
    imp: dict[str, torch.Tensor] | None
    device: torch.device | None = None  # compute device (None = where ``x`` is)
    dtype: torch.dtype | None = None  # the block's activation dtype (None = ``x``'s)
    shard: Shard | None = None  # this process's part of each mini-batch under torch.distributed
    inputs: dict[str, InputQuantizer] = field(default_factory=dict)  # input quantizers of the recipe
    # fused experts tensors whose recipe quantizes inputs: full name -> (input scheme, [E] static abs-max or None)
    expert_inputs: dict[str, ExpertInput] = field(default_factory=dict)
    # full layer name -> the weight tensor scale to quantize with (schemes that have one; fused groups share it)
    tensor_scales: dict[str, torch.Tensor] = field(default_factory=dict)

    def fetch(self, cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` of ``x`` or ``y`` on the compute device in the block's dtype (see `gather_rows`)."""
        return gather_rows(cache, idx, self.device or cache.device, self.dtype or cache.dtype)


class BlockTuner(Protocol):
    """Turns one block's FP Linears into QTensors; returns (name -> QTensor, info dict).

    needs_importance: the FP pass collects each Linear's input sum of squares (``job.imp``).
    needs_targets: the tuner reads the block's FP outputs (``job.y``); a tuner that only
    reads the quantized inputs (GPTQ) sets it False and the FP chain is not run at all
    (one block forward per block saved), unless static input scales need it.
    """

    needs_importance: bool
    needs_targets: bool

    def __call__(self, job: BlockJob) -> tuple[dict[str, QTensor], dict[str, float]]: ...


def quantize_blockwise(model: nn.Module, plan: Plan, tuner: BlockTuner, settings: Mapping[str, Any],
                       ctx: RunContext, options: PipelineOptions | None = None,
                       on_block: Callable[[int], None] | None = None) -> list[dict[str, float]]:
    """Quantize ``model`` in place block by block; returns per-block info (loss, seconds).

    settings: everything about the method that determines the result (method, config);
    stored in the work folder with the plan and ``options`` so a resume with different
    settings is refused. ctx: the run's context, whole (calibration tokens, device, work
    and offload folders, cache placement, progress). on_block: called with the block index
    after each block is saved (tests interrupt here).
    """
    options = options or PipelineOptions()
    record = work_settings(settings, plan, options, model, ctx.calib) if ctx.calib is not None else {}
    task = TunePass(plan, tuner, options)
    return walk_blocks(model, task, record, ctx, options.chunk, on_block)


class PlannedBlockPass:
    """What the passes that store each block's planned layers as QTensors share (`TunePass`, data-free RTN's
    `lowbit.ptq.blockwise.rounding.RoundPass`): the plan's layers of block ``i``, the CPU as the results' home,
    and their packing into and out of the work folder, so a resumed walk reads what either pass wrote alike."""

    plan: Plan
    walk: Walk

    def layers(self, i: int) -> dict[str, tuple[str, Scheme]]:
        return block_layers(self.plan, self.walk.names[id(self.walk.blocks[i])])

    def home(self, i: int) -> torch.device:
        return torch.device("cpu")

    def decode(self, i: int, raw: Mapping[str, torch.Tensor], path: Path) -> dict[str, QTensor]:
        block, layers = self.walk.blocks[i], self.layers(i)
        return unpack_qtensors(raw, path, layers, layer_shapes(block, layers))  # type: ignore[return-value]

    def pack(self, result: Mapping[str, QTensor]) -> dict[str, torch.Tensor]:
        return pack_qtensors(result)


class TunePass(PlannedBlockPass):
    """The `BlockPass` of the tuning methods (see the module doc)."""

    desc = "ptq blocks"
    changes_float = False

    def __init__(self, plan: Plan, tuner: BlockTuner, options: PipelineOptions) -> None:
        self.plan, self.tuner, self.options = plan, tuner, options
        self.cache_dtype = CACHE_DTYPES[options.cache_dtype]
        self.x_fp: torch.Tensor | None = None
        self.x_q: torch.Tensor | None = None
        self.y: torch.Tensor | None = None
        self.inputs: dict[str, InputQuantizer] = {}
        self.expert_inputs: dict[str, ExpertInput] = {}

    def begin(self, walk: Walk, x: torch.Tensor) -> None:
        self.walk = walk
        self.x_fp, self.x_q = x, None
        if not self.options.fp_inputs and not _tracks_fp(self.tuner, self.plan):
            self.x_fp, self.x_q = None, x  # only the quantized chain is needed: the captured inputs become X_q
        elif not self.options.fp_inputs:
            self.x_q = new_cache(x.shape, x.dtype, x.device, walk.device)
            self.x_q.copy_(x)

    def step(self, i: int, block: nn.Module, saved: dict[str, QTensor] | None
             ) -> tuple[dict[str, QTensor], dict[str, float]]:
        w, plan, tuner = self.walk, self.plan, self.tuner
        layers = self.layers(i)
        linears = block_linears(block, layers)  # experts tensors: no hooks, tensor scales or input quantizers here
        want_imp = tuner.needs_importance and saved is None
        static = [n for n in linears if plan[n].needs_calibration]
        hooked = {n: block.get_submodule(r) for n, (r, _) in linears.items() if want_imp or n in static}
        kinds = ("sumsq",) * want_imp + ("absmax",) * bool(static)
        ex_in, ex_static = _expert_input_layers(block, layers, plan)
        all_experts, min_tokens = _expert_calibration(tuner)
        x_fp, x_q = self.x_fp, self.x_q
        x_in = x_q if x_q is not None else x_fp
        # the targets overwrite X_fp in place, unless the tuner reads X_fp itself
        y = x_fp if x_q is not None else new_cache(x_fp.shape, x_fp.dtype, x_fp.device, w.device)  # type: ignore[union-attr]
        with torch.no_grad(), activation_stats(hooked, kinds) as h, tuning_attention(w.model), kv_paused(w.model), \
                expert_stats(ex_static, ("absmax",), all_experts=all_experts) as est:
            if y is not None:  # FP targets: float keys / values too (the tuned chain runs with the quantized KV cache)
                map_block(block, x_fp, y, w.kwargs, self.options.chunk, w.device, w.dtype, w.shard)  # type: ignore[arg-type]
        self.x_fp, self.y = None, y
        amax = shared_amax({n: a.amax() for n, a in reduce_across(h.result("absmax"), w.shard, "max").items()
                            if n in static}) if static else {}
        self.inputs = input_quantizers(plan, linears, amax, w.device)
        for st in est.values():
            st.reduce(lambda t, op: reduce_tensor(t, w.shard, op))
        ex_amax = static_input_amax(est, {m: tuple(n.rsplit(".", 1)[1] for n in ex_in
                                                   if n.rsplit(".", 1)[0] == m and plan[n].needs_calibration)
                                          for m in est}, min_tokens)
        self.expert_inputs = {n: (plan[n].input, ex_amax.get(n)) for n in ex_in}  # type: ignore[misc]
        if saved is not None:
            return saved, {"resumed": 1.0}
        # summed over the ranks in float64 and cast once: the scales searched from it must not
        # depend on how many processes share the samples
        imp = ({n: t.float() for n, t in reduce_across(h.result("sumsq", torch.float64), w.shard).items()}
               if want_imp else None)
        job = BlockJob(i, block, layers, x_in, y, w.kwargs, imp, w.device, w.dtype, w.shard, self.inputs,  # type: ignore[arg-type]
                       self.expert_inputs, block_tensor_scales(block, linears))
        with tuning_attention(w.model):
            return tuner(job)

    def finish(self, i: int, block: nn.Module, result: Mapping[str, QTensor]) -> None:
        w = self.walk
        for name, (scheme, amax) in self.expert_inputs.items():  # experts keep the input quantization they were tuned with
            result[name].with_input(scheme, amax)  # type: ignore[attr-defined]
        install(block, self.layers(i), result, w.device, self.inputs)  # Linears and experts modules alike
        if self.x_q is not None:
            with torch.no_grad(), tuning_attention(w.model):
                map_block(block, self.x_q, self.x_q, w.kwargs, self.options.chunk, w.device, w.dtype, w.shard)
        self.x_fp, self.y = self.y, None

    def end(self) -> None:
        quantize_rest(self.walk.model, self.plan, self.walk.names, self.walk.blocks)


def _expert_input_layers(block: nn.Module, layers: Mapping[str, tuple[str, Scheme]], plan: Plan
                         ) -> tuple[list[str], dict[str, nn.Module]]:
    """(the block's planned experts tensors whose recipe quantizes inputs, full name -> experts module of those with
    static input scales to calibrate on the FP inputs)."""
    experts = {n: t for n, t in block_experts(block, layers).items() if plan[n].input is not None}
    static = {n.rsplit(".", 1)[0]: block.get_submodule(t.module) for n, t in experts.items()
              if plan[n].needs_calibration}
    return list(experts), static


def _expert_calibration(tuner: BlockTuner) -> tuple[bool, int]:
    """(all-experts calibration, token threshold) for the experts' static input scales: the method's own settings
    where it has them (GPTQ's ``all_experts`` / ``min_expert_tokens``), else the defaults RTN uses."""
    s = getattr(tuner, "settings", None)
    return bool(getattr(s, "all_experts", True)), int(getattr(s, "min_expert_tokens", MIN_TOKENS))


def _tracks_fp(tuner: BlockTuner, plan: Plan) -> bool:
    """Whether the FP chain (``X_fp``, targets ``Y``) must run: the tuner reads targets or importance, or a
    recipe's static input scale is taken from the FP inputs."""
    return (tuner.needs_targets or tuner.needs_importance
            or any(r.needs_calibration for _, r in plan.items()))


_CALIB = ("routed", "statistics_tokens")  # a QuantStack's calibration counts, kept in the work folder beside it


def pack_qtensors(qts: Mapping[str, QTensor | QuantStack]) -> dict[str, torch.Tensor]:
    """A block's tuned layers as the tensors its work-folder file holds (``layer::part``; an experts tensor's
    parts stacked over its experts, with its calibration counts as ``layer::calib.routed`` ...)."""
    out = {f"{n}::{k}": v.detach().cpu().contiguous() for n, q in qts.items() for k, v in q.pack().items()}
    for n, q in qts.items():
        calib = getattr(q, "calibration", None)
        if calib is not None:
            out |= {f"{n}::calib.{k}": torch.tensor(calib[k], dtype=torch.int64) for k in _CALIB}
            out[f"{n}::calib.all_experts"] = torch.tensor(int(calib["all_experts"]))
    return out


def unpack_qtensors(raw: Mapping[str, torch.Tensor], path: Path, layers: Mapping[str, tuple[str, Scheme]],
                    shapes: Mapping[str, tuple[int, ...]]) -> dict[str, QTensor | QuantStack]:
    """`pack_qtensors` undone for the block's planned ``layers``; anything else is an error naming ``path``."""
    out: dict[str, QTensor | QuantStack] = {}
    for name, (_rel, scheme) in layers.items():
        d = {k.split("::", 1)[1]: v for k, v in raw.items() if k.split("::", 1)[0] == name}
        if not d:
            raise ConfigError(f"{path} lacks layer {name}; delete the work folder and rerun")
        calib = {k.removeprefix("calib."): d.pop(k) for k in list(d) if k.startswith("calib.")}
        shape = shapes[name]
        try:
            if len(shape) == 3:
                stack = QuantStack.from_packed(d, shape[0], (shape[1], shape[2]), scheme)
                if calib:
                    stack.calibration = {**{k: calib[k].tolist() for k in _CALIB},
                                         "all_experts": bool(calib["all_experts"])}
                out[name] = stack
            else:
                out[name] = QTensor.from_packed(d, shape, scheme)  # type: ignore[arg-type]
        except (CheckpointError, KeyError) as e:
            raise CheckpointError(f"{path}, layer {name}: {e}; delete the work folder and rerun") from None
    return out


