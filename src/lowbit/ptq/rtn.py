"""Round-to-nearest PTQ, optionally with the importance-weighted scale search.

Plain RTN needs no data. With ``search=True`` every layer's scales are chosen by the
grid search of formats.md, weighting each input column by the summed squared
calibration activations that feed it ("optimized RTN"); that is also SignRoundV2's
initialisation, which is why it lives in the shared PTQ layer. RTN works on the whole
model at once: with a device it moves there for the importance pass and the rounding.

Recipes that quantize inputs get their input quantizers; static input scales (NVFP4's
tensor scale, FP8 / INT8 per tensor) are calibrated in the same pass over the FP model,
on the calibration batches only. The parts of a matmul engines fuse (q/k/v, gate/up)
share one weight tensor scale and one static input scale (`lowbit.models.fused`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lowbit.configs import check_fields
from lowbit.errors import ConfigError
from lowbit.formats import QTensor, quantize
from lowbit.models.activations import collect
from lowbit.models.fused import shared_amax, shared_tensor_scales
from lowbit.models.lazy import is_lazy
from lowbit.models.placement import on_device
from lowbit.nn import replace_linears
from lowbit.plans.plan import Plan
from lowbit.ptq.expert_calib import (
    AFFINITY_FLOOR,
    AFFINITY_FLOOR_HELP,
    AFFINITY_HELP,
    ALL_EXPERTS_HELP,
    MIN_TOKENS,
    MIN_TOKENS_HELP,
    check_affinity,
    expert_stats,
)
from lowbit.ptq.experts import planned_modules, quantize_experts, split
from lowbit.ptq.methods import Method, RunContext, flag, knob, register


@dataclass(frozen=True)
class RTNSettings:
    """search: pick each group's scale by the importance-weighted search (needs calibration data).

    all_experts / min_expert_tokens: how mixture-of-experts experts get their per-expert
    calibration (`lowbit.ptq.expert_calib`: token counts, static input scales, importance).
    expert_importance: weight each expert's scale search by its own calibration statistics.
    Off by default because on the MoE organism the search on the experts' weights alone scored
    better at every width (means of 2 seeds, W3 g128 64.27 vs 64.62; benchmarks/results/moe.md);
    the statistics are still gathered for token counts and input scales.
    expert_affinity / affinity_floor: with ``expert_importance``, each expert's importance is router-weighted
    as GPTQ's expert Hessians are (`lowbit.ptq.expert_calib.affinity_mix`: a token counts its routing weight
    squared in the experts the router picked, plus the floor): the diagonal of those Hessians. On by default
    for ``expert_importance`` (the rule written before the rows: below the plain importance on the mean of 4
    seeds at W4 g128 and W3 g128 on the MoE organism; it was, by 0.008 +- 0.025 and 0.108 +- 0.040,
    benchmarks/results/moe.md); read by nothing else, and given by name without ``expert_importance`` it is
    refused (`_check_options`).
    """

    search: bool = knob(True, "choose scales by the importance-weighted search on calibration activations; rtn --no-search = "
                  "plain round-to-nearest, no data needed")
    all_experts: bool = knob(True, ALL_EXPERTS_HELP)
    min_expert_tokens: int = knob(MIN_TOKENS, MIN_TOKENS_HELP, minimum=0)
    expert_importance: bool = knob(False, "weight the experts' scale search by each expert's own calibration "
                                   "statistics (default: the search on their weights alone, which scored better on "
                                   "the MoE organism)")
    expert_affinity: bool = knob(True, AFFINITY_HELP)
    affinity_floor: float = knob(AFFINITY_FLOOR, AFFINITY_FLOOR_HELP)

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "RTN setting")
        check_affinity(self.expert_affinity, self.affinity_floor, "statistics")
        if self.affinity_floor != AFFINITY_FLOOR and not self.weighted_importance:
            raise ConfigError(_unread("--affinity-floor", self))

    @property
    def weighted_importance(self) -> bool:
        """Whether the experts' search runs on router-weighted importance (the only path that reads the weighting)."""
        return self.search and self.expert_importance and self.expert_affinity


def _unread(option: str, s: RTNSettings) -> str:
    return (f"{option} weights RTN's per-expert importance, which {'--no-search turns off' if not s.search else 'is off'}"
            f": pass --expert-importance{'' if s.search else ' with the search'}, or drop {option}")


def _check_options(options: Mapping[str, Any], s: RTNSettings) -> None:
    """``--expert-affinity`` / ``--no-expert-affinity`` given by name on a run without the per-expert importance:
    the default-on knob would be silently unread there (the settings alone cannot tell it was asked for)."""
    if "expert_affinity" in options and not (s.search and s.expert_importance):
        raise ConfigError(_unread(flag("expert_affinity") if options["expert_affinity"] else "--no-expert-affinity", s))


def searched(plan: Plan) -> Plan:
    """The same plan with every scheme switched to the ``search`` scale rule.

    4-over-6 already picks its scales by error, so those schemes keep their rule; input
    schemes are untouched (their scales are chosen at run time).
    """
    return plan.with_weights({n: s if s.rule == "4over6" else s.replace(rule="search")
                              for n, s in plan.weights().items()})


def rtn_quantize(model: nn.Module, plan: Plan, calib: torch.Tensor | None = None, search: bool = False,
                 imp: Mapping[str, torch.Tensor] | None = None, progress: bool = True, all_experts: bool = True,
                 min_expert_tokens: int = MIN_TOKENS, expert_importance: bool = False,
                 affinity: float | None = None) -> Plan:
    """Quantize ``model`` in place; returns the plan actually applied.

    Fused experts tensors in the plan (`lowbit.ptq.experts`) are rounded per expert
    matrix; with ``search`` each expert's scales are searched on its weights alone (uniform
    importance) or, with ``expert_importance``, with the importance of its own inputs from the
    same calibration pass (all-experts calibration unless ``all_experts`` is False; experts
    below ``min_expert_tokens`` tokens: uniform importance). Token counts are gathered either way.
    affinity: None = plain importance; a float = router-weighted importance with that floor
    (`RTNSettings.expert_affinity`; needs ``search`` and ``expert_importance``).
    """
    if affinity is not None and not (search and expert_importance):
        raise ConfigError("router-weighted expert importance (affinity) needs search=True and expert_importance=True")
    if search:
        plan = searched(plan)
    applied = plan
    plan, experts = split(model, plan)
    static = plan.needs_calibration()
    expert_static = experts.needs_calibration()
    # the experts' token counts come with every calibration pass; their statistics only when used
    count_experts = bool(list(experts)) and (search or bool(expert_static))
    expert_kinds = ("sumsq",) * (search and expert_importance) + ("absmax",) * bool(expert_static)
    kinds = (["sumsq"] if search and imp is None else []) + (["absmax"] if static else [])
    if (kinds or count_experts) and calib is None:
        need = [*static, *expert_static]
        why = "RTN's importance search" if search else f"the static input scales of {need[0]}"
        raise ConfigError(f"{why} needs calibration batches; pass calib"
                          + (", or search=False (--no-search) for plain round-to-nearest" if not need else ""))
    amax = None
    modules = {m: model.get_submodule(m) for m in planned_modules(model, experts)} if count_experts else {}
    per_expert: dict = {}
    if kinds or count_experts:
        with expert_stats(modules, expert_kinds, all_experts=all_experts, affinity=affinity is not None) as per_expert:
            stats = collect(model, calib, list(plan), kinds, progress=progress)
        imp = stats.result("sumsq") if "sumsq" in kinds else imp
        amax = shared_amax({n: a.amax() for n, a in stats.result("absmax").items()}) if static else None
    weights = {n: model.get_submodule(n).weight for n in plan}
    scales = shared_tensor_scales(weights, plan.weights())
    replace_linears(model, plan, imp=imp, progress=progress, amax=amax, tensor_scales=scales)
    quantize_experts(model, experts, per_expert, min_expert_tokens, affinity)
    return applied


class RTNTuner:
    """RTN as a `lowbit.ptq.blockwise.BlockTuner`: each planned Linear of the block rounded to nearest, its scales
    searched with the importance of its float inputs (``job.imp``, this block's share of the statistics the
    whole-model path collects in one pass), its fused group's tensor scale and static input scale as there."""

    needs_targets = False

    def __init__(self, settings: RTNSettings) -> None:
        self.settings = settings
        self.needs_importance = settings.search

    def __call__(self, job: Any) -> tuple[dict[str, QTensor], dict[str, float]]:
        from lowbit.ptq.blockwise.release import give_back_free_memory

        out: dict[str, QTensor] = {}
        for name, (rel, scheme) in job.layers.items():
            w = job.block.get_submodule(rel).weight.detach()
            out[name] = quantize(w, scheme, None if job.imp is None else job.imp[name], job.tensor_scales.get(name))
            # the search's candidates leave freed chunks glibc would keep below the next layer's: the high-water mark
            # rose 1.14 -> 1.26 GiB over three 1.1B blocks without this (bigmodel_calib.md)
            give_back_free_memory()
        return out, {}


def rtn_blockwise(model: nn.Module, plan: Plan, settings: RTNSettings, ctx: RunContext) -> Plan:
    """RTN on the block-wise engine (a lazily loaded model: resumable from a work folder): the same codes as
    `rtn_quantize` on the whole float model.

    The statistics are the float model's (each block's planned Linears see the float block's inputs, as the
    whole-model calibration pass gives them: the float chain is carried from block to block, in the same chunks
    of samples as the whole-model pass's batches), so the searched scales, static input scales and codes are
    those of the whole-model path (tests/test_bigmodel_memory.py). Fused experts tensors are refused: their
    per-expert calibration runs on the whole model (`lowbit.ptq.expert_calib`). Without data (``--no-search``)
    the walk reads none: it rotates each block as it reads it and rounds it (`lowbit.ptq.blockwise.rounding`).
    """
    from lowbit.ptq.blockwise import PipelineOptions, quantize_blockwise

    if ctx.calib is None and not settings.search:  # data-free: the walk only rotates (lowbit.ptq.blockwise.rounding)
        from lowbit.ptq.blockwise.rounding import round_blockwise

        round_blockwise(model, plan, _work_record(settings), ctx)
        return plan
    if ctx.calib is None or ctx.calib.numel() == 0:
        raise ConfigError("RTN's importance search block by block walks calibration batches through the blocks; "
                          "pass them, or --no-search for plain round-to-nearest")
    if settings.search:
        plan = searched(plan)
    _, experts = split(model, plan)
    if list(experts):
        raise ConfigError(f"RTN block by block does not calibrate fused experts tensors ({next(iter(experts))}); "
                          "quantize this model without --offload-dir / --workdir, or with --method gptq")
    recorded, options = _work_record(settings), PipelineOptions(fp_inputs=True, chunk=BATCH)
    quantize_blockwise(model, plan, RTNTuner(settings), recorded, ctx, options)
    return plan


BATCH = 8  # samples per forward: `collect`'s batch, so the float statistics are summed in the same order


def _work_record(settings: RTNSettings) -> dict[str, Any]:
    return {"method": "rtn", "config": dataclasses.asdict(settings)}


def _work(settings: RTNSettings, plan: Plan, _ctx: RunContext) -> tuple[dict, Any, Plan]:
    from lowbit.ptq.blockwise import PipelineOptions

    return _work_record(settings), PipelineOptions(fp_inputs=True, chunk=BATCH), searched(plan) if settings.search \
        else plan


def _run(model: nn.Module, plan: Plan, settings: RTNSettings, ctx: RunContext) -> Plan:
    if is_lazy(model):  # a model in memory keeps the one whole-model calibration pass (same codes, fewer forwards)
        return rtn_blockwise(model, plan, settings, ctx)
    with on_device(model, ctx.device):
        return rtn_quantize(model, plan, ctx.calib, settings.search, progress=ctx.progress,
                            all_experts=settings.all_experts, min_expert_tokens=settings.min_expert_tokens,
                            expert_importance=settings.expert_importance,
                            affinity=settings.affinity_floor if settings.weighted_importance else None)


register(Method("rtn", RTNSettings, _run, blockwise=False, needs_calib=lambda s: s.search,
                summary="round-to-nearest; with search, scales picked by importance-weighted error",
                work=_work, lazy_with_calib=True, check_options=_check_options))
