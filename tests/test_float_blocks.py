"""FP block quantizers (NVFP4, MXFP4, MXFP8, UE5M3) against independent references."""

import pytest
import torch

from lowbit.formats import QTensor, Scheme, minifloat, qdq, quantize, relative_error
from lowbit.formats.float_blocks import e2m1_index, round_e2m1_mag
from lowbit.formats.grids import E2M1_MAGNITUDES, decode_e2m1
from lowbit.formats.groups import to_groups

MAGS = torch.tensor(E2M1_MAGNITUDES)


def ref_e2m1(a: torch.Tensor) -> torch.Tensor:
    """Brute-force nearest E2M1 magnitude, ties to the even index."""
    d = (a.clamp(max=6.0).double().unsqueeze(-1) - MAGS.double()).abs()
    best = d.min(-1, keepdim=True).values
    cand = d == best
    even = torch.arange(8) % 2 == 0
    idx = torch.where((cand & even).any(-1), (cand & even).float().argmax(-1), cand.float().argmax(-1))
    return MAGS[idx]


def ref_nvfp4(w: torch.Tensor, block: int, smax: float = 448.0) -> torch.Tensor:
    """The spec's NVFP4 formulas, computed directly with torch's float8 cast."""
    enc = 6 * smax / w.abs().max()
    x = to_groups(w, block)
    s = (x.abs().amax(-1) / 6 * enc).to(torch.float8_e4m3fn).float()
    t = torch.where(s.unsqueeze(-1) > 0, x * enc / s.unsqueeze(-1), torch.zeros_like(x))
    q = torch.sign(t) * ref_e2m1(t.abs())
    return (q * s.unsqueeze(-1) / enc).reshape(w.shape[0], -1)[:, : w.shape[1]]


def heavy(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.distributions.StudentT(3.0).sample((rows, cols)) * 0.02 if seed == 0 else \
        torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))


def test_e2m1_rounding_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    a = torch.cat([torch.rand(50_000, generator=g) * 8, torch.arange(0, 8.01, 0.25),
                   torch.tensor([5.0, 5.0001, 4.9999, 1e30])])
    r = round_e2m1_mag(a)
    assert torch.equal(r, ref_e2m1(a))
    assert torch.equal(decode_e2m1(e2m1_index(r)), r)


@pytest.mark.parametrize("block", [4, 8, 16, 32, 64, 256])
def test_nvfp4_matches_spec_formula(block):
    w = heavy(48, 256 + 5)  # ragged last block
    s = Scheme.parse("nvfp4").replace(group_size=block)
    q = quantize(w, s)
    assert q.codes.shape == (48, -(-261 // block), block) and q.codes.dtype == torch.uint8
    ref = ref_nvfp4(w, block)
    assert torch.allclose(q.dequantize(), ref, rtol=1e-6, atol=0)
    # scales lie on the E4M3 grid
    assert torch.equal(q.scales.to(torch.float8_e4m3fn).float(), q.scales)


def test_pack_round_trip_and_nibble_order():
    w = heavy(8, 70, seed=1)
    for name in ("nvfp4", "nvfp4-46", "mxfp4", "mxfp8", "nvfp4-ue5m3", "nvfp4:block=8,rule=span"):
        q = quantize(w, name)
        d = q.pack()
        q2 = QTensor.from_packed(d, q.shape, q.scheme)
        assert torch.equal(q2.codes, q.codes) and torch.equal(q2.dequantize(), q.dequantize()), name
    q = quantize(w, "nvfp4")
    flat = q.codes.reshape(8, -1)
    packed = q.pack()["codes"]
    assert torch.equal(packed[:, 0] & 0xF, flat[:, 0]) and torch.equal(packed[:, 0] >> 4, flat[:, 1])


def test_mxfp4_ocp_scale():
    w = heavy(16, 96, seed=1)
    q = quantize(w, "mxfp4")
    amax = to_groups(w, 32).abs().amax(-1)
    want = torch.exp2(torch.floor(torch.log2(amax)) - 2)  # OCP: floor(log2 amax) - emax(E2M1)
    assert torch.equal(q.scales, want) and q.tensor_scale is None
    t = to_groups(w, 32) / want.unsqueeze(-1)
    ref = torch.sign(t) * ref_e2m1(t.abs()) * want.unsqueeze(-1)
    assert torch.equal(q.dequantize(), ref.reshape(16, -1))
    ceil = quantize(w, "mxfp4:round=ceil")
    assert (to_groups(w, 32).abs().amax(-1) <= 6 * ceil.scales).all()  # ceil never clips


def test_mxfp8_matches_torch_cast():
    w = heavy(16, 64, seed=1)
    q = quantize(w, "mxfp8")
    amax = to_groups(w, 32).abs().amax(-1)
    s = torch.exp2(torch.floor(torch.log2(amax)) - 8)
    ref = (to_groups(w, 32) / s.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s.unsqueeze(-1)
    assert torch.equal(q.dequantize(), ref.reshape(16, -1))
    assert torch.equal(q.codes.view(torch.float8_e4m3fn).float() * q.scales.unsqueeze(-1), ref)
    per_channel = quantize(w, "mxfp8:block=-1,scale=fp32")
    assert relative_error(w, per_channel.dequantize()) < 1e-3


def test_ue5m3_without_tensor_scale():
    w = heavy(32, 128, seed=1) * 1e-3
    q = quantize(w, "nvfp4-ue5m3")
    assert q.tensor_scale is None
    assert torch.equal(minifloat.cast_scale(q.scales, "ue5m3"), q.scales)
    with_ts = quantize(w, "nvfp4-ue5m3:tensor=1")
    assert with_ts.tensor_scale is not None
    plain = quantize(w, "nvfp4")
    for x in (q, with_ts):
        assert relative_error(w, x.dequantize()) < 0.02
    assert relative_error(w, q.dequantize()) <= relative_error(w, plain.dequantize()) * 1.1


def test_guard_keeps_tiny_blocks_alive():
    w = torch.randn(4, 64) * 1e-9
    w[0, 0] = 1.0  # one huge value: every other block underflows the E4M3 scale
    plain = quantize(w, "nvfp4:block=8").dequantize()
    guarded = quantize(w, "nvfp4:block=8,guard=1").dequantize()
    nz_blocks = to_groups(w, 8).abs().amax(-1) > 0
    assert (to_groups(plain, 8).abs().amax(-1)[nz_blocks] == 0).any()  # the paradox exists
    assert (to_groups(guarded, 8).abs().amax(-1)[nz_blocks] > 0).all()  # and the guard fixes it


def test_search_uses_importance():
    w = heavy(64, 128, seed=1)
    imp = torch.ones(128)
    imp[:16] = 100.0
    s = Scheme.parse("nvfp4:rule=search")
    weighted = quantize(w, s, imp).dequantize()
    plain = quantize(w, s).dequantize()

    def werr(x):
        return float(((x - w) ** 2 * imp).sum())

    assert werr(weighted) <= werr(plain)
    assert relative_error(w, plain) <= relative_error(w, quantize(w, "nvfp4").dequantize())
    with pytest.raises(ValueError):
        quantize(w, s, torch.ones(127))


def test_rules_order_on_tensor_and_zero_tensor():
    w = heavy(64, 256)
    errs = {r: relative_error(w, qdq(w, f"nvfp4-46:block=8,rule={r}")) for r in
            ("absmax", "4over6", "span", "brute")}
    assert errs["brute"] <= errs["span"] <= errs["4over6"] <= errs["absmax"]
    z = torch.zeros(3, 32)
    for name in ("nvfp4", "nvfp4-46", "mxfp4", "nvfp4-ue5m3"):
        assert torch.equal(qdq(z, name), z)




def test_against_fouroversix():
    fos = pytest.importorskip("fouroversix")
    from fouroversix.quantize.config import QuantizationConfig
    from fouroversix.quantize.frontend import dequantize, quantize_to_fp4

    del fos
    w = heavy(128, 256)
    for ours, rule in (("nvfp4", "static_6"), ("nvfp4-46", "mse")):
        theirs = dequantize(quantize_to_fp4(w, QuantizationConfig(scale_rule=rule, backend="pytorch")),
                            torch.float32)
        e_ours, e_theirs = relative_error(w, qdq(w, ours)), relative_error(w, theirs)
        assert abs(e_ours - e_theirs) < 1e-6 * e_theirs
        assert e_ours <= e_theirs * (1 + 1e-6)


@pytest.mark.parametrize("name", ["nvfp4-46", "mxfp4"])
def test_quantized_model_saves_and_loads(tmp_path, name):
    """End to end: RTN-replace a tiny Llama's Linears, save natively, load, same logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowbit.files import native
    from lowbit.models import linear_layers
    from lowbit.nn import replace_linears
    from lowbit.plans.plan import Plan

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
    model = LlamaForCausalLM(cfg).eval()
    replace_linears(model, Plan.uniform(list(linear_layers(model)), name), progress=False)
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    native.save(model, None, tmp_path / "ckpt")
    loaded, _ = native.load(tmp_path / "ckpt")
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    assert torch.equal(got, want)
