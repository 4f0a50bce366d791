"""Mixed precision: a per-layer plan chosen by DeltaLoss and an exact knapsack, for any method.

SignRoundV2's allocation: every candidate scheme quantizes the whole model (RTN), the
causal-LM loss is back-propagated on a few calibration batches, each layer is scored by
the first-order loss change of its quantization (`sensitivity.delta_loss`), and an exact
multiple-choice knapsack (`allocate.allocate`) picks one scheme per layer within the
average-bit budget. The result is an ordinary `Plan`, which any method (RTN, SignRound,
SignRoundV2) then applies; the plan and its bits-per-layer plot go into the checkpoint.

A fused mixture-of-experts tensor (``...mlp.experts.gate_up_proj``) is one knapsack item,
sized as its E stacked ``[out, in]`` matrices (``E * out`` rows of ``in`` columns, so its
bits, scales included, count exactly), scored by DeltaLoss over all its experts: the plan
gives one recipe to a fused tensor, as GGUF's 3-D tensors and vLLM's MoE layers need. Options
that quantize inputs (W4A4, W8A8) are candidates for experts too: DeltaLoss adds each expert's
activation term, and every expert method calibrates one static input scale per expert.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lowbit.configs import check_fields
from lowbit.errors import ConfigError
from lowbit.formats import Recipe
from lowbit.formats.kquants import fit_width
from lowbit.formats.kv import KVScheme
from lowbit.models.experts import expert_tensors, planned_shape
from lowbit.models.lazy import is_lazy
from lowbit.models.placement import model_device, on_device
from lowbit.nn.precision import resolve_dtype
from lowbit.plans.plan import Plan
from lowbit.ptq.allocate import Allocation, allocate, tie_qkv
from lowbit.ptq.expert_calib import check_stat_experts
from lowbit.ptq.sensitivity import DTYPES, MODES, delta_loss

DTYPE_CHOICES = ("auto", *DTYPES)


@dataclass(frozen=True)
class MixedSettings:
    """A mixed-precision budget.

    avg_bits: average bits per weight over the planned layers. options: candidate recipes
        (weight schemes, or recipes that quantize inputs too: w4a4-mxfp4, w8a8-mxfp8); a
        recipe costs its weight bits.
    delta_mode: DeltaLoss score, ``abs`` (reference code) or ``signed`` (the paper's term).
    tie_qkv: q/k/v of a block take one scheme (fused-QKV kernels need that).
    count_scales: the budget counts scale and zero-point bits (False = element bits only).
    nsamples: calibration samples used for the DeltaLoss passes.
    lm_head_min_bits: a planned lm_head may take only options of at least this many bits.
    dtype: precision of the DeltaLoss passes (auto = bf16 where the hardware has fast bf16).
    """

    avg_bits: float
    options: tuple[str, ...]
    delta_mode: str = "abs"
    tie_qkv: bool = False
    count_scales: bool = True
    nsamples: int = 16
    lm_head_min_bits: int = 6
    dtype: str = "auto"

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "mixed-precision setting", {"avg_bits": "--avg-bits"})
        opts = self.options.split(",") if isinstance(self.options, str) else self.options
        object.__setattr__(self, "options", tuple(Recipe.parse(o).name for o in opts if str(o).strip()))
        if not self.options:
            raise ConfigError("mixed precision needs at least one option, e.g. --options w2g64,w4g128")
        if not self.avg_bits > 0:
            raise ConfigError(f"--avg-bits must be positive, got {self.avg_bits}")
        if self.delta_mode not in MODES:
            raise ConfigError(f"--delta-mode must be one of {MODES}, got {self.delta_mode!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"DeltaLoss dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.nsamples < 1:
            raise ConfigError(f"DeltaLoss needs at least one sample, got {self.nsamples}")

    def schemes(self) -> list[Recipe]:
        return list(dict.fromkeys(Recipe.parse(o) for o in self.options))


def check_feasible(model: nn.Module, plan: Plan, settings: MixedSettings) -> None:
    """Every option fits every planned layer, and the budget is reachable — before any DeltaLoss pass runs.

    Scores only decide *which* plan wins; whether any plan fits the budget depends on
    the layer shapes and options alone, so an impossible budget costs no forward pass.
    """
    sizes = {n: _shape(model, n) for n in plan}
    for n, (_, cols) in sizes.items():
        for o in settings.schemes():
            fit_width(o, cols).check_width(cols, n)
    tensors = expert_tensors(model)
    if any(o.input is not None for o in settings.schemes()):  # scored and calibrated per expert: gate_up / down only
        for module in dict.fromkeys(tensors[n].module for n in plan if n in tensors):
            check_stat_experts(model.get_submodule(module), module)
    zero = {o.name: dict.fromkeys(sizes, 0.0) for o in settings.schemes()}
    ties = tie_qkv(list(plan)) if settings.tie_qkv else ()
    allocate(zero, sizes, settings.schemes(), settings.avg_bits, ties=ties, count_scales=settings.count_scales,
             lm_head_min_bits=settings.lm_head_min_bits)


def mixed_plan(model: nn.Module, plan: Plan, settings: MixedSettings, calib: torch.Tensor,
               device: str | torch.device | None = None, progress: bool = True,
               folder: str | Path | None = None, cache_device: str = "device") -> Allocation:
    """DeltaLoss-scored, knapsack-allocated plan over the layers of ``plan`` (their schemes are ignored).

    A lazily loaded model (`lowbit.models.lazy`) is scored block by block, with the same scores
    (`lowbit.ptq.streamed_deltaloss`): ``folder`` (the offload folder) keeps each finished option's
    scores for a rerun, and with ``cache_device="disk"`` the stored block inputs.
    """
    if calib is None or calib.numel() == 0:
        raise ConfigError("mixed precision needs calibration batches for its DeltaLoss passes")
    check_feasible(model, plan, settings)
    sizes = {n: _shape(model, n) for n in plan}
    if is_lazy(model):  # one block in memory at a time: gradient checkpointing at block granularity
        from lowbit.ptq.streamed_deltaloss import streamed_delta_loss

        where = torch.device(device) if device is not None else torch.device("cpu")
        scores = streamed_delta_loss(model, list(plan), settings.schemes(), calib[: settings.nsamples],
                                     mode=settings.delta_mode, progress=progress,
                                     dtype=resolve_dtype(settings.dtype, where), folder=folder,
                                     cache_device="disk" if cache_device == "disk" else "cpu", device=where)
    else:
        with on_device(model, device):  # DeltaLoss is whole-model forward/backward passes
            dtype = resolve_dtype(settings.dtype, model_device(model))
            scores = delta_loss(model, list(plan), settings.schemes(), calib[: settings.nsamples],
                                mode=settings.delta_mode, progress=progress, dtype=dtype)
    ties = tie_qkv(list(plan)) if settings.tie_qkv else ()
    return allocate(scores, sizes, settings.schemes(), settings.avg_bits, ties=ties,
                    count_scales=settings.count_scales, lm_head_min_bits=settings.lm_head_min_bits)


def _shape(model: nn.Module, name: str) -> tuple[int, int]:
    return planned_shape(model, name)


# ------------------------------------------------------------------ the KV cache, per layer
def kv_bits(scheme: KVScheme, kv_heads: int, head_dim: int) -> int:
    """Bits one token takes in one attention's cache under ``scheme`` (keys and values, run-time scales included)."""
    return round(8 * scheme.bytes_per_token(1, kv_heads, head_dim))


def allocate_kv(scores: dict[str, dict[str, float]], shapes: dict[str, tuple[int, int]], avg_bits: float,
                ) -> dict[str, str]:
    """The KV scheme of each attention minimising the summed DeltaLoss with the cache's average bits per element
    (scales included) at most ``avg_bits``: an exact multiple-choice knapsack over the layers.

    scores: scheme name -> attention name -> DeltaLoss (`sensitivity.kv_delta_loss`); shapes:
    attention name -> (KV heads, head_dim). Refused when even the smallest choice everywhere exceeds
    the budget.
    """
    names = sorted(shapes)
    options = [KVScheme.parse(s) for s in scores]
    elements = sum(2 * h * d for h, d in shapes.values())
    budget = math.floor(avg_bits * elements + 1e-9)
    # state: total bits so far -> (summed score, choices); a state no cheaper and no better than another is dropped
    states: dict[int, tuple[float, tuple[str, ...]]] = {0: (0.0, ())}
    for n in names:
        nxt: dict[int, tuple[float, tuple[str, ...]]] = {}
        for bits, (score, picks) in states.items():
            for o in options:
                b = bits + kv_bits(o, *shapes[n])
                cand = (score + scores[o.name][n], (*picks, o.name))
                if b <= budget and (b not in nxt or cand[0] < nxt[b][0]):
                    nxt[b] = cand
        states = _pareto(nxt)
        if not states:
            least = min(kv_bits(o, *shapes[names[0]]) for o in options) / (2 * shapes[names[0]][0] * shapes[names[0]][1])
            raise ConfigError(f"--kv-bits {avg_bits}: the KV options {', '.join(scores)} need at least {least:.2f} "
                              "bits per cached element; raise the budget or add a smaller option")
    best = min(states.values(), key=lambda t: t[0])
    return dict(zip(names, best[1], strict=True))


def _pareto(states: dict[int, tuple[float, tuple[str, ...]]]) -> dict[int, tuple[float, tuple[str, ...]]]:
    out, best = {}, math.inf
    for bits in sorted(states):
        if states[bits][0] < best:
            out[bits], best = states[bits], states[bits][0]
    return out


def mixed_kv(model: nn.Module, options: Sequence[str], avg_bits: float, calib: torch.Tensor, mode: str = "abs",
             nsamples: int = 16, progress: bool = True) -> dict[str, KVScheme]:
    """Attention name -> KV scheme chosen by DeltaLoss over the KV ``options`` within ``avg_bits`` per element."""
    from lowbit.nn.kv_quant import cache_shapes
    from lowbit.ptq.sensitivity import kv_delta_loss

    if calib is None or calib.numel() == 0:
        raise ConfigError("per-layer KV choices need calibration batches for their DeltaLoss passes")
    shapes = cache_shapes(model)
    kvs = [KVScheme.parse(o) for o in options]
    floor = min(sum(kv_bits(k, *s) for s in shapes.values()) for k in kvs)
    if floor > avg_bits * sum(2 * h * d for h, d in shapes.values()) + 1e-9:
        allocate_kv({k.name: dict.fromkeys(shapes, 0.0) for k in kvs}, shapes, avg_bits)  # raises, naming the floor
    scores = kv_delta_loss(model, kvs, calib[:nsamples], mode=mode, progress=progress)
    return {n: KVScheme.parse(s) for n, s in allocate_kv(scores, shapes, avg_bits).items()}
