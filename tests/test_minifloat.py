"""Scale casts: E4M3 bit-exact against torch.float8_e4m3fn, UE5M3 and E8M0 against brute force."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit.errors import SchemeError
from lowbit.formats import minifloat

ALL_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def torch_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).float()


def nearest_on_grid(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Brute-force round to nearest grid value (ties to the even code = even index + 1)."""
    g = torch.cat([torch.zeros(1), grid]).double()
    d = (x.double().unsqueeze(-1) - g).abs()
    best = d.min(-1, keepdim=True).values
    cand = (d == best)
    # ties: prefer the even code; codes are indices into g (0 = zero)
    even = (torch.arange(g.numel()) % 2 == 0)
    idx = torch.where((cand & even).any(-1), (cand & even).float().argmax(-1), cand.float().argmax(-1))
    return g[idx].float()


def test_e4m3_all_codes_round_trip():
    v = minifloat.minifloat_from_code(ALL_CODES, minifloat.E4M3)
    ref = ALL_CODES.view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.isnan(v), torch.isnan(ref))
    fin = torch.isfinite(ref)
    assert fin.sum() == 254
    assert torch.equal(v[fin], ref[fin])
    assert torch.equal(minifloat.minifloat_to_code(ref[fin], minifloat.E4M3), ALL_CODES[fin])
    assert torch.equal(minifloat.round_minifloat(ref[fin], minifloat.E4M3), ref[fin])


def test_e4m3_edges_match_torch():  # the arithmetic rounding (UE5M3 uses it) against torch
    grid = minifloat.minifloat_grid(minifloat.E4M3)
    assert grid.numel() == 126 and grid[0] == 2.0**-9 and grid[-1] == 448.0
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties
    edge = torch.tensor([0.0, -0.0, 2.0**-10, 2.0**-10 * 1.0001, 2.0**-11, 3 * 2.0**-10, 2.0**-6,
                         447.9, 448.0, 449.0, 463.99, 464.0, 480.0, 1e6, float("inf"), 1e-45])
    x = torch.cat([grid, mids, -mids, edge, -edge, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9))])
    assert torch.equal(minifloat.round_minifloat_generic(x, minifloat.E4M3), torch_e4m3(x))
    # saturation (torch >= 2.13 saturates too; the spec asks for saturation either way)
    assert minifloat.round_minifloat_generic(torch.tensor([1e30, -1e30]), minifloat.E4M3).tolist() == [448.0, -448.0]


def test_e4m3_random_matches_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g) * torch.exp(torch.randn(200_000, generator=g) * 5)
    assert torch.equal(minifloat.round_minifloat_generic(x, minifloat.E4M3), torch_e4m3(x.clamp(-448, 448)))


@settings(max_examples=100, deadline=None)
@given(st.floats(min_value=-500, max_value=500, allow_nan=False, width=32))
def test_e4m3_hypothesis(v):
    x = torch.tensor([v], dtype=torch.float32)
    assert torch.equal(minifloat.round_minifloat_generic(x, minifloat.E4M3), torch_e4m3(x))


def test_ue5m3_grid_and_codes():
    grid = minifloat.minifloat_grid(minifloat.UE5M3)
    assert grid[0] == 2.0**-17 and grid[-1] == 114688.0 and torch.all(grid[1:] > grid[:-1])
    assert grid[6] == 7 * 2.0**-17 and grid[7] == 2.0**-14  # subnormals m/8 * 2^-14, then normals
    codes = minifloat.minifloat_to_code(grid, minifloat.UE5M3)
    assert torch.equal(codes.long(), torch.arange(1, 255))
    assert torch.equal(minifloat.minifloat_from_code(codes, minifloat.UE5M3), grid)
    assert torch.isnan(minifloat.minifloat_from_code(torch.tensor([255], dtype=torch.uint8), minifloat.UE5M3)).all()


def test_ue5m3_rounding_brute_force():
    grid = minifloat.minifloat_grid(minifloat.UE5M3)
    g = torch.Generator().manual_seed(1)
    x = torch.exp(torch.empty(20_000).uniform_(-14, 12, generator=g))
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([x, mids, grid, torch.tensor([0.0, 1e9, 2.0**-19])])
    assert torch.equal(minifloat.round_minifloat(x, minifloat.UE5M3), nearest_on_grid(x.clamp(max=114688.0), grid))
    assert minifloat.round_minifloat(torch.tensor([-3.0]), minifloat.UE5M3).item() == 0.0  # unsigned


@pytest.mark.parametrize("mode", ["floor", "ceil", "nearest"])
def test_e8m0_rounding(mode):
    g = torch.Generator().manual_seed(2)
    x = torch.exp(torch.empty(5000).uniform_(-80, 80, generator=g))
    x = torch.cat([x, torch.tensor([1.0, 2.0, 0.5, 3.0, 2**0.5, 1e-30, 6.0])])
    v = minifloat.round_e8m0(x, mode)
    lg = torch.log2(x.double())
    want = {"floor": torch.floor, "ceil": torch.ceil, "nearest": torch.round}[mode](lg)
    assert torch.equal(torch.log2(v.double()), want)
    codes = minifloat.e8m0_to_code(v)
    assert torch.equal(minifloat.e8m0_from_code(codes), v)
    assert torch.equal(codes.long(), (want + 127).long())


def test_e8m0_range_and_codes():
    assert minifloat.round_e8m0(torch.tensor([0.0]), "floor").item() == 2.0**-127
    assert minifloat.round_e8m0(torch.tensor([float("inf")]), "ceil").item() == 2.0**127
    all_codes = torch.arange(255)
    assert torch.equal(minifloat.e8m0_to_code(minifloat.e8m0_from_code(all_codes)).long(), all_codes)
    assert math.isnan(minifloat.e8m0_from_code(torch.tensor([255])).item())
    with pytest.raises(SchemeError):
        minifloat.round_e8m0(torch.ones(1), "up")


def test_cast_scale_dispatch():
    x = torch.tensor([0.3, 5.0])
    assert torch.equal(minifloat.cast_scale(x, "e4m3"), torch_e4m3(x))
    assert torch.equal(minifloat.cast_scale(x, "fp16"), x.half().float())
    assert minifloat.cast_scale(x, "e8m0", "ceil").tolist() == [0.5, 8.0]
    for fmt in ("e4m3", "ue5m3", "e8m0"):
        grid = minifloat.scale_grid(fmt)
        assert torch.equal(minifloat.scale_from_code(minifloat.scale_to_code(grid, fmt), fmt), grid)
        assert minifloat.smallest_scale(fmt) == grid[0].item()
    with pytest.raises(SchemeError):
        minifloat.cast_scale(x, "e5m2")
