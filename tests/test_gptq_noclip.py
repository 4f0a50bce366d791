"""GPTQ's scale search without clipping (``clip=False``): only scales at or above abs-max, no least-squares refit."""

import pytest
import torch
from ptq_helpers import tiny_model, uniform
from test_gptq import correlated, output_error

from lowbit.errors import ConfigError
from lowbit.formats import Scheme, quantize
from lowbit.formats.groups import to_groups
from lowbit.formats.integer import (
    group_range,
    int_params,
    params_from_range,
    search_int_params,
    search_shrinks,
)
from lowbit.ptq.gptq import GPTQSettings, check_plan, gptq_layers, gptq_matrix

NOCLIP = GPTQSettings(clip=False)


def weighted_err(wg, sc, s, imp):
    lv = (wg / sc.unsqueeze(-1)).round().clamp(s.qmin, s.qmax)
    return ((lv * sc.unsqueeze(-1) - wg) ** 2 * imp).sum(-1)


def brute_noclip(wg: torch.Tensor, s: Scheme, imp: torch.Tensor) -> torch.Tensor:
    """Per group, the least weighted error over abs-max and every multiplier >= 1 of its range (symmetric INT)."""
    rng = group_range(wg, s)
    errs = [weighted_err(wg, int_params(wg, s)[0], s, imp)]
    errs += [weighted_err(wg, params_from_range(rng, s, f)[0], s, imp) for f in search_shrinks(s) if f >= 1]
    return torch.stack(errs).amin(0)


@pytest.mark.parametrize("scheme", ["w4g32", "w3g32", "w2g32"])
def test_no_clip_search_never_goes_below_abs_max(scheme):
    """Every scale is at or above abs-max's, and some above it (the search still aligns the grid)."""
    s = Scheme.parse(scheme).replace(rule="search")
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    w[:, 5] *= 6  # outliers the clipping search would cut
    wg, imp = to_groups(w, 32), torch.rand(1, 8, 32, generator=torch.Generator().manual_seed(1)) + 0.1
    absmax = int_params(wg, s)[0].abs()
    clipped = search_int_params(wg, s, imp)[0].abs()
    kept = search_int_params(wg, s, imp, clip=False)[0].abs()
    assert (kept >= absmax).all() and (kept > absmax).any()
    assert (clipped < absmax).any()  # the default does clip here: the comparison can fail


def test_no_clip_search_is_near_the_brute_force_optimum_among_unclipped_scales():
    """Coarse-to-fine against every multiplier >= 1 (symmetric INT4, the GPTQ W4 case): never worse than abs-max,
    within 2 % of the brute-force optimum on the total (the jagged error curve can hide a far optimum)."""
    s = Scheme.parse("w4g32").replace(rule="search")
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    wg, imp = to_groups(w, 32), torch.ones(1, 2, 32)
    got = weighted_err(wg, search_int_params(wg, s, imp, clip=False)[0], s, imp)
    assert (got <= weighted_err(wg, int_params(wg, s)[0], s, imp)).all()
    best = brute_noclip(wg, s, imp)
    assert (got >= best - 1e-6).all() and float(got.sum()) <= 1.02 * float(best.sum())


def test_gptq_no_clip_keeps_the_largest_weights_and_beats_rtn():
    s = Scheme.parse("w4g32").replace(rule="search")
    h = correlated()
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(1))
    out, _ = gptq_layers({"a": (w, s)}, h, NOCLIP)
    ref, _ = gptq_layers({"a": (w, s)}, h, GPTQSettings())
    absmax = int_params(to_groups(w, 32), s)[0].abs()
    assert (out["a"].scales.abs() >= absmax).all()
    assert not torch.equal(out["a"].scales, ref["a"].scales)  # the default searched scales clip
    deq, *_ = gptq_matrix(w, h, s, NOCLIP)
    assert torch.equal(out["a"].dequantize(), deq)
    rtn = quantize(w, s, h.diagonal().float()).dequantize()
    assert output_error(w, deq, h) < 0.8 * output_error(w, rtn, h)


def test_no_clip_is_refused_where_it_cannot_apply():
    with pytest.raises(ConfigError, match="--no-clip restricts the scale search; with --no-search"):
        GPTQSettings(clip=False, search=False)
    m = tiny_model(layers=1)
    check_plan(NOCLIP, uniform(m, "w4g32"))
    for scheme in ("nvfp4", "q4_k"):
        with pytest.raises(ConfigError, match=f"--no-clip restricts the scale search of INT groups; {scheme}"):
            check_plan(NOCLIP, uniform(m, scheme))
