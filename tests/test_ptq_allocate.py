"""Bit allocation: exact knapsack vs brute force, budget rules, ties, lm_head, DeltaLoss, plots."""

import copy
import itertools
import math

import pytest
import torch
from ptq_helpers import block_names, calib, tiny_model

from lowbit.errors import ConfigError
from lowbit.formats import Scheme, qdq
from lowbit.plans.plan import Plan
from lowbit.ptq.allocate import allocate, layer_bits, positional_plan, save_allocation, solve_mckp, tie_qkv
from lowbit.ptq.sensitivity import delta_loss


def brute(costs, values, budget):
    best = None
    for pick in itertools.product(*[range(len(c)) for c in costs]):
        c = sum(costs[i][k] for i, k in enumerate(pick))
        v = sum(values[i][k] for i, k in enumerate(pick))
        if c <= budget and (best is None or v < best[1] - 1e-12):
            best = (c, v)
    return best


@pytest.mark.parametrize("seed", range(25))
def test_knapsack_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    items = int(torch.randint(1, 7, (1,), generator=g))
    opts = int(torch.randint(1, 4, (1,), generator=g))
    costs = torch.randint(1, 20, (items, opts), generator=g).tolist()
    values = (torch.randn(items, opts, generator=g) * (1 if seed % 2 else 5)).tolist()
    budget = int(torch.randint(items, 20 * items, (1,), generator=g))
    want = brute(costs, values, budget)
    if want is None:
        with pytest.raises(ConfigError):
            solve_mckp(costs, values, budget)
        return
    picks, cost, value = solve_mckp(costs, values, budget)
    assert cost <= budget and math.isclose(value, want[1], abs_tol=1e-9)
    assert cost == sum(costs[i][k] for i, k in enumerate(picks))


def test_beam_limit_still_feasible():
    g = torch.Generator().manual_seed(3)
    costs = torch.randint(1, 50, (12, 3), generator=g).tolist()
    values = torch.randn(12, 3, generator=g).tolist()
    picks, cost, _ = solve_mckp(costs, values, 300, beam=4)
    assert cost <= 300 and len(picks) == 12


SIZES = {"model.layers.0.self_attn.q_proj": (64, 64), "model.layers.0.self_attn.k_proj": (32, 64),
         "model.layers.0.self_attn.v_proj": (32, 64), "model.layers.0.mlp.down_proj": (64, 128)}


def scores_for(names, low=10.0, high=1.0):
    return {Scheme.parse("w2g64").name: {n: low * (i + 1) for i, n in enumerate(names)},
            Scheme.parse("w4g64").name: {n: high for n in names}}


def test_budget_is_respected_and_exact_bits_counted():
    s2, s4 = Scheme.parse("w2g64"), Scheme.parse("w4g64")
    assert layer_bits(s4, (64, 128)) == 4 * 64 * 128 + 16 * 64 * 2
    assert layer_bits(s4, (64, 128), count_scales=False) == 4 * 64 * 128
    a = allocate(scores_for(SIZES), SIZES, [s2, s4], avg_bits=3.0)
    assert a.total_bits <= a.budget_bits == math.floor(3.0 * a.params)
    assert set(a.plan.schemes()) == {s2, s4} and list(a.plan) == list(SIZES)
    loose = allocate(scores_for(SIZES), SIZES, [s2, s4], avg_bits=5.0)
    assert loose.plan.is_uniform and loose.plan.schemes() == [s4]


def test_impossible_budget_names_the_minimum():
    with pytest.raises(ConfigError, match=r"cheapest plan averages 2\.25"):
        allocate(scores_for(SIZES), SIZES, ["w2g64", "w4g64"], avg_bits=2.1)
    a = allocate(scores_for(SIZES), SIZES, ["w2g64", "w4g64"], avg_bits=2.1, count_scales=False)
    assert a.plan.schemes() == [Scheme.parse("w2g64")]


def test_ties_force_one_choice():
    ties = tie_qkv(list(SIZES))
    assert ties == [list(SIZES)[:3]]
    a = allocate(scores_for(SIZES), SIZES, ["w2g64", "w4g64"], avg_bits=3.2, ties=ties)
    assert len({a.plan[n] for n in ties[0]}) == 1


def test_lm_head_rule():
    sizes = {**SIZES, "lm_head": (256, 64)}
    sc = {Scheme.parse(k).name: {n: v for n in sizes} for k, v in (("w2g64", 0.0), ("w4g64", 1.0), ("w8", 2.0))}
    a = allocate(sc, sizes, ["w2g64", "w4g64", "w8"], avg_bits=8.5)
    assert a.plan.weight("lm_head").bits == 8 and a.plan.weight("model.layers.0.mlp.down_proj").bits == 2
    with pytest.raises(ConfigError, match="lm_head needs >= 6 bits"):
        allocate(sc, sizes, ["w2g64", "w4g64"], avg_bits=8.5)
    assert allocate(sc, sizes, ["w2g64", "w4g64"], avg_bits=8.5, lm_head_min_bits=0).plan.weight("lm_head").bits == 2


def test_delta_loss_matches_manual_gradient_and_restores_weights():
    m = tiny_model(layers=1)
    names = block_names(m)
    before = {n: m.get_submodule(n).weight.detach().clone() for n in names}
    c = calib(4, 16)
    got = delta_loss(m, names, ["w2g32"], c, mode="abs", batch_size=2, progress=False)[Scheme.parse("w2g32").name]
    signed = delta_loss(m, names, ["w2g32"], c, mode="signed", batch_size=4, progress=False)[Scheme.parse("w2g32").name]
    assert all(torch.equal(m.get_submodule(n).weight, before[n]) for n in names)
    ref = copy.deepcopy(m)
    with torch.no_grad():
        for n in names:
            ref.get_submodule(n).weight.copy_(qdq(before[n], "w2g32"))
    ref(input_ids=c, labels=c).loss.backward()
    for n in names:
        term = ref.get_submodule(n).weight.grad * (qdq(before[n], "w2g32") - before[n])
        assert math.isclose(got[n], float(term.abs().sum()), rel_tol=1e-4)
        assert math.isclose(signed[n], float(term.sum()), rel_tol=1e-3, abs_tol=1e-7)
    assert all(got[n] >= abs(signed[n]) for n in names)


def test_bf16_delta_loss_ranks_layers_like_fp32_and_runs_bf16_products():
    """bf16 only has to keep the ranking the knapsack sees; the weights must stay fp32."""
    m = tiny_model(layers=2)
    names = block_names(m)
    before = {n: m.get_submodule(n).weight.detach().clone() for n in names}
    c = calib(8, 16)
    key = Scheme.parse("w2g32").name
    ref = delta_loss(m, names, ["w2g32"], c, batch_size=4, progress=False)[key]
    seen = []  # autocast casts below F.linear: the products' dtype shows in the outputs
    hooks = [m.get_submodule(n).register_forward_hook(lambda _m, _i, out: seen.append(out.dtype)) for n in names]
    got = delta_loss(m, names, ["w2g32"], c, batch_size=4, progress=False, dtype="bf16")[key]
    for h in hooks:
        h.remove()
    assert seen and set(seen) == {torch.bfloat16}
    assert all(torch.equal(m.get_submodule(n).weight, before[n]) for n in names)
    assert all(m.get_submodule(n).weight.dtype == torch.float32 for n in names)
    a, b = torch.tensor([ref[n] for n in names]), torch.tensor([got[n] for n in names])
    rank = lambda t: t.argsort().argsort().double()  # noqa: E731
    assert torch.corrcoef(torch.stack([rank(a), rank(b)]))[0, 1] > 0.95
    assert torch.allclose(a, b, rtol=0.02)
    with pytest.raises(ConfigError, match="dtype"):
        delta_loss(m, names, ["w2g32"], c, progress=False, dtype="fp16")


def test_plan_json_and_png(tmp_path):
    a = allocate(scores_for(SIZES), SIZES, ["w2g64", "w4g64"], avg_bits=3.0)
    save_allocation(a, SIZES, tmp_path / "plan.json", tmp_path / "plan.png")
    assert Plan.load(tmp_path / "plan.json").layers == a.plan.layers
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize("from_end", [False, True])
def test_positional_plan_fills_one_end_within_budget(from_end):
    sizes = {f"model.layers.{i}.mlp.down_proj": (64, 128) for i in range(6)}
    lo, hi = Scheme.parse("w2g64"), Scheme.parse("w4g128")
    a = positional_plan(sizes, lo, hi, 3.0, from_end=from_end)
    picks = [a.plan[n].name for n in sizes]
    params = 6 * 64 * 128
    assert a.total_bits <= math.floor(3.0 * params) == a.budget_bits
    assert a.total_bits == sum(layer_bits(a.plan[n], sizes[n]) for n in sizes)
    k = picks.count(hi.name)
    assert 0 < k < 6
    assert picks == ([hi.name] * k + [lo.name] * (6 - k) if not from_end else [lo.name] * (6 - k) + [hi.name] * k)
    # one more high layer would break the budget
    assert a.total_bits + layer_bits(hi, (64, 128)) - layer_bits(lo, (64, 128)) > a.budget_bits
    with pytest.raises(ConfigError, match="below the all-w2g64 plan"):
        positional_plan(sizes, lo, hi, 2.0)
