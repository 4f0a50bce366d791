"""The block-wise PTQ pipeline shared by every tuning method (SignRound, SignRoundV2, ...).

capture the inputs of decoder block 0 (a forward pre-hook that stops the model there),
then for each block: FP targets ``Y = block_fp(X_fp)``, tune the block's quantization on
``X_q`` (outputs of the already quantized blocks), freeze, propagate ``X_q = block_q(X_q)``,
``X_fp = Y``. Only the block being tuned sits on the compute device; with an offload
folder the FP weights of all other blocks live on disk (safetensors, one file per block)
so peak memory grows with one block plus the cached activations.

After each block its quantized weights are written atomically to the work folder. A
rerun with the same settings replays the finished blocks (forward passes only, the same
chunking and order, hence bit-identical activations) and continues with the next one;
a rerun with different settings is refused rather than mixing two runs.

Recipes that quantize inputs: each such Linear gets an `InputQuantizer` before its
block is tuned (``BlockJob.inputs``), so the tuner sees quantized inputs inside the
block, and the installed `QuantLinear` keeps it. Static input scales are the abs-max
of the Linear's FP inputs on the calibration batches, taken by hooks during the pass
that computes the block's FP targets (so a resumed block gets the same scales again).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from lowbit.formats import QTensor, Scheme
from lowbit.formats.plan import Plan
from lowbit.models.activations import activation_stats
from lowbit.models.attention import tuning_attention
from lowbit.models.fused import shared_amax
from lowbit.models.layers import decoder_blocks
from lowbit.models.lazy import is_lazy, materialize
from lowbit.models.placement import check_device
from lowbit.nn.input_quant import InputQuantizer
from lowbit.ptq.blockwise import shards
from lowbit.ptq.blockwise.access import (
    BlockLayout,
    block_dtype,
    block_layers,
    block_tensor_scales,
    input_quantizers,
    install,
    layer_shapes,
    module_names,
    quantize_rest,
)
from lowbit.ptq.blockwise.cache import CACHE_DTYPES, gather_rows, map_block, new_cache
from lowbit.ptq.blockwise.capture import capture_inputs
from lowbit.ptq.blockwise.offload import block_loader
from lowbit.ptq.blockwise.options import PipelineOptions
from lowbit.ptq.blockwise.shards import Shard, check_world, rank_folder, reduce_across
from lowbit.ptq.blockwise.store import open_workdir, resume_point, work_settings


@dataclass
class BlockJob:
    """Everything a tuner needs for one block.

    layers: full layer name -> (module name relative to the block, scheme).
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


def quantize_blockwise(model: nn.Module, plan: Plan, calib: torch.Tensor, tuner: BlockTuner,
                       settings: Mapping[str, Any], options: PipelineOptions | None = None,
                       workdir: str | Path | None = None, progress: bool = True,
                       on_block: Callable[[int], None] | None = None) -> list[dict[str, float]]:
    """Quantize ``model`` in place block by block; returns per-block info (loss, seconds).

    settings: everything that determines the result (method, config); stored in the
    work folder so a resume with different settings is refused.
    on_block: called with the block index after each block is saved (tests interrupt here).

    Caches: the quantized inputs ``X_q`` and one FP buffer that holds ``X_fp`` until the
    block's targets overwrite it in place (``Y`` is the next block's ``X_fp``); with
    ``fp_inputs`` the tuner reads ``X_fp`` itself, so ``Y`` gets a buffer of its own.
    Under torch.distributed (torchrun) every rank computes its share of the samples in
    the forward passes, the caches are all-gathered, and only rank 0 writes the work folder.
    """
    options = options or PipelineOptions()
    shard = shards.current_shard()
    check_world(len(calib), shard)
    blocks = decoder_blocks(model)
    names = module_names(model)
    device = check_device(options.device) or torch.device("cpu")
    where = device if options.cache_device == "device" else torch.device("cpu")
    x, kwargs = capture_inputs(model, blocks[0], calib, device, CACHE_DTYPES[options.cache_dtype], where, shard)
    dtype = block_dtype(blocks[0])
    wd = open_workdir(workdir, work_settings(settings, plan, options, model, calib), shard)
    offload = block_loader(model, blocks, rank_folder(options.offload_dir, shard))

    def layout(i: int) -> BlockLayout:
        layers = block_layers(plan, names[id(blocks[i])])
        return layers, layer_shapes(blocks[i], layers)

    start = resume_point(wd, len(blocks), shard, layout)
    x_fp, x_q = x, None
    if not options.fp_inputs and not _tracks_fp(tuner, plan):
        x_fp, x_q = None, x  # only the quantized chain is needed: the captured inputs become X_q
    elif not options.fp_inputs:
        x_q = new_cache(x.shape, x.dtype, x.device, device)
        x_q.copy_(x)
    infos: list[dict[str, float]] = []
    bar = tqdm(range(len(blocks)), desc="ptq blocks", unit="block", disable=not progress or shard.rank != 0)
    for i in bar:
        block = blocks[i]
        layers = block_layers(plan, names[id(block)])
        if offload:
            offload.load(i, block, device)
        block.to(device)
        t0 = time.perf_counter()
        want_imp = tuner.needs_importance and i >= start
        static = [n for n in layers if plan[n].needs_calibration]
        hooked = {n: block.get_submodule(r) for n, (r, _) in layers.items() if want_imp or n in static}
        kinds = ("sumsq",) * want_imp + ("absmax",) * bool(static)
        x_in = x_q if x_q is not None else x_fp
        # the targets overwrite X_fp in place, unless the tuner reads X_fp itself
        y = x_fp if x_q is not None else new_cache(x_fp.shape, x_fp.dtype, x_fp.device, device)
        with torch.no_grad(), activation_stats(hooked, kinds) as h, tuning_attention(model):
            if y is not None:
                map_block(block, x_fp, y, kwargs, options.chunk, device, dtype, shard)
        x_fp = None
        amax = shared_amax({n: a.amax() for n, a in reduce_across(h.result("absmax"), shard, "max").items()
                            if n in static}) if static else {}
        inputs = input_quantizers(plan, layers, amax, device)
        if i < start:
            qts = wd.load_block(i, layers, layer_shapes(block, layers))  # type: ignore[union-attr]
            info: dict[str, float] = {"resumed": 1.0}
        else:
            # summed over the ranks in float64 and cast once: the scales searched from it must not
            # depend on how many processes share the samples
            imp = ({n: t.float() for n, t in reduce_across(h.result("sumsq", torch.float64), shard).items()}
                   if want_imp else None)
            job = BlockJob(i, block, layers, x_in, y, kwargs, imp, device, dtype, shard, inputs,
                           block_tensor_scales(block, layers))
            with tuning_attention(model):
                qts, info = tuner(job)
            if wd and i in wd.damaged:
                info["retuned_damaged"] = 1.0
            if wd and shard.rank == 0:
                wd.save_block(i, qts)
        x_in = None
        install(block, layers, qts, device, inputs)
        if x_q is not None:
            with torch.no_grad(), tuning_attention(model):
                map_block(block, x_q, x_q, kwargs, options.chunk, device, dtype, shard)
        x_fp = y
        block.to("cpu")
        info["seconds"] = time.perf_counter() - t0
        infos.append(info)
        bar.set_postfix({k: f"{v:.3g}" for k, v in info.items() if k in ("loss", "rtn_loss")})
        if on_block is not None and i >= start:
            on_block(i)
    quantize_rest(model, plan, names, blocks)
    if is_lazy(model):
        materialize(model)  # every block is loaded by now: this only drops the marker
    return infos


def _tracks_fp(tuner: BlockTuner, plan: Plan) -> bool:
    """Whether the FP chain (``X_fp``, targets ``Y``) must run: the tuner reads targets or importance, or a
    recipe's static input scale is taken from the FP inputs."""
    return (tuner.needs_targets or tuner.needs_importance
            or any(r.needs_calibration for _, r in plan.items()))
