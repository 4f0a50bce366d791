"""Fused matmuls (q/k/v, gate/up) share one NVFP4 tensor scale, so vLLM serves the file as lowbit evaluates it.

vLLM loads q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` and keeps one
global scale per fused layer: ``weight_global_scale.max()`` (and ``input_global_scale.max()``)
in its compressed-tensors NVFP4 scheme's ``process_weights_after_loading``. `vllm_view`
below applies that rule to an exported file; lowbit's weights must come out unchanged.
"""

import copy

import pytest
import torch
from ptq_helpers import calib, tiny_model, uniform
from safetensors.torch import load_file

from lowbit.errors import SchemeError
from lowbit.files.fused import fused_groups
from lowbit.formats import Scheme, quantize
from lowbit.models.fused import own_tensor_scale, shared_amax, shared_encodes
from lowbit.nn import QuantLinear, quant_layers, set_module
from lowbit.ptq import quantize_model

pytest.importorskip("compressed_tensors")

from lowbit.files import compressed_tensors as ct  # noqa: E402


def vllm_view(path) -> dict[str, dict[str, float]]:
    """Per fused part: its stored global scales and the one vLLM uses for the fused layer (the largest)."""
    t = load_file(str(path / ct.WEIGHTS))
    out = {}
    names = sorted({k.rsplit(".", 1)[0] for k in t if k.endswith(".weight_global_scale")})
    for group in fused_groups(names):
        for key in ("weight_global_scale", "input_global_scale"):
            if f"{group[0]}.{key}" not in t:
                continue
            fused = max(float(t[f"{n}.{key}"]) for n in group)  # vLLM: layer.<key>.max()
            for n in group:
                out.setdefault(n, {})[key] = (float(t[f"{n}.{key}"]), fused)
    return out


def test_fused_groups_by_name():
    names = [f"m.layers.{i}.{p}" for i in range(2) for p in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    groups = fused_groups(reversed(names))
    assert groups == [["m.layers.0.mlp.gate_proj", "m.layers.0.mlp.up_proj"],
                      ["m.layers.0.self_attn.q_proj", "m.layers.0.self_attn.k_proj", "m.layers.0.self_attn.v_proj"],
                      ["m.layers.1.mlp.gate_proj", "m.layers.1.mlp.up_proj"],
                      ["m.layers.1.self_attn.q_proj", "m.layers.1.self_attn.k_proj", "m.layers.1.self_attn.v_proj"]]
    assert fused_groups(["a.q_proj", "b.k_proj", "a.o_proj"]) == []  # other parents, unfused layers


def test_shared_scale_is_the_groups_smallest_and_largest_amax():
    own = {"a.q_proj": torch.tensor(3.0), "a.k_proj": torch.tensor(2.0), "a.v_proj": torch.tensor(5.0),
           "a.o_proj": torch.tensor(7.0)}
    got = shared_encodes(own)
    assert all(float(got[f"a.{p}"]) == 2.0 for p in ("q_proj", "k_proj", "v_proj")) and float(got["a.o_proj"]) == 7
    amax = shared_amax({"a.gate_proj": torch.tensor(1.0), "a.up_proj": torch.tensor(4.0)})
    assert float(amax["a.gate_proj"]) == float(amax["a.up_proj"]) == 4.0


def test_quantize_takes_a_given_tensor_scale_and_refuses_it_without_one():
    w = torch.randn(8, 32)
    enc = own_tensor_scale(w * 3, Scheme.parse("nvfp4"))  # a group whose largest weight is 3x this one's
    q = quantize(w, "nvfp4", tensor_scale=enc)
    assert float(q.tensor_scale) == float(enc) and (q.dequantize() - w).abs().max() < 0.2 * w.abs().max()
    with pytest.raises(SchemeError, match="no tensor scale"):
        quantize(w, "w4g32", tensor_scale=enc)


@pytest.mark.parametrize("method,settings", [("rtn", {"search": False}), ("rtn", {"search": True}),
                                             ("gptq", {}), ("signround2", {"iters": 2})])
@pytest.mark.parametrize("recipe", ["nvfp4", "w4a4-nvfp4"])
def test_every_method_quantizes_fused_parts_with_one_scale(tmp_path, method, settings, recipe):
    model = tiny_model()
    plan = uniform(model, recipe)
    own = {n: own_tensor_scale(model.get_submodule(n).weight, Scheme.parse("nvfp4")) for n in plan}
    groups = fused_groups(plan)
    assert any(len({float(own[n]) for n in g}) > 1 for g in groups)  # the parts would differ on their own
    quantize_model(model, plan, method, settings, calib=calib(), progress=False)
    layers = quant_layers(model)
    for g in groups:  # lowbit itself computes with the shared scale: the group's smallest
        assert {float(layers[n].tensor_scale) for n in g} == {min(float(own[n]) for n in g)}
    ct.export(model, None, tmp_path / "ct")
    view = vllm_view(tmp_path / "ct")
    assert set(view) == {n for g in groups for n in g}
    keys = {"weight_global_scale"} | ({"input_global_scale"} if recipe.startswith("w4a4") else set())
    for scales in view.values():
        assert set(scales) == keys
        for stored, fused in scales.values():  # what vLLM uses is what lowbit stored (and evaluated)
            assert stored == fused


def test_export_refuses_fused_parts_with_their_own_scales(tmp_path):
    """A checkpoint made before the shared scale (each part its own) would be served wrong: refused."""
    model = tiny_model()
    for n in uniform(model, "nvfp4"):
        set_module(model, n, QuantLinear.from_linear(model.get_submodule(n), "nvfp4"))
    with pytest.raises(SchemeError, match="different NVFP4 weight_global_scale"):
        ct.export(model, None, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()


def test_merged_adapters_and_qat_keep_one_scale_per_fused_group():
    from lowbit.peft import PeftConfig, apply_adapters, merge_and_requantize
    from lowbit.qat import resolve, to_qat, to_quant_linear

    model = tiny_model()
    plan = uniform(model, "nvfp4")
    fp = {n: model.get_submodule(n).weight.detach().clone() for n in plan}
    quantize_model(model, plan, "rtn", {"search": False}, progress=False)
    m = copy.deepcopy(model)
    apply_adapters(m, PeftConfig("lora", rank=2), fp_weights=fp)
    for p in m.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)  # a non-zero update, different per layer
    merge_and_requantize(m)
    q = copy.deepcopy(model)
    to_qat(q, resolve("nvfp4"))
    with torch.no_grad():
        for n in quant_layers(model):
            q.get_submodule(n).weight.mul_(1 + 0.1 * torch.rand(()))  # trained weights, scaled apart
    to_quant_linear(q)
    for done in (m, q):
        layers = quant_layers(done)
        for g in fused_groups(plan):
            assert len({float(layers[n].tensor_scale) for n in g}) == 1
