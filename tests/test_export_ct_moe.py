"""compressed-tensors export of quantized mixture-of-experts experts: the per-expert layout vLLM and transformers read.

References: transformers + compressed-tensors loading the folder (its MoE loader decompresses the per-expert
tensors into float experts: logits equal to lowbit's model, bit for bit in float32), lowbit's own reader
(the file's codes and scales rebuilt exactly), and the names vLLM's MoE loader maps (RoutedExperts'
``experts.{e}.gate_proj`` / Mixtral's ``block_sparse_moe.experts.{e}.w1``).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors import safe_open
from test_accounting import FAST, _last, _save, make

pytest.importorskip("compressed_tensors")

from lowbit.cli import main  # noqa: E402
from lowbit.errors import SchemeError  # noqa: E402
from lowbit.files import compressed_experts as moe  # noqa: E402
from lowbit.files import compressed_tensors as ct  # noqa: E402
from lowbit.files.compressed_read import qtensor_from  # noqa: E402
from lowbit.files.specs import LayerSpec  # noqa: E402
from lowbit.formats import quantize  # noqa: E402
from lowbit.nn.quant_experts import quant_stacks  # noqa: E402
from lowbit.plans.plan import Plan  # noqa: E402
from lowbit.plans.source import build_plan  # noqa: E402
from lowbit.ptq import quantize_model  # noqa: E402

SLOTS = ("codes", "scales", "zeros", "tensor_scale")


def quantized(arch: str, experts: str, rest: str | None = None, model=None):
    """``arch``'s tiny model with its experts RTN-quantized to ``experts`` (attention to ``rest``, default the same)."""
    model = model if model is not None else make(arch)
    plan = build_plan(model, experts)
    if rest is not None:
        other = build_plan(model, rest)
        plan = Plan({n: r if ".experts." in n else other[n] for n, r in plan.layers.items()})
    quantize_model(model, plan, "rtn", {"search": False}, progress=False)
    return model


def logits(model) -> torch.Tensor:
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits


def keys(folder) -> list[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return list(f.keys())


def same_stacks(a, b) -> None:
    a, b = quant_stacks(a), quant_stacks(b)
    assert set(a) == set(b) and a
    for name, s in a.items():
        for slot in SLOTS:
            x, y = getattr(s, slot), getattr(b[name], slot)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (name, slot)


# ------------------------------------------------------------------ layout and readback
@pytest.mark.parametrize("arch, block, names", [
    ("qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
    ("qwen2_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
    ("olmoe", "mlp", ("gate_proj", "up_proj", "down_proj")),
    ("mixtral", "block_sparse_moe", ("w1", "w3", "w2")),
])
def test_experts_written_per_expert_and_read_back_exactly_by_transformers_and_lowbit(arch, block, names, tmp_path):
    from transformers import AutoModelForCausalLM

    model = quantized(arch, "w4g8")
    ct.export(model, None, tmp_path / "ct")
    have = keys(tmp_path / "ct")
    for layer in (0, 1):
        for e in range(8):
            for proj in names:
                for part in ("weight_packed", "weight_scale", "weight_shape"):
                    assert f"model.layers.{layer}.{block}.experts.{e}.{proj}.{part}" in have
        assert f"model.layers.{layer}.{block}.gate.weight" in have  # the router, 16-bit, under the file's block name
    assert not [k for k in have if k.endswith((".codes", ".scales", "gate_up_proj", "down_proj"))]  # nothing fused
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]  # vLLM picks its model class by this name
    assert model.config.architectures is None  # the model's own config is left as it was
    qc = config["quantization_config"]
    targets = [t for g in qc["config_groups"].values() for t in g["targets"]]
    assert f"re:^model\\.layers\\.0\\.{block}\\.experts\\.\\d+\\.({names[0]}|{names[1]}|{names[2]})$" in targets
    assert f"model.layers.0.{block}.gate" in qc["ignore"]
    if arch == "qwen2_moe":
        assert "model.layers.0.mlp.shared_expert.gate_proj" in targets  # the shared expert: plain Linears
    want = logits(model)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ct"), dtype=torch.float32).eval()
    assert not quant_stacks(theirs)  # transformers: float experts decompressed from the per-expert tensors
    assert torch.equal(logits(theirs), want)
    ours = ct.load_decompressed(tmp_path / "ct")
    same_stacks(model, ours)  # lowbit: the very codes, as QuantExperts
    assert torch.equal(logits(ours), want)


def test_vllm_finds_one_scheme_for_each_layers_experts_by_its_names(tmp_path):
    """vLLM resolves a MoE layer's scheme by the unfused names ``{layer}.experts.0.{gate,up,down}_proj``
    (CompressedTensorsMoEMethod.get_moe_method) with compressed-tensors' target matching."""
    from compressed_tensors.utils.match import is_match

    model = quantized("qwen3_moe", "w4g8")
    ct.export(model, None, tmp_path / "ct")
    groups = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["config_groups"]
    for layer in (0, 1):
        hits = {g for proj in ("gate_proj", "up_proj", "down_proj") for g, v in groups.items()
                if any(is_match(f"model.layers.{layer}.mlp.experts.0.{proj}", torch.nn.Linear(1, 1), t)
                       for t in v["targets"])}
        assert len(hits) == 1


def test_asymmetric_and_nvfp4_experts_read_back_exactly_by_lowbit_with_transformers_note(tmp_path):
    """transformers' MoE loader drops zero points and global scales: the export says so; lowbit reads them."""
    for scheme in ("w4g8a", "nvfp4"):
        model = quantized("qwen3_moe", scheme, "w4g8")
        with pytest.warns(UserWarning, match="transformers' MoE loader drops their"):
            ct.export(model, None, tmp_path / scheme)
        ours = ct.load_decompressed(tmp_path / scheme)
        same_stacks(model, ours)
        assert torch.equal(logits(ours), logits(model))
        if scheme == "nvfp4":  # vLLM's w13 global scales [E, 2]: gate and up of an expert carry the same one
            with safe_open(str(tmp_path / scheme / "model.safetensors"), "pt") as f:
                for e in range(8):
                    g, u = (f.get_tensor(f"model.layers.0.mlp.experts.{e}.{p}.weight_global_scale")
                            for p in ("gate_proj", "up_proj"))
                    assert torch.equal(g, u)


def wider_moe():
    """One Qwen3-MoE layer whose expert widths (64 in, 32 in) hold 32-column blocks."""
    import transformers as tf

    torch.manual_seed(0)
    return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2))


def test_mxfp4_and_mxfp8_experts_round_trip(tmp_path):
    for scheme in ("mxfp4", "mxfp8"):
        model = quantized("qwen3_moe", scheme, model=wider_moe())
        ct.export(model, None, tmp_path / scheme)
        ours = ct.load_decompressed(tmp_path / scheme)
        same_stacks(model, ours)
        assert torch.equal(logits(ours), logits(model))


@pytest.mark.parametrize("scheme, fmt", [("w4g32", None), ("w3g64a", None), ("w2g16", None), ("w8", None),
                                         ("w8", "int-quantized"), ("nvfp4", None), ("nvfp4-46", None),
                                         ("mxfp4", None), ("fp8", None), ("mxfp8", None)])
def test_every_weight_format_reads_back_to_the_same_codes(scheme, fmt):
    """`qtensor_from` inverts `layer_tensors` exactly for every format an expert (or a Linear) can be written in."""
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(0))
    q = quantize(w, scheme)
    t = ct.target_for(q.scheme, 128)
    if fmt is not None:
        t = ct.Target(fmt, t.args)
    back = qtensor_from(ct.layer_tensors(q, t), t.format, t.args, (24, 128), "w")
    for slot in SLOTS:
        a, b = getattr(back, slot), getattr(q, slot)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), slot
    assert torch.equal(back.dequantize(), q.dequantize())


# ------------------------------------------------------------------ refusals and notes
def test_experts_of_one_layer_in_two_recipes_are_refused_before_anything_is_written(tmp_path):
    model = make("qwen3_moe")
    plan = build_plan(model, "w4g8")
    plan = Plan({n: (build_plan(model, "w8g16")[n] if n.endswith("down_proj") and ".experts" in n else r)
                 for n, r in plan.layers.items()})
    quantize_model(model, plan, "rtn", {"search": False}, progress=False)
    with pytest.raises(SchemeError, match=r"gate_up_proj is w4g8 but down_proj is w8g16.*All MoE projections"):
        ct.export(model, None, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()


def test_partly_quantized_experts_and_gpt_oss_are_refused(tmp_path):
    model = make("qwen3_moe")
    plan = build_plan(model, "w4g8")
    only_up = Plan({n: r for n, r in plan.layers.items() if not n.endswith("experts.down_proj")})
    quantize_model(model, only_up, "rtn", {"search": False}, progress=False, keep16=False)
    with pytest.raises(SchemeError, match="only gate_up_proj is quantized"):
        ct.export(model, None, tmp_path / "ct")
    oss = quantized("gpt_oss", "w4g8")
    with pytest.raises(SchemeError, match="gpt-oss experts cannot be exported to compressed-tensors"):
        ct.export(oss, None, tmp_path / "oss")
    assert list(tmp_path.iterdir()) == []


def test_vllm_limits_are_named_for_experts_it_cannot_serve():
    spec = [LayerSpec("model.layers.0.mlp.experts.gate_up_proj", quantize(torch.ones(2, 16), "fp8").scheme,
                          None, (32, 16), experts=8)]
    spec.append(LayerSpec("model.layers.0.mlp.experts.down_proj", spec[0].scheme, None, (16, 16), experts=8))
    notes = ct.vllm_fused_notes(spec)
    assert len(notes) == 1 and "FP8 weights need FP8 inputs" in notes[0]
    from lowbit.formats import InputScheme, Scheme

    w8, static = Scheme.parse("w8"), InputScheme.parse("int8-static")
    assert "dynamic per token" in moe.vllm_moe_limit(w8, static)
    assert moe.vllm_moe_limit(w8, InputScheme.parse("int8")) is None
    assert moe.vllm_moe_limit(Scheme.parse("w4g128"), None) is None
    assert moe.vllm_moe_limit(Scheme.parse("nvfp4"), InputScheme.parse("nvfp4")) is None


# ------------------------------------------------------------------ the command line
@pytest.fixture(scope="module")
def moe_src(tmp_path_factory, tiny_tokenizer):
    return _save("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3moe", tiny_tokenizer)


def test_cli_export_then_eval_reads_the_experts(moe_src, tmp_path, capsys):
    q, out = tmp_path / "q", tmp_path / "ct"
    assert main(["quantize", str(moe_src), "--scheme", "w4g16", *FAST, "--out", str(q)]) == 0
    capsys.readouterr()
    assert main(["export", str(q), "--to", "compressed-tensors", "--out", str(out)]) == 0
    assert "model.layers.1.mlp.experts.7.down_proj.weight_packed" in keys(out)
    assert main(["eval", str(q), "--windows", "2", "--eval-seqlen", "64", "--json"]) == 0
    native = _last(capsys)["ppl"]
    assert main(["eval", str(out), "--windows", "2", "--eval-seqlen", "64", "--json"]) == 0
    assert _last(capsys)["ppl"] == pytest.approx(native, rel=1e-6)


def test_cli_mixed_expert_recipes_refused_by_export_and_by_quantize_export_to(moe_src, tmp_path, capsys):
    layers = {f"model.layers.{i}.mlp.experts.{p}": s for i in (0, 1)
              for p, s in (("gate_up_proj", "w4g16"), ("down_proj", "w8g16"))}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": layers}))
    assert main(["quantize", str(moe_src), "--plan", str(plan), *FAST, "--export-to", "compressed-tensors",
                 "--out", str(tmp_path / "r")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("lowbit")]
    assert len(err) == 1 and "one scheme" in err[0] and not (tmp_path / "r").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["quantize", str(moe_src), "--plan", str(plan), *FAST, "--out", str(tmp_path / "q")]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "q"), "--to", "compressed-tensors", "--out", str(tmp_path / "ct")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("lowbit")]
    assert len(err) == 1 and "gate_up_proj is w4g16 but down_proj is w8g16" in err[0]
    assert not (tmp_path / "ct").exists()


@pytest.mark.parametrize("scheme", ("w4g8", "fp8"))
def test_inspect_counts_every_expert_of_the_export_with_its_recipe(scheme, tmp_path):
    """Per-expert layers resolve their config group through its ``re:`` target (FP8 ``weight`` keys included)."""
    from lowbit.api.inspect import inspect

    model = quantized("qwen3_moe", scheme)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp8 weight-only experts: vLLM's limit, noted
        ct.export(model, None, tmp_path / "ct")
    info = inspect(tmp_path / "ct")
    assert sum(info["schemes"].values()) == 8 + 2 * 8 * 3 and len(info["schemes"]) == 1  # attention + experts
    assert "experts" not in info["matmul_weights"]["float"]
    experts = sum(p.numel() for p in make("qwen3_moe").parameters() if p.dim() == 3)
    assert info["matmul_weights"]["quantized"]["experts"] == experts


@pytest.mark.parametrize("weights, inputs, key", [("fp8", "fp8-static", "input_scale"),
                                                  ("nvfp4", "nvfp4", "input_global_scale")])
def test_per_expert_static_input_scales_are_written_per_expert_with_gate_and_up_equal(weights, inputs, key, tmp_path):
    from lowbit.formats import InputScheme
    from lowbit.formats.inputs import encode_scale

    model = quantized("qwen3_moe", weights)
    inp = InputScheme.parse(inputs)
    amax = {}
    for name, stack in quant_stacks(model).items():
        amax[name] = torch.arange(1, 9, dtype=torch.float32) * (2 if name.endswith("down_proj") else 1)
        stack.with_input(inp, amax[name])
    ct.export(model, None, tmp_path / "ct")
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    experts = [g for g in qc["config_groups"].values() if any(".experts" in t for t in g["targets"])]
    assert len(experts) == 1 and experts[0]["input_activations"]["dynamic"] in (False, "local")
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        for e in range(8):
            g, u, d = (f.get_tensor(f"model.layers.1.mlp.experts.{e}.{p}.{key}")
                       for p in ("gate_proj", "up_proj", "down_proj"))
            assert torch.equal(g, u)  # vLLM: "input_scales of w1 and w3 of a layer must be equal"
            want = encode_scale(inp, amax["model.layers.1.mlp.experts.gate_up_proj"][e]).reshape(1)
            assert torch.equal(g, want) and not torch.equal(g, d)


def test_int8_experts_with_static_input_scales_warn_naming_vllms_limit(tmp_path):
    from lowbit.formats import InputScheme

    model = quantized("qwen3_moe", "w8")
    for stack in quant_stacks(model).values():
        stack.with_input(InputScheme.parse("int8-static"), torch.ones(8))
    with pytest.warns(UserWarning, match="dynamic per token"):
        ct.export(model, None, tmp_path / "ct")
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.experts.3.down_proj.weight").dtype == torch.int8  # int-quantized


def test_layers_with_different_expert_recipes_export_with_a_transformers_note_and_read_back_exactly(tmp_path):
    """vLLM serves a recipe per layer; transformers' MoE loader uses the first experts group for every layer (the
    note says so, and its logits do differ), lowbit's reader takes each layer's own group."""
    from transformers import AutoModelForCausalLM

    model = make("qwen3_moe")
    plan = build_plan(model, "w4g8")
    w8 = build_plan(model, "w8g8")
    plan = Plan({n: (w8[n] if n.startswith("model.layers.1.mlp.experts") else r) for n, r in plan.layers.items()})
    quantize_model(model, plan, "rtn", {"search": False}, progress=False)
    with pytest.warns(UserWarning, match="first experts config group"):
        ct.export(model, None, tmp_path / "ct")
    ours = ct.load_decompressed(tmp_path / "ct")
    same_stacks(model, ours)
    assert torch.equal(logits(ours), logits(model))
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ct"), dtype=torch.float32).eval()
    assert not torch.allclose(logits(theirs), logits(model), atol=1e-3)


def test_a_layout_lowbit_does_not_rebuild_falls_back_to_transformers_with_a_warning(tmp_path):
    """Another tool's act-order experts (permuted groups, ``weight_g_idx``): read by transformers, said so."""
    from safetensors.torch import load_file, save_file

    model = quantized("qwen3_moe", "w4g8")
    ct.export(model, None, tmp_path / "ct")
    f = tmp_path / "ct" / "model.safetensors"
    tensors = load_file(str(f))
    tensors["model.layers.0.mlp.experts.0.gate_proj.weight_g_idx"] = torch.arange(32).flip(0).int() // 8
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="decompressed by transformers, not rebuilt code for code.*weight_g_idx"):
        back = ct.load_decompressed(tmp_path / "ct")
    assert not quant_stacks(back)


def test_quantize_says_before_tuning_which_expert_plan_vllm_cannot_serve(moe_src, tmp_path, capsys):
    with pytest.warns(UserWarning, match=r"compressed-tensors export would not load in vLLM: "
                                         r"model\.layers\.0\.mlp\.experts \(fp8\).*FP8 weights need FP8 inputs"):
        assert main(["quantize", str(moe_src), "--scheme", "fp8", *FAST, "--out", str(tmp_path / "q")]) == 0


def test_expert_recipe_compressed_tensors_has_no_format_for_is_refused_naming_the_tensor(tmp_path):
    model = quantized("qwen3_moe", "mxfp6-e2m3", "w4g16", model=wider_moe())
    with pytest.raises(SchemeError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj: scheme mxfp6-e2m3 has no "
                                          "compressed-tensors format"):
        ct.export(model, None, tmp_path / "ct")
    assert list(tmp_path.iterdir()) == []


def test_a_file_missing_an_expert_is_one_clear_error_not_a_fallback(tmp_path):
    from safetensors.torch import load_file, save_file

    from lowbit.errors import CheckpointError

    model = quantized("qwen3_moe", "w4g8")
    ct.export(model, None, tmp_path / "ct")
    f = tmp_path / "ct" / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(f)).items() if ".experts.7." not in k or "layers.1" not in k}
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts: the file holds experts .* \(7\) but "
                                              "the config declares 8"):
        ct.load_decompressed(tmp_path / "ct")


def test_rtn_calibrated_expert_input_scales_reach_the_export(tmp_path):
    """End to end: RTN calibrates one input abs-max per expert (`ptq/expert_calib.py`); the export writes exactly
    those, per expert, and no stray ``input_amax`` tensor."""
    from lowbit.formats.inputs import encode_scale
    from lowbit.ptq import quantize_model

    model = make("qwen3_moe")
    plan = build_plan(model, "w8a8-fp8-static")
    calib = torch.randint(0, model.config.vocab_size, (4, 16))
    quantize_model(model, plan, "rtn", {"search": False}, calib=calib, progress=False)
    stacks = quant_stacks(model)
    assert stacks and all(s.input_amax is not None for s in stacks.values())
    ct.export(model, None, tmp_path / "ct")
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert not any(k.endswith("input_amax") for k in keys)
        stack = stacks["model.layers.0.mlp.experts.gate_up_proj"]
        for e in range(stack.num_experts):
            g = f.get_tensor(f"model.layers.0.mlp.experts.{e}.gate_proj.input_scale")
            assert torch.equal(g, encode_scale(stack.input_scheme, stack.input_amax[e]).reshape(g.shape))
