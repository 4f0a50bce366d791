"""GPTQ's ``score_rule``: the attention-score projections (q_proj, k_proj) on their own scale rule, the rest searched."""

import pytest
import torch
from ptq_helpers import calib, tiny_model, uniform
from test_gptq import correlated

from lowbit.errors import ConfigError
from lowbit.formats import Scheme
from lowbit.formats.groups import to_groups
from lowbit.formats.integer import int_params
from lowbit.plans.plan import Plan
from lowbit.ptq.gptq import GPTQSettings, check_plan, gptq_layers, gptq_quantize, is_score_projection

Q, K, V = (f"model.layers.0.self_attn.{p}_proj" for p in "qkv")


def qkv(seed: int = 1) -> dict[str, tuple[torch.Tensor, Scheme]]:
    """Three [24, 96] matrices with an outlier column (what the clipping search cuts), one searched W4 g32 scheme."""
    s = Scheme.parse("w4g32").replace(rule="search")
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in (Q, K, V):
        w = torch.randn(24, 96, generator=g)
        w[:, 7] *= 6
        out[name] = (w, s)
    return out


def absmax_scales(w: torch.Tensor, s: Scheme) -> torch.Tensor:
    return int_params(to_groups(w.float(), 32), s)[0]


def test_score_projections_are_q_and_k_only():
    assert is_score_projection(Q) and is_score_projection(K)
    assert not any(map(is_score_projection, (V, "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.up_proj",
                                             "model.layers.0.self_attn.q_norm")))


@pytest.mark.parametrize("rule", ["noclip", "absmax"])
def test_score_rule_changes_q_and_k_only(rule):
    """q/k: never below abs-max (noclip) or exactly abs-max; v: the default's scales and values; the stored
    scheme stays the plan's. The default clips here, so each comparison can fail."""
    w, h = qkv(), correlated()
    ref, _ = gptq_layers(w, h, GPTQSettings())
    got, _ = gptq_layers(w, h, GPTQSettings(score_rule=rule))
    for name in (Q, K):
        amax = absmax_scales(*w[name])
        assert (ref[name].scales.abs() < amax.abs()).any()
        if rule == "absmax":
            assert torch.equal(got[name].scales, amax)
        else:
            assert (got[name].scales.abs() >= amax.abs()).all()
        assert got[name].scheme == w[name][1]
    torch.testing.assert_close(got[V].scales, ref[V].scales, rtol=0, atol=0)
    torch.testing.assert_close(got[V].dequantize(), ref[V].dequantize(), rtol=1e-6, atol=1e-6)


def test_score_rule_search_is_the_default():
    w, h = qkv(2), correlated(seed=3)
    a, _ = gptq_layers(w, h, GPTQSettings())
    b, _ = gptq_layers(w, h, GPTQSettings(score_rule="search"))
    assert all(torch.equal(a[n].codes, b[n].codes) and torch.equal(a[n].scales, b[n].scales) for n in w)


def test_score_rule_on_a_model_changes_only_q_and_k():
    """Through the block-wise pass: q/k layers differ from the default's, layer 0's v_proj (quantized in the same
    group, before anything differs downstream) does not."""
    models = {}
    for rule in ("search", "absmax"):
        m = tiny_model(layers=1)
        models[rule] = m
        gptq_quantize(m, uniform(m, "w4g32"), GPTQSettings(score_rule=rule), calib(), progress=False)
    a, b = ({n: m.get_submodule(n).qweight.dequantize() for n in (Q, K, V)} for m in models.values())
    assert not torch.equal(a[Q], b[Q]) and not torch.equal(a[K], b[K])
    torch.testing.assert_close(a[V], b[V], rtol=1e-6, atol=1e-6)


def test_score_rule_is_refused_where_it_cannot_apply():
    with pytest.raises(ConfigError, match="--score-rule changes the searched scales"):
        GPTQSettings(score_rule="noclip", search=False)
    with pytest.raises(ConfigError, match="score_rule must be one of"):
        GPTQSettings(score_rule="minmax")
    m = tiny_model(layers=1)
    check_plan(GPTQSettings(score_rule="noclip"), uniform(m, "w4g32"))
    check_plan(GPTQSettings(score_rule="absmax"), uniform(m, "nvfp4"))
    with pytest.raises(ConfigError, match="--score-rule noclip restricts the scale search of INT groups; nvfp4"):
        check_plan(GPTQSettings(score_rule="noclip"), uniform(m, "nvfp4"))
    mlp_only = Plan.uniform(["model.layers.0.mlp.up_proj"], "w4g32")
    with pytest.raises(ConfigError, match="the plan quantizes none"):
        check_plan(GPTQSettings(score_rule="absmax"), mlp_only)
