"""SignRound / SignRoundV2 on fused mixture-of-experts experts (issue 34 point 3).

Tiny random Qwen3-MoE (fused ``[E, 2I, H]`` / ``[E, H, I]``) and gpt-oss (transposed,
interleaved gate/up, biases, clamped GLU) from their configs: tuning lowers the error RTN
leaves, the frozen `QuantExperts` computes exactly what the tuned fake-quant forward did,
the router is untouched, and resume / offload give the same codes as one uninterrupted run.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_accounting import make
from test_ptq_pipeline import Interrupt

from lowbit.models.experts import expert_tensors
from lowbit.models.layers import decoder_blocks
from lowbit.nn.quant_experts import QuantExperts, QuantStack, quant_stacks
from lowbit.plans.plan import Plan
from lowbit.plans.source import build_plan
from lowbit.ptq import quantize_model
from lowbit.ptq.blockwise import PipelineOptions, quantize_blockwise
from lowbit.ptq.expert_rounding import StackRounder, TunedExperts
from lowbit.ptq.methods import RunContext
from lowbit.ptq.signround import SignRoundTuner, make_config, signround_quantize

ARCHS = ("qwen3_moe", "gpt_oss")


pytestmark = pytest.mark.usefixtures("one_thread")


def _calib(n: int = 8, seqlen: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _experts_plan(model: torch.nn.Module, scheme: str) -> Plan:
    plan = build_plan(model, scheme)
    return Plan({n: plan[n] for n in expert_tensors(model)})


def _routers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".gate." in n or ".router." in n}


def _logit_mse(model: torch.nn.Module, ref: torch.Tensor, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(ids).logits - ref).pow(2).mean())


def _stacks_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = quant_stacks(a), quant_stacks(b)
    assert sa.keys() == sb.keys() and sa
    return all(torch.equal(sa[n].codes, sb[n].codes) and torch.equal(sa[n].scales, sb[n].scales) for n in sa)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("v2", (False, True))
def test_tuning_the_experts_lowers_the_error_rtn_leaves_and_keeps_the_router(arch, v2):
    model = make(arch).eval()
    plan = _experts_plan(model, "w2g8")
    calib = _calib()
    routers = _routers(model)
    with torch.no_grad():
        fp = model(calib).logits
    rtn = copy.deepcopy(model)
    quantize_model(rtn, plan, "rtn", {"search": v2}, calib=calib, progress=False, keep16=False)
    tuned = copy.deepcopy(model)
    infos = signround_quantize(tuned, plan, make_config(iters=40, batch_size=4, v2=v2), calib, progress=False)
    assert len(quant_stacks(tuned)) == 4 and not expert_tensors(tuned)  # both layers' gate_up / down quantized
    assert all(i["loss"] < i["rtn_loss"] for i in infos)  # every block's own loss went down
    assert _logit_mse(tuned, fp, calib) < _logit_mse(rtn, fp, calib)  # and the model's output error with it
    assert all(torch.equal(p, routers[n]) for n, p in _routers(tuned).items()) and routers


@pytest.mark.parametrize("arch, scheme", [("qwen3_moe", "w4g8"), ("gpt_oss", "w4g8"), ("qwen3_moe", "nvfp4"),
                                          ("gpt_oss", "nvfp4")])
def test_iters0_is_rtn_of_every_expert(arch, scheme):
    model = make(arch).eval()
    plan = _experts_plan(model, scheme)
    rtn, sr = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(rtn, plan, "rtn", {"search": False}, progress=False, keep16=False)
    signround_quantize(sr, plan, make_config(iters=0), _calib(), progress=False)
    assert _stacks_equal(rtn, sr)


def _perturb(rounder: StackRounder, seed: int) -> None:
    """Move every parameter off its start, as tuning does (offsets in [-0.5, 0.5], factors near 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in rounder.named_parameters():
            noise = torch.rand(p.shape, generator=g)
            p.copy_(noise - 0.5 if name.endswith(".v") else 0.8 + 0.3 * noise)
        rounder.clamp_()


@pytest.mark.parametrize("arch, scheme, v2", [
    ("qwen3_moe", "w3g8", False), ("qwen3_moe", "w4g8a", False), ("qwen3_moe", "w2g8", True),
    ("qwen3_moe", "nvfp4", False), ("gpt_oss", "w3g8", True), ("gpt_oss", "w4g8a", False),
    ("gpt_oss", "nvfp4", True)])
def test_frozen_experts_compute_exactly_what_the_tuned_forward_did(arch, scheme, v2):
    from lowbit.formats import Scheme

    model = make(arch).eval()
    experts = decoder_blocks(model)[0].mlp.experts
    s = Scheme.parse(scheme)
    transposed = bool(getattr(experts, "is_transposed", False))
    rounders = {}
    for i, (name, p) in enumerate((n, p) for n, p in experts.named_parameters(recurse=False) if p.dim() == 3):
        w = p.detach().transpose(1, 2) if transposed else p.detach()
        rounders[name] = StackRounder(w, s, None, v2)
        _perturb(rounders[name], i)
    tuned = TunedExperts(experts, rounders)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, experts.gate_up_proj.shape[-1 if not transposed else 1], generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(20)])
    wts = torch.rand(20, 2, generator=g)
    with torch.no_grad():
        want = tuned(x, idx, wts)
        frozen = QuantExperts(experts, {n: r.export() for n, r in rounders.items()})
        got = frozen(x, idx, wts)
    assert torch.equal(got, want)
    assert all(isinstance(m, QuantStack) for m in frozen.stacks().values()) and len(frozen.stacks()) == 2


@pytest.mark.parametrize("scheme, v2", [("q4_k", False), ("q3_k", True), ("mxfp4", False), ("mxfp4", True)])
def test_wide_formats_tune_and_freeze_exactly(scheme, v2):
    """K-quants (256-column super-blocks) and MXFP4 (32-blocks): a standalone Qwen3-MoE experts module of 256 columns."""
    import transformers as tf
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from lowbit.formats import Scheme

    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=256, num_experts=3, num_experts_per_tok=2)
    experts = Qwen3MoeExperts(cfg)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(experts.down_proj, std=0.05)
    rounders = {n: StackRounder(experts.get_parameter(n).detach(), Scheme.parse(scheme), None, v2)
                for n in ("gate_up_proj", "down_proj")}
    for i, r in enumerate(rounders.values()):
        _perturb(r, i)
    g = torch.Generator().manual_seed(1)
    x, idx, wts = torch.randn(6, 256, generator=g), torch.randint(0, 3, (6, 2), generator=g), torch.rand(6, 2)
    with torch.no_grad():
        want = TunedExperts(experts, rounders)(x, idx, wts)
        got = QuantExperts(experts, {n: r.export() for n, r in rounders.items()})(x, idx, wts)
    assert torch.equal(got, want)


def _run(model, plan, workdir=None, offload=None, stop_after=None):
    def on_block(i):
        if stop_after is not None and i == stop_after:
            raise Interrupt

    cfg = make_config(iters=6, batch_size=4, v2=True)
    return quantize_blockwise(model, plan, SignRoundTuner(cfg), {"method": "signround2", "config": cfg.to_dict()},
                              RunContext(calib=_calib(), workdir=workdir, offload_dir=offload, progress=False),
                              PipelineOptions(chunk=4), on_block=on_block)


@pytest.mark.parametrize("arch", ARCHS)
def test_resume_and_offload_give_the_same_experts(arch, tmp_path):
    model = make(arch).eval()
    plan = build_plan(model, "w3g8")  # attention Linears and experts together
    full = copy.deepcopy(model)
    _run(full, plan)
    part = copy.deepcopy(model)
    with pytest.raises(Interrupt):
        _run(part, plan, workdir=tmp_path / "w", stop_after=0)
    resumed = copy.deepcopy(model)
    infos = _run(resumed, plan, workdir=tmp_path / "w", offload=tmp_path / "off")
    assert [i.get("resumed", 0.0) for i in infos] == [1.0, 0.0]
    assert _stacks_equal(full, resumed)
    ids = _calib(2, 16, seed=7)
    with torch.no_grad():
        assert torch.equal(full(ids).logits, resumed(ids).logits)


def test_cli_signround2_quantizes_the_experts_and_the_file_evaluates(tmp_path, capsys, tiny_tokenizer):
    from test_accounting import _last, _save

    from lowbit.cli import main

    src = _save("qwen3_moe", tmp_path / "moe", tiny_tokenizer)
    out = tmp_path / "q"
    assert main(["quantize", str(src), "--scheme", "w4g16", "--method", "signround2", "--iters", "4",
                 "--nsamples", "4", "--seqlen", "32", "--no-eval", "--json", "--out", str(out)]) == 0
    acc = _last(capsys)["matmul_weights"]
    assert "experts" in acc["quantized"] and set(acc["float"]) == {"router", "embeddings", "lm_head"}
    assert main(["eval", str(out), "--windows", "2", "--eval-seqlen", "32", "--json"]) == 0
    assert _last(capsys)["ppl"] > 1


def test_an_expert_no_token_reaches_keeps_its_rtn_start_finite():
    """Its rounder gets a zero gradient (sign 0): it stays exactly where RTN put it, never NaN, while the routed
    experts move (gpt-oss: a router bias of -1e4 keeps expert 7 out of every top-k)."""
    model = make("gpt_oss").eval()
    with torch.no_grad():
        for block in decoder_blocks(model):
            block.mlp.router.bias[7] = -1e4
    plan = _experts_plan(model, "w2g8")
    rtn, sr = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(rtn, plan, "rtn", {"search": False}, progress=False, keep16=False)
    signround_quantize(sr, plan, make_config(iters=30, batch_size=4), _calib(), progress=False)
    a, b = quant_stacks(rtn), quant_stacks(sr)
    for n in a:
        assert torch.equal(a[n].codes[7], b[n].codes[7]) and torch.equal(a[n].scales[7], b[n].scales[7])
        assert torch.isfinite(b[n].scales).all()
    assert any(not torch.equal(a[n].codes[:7], b[n].codes[:7]) for n in a)


@pytest.mark.parametrize("arch, scheme, v2", [("qwen3_moe", "w4a4-nvfp4", True), ("gpt_oss", "w4a4-nvfp4", False),
                                              ("qwen3_moe", "w8a8-int8", True), ("gpt_oss", "w8a8-fp8-static", True)])
def test_frozen_experts_with_quantized_inputs_compute_exactly_what_the_tuned_forward_did(arch, scheme, v2):
    """Input recipes: the tuned forward quantizes each expert's two inputs with its own static scale, as the frozen
    module will (the same routed loop), and differs from the weight-only forward (the inputs really are quantized)."""
    from lowbit.formats.recipe import Recipe

    model = make(arch).eval()
    experts = decoder_blocks(model)[0].mlp.experts
    recipe = Recipe.parse(scheme)
    transposed = bool(getattr(experts, "is_transposed", False))
    rounders, inputs = {}, {}
    for i, (name, p) in enumerate((n, p) for n, p in experts.named_parameters(recurse=False) if p.dim() == 3):
        w = p.detach().transpose(1, 2) if transposed else p.detach()
        rounders[name] = StackRounder(w, recipe.weight, None, v2)
        _perturb(rounders[name], i)
        amax = torch.linspace(0.5, 3.0, 8) * (1 + i) if recipe.needs_calibration else None
        inputs[name] = (recipe.input, amax)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, experts.gate_up_proj.shape[-1 if not transposed else 1], generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(20)])
    wts = torch.rand(20, 2, generator=g)
    with torch.no_grad():
        want = TunedExperts(experts, rounders, inputs)(x, idx, wts)
        weight_only = TunedExperts(experts, rounders)(x, idx, wts)
        frozen = QuantExperts(experts, {n: r.export().with_input(*inputs[n]) for n, r in rounders.items()})
        got = frozen(x, idx, wts)
    assert torch.equal(got, want)
    assert (want - weight_only).abs().max() > 1e-3 * weight_only.abs().max()
    xg = x.clone().requires_grad_(True)  # tuning: the input quantization passes gradients straight through
    TunedExperts(experts, rounders, inputs)(xg, idx, wts).sum().backward()
    assert xg.grad is not None and bool(xg.grad.abs().sum() > 0)
    assert all(p.grad is not None for r in rounders.values() for p in r.parameters() if p.requires_grad)


def test_signround2_with_an_input_recipe_tunes_on_quantized_inputs_with_rtns_static_scales():
    model = make("qwen3_moe").eval()
    plan = _experts_plan(model, "w4a4-nvfp4")
    calib = _calib()
    rtn, tuned = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(rtn, plan, "rtn", {}, calib=calib, progress=False, keep16=False)
    infos = signround_quantize(tuned, plan, make_config(iters=20, batch_size=4, v2=True), calib, progress=False)
    assert all(i["loss"] <= i["rtn_loss"] for i in infos) and any(i["loss"] < i["rtn_loss"] for i in infos)
    got, ref = quant_stacks(tuned), quant_stacks(rtn)
    assert got.keys() == ref.keys() and len(got) == 4
    for n, s in got.items():  # block 0's experts read the float states: the same calibration as RTN's
        assert s.input_scheme == ref[n].input_scheme
        if ".0." in n:
            assert torch.equal(s.input_amax, ref[n].input_amax)
