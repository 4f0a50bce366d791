"""Calibration that reaches every expert: tokens per expert, all-experts statistics, the low-token fallback, GPTQ.

References: the router's own top-k (brute-force counts), the float experts module's output (all-experts mode
only reads), Hessians / importances summed by hand from the captured expert inputs, `gptq_layers` on one
expert's matrix as on a Linear, RTN of a starved expert's weights, and an uninterrupted run (resume).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_accounting import FAST, _last, make

from lowbit.cli import main
from lowbit.models.experts import expert_tensors
from lowbit.nn.quant_experts import QuantExperts
from lowbit.plans.plan import Plan
from lowbit.plans.source import build_plan
from lowbit.ptq import quantize_model
from lowbit.ptq.blockwise import PipelineOptions, quantize_blockwise
from lowbit.ptq.expert_calib import expert_stats
from lowbit.ptq.gptq import GPTQSettings, GPTQTuner, gptq_layers
from lowbit.ptq.methods import RunContext
from lowbit.ptq.rtn import searched


def _calib(n: int = 8, seqlen: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _experts(model) -> dict[str, torch.nn.Module]:
    return {t.module: model.get_submodule(t.module) for t in expert_tensors(model).values()}


def _capture(model, ids):
    """Each experts module's (hidden states, top-k indices) of a float forward of ``ids``."""
    got, handles = {}, []
    for name, m in _experts(model).items():
        def hook(_m, args, kwargs, name=name):
            got.setdefault(name, []).append((args[0].detach().reshape(-1, args[0].shape[-1]), args[1].detach()))
        handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return {n: (torch.cat([a for a, _ in v]), torch.cat([b for _, b in v])) for n, v in got.items()}


def _never_route(model, expert: int) -> None:
    """Patch every Qwen3-MoE router so ``expert`` is never among the top-k (the routing stays a valid top-k)."""
    for m in model.modules():
        if type(m).__name__ == "Qwen3MoeTopKRouter":
            def fwd(x, m=m):
                logits = torch.nn.functional.linear(x.reshape(-1, m.hidden_dim), m.weight)
                probs = torch.softmax(logits.masked_fill(torch.arange(m.num_experts) == expert, -torch.inf), -1)
                v, i = torch.topk(probs, m.top_k, dim=-1)
                return logits, (v / v.sum(-1, keepdim=True)).to(logits.dtype), i
            m.forward = fwd


@pytest.mark.parametrize("arch", ("qwen3_moe", "mixtral", "gpt_oss"))
def test_routed_counts_equal_the_routers_top_k_and_statistics_do_not_change_the_output(arch):
    model = make(arch)
    ids = _calib(3, 20)
    with torch.no_grad():
        want_logits = model(ids, output_router_logits=True)
    k = model.config.num_experts_per_tok
    brute = [torch.bincount(g.topk(k, -1).indices.reshape(-1), minlength=8) for g in want_logits.router_logits]
    for all_experts in (True, False):
        with torch.no_grad(), expert_stats(_experts(model), ("sumsq",), all_experts=all_experts) as st:
            logits = model(ids).logits
        assert torch.equal(logits, want_logits.logits)  # statistics only read: the block output is the router's
        for layer, s in enumerate(st.values()):
            cov = s.coverage()
            assert list(cov.routed) == brute[layer].tolist()
            assert list(cov.seen) == ([60] * 8 if all_experts else brute[layer].tolist())  # 3 x 20 tokens


def test_statistics_are_each_experts_own_inputs():
    """gate_up's importance = the squares of the tokens it gets; down's = those of the expert's activation."""
    model = make("qwen3_moe")
    ids = _calib(2, 16)
    seen = _capture(model, ids)
    for all_experts in (True, False):
        with torch.no_grad(), expert_stats(_experts(model), ("sumsq", "xtx"), all_experts=all_experts) as st:
            model(ids)
        for name, s in st.items():
            x, idx = seen[name]
            m = _experts(model)[name]
            for e in (0, 5):
                xe = x if all_experts else x[(idx == e).any(-1)]
                gate, up = (xe @ m.gate_up_proj[e].T).chunk(2, -1)
                act = torch.nn.functional.silu(gate) * up
                torch.testing.assert_close(s.result("sumsq", "gate_up_proj")[e].float(), xe.pow(2).sum(0))
                torch.testing.assert_close(s.result("xtx", "down_proj")[e].float(), act.T @ act)


def test_gptq_expert_is_gptq_of_its_matrix_under_its_own_hessian():
    """Experts-only plan, routed-only statistics: expert e's codes = gptq_layers on its [out, in] matrix with
    H = X_e^T X_e of the tokens the float router sent it (block 0's experts read the float model's states)."""
    model = make("qwen3_moe")
    c = _calib(8, 32)
    name = "model.layers.0.mlp.experts"
    x, idx = _capture(model, c)[name]
    plan = Plan({f"{name}.gate_up_proj": build_plan(model, "w3g8")[f"{name}.gate_up_proj"]})
    s = GPTQSettings(all_experts=False, expert_affinity=False)  # the plain Hessian of the routed tokens
    q = copy.deepcopy(model)
    quantize_model(q, plan, "gptq", s, calib=c, progress=False)
    stack = q.get_submodule(name).stacks()["gate_up_proj"]
    scheme = searched(plan).weight(f"{name}.gate_up_proj")
    for e in (0, 3, 7):
        xe = x[(idx == e).any(-1)].float()
        h = (xe.T @ xe).double()
        want = gptq_layers({"w": (model.get_submodule(name).gate_up_proj[e].detach(), scheme)}, h, s)[0]["w"]
        assert torch.equal(stack.expert(e).codes, want.codes) and torch.equal(stack.expert(e).scales, want.scales)


@pytest.mark.parametrize("method, settings", (("gptq", {"all_experts": False}), ("rtn", {"all_experts": False})))
def test_a_never_routed_expert_gets_rtn_on_its_weights_and_a_warning(method, settings):
    model = make("qwen3_moe")
    _never_route(model, 7)
    plan = Plan({n: r for n, r in build_plan(model, "w3g8").items() if "experts" in n})
    q = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"got fewer than 16 calibration tokens") as rec:
        quantize_model(q, plan, method, settings, calib=_calib(), progress=False)
    said = " ".join(str(w.message) for w in rec)
    assert all(f"model.layers.{i}.mlp.experts: experts [7] (0 tokens)" in said for i in (0, 1))
    for name, m in _experts(model).items():
        qe = q.get_submodule(name)
        assert qe.calibration["routed"][7] == 0 and qe.calibration["statistics_tokens"][7] == 0
        for p, stack in qe.stacks().items():
            w = getattr(m, p).detach()
            want = QuantExperts.from_float(copy.deepcopy(m), {p: searched(plan).weight(f"{name}.{p}")})
            assert torch.equal(stack.expert(7).codes, want.stacks()[p].expert(7).codes)  # RTN, uniform importance
            sc = stack.scales[7].float().abs()
            assert torch.isfinite(stack.dequantize()).all() and bool((sc > 0).all()) and not bool((sc == 1).any())
            assert not torch.equal(stack.dequantize()[7], torch.zeros_like(w[7]))


def test_all_experts_mode_calibrates_a_never_routed_expert_and_says_the_router_starves_it():
    model = make("qwen3_moe")
    _never_route(model, 7)
    plan = Plan({n: r for n, r in build_plan(model, "w3g8").items() if "experts" in n})
    q = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"router sent fewer than 16 .* experts \[7\]") as rec:
        quantize_model(q, plan, "gptq", {}, calib=_calib(), progress=False)
    assert not any("were quantized by" in str(w.message) for w in rec)  # no fallback needed
    assert all(q.get_submodule(n).calibration["statistics_tokens"] == [256] * 8 for n in _experts(model))


@pytest.mark.parametrize("arch", ("qwen3_moe", "mixtral", "gpt_oss"))
def test_gptq_on_experts_beats_rtn_on_the_model_output(arch):
    model = make(arch)
    c, ids = _calib(8, 32), _calib(4, 32, seed=11)
    plan = build_plan(model, "w2g8")
    with torch.no_grad():
        ref = model(ids).logits
    errs = {}
    for method in ("rtn", "gptq"):
        q = copy.deepcopy(model)
        quantize_model(q, plan, method, {}, calib=c, progress=False)  # both with their scale search
        with torch.no_grad():
            errs[method] = float((q(ids).logits - ref).pow(2).mean())
    assert errs["gptq"] < 0.97 * errs["rtn"], errs


class _Interrupt(Exception):
    pass


def _gptq(model, workdir, stop_after=None, offload=None):
    def on_block(i):
        if stop_after is not None and i == stop_after:
            raise _Interrupt

    s = GPTQSettings()
    plan = searched(build_plan(model, "w3g8"))
    ctx = RunContext(calib=_calib(), workdir=workdir, offload_dir=offload, progress=False)
    return quantize_blockwise(model, plan, GPTQTuner(s), {"method": "gptq", "config": s.to_dict()}, ctx,
                              PipelineOptions(), on_block=on_block)


def test_resume_and_offload_give_the_same_experts_and_token_counts(tmp_path):
    model = make("qwen3_moe")
    full = copy.deepcopy(model)
    _gptq(full, None)
    with pytest.raises(_Interrupt):
        _gptq(copy.deepcopy(model), tmp_path / "w", stop_after=0)
    resumed = copy.deepcopy(model)
    infos = _gptq(resumed, tmp_path / "w")
    assert [i.get("resumed") for i in infos] == [1.0, None]
    for name in _experts(model):
        a, b = full.get_submodule(name), resumed.get_submodule(name)
        assert a.calibration == b.calibration and sum(a.calibration["routed"]) == 8 * 32 * 2
        for p, s in a.stacks().items():
            assert torch.equal(s.codes, b.stacks()[p].codes) and torch.equal(s.scales, b.stacks()[p].scales)
    offloaded = copy.deepcopy(model)
    _gptq(offloaded, None, offload=str(tmp_path / "off"))  # float blocks on disk, one at a time in memory
    ids = _calib(2, 16, seed=3)
    with torch.no_grad():
        assert torch.equal(full(ids).logits, resumed(ids).logits)
        assert torch.equal(full(ids).logits, offloaded(ids).logits)


def test_cli_gptq_reports_tokens_per_expert_next_to_the_output(tmp_path, capsys, tiny_tokenizer):
    from test_accounting import _save

    src = _save("qwen3_moe", tmp_path / "m", tiny_tokenizer)
    out = tmp_path / "q"
    args = ["quantize", str(src), "--scheme", "w4g16", *FAST[2:], "--method", "gptq", "--nsamples", "4",
            "--seqlen", "32", "--no-all-experts", "--out", str(out)]
    assert main(args) == 0
    summary = _last(capsys)
    tokens = summary["expert_tokens"]
    assert set(tokens) == {f"model.layers.{i}.mlp.experts" for i in (0, 1)}
    assert all(sum(t["routed"]) == 4 * 32 * 2 and t["statistics_tokens"] == t["routed"] and not t["all_experts"]
               for t in tokens.values())
    assert json.loads((out / "expert_tokens.json").read_text()) == tokens
    assert summary["matmul_weights"]["float"].get("experts") is None


def test_rtn_search_gives_each_expert_the_importance_of_its_own_tokens():
    """Each expert's scales = the search under the squared inputs the router sent it, as a Linear's would be."""
    from lowbit.formats import quantize

    model = make("qwen3_moe")
    c = _calib(8, 32)
    name = "model.layers.1.mlp.experts"
    x, idx = _capture(model, c)[name]
    plan = Plan({f"{name}.{p}": build_plan(model, "w3g8")[f"{name}.{p}"] for p in ("gate_up_proj", "down_proj")})
    q = copy.deepcopy(model)
    quantize_model(q, plan, "rtn", {"all_experts": False, "expert_importance": True, "expert_affinity": False}, calib=c,
                   progress=False)  # the plain importance (the router-weighted one: tests/test_expert_affinity.py)
    stack = q.get_submodule(name).stacks()["gate_up_proj"]
    scheme = searched(plan).weight(f"{name}.gate_up_proj")
    w = model.get_submodule(name).gate_up_proj.detach()
    uniform = QuantExperts.from_float(copy.deepcopy(model.get_submodule(name)), {"gate_up_proj": scheme})
    differs = 0
    for e in range(8):
        xe = x[(idx == e).any(-1)]
        want = quantize(w[e], scheme, imp=xe.pow(2).sum(0))
        assert torch.equal(stack.expert(e).codes, want.codes)
        differs += not torch.equal(want.codes, uniform.stacks()["gate_up_proj"].expert(e).codes)
    assert differs >= 6  # the importance really changes the choice (vs the weights-alone search)
    d = copy.deepcopy(model)  # the default: the weights-alone search (it scored better on the MoE organism)
    quantize_model(d, plan, "rtn", calib=c, progress=False)
    for e in range(8):
        assert torch.equal(d.get_submodule(name).stacks()["gate_up_proj"].expert(e).codes,
                           uniform.stacks()["gate_up_proj"].expert(e).codes)


def _brute_force(qe, x, idx, weights, quantize_inputs: bool):
    """Token by token, slot by slot: expert e's dequantized matrices, its input and activation through qdq_input
    with e's own abs-max (or not), weighted by the router."""
    from lowbit.formats.inputs import qdq_input

    w = qe.float_weights()
    stacks = qe.stacks()

    def q(p, e, v):
        s = stacks[p]
        amax = None if s.input_amax is None else s.input_amax[e]
        return qdq_input(v, s.input_scheme, amax) if quantize_inputs else v

    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            g, u = (w["gate_up_proj"][e] @ q("gate_up_proj", e, x[t:t + 1])[0]).chunk(2)
            a = torch.nn.functional.silu(g) * u
            out[t] += weights[t, j] * (w["down_proj"][e] @ q("down_proj", e, a[None])[0])
    return out


@pytest.mark.parametrize("scheme", ("w4a4-nvfp4", "w8a8-fp8-static", "w8a8-int8", "w8a8-fp8"))
def test_input_quantized_experts_use_each_experts_own_static_scale_and_round_trip(tmp_path, scheme):
    from lowbit.files.native import load, save

    model = make("qwen3_moe")
    plan = build_plan(model, scheme)
    q = copy.deepcopy(model)
    quantize_model(q, plan, "rtn", {"all_experts": False}, calib=_calib(), progress=False)
    name = "model.layers.0.mlp.experts"
    qe = q.get_submodule(name)
    amax = {p: s.input_amax for p, s in qe.stacks().items()}
    static = plan[f"{name}.down_proj"].needs_calibration
    if static:
        assert all(a.shape == (8,) and bool((a > 0).all()) for a in amax.values())
        assert len(set(amax["down_proj"].tolist())) == 8  # one scale per expert, from its own activations
    else:
        assert all(a is None for a in amax.values())  # a dynamic input scheme: nothing to calibrate
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 32, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(40)])
    w = torch.rand(40, 2, generator=g)
    with torch.no_grad():
        got = qe(x, idx, w)
        want = _brute_force(qe, x, idx, w, True)
        plain = copy.deepcopy(qe)
        for s in plain.stacks().values():
            s.input_scheme, s.input_amax = None, None
        weight_only = plain(x, idx, w)  # the float module's own forward on the dequantized weights
    torch.testing.assert_close(_brute_force(qe, x, idx, w, False), weight_only, rtol=0, atol=1e-5)  # same routing
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got - weight_only).abs().max() > 1e-3 * weight_only.abs().max()  # the inputs really are quantized
    save(q, None, tmp_path / "q")
    back, _ = load(tmp_path / "q")
    for p, s in back.get_submodule(name).stacks().items():
        assert s.input_scheme == qe.stacks()[p].input_scheme
        assert (s.input_amax is None) == (amax[p] is None) and (amax[p] is None or torch.equal(s.input_amax, amax[p]))
    ids = _calib(2, 16, seed=4)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, q(ids).logits)


def test_statistics_behind_an_input_quantizer_are_those_of_the_quantized_inputs():
    """With quantizers, gate_up's Hessian is q(x)^T q(x) and down's that of q(act(q(x) W_gu^T)), expert by expert."""
    from lowbit.formats.inputs import qdq_input
    from lowbit.formats.recipe import Recipe

    model = make("qwen3_moe")
    ids = _calib(2, 16)
    seen = _capture(model, ids)
    scheme = Recipe.parse("w4a4-nvfp4").input
    amax = {"gate_up_proj": torch.linspace(1.0, 4.0, 8), "down_proj": torch.linspace(0.02, 0.09, 8)}
    fns = {p: (lambda e, v, p=p: qdq_input(v, scheme, amax[p][e])) for p in amax}
    with torch.no_grad(), expert_stats(_experts(model), ("xtx",), all_experts=False) as plain:
        model(ids)
    mods = _experts(model)
    from lowbit.ptq.expert_calib import ExpertStats

    stats = {n: ExpertStats(m, n, ("xtx",), all_experts=False, quantizers=fns) for n, m in mods.items()}
    for s in stats.values():
        s.__enter__()
    with torch.no_grad():
        model(ids)
    for s in stats.values():
        s.__exit__()
    for name, s in stats.items():
        x, idx = seen[name]
        m = mods[name]
        for e in (0, 5):
            xq = fns["gate_up_proj"](e, x[(idx == e).any(-1)])
            gate, up = (xq @ m.gate_up_proj[e].T).chunk(2, -1)
            aq = fns["down_proj"](e, torch.nn.functional.silu(gate) * up)
            torch.testing.assert_close(s.result("xtx", "gate_up_proj")[e].float(), xq.T @ xq)
            torch.testing.assert_close(s.result("xtx", "down_proj")[e].float(), aq.T @ aq)
            assert not torch.allclose(s.result("xtx", "down_proj")[e], plain[name].result("xtx", "down_proj")[e])


def test_gptq_with_an_input_recipe_calibrates_rtns_static_scales_and_quantizes_under_the_quantized_hessian():
    """W4A4 on experts with GPTQ: each expert's static input abs-max is the one RTN calibrates from the same tokens,
    and its codes = gptq_layers under H = q(X_e)^T q(X_e), its routed tokens through that quantizer."""
    from lowbit.formats.inputs import qdq_input

    model = make("qwen3_moe")
    c = _calib(8, 32)
    name = "model.layers.0.mlp.experts"
    x, idx = _capture(model, c)[name]
    plan = Plan({f"{name}.gate_up_proj": build_plan(model, "w4a4-nvfp4")[f"{name}.gate_up_proj"]})
    s = GPTQSettings(all_experts=False, expert_affinity=False)  # the plain Hessian of the routed tokens
    q, r = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(q, plan, "gptq", s, calib=c, progress=False)
    quantize_model(r, plan, "rtn", {"all_experts": False}, calib=c, progress=False)
    stack = q.get_submodule(name).stacks()["gate_up_proj"]
    amax = stack.input_amax
    assert torch.equal(amax, r.get_submodule(name).stacks()["gate_up_proj"].input_amax)
    assert len(set(amax.tolist())) > 4  # routed-only: each expert's own range (two may share a token's maximum)
    scheme = searched(plan).weight(f"{name}.gate_up_proj")
    for e in (0, 3, 7):
        xe = qdq_input(x[(idx == e).any(-1)].float(), stack.input_scheme, amax[e])
        want = gptq_layers({"w": (model.get_submodule(name).gate_up_proj[e].detach(), scheme)},
                           (xe.T @ xe).double(), s)[0]["w"]
        assert torch.equal(stack.expert(e).codes, want.codes) and torch.equal(stack.expert(e).scales, want.scales)
