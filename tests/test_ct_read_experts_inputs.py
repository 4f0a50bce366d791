"""lowbit's compressed-tensors reader rebuilds experts that quantize their inputs (issue 34 point 5).

Reference: the writer (`lowbit.files.compressed_tensors.export`). A model whose experts carry an input scheme
(`QuantStack.with_input`: per-expert static abs-max, or a dynamic scheme) is exported and read back with
`load_decompressed`: every stack must come back with the same codes, scales, input scheme and, for static
schemes, an abs-max per expert whose scale is the stored one bit for bit, and the loaded model's logits must equal the exported
model's (both run the same quantized inputs). Before, such experts fell back to transformers, which runs their
inputs unquantized.
"""

from __future__ import annotations

import pytest
import torch
from gguf_moe_helpers import tiny_moe
from safetensors import safe_open
from safetensors.torch import save_file
from test_accounting import make
from test_export_ct_moe import SLOTS, logits, quantized

pytest.importorskip("compressed_tensors")

from lowbit.errors import CheckpointError  # noqa: E402
from lowbit.files import compressed_read as cr  # noqa: E402
from lowbit.files import compressed_tensors as ct  # noqa: E402
from lowbit.formats import InputScheme  # noqa: E402
from lowbit.formats.inputs import encode_scale  # noqa: E402
from lowbit.nn.quant_experts import quant_stacks  # noqa: E402


def _with_inputs(weights: str, inputs: str):
    """qwen3_moe with RTN ``weights`` experts whose inputs are quantized by ``inputs`` (uneven abs-max per expert)."""
    # experts 32 columns wide (MX blocks); attention in a format compressed-tensors decompresses exactly
    model = quantized("qwen3_moe", weights, "w4g8", model=tiny_moe("qwen3_moe"))
    inp = InputScheme.parse(inputs)
    for name, stack in quant_stacks(model).items():
        amax = None
        if inp.needs_calibration:  # values no simple float product hits exactly: the inverse must be exact anyway
            amax = torch.linspace(0.37, 5.3, 8) * (1.7 if name.endswith("down_proj") else 1.0)
        stack.with_input(inp, amax)
    return model, inp


@pytest.mark.parametrize("weights, inputs", [("fp8", "fp8-static"), ("nvfp4", "nvfp4"), ("w4g8", "int8"),
                                             ("fp8", "fp8"), ("mxfp4", "mxfp4:round=even")])
def test_experts_with_input_quantization_read_back_exactly_by_lowbit(weights, inputs, tmp_path):
    model, inp = _with_inputs(weights, inputs)
    ct.export(model, None, tmp_path / "ct")
    back = ct.load_decompressed(tmp_path / "ct")
    a, b = quant_stacks(model), quant_stacks(back)
    assert set(a) == set(b) and len(a) == 4
    for name, s in a.items():
        t = b[name]
        for slot in SLOTS:
            x, y = getattr(s, slot), getattr(t, slot)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (name, slot)
        assert t.input_scheme == s.input_scheme == inp
        assert (t.input_amax is None) == (not inp.needs_calibration)
        if inp.needs_calibration:  # many abs-maxes give one stored scale: the scale the forward uses must match
            assert torch.equal(encode_scale(inp, t.input_amax), encode_scale(inp, s.input_amax)), name
    assert torch.equal(logits(back), logits(model))


def test_the_inverse_of_a_stored_scale_is_exact_over_many_values():
    for name in ("fp8-static", "int8-static", "nvfp4"):
        inp = InputScheme.parse(name)
        key = "input_global_scale" if inp.tensor_scale else "input_scale"
        for a in torch.logspace(-3, 3, 200):
            stored = ct.static_input(inp, a.float())[key]
            back = cr.amax_from(inp, {key: stored}, "x")
            assert torch.equal(ct.static_input(inp, back)[key], stored), (name, float(a))


def test_damaged_input_scales_are_refused_by_name(tmp_path):
    model, _ = _with_inputs("fp8", "fp8-static")
    ct.export(model, None, tmp_path / "ct")
    f = tmp_path / "ct" / "model.safetensors"
    with safe_open(str(f), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    key = "model.layers.1.mlp.experts.3.up_proj.input_scale"
    tensors[key] = tensors[key] * 2  # gate and up read one input: their scales must agree
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.3: gate and up have different input scales"):
        ct.load_decompressed(tmp_path / "ct")
    del tensors[key]
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.3\.up_proj: input scheme fp8-static needs its calibrated "
                                              "input_scale"):
        ct.load_decompressed(tmp_path / "ct")


def test_rtn_calibrated_w8a8_fp8_static_export_evaluates_the_same_in_lowbit(tmp_path):
    """End to end from a real calibration: the static per-expert scales RTN measured survive the file."""
    from lowbit.plans.source import build_plan
    from lowbit.ptq import quantize_model

    model = make("qwen3_moe")
    quantize_model(model, build_plan(model, "w8a8-fp8-static"), "rtn", {"search": False},
                   calib=torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0)), progress=False)
    ct.export(model, None, tmp_path / "ct")
    back = ct.load_decompressed(tmp_path / "ct")
    for name, s in quant_stacks(model).items():
        got = quant_stacks(back)[name]
        assert torch.equal(encode_scale(got.input_scheme, got.input_amax), encode_scale(s.input_scheme, s.input_amax))
    assert torch.equal(logits(back), logits(model))
