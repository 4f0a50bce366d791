"""AWQ: activation-aware per-input-channel scales, folded into the weights before any method quantizes.

A Linear's input channels that carry large activations matter most; scaling such a
channel's weights up by ``s_j`` (and its input down by ``s_j``, which the preceding norm
or Linear absorbs exactly) gives them more of the quantization grid. Per group of
Linears that read one tensor, AWQ tries ``s = mean|x|^a / mean|w|^(1-a)`` (``duo``; plain
``mean|x|^a`` without) for ``a`` on a grid in [0, 1), normalised to a geometric mean of
1, and keeps the ``s`` whose quantized layers have the smallest output error on the
calibration inputs. A candidate is scored where its error shows:

* the Linears after a norm (q/k/v, gate/up) by the output of the attention's o_proj /
  the MLP's down_proj: the block runs up to that module (and stops there) on the first
  ``samples`` calibration samples, with the group's weights replaced by
  ``Q(W diag(s)) diag(s)^-1`` (the scaled, quantized weights in the original
  coordinates: the folded model's function, nothing folded yet), against the float
  block. A per-layer error is not enough here: on models with outlier channels it
  can fall for q/k while the attention output gets worse;
* a single Linear after a Linear (down after up, o after v) by its own output error
  ``tr(E H E^T)``, ``E = Q(W diag(s)) diag(s)^-1 - W``, ``H = X^T X`` over all
  calibration tokens: exact for a linear layer, and one small GEMM per candidate.

The identity is always a candidate, so a group is never scaled to a larger error.

Scaled pairs in llama-style blocks (`lowbit.models.structure`): input_layernorm -> q/k/v,
post_attention_layernorm -> gate/up, up -> down, and v -> o when their widths agree (not
with grouped-query attention, where v has fewer output channels than o has inputs).

This is a pre-step: the model stays float, each block keeps its function (checked), and
then RTN, GPTQ or SignRoundV2 quantizes the scaled weights. It walks the blocks once on
the block-wise engine (`lowbit.ptq.blockwise`, as the methods do: one block on the
compute device, offload folder, resume from a work folder, torchrun shards), with each
block's inputs taken from the blocks before it: float (``inputs="fp"``) or
round-to-nearest quantized with the plan's schemes (``"quantized"``, the inputs a
quantized model really gives).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowbit.configs import check_fields
from lowbit.errors import CheckpointError, ConfigError, ModelError
from lowbit.formats import Scheme, qdq
from lowbit.formats.groups import to_groups
from lowbit.models.activations import activation_stats
from lowbit.models.structure import BlockLayout, block_layout
from lowbit.nn.input_rotation import rotation_of
from lowbit.plans.plan import Plan
from lowbit.ptq.blockwise import (
    Walk,
    fingerprint,
    map_block,
    new_cache,
    reduce_across,
    reduce_tensor,
    run_block,
    walk_blocks,
)
from lowbit.ptq.blockwise.release import give_back_free_memory
from lowbit.ptq.methods import RunContext

INPUTS = ("fp", "quantized")
CHUNK = 8
GroupResult = tuple["torch.Tensor | None", float]  # one scale group's scales (None = the identity) and error ratio


class _Stop(Exception):
    """Ends a block forward once the probed module's output is recorded."""


@dataclass(frozen=True)
class AWQSettings:
    """grid: exponents ``a = k / grid`` tried; duo: divide by the weights' mean magnitude too;
    samples: calibration samples a norm group's candidates are scored on; inputs: see module doc."""

    grid: int = 20
    duo: bool = True
    samples: int = 8
    inputs: str = "fp"

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "AWQ setting")
        if self.grid < 1:
            raise ConfigError(f"AWQ grid must be >= 1, got {self.grid}")
        if self.samples < 1:
            raise ConfigError(f"AWQ samples must be >= 1, got {self.samples}")
        if self.inputs not in INPUTS:
            raise ConfigError(f"AWQ inputs must be one of {INPUTS}, got {self.inputs!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ScaleGroup:
    """One producer (a norm or a Linear) and the Linears reading its output (relative names).

    probe: the module whose output scores a candidate (None: the single layer's own output, through ``X^T X``).
    """

    prev: str
    layers: tuple[str, ...]
    probe: str | None = None


def scale_groups(block: nn.Module, layout: BlockLayout) -> list[ScaleGroup]:
    """The block's scale groups; a group whose scaled Linears rotate their input online is left out
    (a per-channel scale cannot pass through the rotation: ``(x / s) R`` is not ``(x R) / s``)."""
    groups = [ScaleGroup(layout.attn_norm, layout.attn_in, layout.attn_out)]
    if layout.value is not None:
        v, o = block.get_submodule(layout.value), block.get_submodule(layout.attn_out)
        if v.out_features == o.in_features:  # grouped-query attention: v is narrower than o's input
            groups.append(ScaleGroup(layout.value, (layout.attn_out,)))
    groups.append(ScaleGroup(layout.mlp_norm, layout.mlp_in, layout.mlp_out))
    if layout.up is not None:
        groups.append(ScaleGroup(layout.up, (layout.mlp_out,)))
    return [g for g in groups if all(rotation_of(block.get_submodule(n)) is None for n in g.layers)]


def awq_scale(model: nn.Module, plan: Plan, calib: torch.Tensor, settings: AWQSettings | None = None,
              **context: Any) -> dict[str, Any]:
    """Search and fold AWQ scales into ``model`` (float, in place), block by block; returns a summary.

    context: the other `RunContext` fields (device, workdir, offload_dir, cache_device, progress).
    """
    return awq_run(model, plan, settings or AWQSettings(), RunContext(calib=calib, **context))


def awq_run(model: nn.Module, plan: Plan, settings: AWQSettings, ctx: RunContext) -> dict[str, Any]:
    """`awq_scale` under a run context: the block-wise engine walks the blocks (offload, resume, shards).

    With a work folder, each block's scales go to ``WORKDIR/awq`` (beside the method's own
    blocks), so an interrupted run replays them instead of searching again.
    """
    if ctx.calib is None or ctx.calib.numel() == 0:
        raise ConfigError("AWQ needs calibration batches (LongTensor [nsamples, seqlen])")
    t0 = time.perf_counter()
    task = AWQPass(plan, settings, block_layout(model, "AWQ"))
    ctx = dataclasses.replace(ctx, workdir=awq_workdir(ctx.workdir))
    walk_blocks(model, task, awq_record(model, plan, settings, ctx.calib), ctx, CHUNK)
    gains, scaled = task.gains, task.scaled
    return {**settings.to_dict(), "groups": len(gains), "scaled": sum(scaled),
            "mean_error_ratio": round(sum(gains) / max(len(gains), 1), 4), "seconds": round(time.perf_counter() - t0, 2)}


def awq_record(model: nn.Module, plan: Plan, settings: AWQSettings, calib: torch.Tensor) -> dict[str, Any]:
    """Everything that decides AWQ's scales, as its work folder's ``run.json`` records it (and the early check)."""
    return {"step": "awq", "config": settings.to_dict(), "plan": plan.to_dict(), **fingerprint(model, calib)}


def awq_workdir(workdir: str | Path | None) -> str | None:
    """AWQ's own work folder inside a run's ``--workdir`` (beside the method's blocks)."""
    return None if workdir is None else str(Path(workdir) / "awq")


class AWQPass:
    """AWQ's `BlockPass`: per block, the float pass with statistics, the search, the fold, the check.

    The inputs of the next block are the float outputs (``inputs="fp"``) or the outputs
    with the block's planned Linears round-to-nearest quantized (``"quantized"``). A
    block's result (per scale group: its scales, or none, and the error ratio) is what the
    work folder keeps; a resumed block folds its saved scales instead of searching.
    """

    desc = "awq blocks"
    changes_float = True
    cache_dtype = None  # the model's own dtype

    def __init__(self, plan: Plan, settings: AWQSettings, layout: BlockLayout) -> None:
        self.plan, self.settings, self.layout = plan, settings, layout
        self.gains: list[float] = []
        self.scaled: list[bool] = []

    def begin(self, walk: Walk, x: torch.Tensor) -> None:
        self.walk, self.x = walk, x
        self.homes = [_device_of(b) for b in walk.blocks]
        self.y: torch.Tensor | None = None

    def home(self, i: int) -> torch.device:
        return self.homes[i]

    def _groups(self, block: nn.Module) -> tuple[dict[str, Scheme], list[ScaleGroup]]:
        """The block's planned Linears (relative name -> scheme) and the scale groups that hold one."""
        prefix = self.walk.names[id(block)] + "."
        schemes = {rel[len(prefix):]: r.weight for rel, r in self.plan.items() if rel.startswith(prefix)}
        return schemes, [g for g in scale_groups(block, self.layout) if any(n in schemes for n in g.layers)]

    def decode(self, i: int, raw: Mapping[str, torch.Tensor], path: Path) -> dict[str, GroupResult]:
        _, groups = self._groups(self.walk.blocks[i])
        block = self.walk.blocks[i]
        out: dict[str, GroupResult] = {}
        for g in groups:
            gain, s = raw.get(f"{g.prev}::gain"), raw.get(f"{g.prev}::scale")
            width = block.get_submodule(g.layers[0]).in_features
            if gain is None or gain.numel() != 1 or (s is not None and tuple(s.shape) != (width,)):
                raise CheckpointError(f"{path} does not hold the AWQ scales of {g.prev}; delete the work folder "
                                      "and rerun")
            out[g.prev] = (s, float(gain))
        if len(raw) != sum(1 + (s is not None) for s, _ in out.values()):
            raise CheckpointError(f"{path} holds tensors of other scale groups; delete the work folder and rerun")
        return out

    def pack(self, result: Mapping[str, GroupResult]) -> dict[str, torch.Tensor]:
        out = {f"{prev}::gain": torch.tensor(gain, dtype=torch.float64) for prev, (_, gain) in result.items()}
        out |= {f"{prev}::scale": s.detach().cpu().contiguous() for prev, (s, _) in result.items() if s is not None}
        return out

    def step(self, i: int, block: nn.Module, saved: dict[str, GroupResult] | None
             ) -> tuple[dict[str, GroupResult], dict[str, float]]:
        w = self.walk
        schemes, groups = self._groups(block)
        y, stats = self._block_stats(block, groups if saved is None else [])
        self.y = y
        result: dict[str, GroupResult] = {}
        probe = _Probe(block, self.x[:self.settings.samples], w.kwargs, w.device, w.dtype)
        for g in groups:
            if saved is None:
                result[g.prev] = search_scales(block, g, schemes, stats[g.layers[0]], self.settings, probe)
            else:
                result[g.prev] = saved[g.prev]
            s, gain = result[g.prev]
            if s is not None:
                fold(block, g, s.to(w.device))
            self.gains.append(gain)
            self.scaled.append(s is not None)
            give_back_free_memory()  # each group's candidates: freed chunks glibc would otherwise keep (release.py)
        return result, {"resumed": 1.0} if saved is not None else {}

    def _block_stats(self, block: nn.Module, groups: list[ScaleGroup]
                     ) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor | None]]]:
        """The block's float output, and per group's first Linear: (mean |x| [in], X^T X / tokens or None).

        Sums are taken over this rank's samples and added over the ranks before they are averaged.
        """
        w, x = self.walk, self.x
        mods = {g.layers[0]: block.get_submodule(g.layers[0]) for g in groups}
        linear = {g.layers[0]: mods[g.layers[0]] for g in groups if g.probe is None}
        y = new_cache(x.shape, x.dtype, x.device, w.device)
        with torch.no_grad(), activation_stats(mods, ("sumabs",)) as st, activation_stats(linear, ("xtx",)) as sx:
            map_block(block, x, y, w.kwargs, CHUNK, w.device, w.dtype, w.shard)
        out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        if mods:
            mean = reduce_across(st.result("sumabs", torch.float64, w.device), w.shard)
            xtx = reduce_across(sx.result("xtx", torch.float64, w.device), w.shard) if linear else {}
            tokens = {n: int(reduce_tensor(torch.tensor(st.tokens[n], device=w.device), w.shard)) for n in mods}
            out = {n: (mean[n].float() / tokens[n], xtx[n].float() / tokens[n] if n in xtx else None) for n in mods}
        return y, out

    def finish(self, i: int, block: nn.Module, result: Mapping[str, GroupResult]) -> None:
        w, y = self.walk, self.y
        _check_same(block, self.x, y, w.kwargs, w.names[id(block)], w.device, w.dtype)  # type: ignore[arg-type]
        if self.settings.inputs == "quantized":
            _propagate(block, self.x, w, self._groups(block)[0])
        else:
            self.x = y  # type: ignore[assignment]
        self.y = None

    def end(self) -> None:
        pass


def _device_of(block: nn.Module) -> torch.device:
    """Where a block's weights are (the CPU for one still on meta: that is where loading puts it)."""
    p = next(block.parameters(), None)
    return torch.device("cpu") if p is None or p.device.type == "meta" else p.device


class _Probe:
    """The output of one module of the block on a few samples, the block stopping right after it."""

    def __init__(self, block: nn.Module, x: torch.Tensor, kwargs: Mapping[str, Any], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.block, self.x, self.kwargs, self.device, self.dtype = block, x, kwargs, device, dtype
        self.refs: dict[str, torch.Tensor] = {}

    def output(self, name: str) -> torch.Tensor:
        got: list[torch.Tensor] = []

        def hook(_m: nn.Module, _a: tuple, out: torch.Tensor) -> None:
            got.append(out.detach())
            raise _Stop

        handle = self.block.get_submodule(name).register_forward_hook(hook)
        try:
            with torch.no_grad():
                for part in self.x.split(CHUNK):
                    try:
                        self.block(part.to(self.device).to(self.dtype), **self.kwargs)
                    except _Stop:
                        pass
        finally:
            handle.remove()
        return torch.cat(got)

    def error(self, name: str) -> float:
        """Squared error of ``name``'s output now against its output the first time it was asked."""
        if name not in self.refs:
            self.refs[name] = self.output(name)
        return float((self.output(name) - self.refs[name]).pow(2).sum())


def _plain_rule(s: Scheme) -> Scheme:
    """The scheme with abs-max scales where it searches (a search per candidate would cost ~25x)."""
    return s.replace(rule="absmax") if s.rule == "search" else s


@torch.no_grad()
def search_scales(block: nn.Module, group: ScaleGroup, schemes: Mapping[str, Scheme],
                  stat: tuple[torch.Tensor, torch.Tensor | None], settings: AWQSettings, probe: _Probe
                  ) -> tuple[torch.Tensor | None, float]:
    """The best scales of one group (None = keep the identity) and their error relative to the identity's."""
    x_mean, h = stat
    weights = {n: block.get_submodule(n).weight.detach().float() for n in group.layers}
    planned = [n for n in group.layers if n in schemes]
    if group.probe is not None:
        probe.error(group.probe)  # the float reference, before any weight is swapped

    def error(s: torch.Tensor | None) -> float:
        if group.probe is None:
            return _layer_error([(weights[n], _plain_rule(schemes[n])) for n in planned], s, h)  # type: ignore[arg-type]
        with _swapped(block, {n: _scaled_qdq(weights[n], _plain_rule(schemes[n]), s) for n in planned}):
            return probe.error(group.probe)

    base = error(None)
    x_mean = x_mean.float().clamp_min(float(x_mean.float().mean()) * 1e-6 + 1e-12)
    w_mean = _weight_magnitude(torch.cat(list(weights.values())), schemes[planned[0]]) if settings.duo else None
    best, best_s = base, None
    for k in range(settings.grid):
        a = k / settings.grid
        s = x_mean.pow(a) if w_mean is None else x_mean.pow(a) / w_mean.pow(1 - a)
        s = s.clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = error(s)
        if err < best:
            best, best_s = err, s
    return best_s, best / base if base > 0 else 1.0


def _scaled_qdq(w: torch.Tensor, scheme: Scheme, s: torch.Tensor | None) -> torch.Tensor:
    """``Q(W diag(s)) diag(s)^-1``: the weights the folded, quantized model computes with, in W's coordinates."""
    return qdq(w, scheme) if s is None else qdq(w * s, scheme) / s


class _swapped:
    """Temporarily give Linears of ``block`` other weights."""

    def __init__(self, block: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
        self.block, self.weights, self.saved = block, weights, {}

    def __enter__(self) -> None:
        for n, w in self.weights.items():
            lin = self.block.get_submodule(n)
            self.saved[n] = lin.weight
            lin.weight = nn.Parameter(w.to(lin.weight.dtype), requires_grad=False)

    def __exit__(self, *exc: object) -> None:
        for n, w in self.saved.items():
            self.block.get_submodule(n).weight = w


def _weight_magnitude(w: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Mean over output rows of ``|w|`` relative to its group's largest magnitude, per input column."""
    g = scheme.group_for(w.shape[1])
    wg = to_groups(w.abs(), g)
    rel = wg / wg.amax(-1, keepdim=True).clamp_min(1e-12)
    m = rel.reshape(w.shape[0], -1)[:, : w.shape[1]].mean(0)
    return m.clamp_min(float(m.mean()) * 1e-6 + 1e-12)


def _layer_error(planned: list[tuple[torch.Tensor, Scheme]], s: torch.Tensor | None, h: torch.Tensor) -> float:
    """``sum tr(E H E^T)``, ``E = Q(W diag(s)) / s - W``: the layers' output error on the calibration inputs."""
    total = 0.0
    hf = h.float()
    for w, scheme in planned:
        e = _scaled_qdq(w, scheme, s) - w
        total += float((e @ hf * e).sum())
    return total


@torch.no_grad()
def fold(block: nn.Module, group: ScaleGroup, s: torch.Tensor) -> None:
    """Multiply the readers' input columns by ``s`` and divide the producer's output channels by it (exact)."""
    sd = s.double()
    for n in group.layers:
        lin = block.get_submodule(n)
        lin.weight.copy_((lin.weight.double() * sd.to(lin.weight.device)).to(lin.weight.dtype))
    prev = block.get_submodule(group.prev)
    sd = sd.to(prev.weight.device)
    if isinstance(prev, nn.Linear):
        prev.weight.copy_((prev.weight.double() / sd.unsqueeze(1)).to(prev.weight.dtype))
        if prev.bias is not None:
            prev.bias.copy_((prev.bias.double() / sd).to(prev.bias.dtype))
    else:
        prev.weight.copy_((prev.weight.double() / sd).to(prev.weight.dtype))


def _check_same(block: nn.Module, x: torch.Tensor, y: torch.Tensor, kwargs: Mapping[str, Any], name: str,
                device: torch.device, dtype: torch.dtype) -> None:
    """The scaled block must compute what the float block computed (on the first samples)."""
    with torch.no_grad():
        got = run_block(block, x[:CHUNK].to(device).to(dtype), kwargs, CHUNK)
    ref = y[:CHUNK].to(got.device)
    err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    if not err < 1e-3:
        raise ModelError(f"AWQ scaling changed the output of {name} (relative difference {err:.3g}): its blocks do "
                         "not have the llama-style structure lowbit scales; quantize without --awq")


def _propagate(block: nn.Module, x: torch.Tensor, walk: Walk, schemes: Mapping[str, Scheme]) -> None:
    """``x`` becomes the block's output with its planned Linears round-to-nearest quantized (float weights put
    back), in place."""
    weights = {n: qdq(block.get_submodule(n).weight.detach().float(), _plain_rule(s)) for n, s in schemes.items()}
    with _swapped(block, weights), torch.no_grad():
        map_block(block, x, x, walk.kwargs, CHUNK, walk.device, walk.dtype, walk.shard)
