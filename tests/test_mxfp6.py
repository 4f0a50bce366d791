"""MXFP6 (OCP MX v1.0 FP6 elements E2M3 and E3M2, E8M0 scales on blocks of 32): the format added
to the float-block family by its module alone, checked against references that share no code with it:
the element values enumerated from the spec's formula, brute-force nearest-value search, and torch's
float8 casts where an FP6 grid is a slice of an FP8 one."""

import math

import pytest
import torch

from lowbit.errors import SchemeError
from lowbit.formats import InputScheme, QTensor, Scheme, qdq_input, quantize
from lowbit.formats.float_blocks import ELEMENTS

# (ebits, mbits, bias, emax, largest value) from the OCP Microscaling Formats spec v1.0, table 1
SPEC = {"e2m3": (2, 3, 1, 2, 7.5), "e3m2": (3, 2, 3, 4, 28.0)}


def spec_values(elem: str) -> list[float]:
    """Every non-negative value of the element, by magnitude code, from the spec's formula."""
    eb, mb, bias, _, _ = SPEC[elem]
    out = []
    for code in range(1 << (eb + mb)):
        e, m = code >> mb, code & ((1 << mb) - 1)
        out.append(m / 2**mb * 2.0 ** (1 - bias) if e == 0 else (1 + m / 2**mb) * 2.0 ** (e - bias))
    return out


def nearest(t: torch.Tensor, elem: str) -> torch.Tensor:
    """Brute force: the grid value nearest to each ``t`` (ties to the even magnitude code), saturating."""
    mags = torch.tensor(spec_values(elem), dtype=torch.float64)
    d = (t.double().abs().unsqueeze(-1) - mags).abs()
    best = d.min(-1, keepdim=True).values
    tied = d == best
    even = tied & (torch.arange(len(mags)) % 2 == 0)
    idx = torch.where(even.any(-1), even.float().argmax(-1), tied.float().argmax(-1))
    return torch.copysign(mags[idx], t.double()).float()


def reference_qdq(w: torch.Tensor, elem: str, block: int = 32) -> torch.Tensor:
    """OCP MX: X = 2^(floor(log2 amax) - emax) per block (E8M0), elements = nearest(x / X), saturating."""
    emax = SPEC[elem][3]
    out = torch.zeros_like(w)
    for r in range(w.shape[0]):
        for b in range(0, w.shape[1], block):
            x = w[r, b:b + block]
            amax = float(x.abs().max())
            if amax == 0:
                continue
            scale = 2.0 ** (math.frexp(amax)[1] - 1 - emax)
            out[r, b:b + block] = nearest(x / scale, elem) * scale
    return out


@pytest.mark.parametrize("elem", ["e2m3", "e3m2"])
def test_the_grid_is_the_spec(elem):
    s = Scheme.parse(f"mxfp6-{elem}")
    table = s.family.grid(s)
    want = torch.tensor(spec_values(elem))
    assert table.shape == (64,) and torch.equal(table[:32], want) and torch.equal(table[32:], -want)
    assert float(want.max()) == SPEC[elem][4] == ELEMENTS[elem].grid.max
    assert ELEMENTS[elem].grid.tiny == spec_values(elem)[1] and ELEMENTS[elem].bits == 6


@pytest.mark.parametrize("elem", ["e2m3", "e3m2"])
def test_rounding_is_the_nearest_value_ties_to_even(elem):
    vals = spec_values(elem)
    mids = [(a + b) / 2 for a, b in zip(vals, vals[1:], strict=False)]  # every tie
    t = torch.tensor(vals + mids + [v * 1.01 for v in vals] + [40.0, 1e6, 1e-9, 0.0])
    t = torch.cat([t, -t, torch.randn(4000, generator=torch.Generator().manual_seed(1)) * SPEC[elem][4] / 2])
    assert torch.equal(ELEMENTS[elem].cast(t), nearest(t, elem))


def test_the_normal_range_rounds_as_torch_float8_casts():
    """E2M3 has E4M3's 3 mantissa bits and E3M2 has E5M2's 2: on their normal range they round alike."""
    g = torch.Generator().manual_seed(2)
    a = torch.rand(20000, generator=g) * 6.5 + 1.0  # [1, 7.5): E2M3 normals
    assert torch.equal(ELEMENTS["e2m3"].cast(a), a.to(torch.float8_e4m3fn).float())
    b = torch.rand(20000, generator=g) * 27.75 + 0.25  # [0.25, 28): E3M2 normals
    assert torch.equal(ELEMENTS["e3m2"].cast(b), b.to(torch.float8_e5m2).float())


@pytest.mark.parametrize("elem", ["e2m3", "e3m2"])
def test_quantize_matches_the_mx_reference_and_round_trips(elem):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 96, generator=g) * torch.logspace(-3, 2, 6).unsqueeze(1)
    w[1, :32] = 0  # an all-zero block
    w[2, 40] = 1e4  # an outlier block
    s = Scheme.parse(f"mxfp6-{elem}")
    q = quantize(w, s)
    assert torch.equal(q.dequantize(), reference_qdq(w, elem))
    packed = q.pack()
    assert packed["codes"].shape == (6, 96 * 6 // 8)  # 6 bits per code, densely packed
    assert torch.equal(QTensor.from_packed(packed, (6, 96), s).dequantize(), q.dequantize())
    assert s.bits_per_weight() == 6 + 8 / 32


def test_codes_are_the_ocp_bit_layout():
    """sign in bit 5, then exponent and mantissa: -1.5 in E2M3 is 1 01 100, 28 in E3M2 is 0 111 11."""
    s = Scheme.parse("mxfp6-e2m3")
    w = torch.tensor([[-6.0] + [0.0] * 31])  # scale 2^(2-2) = 1: -6.0 = -(1 + 4/8) * 2^2 -> 1 11 100
    assert int(quantize(w, s).codes[0, 0, 0]) == 0b111100
    w = torch.tensor([[28.0 * 4] + [0.0] * 31])  # E3M2: scale 2^(6-4) = 4: 28 -> 0 111 11
    assert int(quantize(w, Scheme.parse("mxfp6-e3m2")).codes[0, 0, 0]) == 0b011111


def test_names_and_refusals():
    for name in ("mxfp6-e2m3", "mxfp6-e3m2", "mxfp6-e2m3:block=16", "mxfp6-e3m2:rule=search", "mxfp6-e2m3:round=ceil"):
        s = Scheme.parse(name)
        assert s.name == name and Scheme.parse(s.name) == s and Scheme.from_dict(s.to_dict()) == s
    with pytest.raises(SchemeError, match="e2m3 elements have 6 bits"):
        Scheme.parse("mxfp6-e2m3:bits=4")
    with pytest.raises(SchemeError, match="4-over-6 needs E2M1"):
        Scheme.parse("mxfp6-e2m3:rule=4over6")
    assert InputScheme.parse("mxfp6-e3m2").name == "mxfp6-e3m2"
    with pytest.raises(SchemeError, match="FP6 inputs need block scales"):
        InputScheme.parse("mxfp6-e2m3:scale=fp32")


@pytest.mark.parametrize("elem", ["e2m3", "e3m2"])
def test_inputs_match_the_mx_reference(elem):
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(4)) * 3
    got = qdq_input(x, InputScheme.parse(f"mxfp6-{elem}"))
    assert torch.equal(got, reference_qdq(x.reshape(-1, 64), elem).reshape(x.shape))


def test_exporters_refuse_what_their_files_cannot_hold():
    from lowbit.files.compressed_tensors import input_args, target_for
    from lowbit.files.gguf_export import exact_type

    s = Scheme.parse("mxfp6-e2m3")
    with pytest.raises(SchemeError, match="no compressed-tensors format"):
        target_for(s, 64)
    assert exact_type(s, 64) is None
    with pytest.raises(SchemeError, match="no compressed-tensors form"):
        input_args(InputScheme.parse("mxfp6-e2m3:round=even"))


def test_signround_and_gptq_take_it_through_the_family():
    from lowbit.ptq.gptq_grids import FpGrid, make_grid
    from lowbit.ptq.rounders import make_rounder

    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    s = Scheme.parse("mxfp6-e3m2")
    rtn = quantize(w, s)
    r = make_rounder(w, s, None, v2=False).export()  # offsets 0, factors 1: the RTN rounding
    assert torch.equal(r.codes, rtn.codes) and torch.equal(r.scales, rtn.scales)
    grid = make_grid(s, None, 64)
    assert isinstance(grid, FpGrid) and not grid.zeros


def test_a_model_saves_and_loads_bit_for_bit(tmp_path):
    """W6A6 MXFP6 through the Linear, the native checkpoint and its loader, with no code of its own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowbit.files.native import load, save
    from lowbit.formats import Recipe
    from lowbit.nn import quant_layers, replace_linears
    from lowbit.plans.plan import Plan

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    model = LlamaForCausalLM(cfg).eval()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    replace_linears(model, Plan.uniform(names, Recipe.parse("mxfp6-e2m3@mxfp6-e3m2")))
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        before = model(ids).logits
    save(model, None, tmp_path / "ck")
    loaded, _ = load(tmp_path / "ck")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, before)
    layer = quant_layers(loaded)[names[0]]
    assert layer.scheme.name == "mxfp6-e2m3" and layer.input_quant.scheme.name == "mxfp6-e3m2"
