"""Bit allocation: one scheme per layer minimising total DeltaLoss under an average-bit budget.

This is a multiple-choice knapsack: each layer (or group of tied layers) picks exactly
one option, costs add up in bits, scores add up. It is solved exactly by dynamic
programming over cost, keeping only the Pareto frontier of (cost, score) states after
each layer — a state that costs more and scores no better than another can never be
part of a better solution, so dropping it loses nothing. States that cannot finish
within the budget even with the cheapest remaining options are dropped too. For very
large models a beam limit caps the frontier (then the answer is approximate).
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lowbit.errors import ConfigError
from lowbit.formats import Recipe, Scheme
from lowbit.formats.kquants import fit_width
from lowbit.io import atomic_write_bytes
from lowbit.plans.plan import Plan


@dataclass(frozen=True)
class Allocation:
    """The chosen plan and its accounting (bits are exact integers over all planned weights)."""

    plan: Plan
    total_bits: int
    budget_bits: int
    params: int
    score: float

    @property
    def avg_bits(self) -> float:
        return self.total_bits / max(self.params, 1)


def layer_bits(scheme: Scheme | Recipe, shape: tuple[int, int], count_scales: bool = True) -> int:
    """Exact storage bits of one ``[out, in]`` weight (scale and zero per group if counted).

    A recipe costs its weight's bits: activations are not stored, so W4A4 and W4A16 cost alike.
    """
    scheme = scheme.weight if isinstance(scheme, Recipe) else scheme
    out, cols = shape
    return fit_width(scheme, cols).storage_bits((out, cols), count_scales)


def solve_mckp(costs: Sequence[Sequence[int]], values: Sequence[Sequence[float]], budget: int,
               beam: int | None = None) -> tuple[list[int], int, float]:
    """Pick one option per item minimising the summed value with summed cost <= budget.

    costs/values: per item, per option. Returns (choice per item, total cost, total value).
    Use ``math.inf`` as a cost to forbid an option. Raises ConfigError when infeasible.
    """
    cs = [np.asarray(c, dtype=np.float64) for c in costs]
    vs = [np.asarray(v, dtype=np.float64) for v in values]
    tail = np.concatenate([np.cumsum([c.min() for c in cs][::-1])[::-1], [0.0]])
    if tail[0] > budget:
        raise ConfigError(f"no combination of options fits the budget: the cheapest plan needs "
                          f"{int(tail[0])} bits, the budget is {budget}")
    cost, val = np.zeros(1), np.zeros(1)
    back: list[tuple[np.ndarray, np.ndarray]] = []
    for i, (c, v) in enumerate(zip(cs, vs, strict=True)):
        cost, val, parent, choice = _expand(cost, val, c, v, budget - tail[i + 1])
        cost, val, parent, choice = _frontier(cost, val, parent, choice, beam)
        back.append((parent, choice))
    state = int(np.argmin(val))
    total_cost, total_val = int(cost[state]), float(val[state])
    picks = []
    for parent, choice in reversed(back):
        picks.append(int(choice[state]))
        state = int(parent[state])
    return picks[::-1], total_cost, total_val


def _expand(cost, val, c, v, limit):
    n, k = len(cost), len(c)
    nc = (cost[:, None] + c[None, :]).reshape(-1)
    nv = (val[:, None] + v[None, :]).reshape(-1)
    parent = np.repeat(np.arange(n), k)
    choice = np.tile(np.arange(k), n)
    ok = nc <= limit
    return nc[ok], nv[ok], parent[ok], choice[ok]


def _frontier(cost, val, parent, choice, beam):
    """Keep states whose score beats every cheaper (or equal-cost) state."""
    order = np.lexsort((val, cost))
    cost, val, parent, choice = cost[order], val[order], parent[order], choice[order]
    prev_min = np.minimum.accumulate(val)
    keep = np.concatenate([[True], val[1:] < prev_min[:-1]])
    idx = np.flatnonzero(keep)
    if beam is not None and len(idx) > beam:
        sel = np.unique(np.linspace(0, len(idx) - 1, beam).round().astype(int))
        idx = idx[sel]
    return cost[idx], val[idx], parent[idx], choice[idx]


# ------------------------------------------------------------------- layers
def tie_qkv(names: Sequence[str]) -> list[list[str]]:
    """Group ``q_proj/k_proj/v_proj`` of each block so they get one scheme together."""
    groups: dict[str, list[str]] = {}
    for n in names:
        m = re.match(r"^(.*)\.(q_proj|k_proj|v_proj)$", n)
        if m:
            groups.setdefault(m.group(1), []).append(n)
    return [g for g in groups.values() if len(g) > 1]


def allocate(scores: Mapping[str, Mapping[str, float]], sizes: Mapping[str, tuple[int, int]],
             options: Sequence[Recipe | Scheme | str], avg_bits: float, ties: Sequence[Sequence[str]] = (),
             count_scales: bool = True, lm_head_min_bits: int = 6, beam: int | None = None) -> Allocation:
    """Choose a recipe per layer of ``sizes`` for ``sum bits <= floor(avg_bits * params)``.

    scores: recipe name -> layer -> DeltaLoss (from `sensitivity.delta_loss`).
    ties: groups of layers forced to one scheme. count_scales: charge scale/zero bits.
    lm_head_min_bits: a layer named ``*lm_head`` may only take options of >= this many bits.
    """
    opts = [Recipe.parse(o) for o in options]
    if not opts:
        raise ConfigError("mixed precision needs at least one option scheme (--options S1,S2)")
    missing = [o.name for o in opts if o.name not in scores]
    if missing:
        raise ConfigError(f"no DeltaLoss scores for options {missing}; score them first")
    groups = _groups(list(sizes), ties)
    params = sum(o * i for o, i in sizes.values())
    budget = math.floor(avg_bits * params)
    costs, values = [], []
    for g in groups:
        costs.append([sum(layer_bits(o, sizes[n], count_scales) for n in g)
                      if _allowed(g, o, lm_head_min_bits) else math.inf for o in opts])
        values.append([sum(scores[o.name][n] for n in g) for o in opts])
    for g, c in zip(groups, costs, strict=True):
        if all(math.isinf(x) for x in c):
            raise ConfigError(f"{g[0]} may not take any option (lm_head needs >= {lm_head_min_bits} bits); "
                              "add such an option (e.g. w8) or leave the lm_head out of the plan")
    try:
        picks, total, score = solve_mckp(costs, values, budget, beam)
    except ConfigError:
        cheapest = sum(min(c) for c in costs)
        raise ConfigError(f"an average of {avg_bits} bits cannot be met with options "
                          f"{[o.name for o in opts]}: the cheapest plan averages {cheapest / params:.4f} bits"
                          f"{'' if count_scales else ' (scale bits ignored)'}; raise --avg-bits or add a "
                          "smaller option") from None
    plan = Plan({n: fit_width(opts[k], sizes[n][1]) for g, k in zip(groups, picks, strict=True) for n in g})
    plan = Plan({n: plan[n] for n in sizes})  # keep model order
    return Allocation(plan, total, budget, params, score)


def positional_plan(sizes: Mapping[str, tuple[int, int]], low: Recipe | Scheme | str, high: Recipe | Scheme | str,
                    avg_bits: float, from_end: bool = False, count_scales: bool = True) -> Allocation:
    """The baseline a sensitivity-driven plan has to beat: ``high`` for the first (or last)
    layers in model order, as many as fit in the budget, ``low`` for the rest.

    Layers are taken contiguously from the chosen end; filling stops at the first layer
    that no longer fits, so the plan is "the first k layers", never a patchwork.
    """
    lo, hi = Recipe.parse(low), Recipe.parse(high)
    names = list(sizes)
    params = sum(o * i for o, i in sizes.values())
    budget = math.floor(avg_bits * params)
    total = sum(layer_bits(lo, sizes[n], count_scales) for n in names)
    if total > budget:
        raise ConfigError(f"an average of {avg_bits} bits is below the all-{lo.name} plan "
                          f"({total / params:.4f} bits); raise --avg-bits")
    chosen = {n: lo for n in names}
    for n in (reversed(names) if from_end else names):
        extra = layer_bits(hi, sizes[n], count_scales) - layer_bits(lo, sizes[n], count_scales)
        if total + extra > budget:
            break
        chosen[n], total = hi, total + extra
    return Allocation(Plan(chosen), total, budget, params, math.nan)


def _groups(names: list[str], ties: Sequence[Sequence[str]]) -> list[list[str]]:
    seen: dict[str, int] = {}
    groups: list[list[str]] = []
    for t in ties:
        t = [n for n in t if n in names]
        if t:
            if any(n in seen for n in t):
                raise ConfigError(f"layer tied twice: {[n for n in t if n in seen]}")
            seen.update({n: len(groups) for n in t})
            groups.append(list(t))
    groups.extend([n] for n in names if n not in seen)
    return groups


def _allowed(group: Sequence[str], recipe: Recipe, lm_head_min_bits: int) -> bool:
    heads = any(n == "lm_head" or n.endswith(".lm_head") for n in group)
    return not heads or recipe.weight.bits >= lm_head_min_bits


# ----------------------------------------------------------------- outputs
def save_allocation(alloc: Allocation, sizes: Mapping[str, tuple[int, int]], json_path: str | Path,
                    png_path: str | Path | None = None) -> None:
    """Write the plan JSON (atomically) and, optionally, the bits-per-layer plot."""
    alloc.plan.save(json_path)
    if png_path is not None:
        atomic_write_bytes(Path(png_path), plot_bits(alloc.plan, sizes))


def plot_bits(plan: Plan, sizes: Mapping[str, tuple[int, int]]) -> bytes:
    """PNG bar chart of bits per weight (scales included) for every layer, in model order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(plan)
    bits = [plan.weight(n).bits_per_weight(sizes[n][1]) for n in names]
    schemes = plan.recipes()
    colors = [f"C{schemes.index(plan[n])}" for n in names]
    fig, ax = plt.subplots(figsize=(max(6.0, len(names) * 0.12), 3.5))
    ax.bar(range(len(names)), bits, color=colors, width=0.9)
    for k, s in enumerate(schemes):
        ax.bar([], [], color=f"C{k}", label=s.name)
    ax.set_xlabel("layer (model order)")
    ax.set_ylabel("bits per weight")
    ax.set_title(f"{plan.describe()}: {plan.average_bits(sizes):.3f} bits on average")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
