"""Fused mixture-of-experts experts as quantized weights (RTN), on tiny random models of each architecture.

References: the float experts module's own forward on the dequantized weights (the routing must be the
model's, bit for bit), RTN of each expert's matrix as a plain Linear (`QuantLinear.from_linear`), and the
native checkpoint's exact round trip.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_accounting import FAST, _last, _matmul_params, _save, make

from lowbit.cli import main
from lowbit.errors import ConfigError
from lowbit.files.native import load, save
from lowbit.models.accounting import account_model
from lowbit.models.experts import expert_tensors
from lowbit.nn import QuantLinear
from lowbit.nn.quant_experts import QuantExperts, QuantStack, quant_stacks
from lowbit.plans.plan import Plan
from lowbit.plans.source import build_plan
from lowbit.ptq import quantize_model

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss")


def _reference(model: torch.nn.Module, quantized: torch.nn.Module) -> torch.nn.Module:
    """``model`` (float) with every quantized experts tensor of ``quantized`` put in as its dequantized float weight."""
    ref = copy.deepcopy(model)
    for name, m in quantized.named_modules():
        if isinstance(m, QuantExperts):
            with torch.no_grad():
                for param, w in m.float_weights().items():
                    ref.get_submodule(name).get_parameter(param).copy_(w)
    return ref


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scheme", ("w4g8", "nvfp4"))
def test_quantized_experts_run_the_float_forward_on_the_dequantized_weights(arch, scheme):
    """Same logits, bit for bit, as the float model given the dequantized experts: the model's routing, biases and
    activation (gpt-oss: transposed, interleaved gate/up, clamped GLU) unchanged."""
    model = make(arch)
    plan = build_plan(model, scheme)
    experts = expert_tensors(model)
    assert set(experts) <= set(plan) and len(experts) == 4  # gate_up_proj and down_proj of both layers
    q = copy.deepcopy(model)
    only = Plan({n: plan[n] for n in experts})  # the experts alone: the reference differs from the float model there
    quantize_model(q, only, "rtn", {"search": False}, progress=False, keep16=False)
    assert len(quant_stacks(q)) == 4 and not expert_tensors(q)  # no float experts tensor left
    ref = _reference(model, q)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want, fp = q(ids).logits, ref(ids).logits, model(ids).logits
    assert torch.equal(got, want)
    assert not torch.equal(got, fp)  # the experts really are quantized
    acc = account_model(q).by_kind()
    assert acc["experts"] == (sum(t.numel for t in experts.values()), 0)
    assert acc["router"][0] == 0  # the router stays 16-bit


@pytest.mark.parametrize("scheme", ("w4g32", "w3g64a", "w4g128:rule=search", "nvfp4", "nvfp4-46", "mxfp4",
                                    "mxfp6-e2m3", "fp8", "q4_k", "q2_k", "q6_k"))
def test_each_experts_codes_are_rtn_of_its_matrix_as_a_linear_and_pack_exactly(scheme):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 24, 256, generator=g) * torch.rand(3, 1, 256, generator=g)  # [E, out, in], uneven columns
    stack = QuantStack.from_float(w, scheme)
    for e in range(3):
        lin = torch.nn.Linear(256, 24, bias=False)
        with torch.no_grad():
            lin.weight.copy_(w[e])
        want, got = QuantLinear.from_linear(lin, scheme).qweight, stack.expert(e)
        for slot in ("codes", "scales", "zeros", "tensor_scale"):
            a, b = getattr(got, slot), getattr(want, slot)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), slot
        assert torch.equal(stack.dequantize()[e], want.dequantize())
    back = QuantStack.from_packed(stack.pack(), 3, (24, 256), stack.scheme)
    for slot in ("codes", "scales", "zeros", "tensor_scale"):
        a, b = getattr(back, slot), getattr(stack, slot)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), slot


@pytest.mark.parametrize("arch", ("qwen2_moe", "gpt_oss"))
def test_native_checkpoint_round_trips_quantized_experts_bit_for_bit(arch, tmp_path, tiny_tokenizer):
    model = make(arch)
    quantize_model(model, build_plan(model, "w4g8"), "rtn", {"search": False}, progress=False)
    save(model, tiny_tokenizer, tmp_path / "q")
    spec = json.loads((tmp_path / "q" / "lowbit.json").read_text())["layers"]
    assert spec["model.layers.0.mlp.experts.gate_up_proj"]["experts"] == 8
    back, _ = load(tmp_path / "q")
    before, after = quant_stacks(model), quant_stacks(back)
    assert set(after) == set(before)
    for name, s in before.items():
        for slot in ("codes", "scales", "zeros", "tensor_scale"):
            a, b = getattr(after[name], slot), getattr(s, slot)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_damaged_expert_count_in_the_manifest_is_refused(tmp_path, tiny_tokenizer):
    from lowbit.errors import CheckpointError
    from lowbit.files.sealed import digests

    model = make("qwen3_moe")
    quantize_model(model, build_plan(model, "w4g8"), "rtn", {"search": False}, progress=False)
    save(model, tiny_tokenizer, tmp_path / "q")
    f = tmp_path / "q" / "lowbit.json"
    m = json.loads(f.read_text())
    m["layers"]["model.layers.0.mlp.experts.down_proj"]["experts"] = 7
    m["files"] = {k: v for k, v in digests(tmp_path / "q").items() if k != "lowbit.json"}
    f.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="down_proj"):
        load(tmp_path / "q")


# ------------------------------------------------------------------ the command line


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tiny_tokenizer):
    return _save("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3moe", tiny_tokenizer)


def test_quantize_rtn_quantizes_the_experts_and_inspect_and_eval_read_them(moe_dir, tmp_path, capsys, tiny_tokenizer):
    out = tmp_path / "q"
    assert main(["quantize", str(moe_dir), "--scheme", "w4g16", *FAST, "--out", str(out)]) == 0
    r = _last(capsys)
    model = make("qwen3_moe", len(tiny_tokenizer))
    experts = sum(p.numel() for p in model.parameters() if p.ndim == 3)
    acc = r["matmul_weights"]
    assert acc["params"] == _matmul_params(model) and acc["quantized"]["experts"] == experts
    assert set(acc["float"]) == {"router", "embeddings", "lm_head"}
    assert r["layers_quantized"] == 8 + 4 and r["layers_16bit"] == 0  # 8 attention Linears, 4 experts tensors
    q, router = sum(acc["quantized"].values()), acc["float"]["router"]
    assert r["bits_per_weight_nominal"] == round((5 * q + 16 * router) / (q + router), 4)  # w4g16: 4 + 16/16
    assert main(["inspect", str(out), "--json"]) == 0
    info = _last(capsys)
    assert info["matmul_weights"] == acc and info["bits_per_weight"] == r["bits_per_weight"]
    assert info["schemes"] == {"w4g16": 12}
    assert main(["eval", str(out), "--windows", "2", "--eval-seqlen", "64", "--json"]) == 0
    assert _last(capsys)["ppl"] > 1


@pytest.mark.parametrize("method", ("gptq", "signround2"))
def test_tuning_methods_quantize_experts_with_input_recipes_and_the_file_keeps_their_scales(moe_dir, tmp_path, capsys,
                                                                                          method):
    """W4A4 with GPTQ / SignRoundV2 (refused before issue 34's second pass): every expert gets its static input scale,
    and the native file reloads to the same logits."""
    out = tmp_path / "q"
    iters = ["--iters", "2"] if method == "signround2" else []
    assert main(["quantize", str(moe_dir), "--scheme", "w4a4-nvfp4", "--method", method, "--no-eval", "--nsamples",
                 "4", "--seqlen", "32", *iters, "--json", "--out", str(out)]) == 0
    acc = _last(capsys)["matmul_weights"]
    assert "experts" in acc["quantized"] and "experts" not in acc["float"]
    model, _ = load(out)
    stacks = quant_stacks(model)
    assert len(stacks) == 4 and all(s.input_scheme is not None and s.input_scheme.name == "nvfp4" for s in stacks.values())
    assert all(s.input_amax.shape == (8,) and bool((s.input_amax > 0).all()) for s in stacks.values())
    ids = torch.randint(0, 100, (1, 16))
    again, _ = load(out)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits) and bool(torch.isfinite(model(ids).logits).all())


def test_tuning_methods_still_run_with_experts_kept_in_float(moe_dir, tmp_path, capsys):
    assert main(["quantize", str(moe_dir), "--scheme", "w4g16", "--method", "gptq", "--no-eval", "--nsamples", "2",
                 "--seqlen", "32", "--keep", "experts", "--json", "--out", str(tmp_path / "q")]) == 0
    assert "experts" in _last(capsys)["matmul_weights"]["float"]


@pytest.mark.parametrize("how, needle", (
    (["--scheme", "w4g16", "--rotate"], "--rotate do not handle mixture-of-experts experts yet"),
    (["--scheme", "w4g32"], "group size 32 is larger than the 16 input columns of model.layers.0.mlp.experts.down_proj"),
))
def test_what_cannot_quantize_experts_is_refused_before_any_work(moe_dir, tmp_path, capsys, how, needle):
    assert main(["quantize", str(moe_dir), "--method", "rtn", *how, "--no-eval", "--out", str(tmp_path / "q")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("lowbit")]
    assert len(err) == 1 and needle in err[0]
    assert list(tmp_path.iterdir()) == []


def test_plan_file_names_experts_tensors_and_unknown_ones_are_refused(moe_dir, tmp_path, capsys):
    layers = {f"model.layers.{i}.mlp.experts.{p}": s for i in (0, 1)
              for p, s in (("gate_up_proj", "w4g32"), ("down_proj", "w8g16"))}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": layers}))
    assert main(["quantize", str(moe_dir), "--plan", str(plan), *FAST, "--out", str(tmp_path / "q")]) == 0
    acc = _last(capsys)["matmul_weights"]
    assert set(acc["quantized"]) == {"experts"} and "experts" not in acc["float"]
    plan.write_text(json.dumps({"layers": {"model.layers.0.mlp.experts.up_proj": "w4g16"}}))
    assert main(["quantize", str(moe_dir), "--plan", str(plan), *FAST, "--out", str(tmp_path / "r")]) == 2
    assert "model.layers.0.mlp.experts.up_proj" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_keep_experts_drops_them_from_a_uniform_plan():
    from lowbit.models.accounting import gate

    model = make("qwen3_moe")
    plan = build_plan(model, "w4g8")
    assert gate(model, list(plan), ("experts",)) == set(expert_tensors(model))
    assert gate(model, list(plan)) == set()  # nothing left in float unasked: no refusal


def test_experts_with_a_static_input_recipe_and_no_calibration_refused_by_the_library_entry():
    model = make("qwen3_moe")
    plan = Plan(build_plan(model, "w4a4-nvfp4").layers)
    with pytest.raises(ConfigError, match="static input scales of model.layers.0.mlp.experts.* needs calibration"):
        quantize_model(model, Plan({n: r for n, r in plan.items() if "experts" in n}), "rtn", {"search": False},
                       progress=False)


def test_transformers_loader_refuses_quantized_experts_by_name(moe_dir, tmp_path):
    # both exports hold experts (tests/test_export_ct_moe.py, tests/test_gguf_moe.py); the loader does not
    out = tmp_path / "q"
    assert main(["quantize", str(moe_dir), "--scheme", "w4g16", *FAST, "--out", str(out)]) == 0
    from transformers import AutoModelForCausalLM

    import lowbit  # noqa: F401  (registers the loader)
    from lowbit.errors import CheckpointError

    with pytest.raises(CheckpointError, match="quantized mixture-of-experts experts"):
        AutoModelForCausalLM.from_pretrained(str(out))
