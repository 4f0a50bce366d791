"""Input (activation) schemes: each format against an independent computation of it."""

import math

import pytest
import torch

from lowbit.errors import ConfigError, SchemeError
from lowbit.formats import InputScheme, Recipe, qdq_input
from lowbit.formats import minifloat as fp8mod
from lowbit.formats.inputs import PRESETS, encode_scale, underflow_fraction
from lowbit.nn.input_quant import InputQuantizer
from lowbit.plans.plan import Plan

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def acts(tokens: int = 12, cols: int = 64, seed: int = 0) -> torch.Tensor:
    """Heavy-tailed activations with a few outlier channels, like a transformer's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cols, generator=g)
    x[:, 3] *= 40
    return x * torch.rand(tokens, 1, generator=g) * 3


def nearest_e2m1(t: float) -> float:
    """Brute force: the E2M1 value nearest to t, ties to the even code, clamped at +-6."""
    mags = [abs(v - min(abs(t), 6.0)) for v in E2M1]
    best = min(range(8), key=lambda k: (mags[k], k % 2))
    return math.copysign(E2M1[best], t)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_names_round_trip(name):
    s = InputScheme.parse(name)
    assert s.name == name and InputScheme.parse(s.name) == s and InputScheme.from_dict(s.to_dict()) == s
    if s.elem == "e2m1":
        e = s.replace(guard=not s.guard)
    else:
        e = s.replace(e8m0_round="ceil") if s.scale == "e8m0" else s.replace(static=not s.static)
    assert InputScheme.parse(e.name) == e


def test_int8_per_token_matches_brute_force():
    x = acts()
    y = qdq_input(x, InputScheme.parse("int8"))
    scale = x.abs().amax(1, keepdim=True) / 127
    grid = torch.arange(-128, 128).float()
    brute = grid[(x.unsqueeze(-1) / scale.unsqueeze(-1) - grid).abs().argmin(-1)] * scale
    assert torch.allclose(y, brute, rtol=0, atol=1e-6)


def test_fp8_per_token_and_static_match_lowbits_minifloat_rounding():
    x = acts()
    s = x.abs().amax(1, keepdim=True) / 448
    ref = fp8mod.round_minifloat(x / s, fp8mod.E4M3) * s
    assert torch.equal(qdq_input(x, InputScheme.parse("fp8")), ref)
    amax = torch.tensor(5.0)  # calibrated below the real max: values above it saturate at 448 * s
    st = qdq_input(x, InputScheme.parse("fp8-static"), amax)
    s0 = amax / 448
    assert torch.equal(st, fp8mod.round_minifloat(x / s0, fp8mod.E4M3) * s0)
    assert st.abs().max() == 5.0


@pytest.mark.parametrize("rnd,rule", [("floor", lambda a: 2.0 ** (math.floor(math.log2(a)) - 2)),
                                      ("ceil", lambda a: 2.0 ** math.ceil(math.log2(a / 6))),
                                      ("even", lambda a: 2.0 ** math.floor(math.log2(a / 3.5)))])
def test_mxfp4_blocks_match_brute_force(rnd, rule):
    x = acts(6, 64)
    y = qdq_input(x, InputScheme.parse(f"mxfp4:round={rnd}"))
    for t in range(x.shape[0]):
        for b in range(2):
            blk = x[t, 32 * b: 32 * b + 32]
            sc = rule(float(blk.abs().max()))
            want = torch.tensor([nearest_e2m1(float(v) / sc) * sc for v in blk])
            assert torch.equal(y[t, 32 * b: 32 * b + 32], want), (rnd, t, b)


def test_mx_even_rule_is_compressed_tensors_rule():
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    amax = torch.rand(4000) * 2.0 ** torch.randint(-20, 20, (4000,)).float()
    theirs = 2.0 ** (generate_mx_scales(amax, 4) - 127)
    from lowbit.formats.inputs import mx_scale

    assert torch.equal(mx_scale(amax, InputScheme.parse("mxfp4:round=even")), theirs)


def test_nvfp4_matches_compressed_tensors_fake_quant():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    x = acts(16, 64)
    s = InputScheme.parse("nvfp4")
    amax = x.abs().max() * 0.8  # calibrated on other tokens: some blocks saturate
    enc = encode_scale(s, amax)
    args = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
                            dynamic="local", scale_dtype=torch.float8_e4m3fn)
    scale, zp = compute_dynamic_scales_and_zp(x, args, None, global_scale=enc.reshape(1))
    theirs = fake_quantize(x, scale, zp, args, global_scale=enc.reshape(1))
    assert torch.equal(qdq_input(x, s, amax), theirs)


def test_block_rules_order_and_guard():
    x = acts(32, 64)
    x[:, 16:32] *= 1e-7  # blocks far below the tensor maximum: their E4M3 scales underflow
    amax = x.abs().max()
    err = {}
    for name in ("nvfp4", "nvfp4:rule=4over6", "nvfp4:rule=span", "nvfp4:guard=1"):
        y = qdq_input(x, InputScheme.parse(name), amax)
        err[name] = ((y - x) ** 2).reshape(32, 4, 16).sum(-1)
    assert (err["nvfp4:rule=4over6"] <= err["nvfp4"]).all() and (err["nvfp4:rule=span"] <= err["nvfp4"] + 1e-12).all()
    plain = qdq_input(x, InputScheme.parse("nvfp4"), amax).reshape(32, 4, 16)
    guarded = qdq_input(x, InputScheme.parse("nvfp4:guard=1"), amax).reshape(32, 4, 16)
    assert (plain[:, 1].abs().amax(-1) == 0).all()  # abs-max without the guard zeroes them
    assert (guarded.abs().amax(-1) > 0).all()
    assert underflow_fraction(x, InputScheme.parse("nvfp4"), amax) == pytest.approx(0.25)
    assert underflow_fraction(x, InputScheme.parse("mxfp4")) == 0.0


def test_straight_through_gradient_and_dtype():
    q = InputQuantizer(InputScheme.parse("mxfp4"))
    x = acts().requires_grad_(True)
    y = q(x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    assert q(acts().bfloat16()).dtype == torch.bfloat16


def test_bad_input_schemes():
    with pytest.raises(SchemeError, match="does not divide"):
        InputScheme.parse("mxfp4").check_width(48, "model.layers.0.mlp.down_proj")
    with pytest.raises(SchemeError, match="static inputs"):
        InputScheme.parse("mxfp4:static=1")
    with pytest.raises(SchemeError, match="unknown input scheme"):
        InputScheme.parse("fp5")
    with pytest.raises(ConfigError, match="calibrate"):
        qdq_input(acts(), InputScheme.parse("nvfp4"))
    with pytest.raises(ConfigError, match="calibrat"):
        InputQuantizer(InputScheme.parse("fp8-static"))


@pytest.mark.parametrize("text", ["w4a4-nvfp4", "w4a4-nvfp4-46", "w4a4-nvfp4-span", "w4a4-mxfp4", "w8a8-mxfp8",
                                  "w8a8-fp8", "w8a8-int8", "w2g64-a8", "w4g128-afp8", "w4g128",
                                  "mxfp4@mxfp4:round=even", "nvfp4@nvfp4-ue5m3"])
def test_recipes_parse_and_round_trip(text):
    r = Recipe.parse(text)
    assert r.name == text and Recipe.parse(r.name) == r and Recipe.from_dict(r.to_dict()) == r


def test_rotation_slot_is_reserved():
    r = Recipe.parse("w4a4-nvfp4")
    with pytest.raises(SchemeError, match="rotation"):
        Recipe(r.weight, r.input, "hadamard")
    with pytest.raises(SchemeError, match="rotation"):
        Recipe.from_dict({**r.to_dict(), "rotation": "hadamard"})


def test_plan_json_new_and_old_forms(tmp_path):
    import json

    p = Plan({"a": "w4a4-nvfp4", "b": "w4g128"})
    d = json.loads(p.to_json())["layers"]
    assert d["b"] == Recipe.parse("w4g128").weight.to_dict()  # weight-only layers keep the old form
    assert d["a"]["input"]["tensor_scale"] is True and d["a"]["rotation"] is None
    f = tmp_path / "plan.json"
    p.save(f)
    assert Plan.load(f) == p
    f.write_text(json.dumps({"layers": {"a": "w8a8-fp8", "b": {"weight": "w4g128", "input": "int8"}}}))
    q = Plan.load(f)
    assert q["a"] == Recipe.parse("w8a8-fp8") and q["b"] == Recipe.parse("w4g128-a8")
    assert q.inputs()["b"] == InputScheme.parse("int8") and not q.needs_calibration()
    assert Plan({"a": "w4a4-nvfp4"}).needs_calibration() == ["a"]
