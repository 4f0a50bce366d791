"""Mixed precision and llama.cpp K-mixes with fused MoE experts (issue 34): DeltaLoss, knapsack items, mix rules."""

from __future__ import annotations

import copy

import pytest
import torch
from test_accounting import make

from lowbit.formats import Scheme
from lowbit.models.experts import expert_tensors, planned_shape
from lowbit.nn.quant_experts import QuantStack
from lowbit.plans.kmix import mix_plan
from lowbit.plans.source import build_plan
from lowbit.ptq.mixed import MixedSettings, check_feasible, mixed_plan
from lowbit.ptq.sensitivity import delta_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def _calib(n: int = 4, seqlen: int = 24) -> torch.Tensor:
    return torch.randint(0, 128, (n, seqlen), generator=torch.Generator().manual_seed(0))


def _reference_scores(model, scheme: str, names, ids) -> dict[str, float]:
    """sum |g (.) (Q - W)| per experts tensor, g at Q: the model with every expert matrix put through RTN's own
    `QuantStack` (not DeltaLoss's quantizer), one backward over all batches."""
    m = copy.deepcopy(model)
    tensors = expert_tensors(m)
    params, diffs = {}, {}
    for n in names:
        t = tensors[n]
        p = m.get_submodule(t.module).get_parameter(t.param)
        w = p.detach().transpose(1, 2) if t.transposed else p.detach()
        q = QuantStack.from_float(w, scheme).dequantize()
        q = q.transpose(1, 2) if t.transposed else q
        diffs[n] = q - p.detach()
        with torch.no_grad():
            p.copy_(q)
        params[n] = p
    for p in m.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    for chunk in ids.split(2):
        (m(input_ids=chunk, labels=chunk).loss * (len(chunk) / len(ids))).backward()
    return {n: float((params[n].grad * diffs[n]).abs().sum()) for n in names}


@pytest.mark.parametrize("arch", ("qwen3_moe", "gpt_oss"))
def test_deltaloss_scores_each_experts_tensor_over_all_its_experts_and_restores_it(arch):
    model = make(arch).eval()
    names = list(expert_tensors(model))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = _calib()
    got = delta_loss(model, names, ["w2g8"], ids, batch_size=2, progress=False)[Scheme.parse("w2g8").name]
    want = _reference_scores(model, "w2g8", names, ids)
    assert set(got) == set(names) and all(v > 0 for v in got.values())
    for n in names:
        assert got[n] == pytest.approx(want[n], rel=1e-4)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # bit-exact restore
    assert all(not p.requires_grad or n in before for n, p in model.named_parameters())


def test_knapsack_sizes_a_fused_tensor_as_its_experts_and_meets_the_budget():
    model = make("qwen3_moe").eval()
    plan = build_plan(model, "w2g16")
    experts = expert_tensors(model)
    assert set(experts) <= set(plan)  # mixed precision plans the experts
    t = next(iter(experts.values()))
    assert planned_shape(model, t.name) == (t.count * t.out_features, t.in_features)
    settings = MixedSettings(avg_bits=3.0, options=("w2g16", "w4g16"), nsamples=4, dtype="fp32")
    alloc = mixed_plan(model, plan, settings, _calib(), progress=False)
    sizes = {n: planned_shape(model, n) for n in plan}
    assert alloc.plan.average_bits(sizes) <= 3.0 + 1e-9
    picked = {alloc.plan.weight(n).name for n in experts}
    assert picked <= {Scheme.parse("w2g16").name, Scheme.parse("w4g16").name} and set(alloc.plan) == set(plan)


def _reference_input_scores(model, recipe: str, ids) -> dict[str, float]:
    """sum |g (.) (Q(x) - x)| over every expert's two inputs, g at Q(x): the model's experts forward written out
    here (transformers' eager loop: routed tokens, gate/up, SiLU GLU, down, router weight), each input replaced by
    its quantization with a straight-through copy whose gradient is kept, the expert weights put through RTN's
    `QuantStack` first (options that all quantize inputs score the activation term only)."""
    from torch.nn import functional as F

    from lowbit.formats import Recipe, qdq_input

    rec = Recipe.parse(recipe)
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.requires_grad_(False)
    tensors = expert_tensors(m)
    for t in tensors.values():
        p = m.get_submodule(t.module).get_parameter(t.param)
        with torch.no_grad():
            p.copy_(QuantStack.from_float(p.detach(), rec.weight).dequantize())
    kept: dict[str, list] = {n: [] for n in tensors}

    def ste(x, name):
        x = x if x.requires_grad else x.detach().requires_grad_(True)
        q = qdq_input(x.detach(), rec.input, None)
        y = x + (q - x).detach()
        y.retain_grad()
        kept[name].append((y, (q - x).detach()))
        return y

    def patch(module, name):
        def forward(hidden, idx, weights):
            out = torch.zeros_like(hidden)
            for e in torch.unique(idx).tolist():
                tok, pos = torch.where(idx == e)
                g, u = F.linear(ste(hidden[tok], f"{name}.gate_up_proj"), module.gate_up_proj[e]).chunk(2, dim=-1)
                y = F.linear(ste(module.act_fn(g) * u, f"{name}.down_proj"), module.down_proj[e])
                out.index_add_(0, tok, y * weights[tok, pos, None])
            return out
        module.forward = forward

    for name in {t.module for t in tensors.values()}:
        patch(m.get_submodule(name), name)
    for chunk in ids.split(2):
        (m(input_ids=chunk, labels=chunk).loss * (len(chunk) / len(ids))).backward()
    return {n: sum(float((y.grad * d).abs().sum()) for y, d in kept[n]) for n in tensors}


def test_input_quantizing_options_score_experts_by_each_experts_activation_term():
    """W4A4 on experts was refused (no per-expert input scales then); now DeltaLoss scores each expert's inputs."""
    from gguf_moe_helpers import tiny_moe

    model = tiny_moe("qwen3_moe", layers=1)
    names = list(expert_tensors(model))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = _calib()
    got = delta_loss(model, names, ["w4a4-mxfp4"], ids, batch_size=2, progress=False)["w4a4-mxfp4"]
    want = _reference_input_scores(model, "w4a4-mxfp4", ids)
    assert set(got) == set(names) and all(v > 0 for v in got.values())
    for n in names:  # lowbit keeps Q(x) - x in bf16 until the backward: close, not equal
        assert got[n] == pytest.approx(want[n], rel=1e-2), n
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not any("forward" in vars(m) for m in model.modules())  # the experts' own forward is back


def test_mixed_precision_with_input_quantizing_options_quantizes_experts_with_per_expert_input_scales():
    """--avg-bits with W4A4 / W8A8 options on a MoE model: experts get input recipes and static per-expert scales."""
    from gguf_moe_helpers import tiny_moe

    from lowbit.ptq import quantize_model

    model = tiny_moe("qwen3_moe", layers=1)
    ids = _calib(8)
    settings = MixedSettings(avg_bits=6.0, options=("w4a4-nvfp4", "w8a8-fp8-static"), nsamples=8, dtype="fp32")
    check_feasible(model, build_plan(model, "w4g32"), settings)  # refused before: "per-expert input scales"
    plan = quantize_model(model, build_plan(model, "w4g32"), "rtn", {"search": False}, calib=ids, mixed=settings,
                          progress=False)
    stacks = {n: m for n, m in model.named_modules() if isinstance(m, QuantStack)}
    assert set(stacks) == set(expert_tensors(tiny_moe("qwen3_moe", layers=1)))
    for name, stack in stacks.items():
        assert stack.input_scheme is not None and stack.input_scheme == plan[name].input
        amax = stack.input_amax
        assert amax is not None and amax.shape == (8,) and bool(torch.isfinite(amax).all() and (amax > 0).all())
    with torch.no_grad():
        assert torch.isfinite(model(ids[:2]).logits).all()


def _moe_sizes(layers: int, shared: bool = False) -> dict[str, tuple[int, int]]:
    sizes = {}
    for i in range(layers):
        pre = f"model.layers.{i}"
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sizes[f"{pre}.self_attn.{p}"] = (256, 256)
        if shared:
            for p in ("gate_proj", "up_proj", "down_proj"):
                sizes[f"{pre}.mlp.shared_expert.{p}"] = (256, 256)
        sizes[f"{pre}.mlp.experts.gate_up_proj"] = (512, 256)
        sizes[f"{pre}.mlp.experts.down_proj"] = (256, 256)
    return sizes


def _names(plan, suffix: str) -> list[str]:
    return [plan[n].name for n in plan if n.endswith(suffix)]


def test_q4_k_m_gives_experts_llama_cpps_types_by_block_index():
    """llama_tensor_get_type with n_expert > 1: ffn_down by the block index in the name over n_layer (so a shared
    expert's ffn_down in the same block gets the same type), ffn_gate/up_exps the base type."""
    more = [0, 3, 6, 7]  # use_more_bits(i, 8): i < 1, i >= 7, (i - 1) % 3 == 2
    q4, q6 = Scheme.parse("q4_k").name, Scheme.parse("q6_k").name
    for shared in (False, True):
        plan = mix_plan(_moe_sizes(8, shared), "q4_k_m", n_gqa=1, n_expert=16)
        assert _names(plan, "experts.down_proj") == [q6 if i in more else q4 for i in range(8)]
        assert set(_names(plan, "experts.gate_up_proj")) == {q4}
        assert _names(plan, "v_proj") == [q6 if i in more else q4 for i in range(8)]  # attn_v: its own counter
        if shared:
            assert _names(plan, "shared_expert.down_proj") == _names(plan, "experts.down_proj")


def test_eight_experts_raise_attention_as_llama_cpp_does():
    plan = mix_plan(_moe_sizes(8), "q4_k_m", n_gqa=1, n_expert=8)
    q8 = Scheme.parse("w8g32").name
    assert set(_names(plan, "v_proj")) == {q8} and set(_names(plan, "k_proj")) == {q8}
    assert set(_names(plan, "o_proj")) == {Scheme.parse("q5_k").name}
    assert set(_names(plan, "q_proj")) == {Scheme.parse("q4_k").name}
    dense = mix_plan(_moe_sizes(8), "q3_k_l", n_gqa=1, n_expert=8)
    assert set(_names(dense, "o_proj")) == {Scheme.parse("q3_k").name}  # no Q5_K bump for Q3_K_L with 8 experts


def test_a_mix_on_a_moe_model_covers_every_experts_tensor():
    model = make("qwen3_moe", vocab=128)
    plan = build_plan(model, "gguf:q6_k")
    assert set(expert_tensors(model)) <= set(plan)
