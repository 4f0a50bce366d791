"""Router-weighted (affinity-weighted) expert Hessians for GPTQ (`GPTQSettings.expert_affinity`, the default), and
the same weighting of RTN's per-expert importance (`RTNSettings.expert_affinity`, the default of ``expert_importance``).

References: the experts module's own forward (perturbing one expert's ``down_proj`` moves the block
output by exactly ``tr(dW H_g dW^T)``, ``H_g`` the routing-weight-squared Hessian of its routed
tokens), a brute-force Hessian from a loop over tokens and their top-k with the router's weights,
`gptq_layers` on one expert's matrix under that Hessian, `quantize` of one expert's matrix under that
Hessian's diagonal (RTN), and the plain statistics kept for an expert the router starves.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_accounting import make
from test_expert_calib import _calib, _experts, _never_route

from lowbit.errors import ConfigError
from lowbit.formats import quantize
from lowbit.plans.plan import Plan
from lowbit.plans.source import build_plan
from lowbit.ptq import quantize_model
from lowbit.ptq.expert_calib import ExpertStats
from lowbit.ptq.gptq import GPTQSettings, gptq_layers
from lowbit.ptq.methods import make_settings
from lowbit.ptq.rtn import RTNSettings, searched

NAME = "model.layers.0.mlp.experts"


def _routing(model, ids) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each experts module's (hidden states [T, H], top-k indices [T, k], routing weights [T, k]) of a float
    forward (its three positional arguments in every transformers 5 MoE block)."""
    got, handles = {}, []
    for name, m in _experts(model).items():
        def hook(_m, args, kwargs, name=name):
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            got.setdefault(name, []).append((x, args[1].detach().reshape(x.shape[0], -1),
                                             args[2].detach().reshape(x.shape[0], -1)))
        handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return {n: tuple(torch.cat([v[i] for v in vs]) for i in range(3)) for n, vs in got.items()}


def _act(m, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s down-projection input for one token, written out per architecture from transformers' code."""
    if getattr(m, "is_transposed", False):  # gpt-oss: [E, in, out] storage, bias, interleaved clamped GLU
        h = x @ m.gate_up_proj[e] + m.gate_up_proj_bias[e]
        gate, up = h[::2].clamp(max=m.limit), h[1::2].clamp(-m.limit, m.limit)
        return (up + 1) * gate * torch.sigmoid(gate * m.alpha)
    gate, up = (m.gate_up_proj[e] @ x).chunk(2)
    return torch.nn.functional.silu(gate) * up


def _brute(m, x, idx, g, all_experts: bool):
    """Per expert and parameter: (plain Hessian, g^2-weighted Hessian of the routed tokens, routed count), float64,
    from a loop over tokens and their top-k slots."""
    count = m.gate_up_proj.shape[0]
    shapes = {"gate_up_proj": x.shape[1], "down_proj": _act(m, 0, x[0]).shape[0]}
    plain = {p: torch.zeros(count, n, n, dtype=torch.float64) for p, n in shapes.items()}
    weighted = {p: torch.zeros(count, n, n, dtype=torch.float64) for p, n in shapes.items()}
    routed = torch.zeros(count, dtype=torch.int64)
    with torch.no_grad():
        for t in range(x.shape[0]):
            picks = {int(e): float(w) for e, w in zip(idx[t], g[t], strict=True)}
            for e in range(count):
                if e not in picks and not all_experts:
                    continue
                ins = {"gate_up_proj": x[t].double(), "down_proj": _act(m, e, x[t]).double()}
                for p, v in ins.items():
                    plain[p][e] += torch.outer(v, v)
                    if e in picks:
                        weighted[p][e] += picks[e] ** 2 * torch.outer(v, v)
                routed[e] += e in picks
    return plain, weighted, routed


def _mix(plain, weighted, routed, floor: float, min_tokens: int) -> torch.Tensor:
    out = plain.clone()
    for e in range(plain.shape[0]):
        if routed[e] >= min_tokens:
            out[e] = weighted[e] + floor * weighted[e].trace() / plain[e].trace() * plain[e]
    return out


@pytest.mark.parametrize("arch", ("qwen3_moe", "mixtral", "gpt_oss"))
def test_down_projs_weighted_hessian_is_exactly_the_block_outputs_error(arch):
    """Perturb expert e's down_proj by dW: the experts module's output moves by ||dY||^2 = tr(dW H_g dW^T), with
    H_g the router-weighted Hessian (floor 0): g^2, not g, and nothing from tokens the router sent elsewhere."""
    model = make(arch)
    ids = _calib(3, 24)
    m = _experts(model)[NAME]
    x, idx, g = _routing(model, ids)[NAME]
    st = ExpertStats(m, NAME, ("xtx",), affinity=True)
    with torch.no_grad(), st:
        model(ids)
    h = st.weighted("xtx", "down_proj", 0.0, 1)
    transposed = bool(getattr(m, "is_transposed", False))
    torch.manual_seed(1)
    for e in (0, 3, 6):
        assert int(st.routed[e]) > 0
        pert = copy.deepcopy(m)
        dw = 1e-2 * torch.randn(pert.down_proj.shape[1:])  # stored layout; [out, in] is its transpose for gpt-oss
        with torch.no_grad():
            pert.down_proj[e] += dw
            dy = (pert(x, idx, g) - m(x, idx, g)).double()
        d = (dw.T if transposed else dw).double()
        torch.testing.assert_close(dy.pow(2).sum(), torch.trace(d @ h[e] @ d.T), rtol=2e-3, atol=0)


@pytest.mark.parametrize("arch", ("qwen3_moe", "gpt_oss"))
@pytest.mark.parametrize("all_experts", (True, False))
def test_weighted_statistics_equal_a_brute_force_loop_over_tokens_with_the_routers_weights(arch, all_experts):
    model = make(arch)
    ids = _calib(2, 20)
    m = _experts(model)[NAME]
    x, idx, g = _routing(model, ids)[NAME]
    st = ExpertStats(m, NAME, ("xtx", "sumsq"), all_experts=all_experts, affinity=True)
    with torch.no_grad(), st:
        model(ids)
    plain, weighted, routed = _brute(m, x, idx, g, all_experts)
    assert torch.equal(st.routed, routed)
    for p in ("gate_up_proj", "down_proj"):
        for floor, min_tokens in ((0.1, 16), (0.0, 1), (2.5, 8)):
            want = _mix(plain[p], weighted[p], routed, floor, min_tokens)
            torch.testing.assert_close(st.weighted("xtx", p, floor, min_tokens), want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(st.weighted("sumsq", p, floor, min_tokens),
                                       torch.diagonal(want, dim1=1, dim2=2), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st.result("xtx", p), plain[p], rtol=1e-5, atol=1e-6)  # plain sums untouched


def test_gptq_expert_is_gptq_of_its_matrix_under_the_router_weighted_hessian():
    """Experts-only plan (block 0 reads the float model's states): expert e's codes = gptq_layers on its matrix with
    the brute-force router-weighted Hessian (all-experts floor 0.1), and they differ from the default's."""
    model = make("qwen3_moe")
    c = _calib(8, 32)
    x, idx, g = _routing(model, c)[NAME]
    m = _experts(model)[NAME]
    plan = Plan({f"{NAME}.gate_up_proj": build_plan(model, "w3g8")[f"{NAME}.gate_up_proj"]})
    s = GPTQSettings()  # the default: expert_affinity on, floor 0.1
    q, base = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(q, plan, "gptq", s, calib=c, progress=False)
    quantize_model(base, plan, "gptq", {"expert_affinity": False}, calib=c, progress=False)
    stack, default = (z.get_submodule(NAME).stacks()["gate_up_proj"] for z in (q, base))
    plain, weighted, routed = _brute(m, x, idx, g, True)
    h = _mix(plain["gate_up_proj"], weighted["gate_up_proj"], routed, 0.1, 16)
    scheme = searched(plan).weight(f"{NAME}.gate_up_proj")
    moved = 0
    for e in range(8):
        assert routed[e] >= 16
        want = gptq_layers({"w": (m.gate_up_proj[e].detach(), scheme)}, h[e], s)[0]["w"]
        assert torch.equal(stack.expert(e).codes, want.codes) and torch.equal(stack.expert(e).scales, want.scales)
        moved += not torch.equal(stack.expert(e).codes, default.expert(e).codes)
    assert moved >= 4


RTN_AFFINITY = {"expert_importance": True}  # the default weighting of --expert-importance
RTN_PLAIN = {"expert_importance": True, "expert_affinity": False}


@pytest.mark.parametrize("method, weighted, plain, checked", [
    # GPTQ: block 0 reads float states in both runs, so its gate_up Hessians differ only by the weighting
    ("gptq", {}, {"expert_affinity": False}, [(0, "gate_up_proj")]),
    ("rtn", RTN_AFFINITY, RTN_PLAIN, [(0, "down_proj"), (1, "down_proj")]),
])
def test_an_expert_the_router_starves_keeps_the_plain_statistics(method, weighted, plain, checked):
    """GPTQ's all-experts Hessian / RTN's plain importance for expert 7, which the router never picks (the
    weighting's default against --no-expert-affinity: the same codes for it, others moved)."""
    model = make("qwen3_moe")
    _never_route(model, 7)
    plan = Plan({n: r for n, r in build_plan(model, "w3g8").items() if "experts" in n})
    q, base = copy.deepcopy(model), copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"router sent fewer than 16 .* experts \[7\]"):
        quantize_model(q, plan, method, weighted, calib=_calib(), progress=False)
    with pytest.warns(UserWarning, match=r"router sent fewer than 16"):
        quantize_model(base, plan, method, plain, calib=_calib(), progress=False)
    for layer, param in checked:
        a, b = (z.get_submodule(f"model.layers.{layer}.mlp.experts").stacks()[param] for z in (q, base))
        assert torch.equal(a.expert(7).codes, b.expert(7).codes) and torch.equal(a.expert(7).scales, b.expert(7).scales)
        assert any(not torch.equal(a.expert(e).codes, b.expert(e).codes) for e in range(7))


def test_what_the_weighting_cannot_honour_is_refused():
    with pytest.raises(ConfigError, match="which --no-expert-affinity turns off: drop one of them"):
        GPTQSettings(expert_affinity=False, affinity_floor=0.5)
    with pytest.raises(ConfigError, match="affinity_floor must be a finite number >= 0"):
        GPTQSettings(expert_affinity=True, affinity_floor=-0.1)
    model = make("qwen3_moe")
    m = _experts(model)[NAME]
    st = ExpertStats(m, NAME, ("xtx",), affinity=True)
    with st, pytest.raises(ConfigError, match="without routing weights.*--no-expert-affinity"):
        m(torch.randn(4, 32), torch.zeros(4, 2, dtype=torch.long), top_k_weights=None)


@pytest.mark.parametrize("all_experts", (True, False))
def test_rtn_expert_is_the_search_under_the_diagonal_of_the_router_weighted_hessian(all_experts):
    """RTN with --expert-importance (its default --expert-affinity): every expert matrix (both parameters, a later
    layer) = the search under the diagonal of the brute-force router-weighted Hessian (floor 0.1) of the float
    model's tokens, and many differ from the plain importance's (--no-expert-affinity)."""
    model = make("qwen3_moe")
    c = _calib(8, 32)
    name = "model.layers.1.mlp.experts"
    x, idx, g = _routing(model, c)[name]
    m = _experts(model)[name]
    params = ("gate_up_proj", "down_proj")
    plan = Plan({f"{name}.{p}": build_plan(model, "w3g8")[f"{name}.{p}"] for p in params})
    q, base = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(q, plan, "rtn", {**RTN_AFFINITY, "all_experts": all_experts}, calib=c, progress=False)
    quantize_model(base, plan, "rtn", {**RTN_PLAIN, "all_experts": all_experts}, calib=c, progress=False)
    plain, weighted, routed = _brute(m, x, idx, g, all_experts)
    moved = 0
    for p in params:
        imp = torch.diagonal(_mix(plain[p], weighted[p], routed, 0.1, 16), dim1=1, dim2=2)
        scheme = searched(plan).weight(f"{name}.{p}")
        got, default = (z.get_submodule(name).stacks()[p] for z in (q, base))
        for e in range(8):
            assert routed[e] >= 16
            want = quantize(getattr(m, p)[e].detach(), scheme, imp=imp[e].float())
            assert torch.equal(got.expert(e).codes, want.codes) and torch.equal(got.expert(e).scales, want.scales)
            moved += not torch.equal(got.expert(e).codes, default.expert(e).codes)
    assert moved >= 8




def test_what_rtns_weighting_cannot_honour_is_refused():
    """The weighting is read only with --expert-importance (and the search): given by name elsewhere it is refused,
    not dropped; RTN's own default (the weights-alone search) takes it as a default without a word."""
    assert RTNSettings().expert_affinity and not RTNSettings().weighted_importance
    assert RTNSettings(expert_importance=True).weighted_importance
    with pytest.raises(ConfigError, match="--expert-affinity weights RTN's per-expert importance, which is off: pass "
                                          "--expert-importance, or drop --expert-affinity"):
        make_settings("rtn", {"expert_affinity": True})
    with pytest.raises(ConfigError, match="--no-expert-affinity weights .* which --no-search turns off"):
        make_settings("rtn", {"search": False, "expert_importance": True, "expert_affinity": False})
    with pytest.raises(ConfigError, match="--affinity-floor weights RTN's per-expert importance, which is off"):
        make_settings("rtn", {"affinity_floor": 0.5})
    with pytest.raises(ConfigError, match="which --no-expert-affinity turns off: drop one of them"):
        RTNSettings(expert_importance=True, expert_affinity=False, affinity_floor=0.5)
    with pytest.raises(ConfigError, match="affinity_floor must be a finite number >= 0"):
        RTNSettings(expert_importance=True, affinity_floor=-0.1)
    assert make_settings("rtn", {**RTN_PLAIN}).weighted_importance is False
    assert make_settings("rtn", {"expert_importance": True, "affinity_floor": 0.0}).affinity_floor == 0.0
