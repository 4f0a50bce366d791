"""Where a run's plan comes from: one typed value, parsed once from the job's inputs.

A quantize run's per-layer recipes come from exactly one of four sources:

* `Uniform`: one recipe on every decoder Linear (``--scheme w4g128``; the default);
* `LlamaCppMix`: llama.cpp's per-tensor K types of a file-type mix (``--scheme q4_k_m``);
* `PlanFile`: a plan JSON naming each layer's recipe (``--plan FILE``), read once;
* `MixedBudget`: mixed precision, the knapsack of `lowbit.ptq.mixed` choosing among
  candidate recipes under a bits budget (``--avg-bits`` + ``--options``).

`plan_source` turns the job's inputs into one of them (refusing two at once) and
`build_plan` turns that into the starting `Plan` for a model, so a scheme text is
parsed once and the question "is this a mix?" is answered once, by the type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from lowbit.errors import ConfigError, SchemeError, did_you_mean
from lowbit.formats.kquants import fit_width
from lowbit.formats.recipe import PRESETS as recipe_presets
from lowbit.formats.recipe import Recipe
from lowbit.formats.scheme import PRESETS as scheme_presets
from lowbit.formats.scheme import Scheme
from lowbit.plans import kmix
from lowbit.plans.plan import Plan

DEFAULT_SCHEME = "w4g128"


@dataclass(frozen=True)
class Uniform:
    """One recipe on every decoder Linear (and the lm_head with ``lm_head``)."""

    recipe: Recipe
    lm_head: bool = False


@dataclass(frozen=True)
class LlamaCppMix:
    """llama.cpp's file-type mix ``name`` (one of `kmix.MIXES`, lower case): K types by tensor role and depth."""

    name: str
    lm_head: bool = False

    def __post_init__(self) -> None:
        if self.name not in kmix.MIXES:
            raise SchemeError(f"unknown K-quant mix {self.name!r}; choose one of {', '.join(kmix.MIXES)}")


@dataclass(frozen=True)
class PlanFile:
    """A plan file (``--plan``), read once; it names its layers itself (the lm_head included, if planned)."""

    path: str
    plan: Plan

    @classmethod
    def load(cls, path: str) -> PlanFile:
        return cls(str(path), Plan.load(path))


@dataclass(frozen=True)
class MixedBudget:
    """Mixed precision over the decoder Linears (and the lm_head with ``lm_head``).

    settings: a `lowbit.ptq.mixed.MixedSettings` (the budget, its candidate recipes in
    ``options`` and the DeltaLoss knobs; it lives with the knapsack, above this package).
    The run starts from the first option everywhere; the knapsack then picks per layer.
    """

    settings: Any
    lm_head: bool = False

    @property
    def options(self) -> list[Recipe]:
        return [Recipe.parse(o) for o in self.settings.options]


PlanSource = Uniform | LlamaCppMix | PlanFile | MixedBudget


def parse_scheme(text: str | Scheme | Recipe | None, lm_head: bool = False) -> Uniform | LlamaCppMix:
    """``--scheme``: a llama.cpp mix name or a recipe (a weight scheme alone is one); None = `DEFAULT_SCHEME`."""
    if kmix.is_mix(text):
        return LlamaCppMix(text.strip().lower(), lm_head)
    try:
        return Uniform(Recipe.parse(DEFAULT_SCHEME if text is None else text), lm_head)
    except SchemeError as e:
        raise _mix_hint(e, str(text)) from None


def _mix_hint(error: SchemeError, text: str) -> SchemeError:
    """``error`` for an unknown ``--scheme``, its did-you-mean chosen among the mix names too.

    `lowbit.formats` suggests among the names it knows; ``--scheme`` also takes llama.cpp's
    mixes, which live here, so a mistyped mix (``q4_k_mm``) is pointed at the mix.
    """
    base = text.strip().lower().partition(":")[0]
    known = [*scheme_presets, *recipe_presets]
    best = did_you_mean(base, [*known, *kmix.MIXES])
    head = f"unknown scheme {base!r}"
    msg = str(error)
    if not best or not msg.startswith(head) or best == did_you_mean(base, known):
        return error
    return SchemeError(head + best + msg[len(head) + len(did_you_mean(base, known)):])


def plan_source(scheme: str | Scheme | Recipe | None = None, plan_file: str | None = None, mixed: Any = None,
                lm_head: bool = False) -> PlanSource:
    """The one source the inputs name (none = the default scheme); two at once is an error naming both."""
    given = [n for n, v in (("--scheme", scheme), ("--plan", plan_file), ("--avg-bits/--options", mixed))
             if v is not None]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} both choose the layers' schemes; give only one")
    if plan_file is not None:
        if lm_head:
            raise ConfigError("--lm-head adds the lm_head to a uniform plan; a plan file names its layers "
                              "itself (add the lm_head there)")
        return PlanFile.load(plan_file)
    if mixed is not None:
        return MixedBudget(mixed, lm_head)
    return parse_scheme(scheme, lm_head)


def needs_calibration(source: PlanSource) -> bool:
    """Whether some recipe the source can give quantizes inputs with static scales (calibrated on data)."""
    if isinstance(source, PlanFile):
        return bool(source.plan.needs_calibration())
    if isinstance(source, MixedBudget):
        return any(r.needs_calibration for r in source.options)
    if isinstance(source, LlamaCppMix):
        return False
    return source.recipe.needs_calibration


def mix_name(source: PlanSource) -> str | None:
    """The llama.cpp file type the plan reproduces (None when the source is not a mix)."""
    return source.name if isinstance(source, LlamaCppMix) else None


def build_plan(model: nn.Module, source: PlanSource | str | Scheme | Recipe | None,
               plan_file: str | None = None, lm_head: bool = False) -> Plan:
    """The starting plan of ``source`` for ``model`` (text and files are parsed into a source first).

    Every recipe is checked against its layer's width. A K-quant on rows that are not a
    multiple of 256 takes llama.cpp's fallback type; mixed precision starts from its
    first option everywhere. Every source covers the fused experts tensors too
    (``...mlp.experts.gate_up_proj``: each expert's matrix like a Linear,
    `lowbit.models.experts`): a llama.cpp mix by its rules for ``ffn_*_exps``, mixed
    precision as one knapsack item per fused tensor.
    """
    from lowbit.models import linear_layers
    from lowbit.models.experts import expert_tensors

    if not isinstance(source, (Uniform, LlamaCppMix, PlanFile, MixedBudget)):
        source = plan_source(source, plan_file, lm_head=lm_head)
    if isinstance(source, PlanFile):
        plan, layers, experts = source.plan, linear_layers(model), expert_tensors(model)
        unknown = [n for n in plan if n not in layers and n not in experts and not _is_linear(model, n)]
        if unknown:
            raise ConfigError(f"plan {source.path} names layers this model lacks or that are neither Linear nor "
                              f"fused experts: {unknown[:3]}; make the plan for this model")
    else:
        layers = linear_layers(model, include_lm_head=source.lm_head)
        experts = expert_tensors(model)
        if isinstance(source, LlamaCppMix):
            sizes = {n: (m.out_features, m.in_features) for n, m in layers.items()}
            # llama.cpp's rules type ffn_*_exps too (n_expert-dependent)
            sizes |= {n: (t.out_features, t.in_features) for n, t in experts.items()}
            n_expert = max((t.count for t in experts.values()), default=0)
            return kmix.mix_plan(_in_model_order(model, sizes), source.name, _n_gqa(model), n_expert)
        first = source.recipe if isinstance(source, Uniform) else source.options[0]
        widths = {n: m.in_features for n, m in layers.items()}
        widths |= {n: t.in_features for n, t in experts.items()}
        plan = Plan({n: fit_width(first, w) for n, w in widths.items()})
    experts = expert_tensors(model)  # their widths are checked once --keep has had its say (`lowbit.ptq.experts`)
    for name, r in plan.items():
        if name not in experts:
            r.check_width(model.get_submodule(name).in_features, name)
    return plan


def _in_model_order(model: nn.Module, sizes: dict) -> dict:
    """``sizes`` keyed by module or ``module.param`` names, in the model's module order (llama.cpp's counting order)."""
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return dict(sorted(sizes.items(), key=lambda kv: order.get(kv[0], order.get(kv[0].rsplit(".", 1)[0], len(order)))))


def _n_gqa(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None) or 1
    return heads // (getattr(cfg, "num_key_value_heads", None) or heads)


def _is_linear(model: nn.Module, name: str) -> bool:
    try:
        return isinstance(model.get_submodule(name), nn.Linear)
    except AttributeError:
        return False
