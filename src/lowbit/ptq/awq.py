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
then RTN, GPTQ or SignRoundV2 quantizes the scaled weights. It walks the blocks once,
like the PTQ pipeline, with each block's inputs taken from the blocks before it: float
(``inputs="fp"``) or round-to-nearest quantized with the plan's schemes (``"quantized"``,
the inputs a quantized model really gives).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from lowbit.configs import check_fields
from lowbit.errors import ConfigError, ModelError
from lowbit.formats import Scheme, qdq
from lowbit.formats.groups import to_groups
from lowbit.formats.plan import Plan
from lowbit.models.activations import activation_stats
from lowbit.models.layers import decoder_blocks
from lowbit.models.placement import check_device
from lowbit.models.structure import BlockLayout, block_layout
from lowbit.nn.input_rotation import rotation_of
from lowbit.ptq.blockwise import capture_inputs, module_names, run_block

INPUTS = ("fp", "quantized")
CHUNK = 8


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


def awq_scale(model: nn.Module, plan: Plan, calib: torch.Tensor, settings: AWQSettings = AWQSettings(),
              device: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Search and fold AWQ scales into ``model`` (float, in place), block by block; returns a summary."""
    if calib is None or calib.numel() == 0:
        raise ConfigError("AWQ needs calibration batches (LongTensor [nsamples, seqlen])")
    t0 = time.perf_counter()
    layout = block_layout(model, "AWQ")
    blocks = decoder_blocks(model)
    names = module_names(model)
    dev = check_device(device) or torch.device("cpu")
    x, kwargs = capture_inputs(model, blocks[0], calib, dev)
    gains: list[float] = []
    scaled: list[bool] = []
    for block in tqdm(blocks, desc="awq blocks", unit="block", disable=not progress):
        home = next(block.parameters()).device
        block.to(dev)
        prefix = names[id(block)] + "."
        schemes = {rel[len(prefix):]: r.weight for rel, r in plan.items() if rel.startswith(prefix)}
        groups = [g for g in scale_groups(block, layout) if any(n in schemes for n in g.layers)]
        y, stats = _block_stats(block, groups, x, kwargs)
        probe = _Probe(block, x[:settings.samples], kwargs)
        for g in groups:
            s, gain = search_scales(block, g, schemes, stats[g.layers[0]], settings, probe)
            if s is not None:
                fold(block, g, s)
            gains.append(gain)
            scaled.append(s is not None)
        _check_same(block, x, y, kwargs, names[id(block)])
        x = _propagate(block, x, kwargs, schemes) if settings.inputs == "quantized" else y
        block.to(home)
    return {**settings.to_dict(), "groups": len(gains), "scaled": sum(scaled),
            "mean_error_ratio": round(sum(gains) / max(len(gains), 1), 4), "seconds": round(time.perf_counter() - t0, 2)}


def _block_stats(block: nn.Module, groups: list[ScaleGroup], x: torch.Tensor, kwargs: Mapping[str, Any]
                 ) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor | None]]]:
    """The block's float output, and per group's first Linear: (mean |x| [in], X^T X / tokens or None)."""
    mods = {g.layers[0]: block.get_submodule(g.layers[0]) for g in groups}
    linear = {g.layers[0]: mods[g.layers[0]] for g in groups if g.probe is None}
    with torch.no_grad(), activation_stats(mods, ("sumabs",)) as st, activation_stats(linear, ("xtx",)) as sx:
        y = run_block(block, x, kwargs, CHUNK)
    out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    if mods:
        mean = st.result("sumabs", device=x.device)
        xtx = sx.result("xtx", device=x.device) if linear else {}
        out = {n: (mean[n] / st.tokens[n], xtx[n] / st.tokens[n] if n in xtx else None) for n in mods}
    return y, out


class _Probe:
    """The output of one module of the block on a few samples, the block stopping right after it."""

    def __init__(self, block: nn.Module, x: torch.Tensor, kwargs: Mapping[str, Any]) -> None:
        self.block, self.x, self.kwargs = block, x, kwargs
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
                        self.block(part, **self.kwargs)
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


def _check_same(block: nn.Module, x: torch.Tensor, y: torch.Tensor, kwargs: Mapping[str, Any], name: str) -> None:
    """The scaled block must compute what the float block computed (on the first samples)."""
    with torch.no_grad():
        got = run_block(block, x[:CHUNK], kwargs, CHUNK)
    ref = y[:CHUNK]
    err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    if not err < 1e-3:
        raise ModelError(f"AWQ scaling changed the output of {name} (relative difference {err:.3g}): its blocks do "
                         "not have the llama-style structure lowbit scales; quantize without --awq")


def _propagate(block: nn.Module, x: torch.Tensor, kwargs: Mapping[str, Any], schemes: Mapping[str, Scheme]
               ) -> torch.Tensor:
    """The block's output with its planned Linears round-to-nearest quantized (float weights put back)."""
    weights = {n: qdq(block.get_submodule(n).weight.detach().float(), _plain_rule(s)) for n, s in schemes.items()}
    with _swapped(block, weights), torch.no_grad():
        return run_block(block, x, kwargs, CHUNK)
