"""The fast FP8 / FP4 element rounding is the arithmetic rounding it replaced, on every finite float32 that matters.

E4M3 rounding and codes go through torch's ``float8_e4m3fn`` cast (`minifloat.round_minifloat`,
`float_blocks.round_e4m3_mag` and the E4M3 element's encode); E2M1 rounding builds its magic
number from the exponent bits. Each is checked against the arithmetic version on a set that
decides every rounding: every float32 sign, exponent and top 11 mantissa bits (all E4M3 / E2M1
round and tie bits lie there, float32 subnormals and values far past saturation included),
each with six patterns of the 12 low bits (zero, one, just below / at / just above the half,
all ones) that decide sticky and tie cases. `benchmarks/e4m3_exhaustive.py` runs all 2^32.
"""

from __future__ import annotations

import torch

from lowbit.formats import float_blocks as fb
from lowbit.formats import minifloat as mf

LOW = (0, 1, 0x7FF, 0x800, 0x801, 0xFFF)


def _deciding_floats() -> torch.Tensor:
    hi = torch.arange(1 << 20, dtype=torch.int64) << 12
    bits = torch.cat([hi | lo for lo in LOW])
    bits = bits[((bits >> 23) & 0xFF) != 0xFF]  # finite only
    return bits.to(torch.int32).view(torch.float32)  # int64 -> int32 keeps the low 32 bits (the sign bit too)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values and equal signs (-0 is not +0 for a code)."""
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


def test_e4m3_cast_is_the_arithmetic_rounding():
    x = _deciding_floats()
    assert x.numel() > 6_000_000 and bool(torch.isfinite(x).all())
    fast, slow = mf.round_minifloat(x, mf.E4M3), mf.round_minifloat_generic(x, mf.E4M3)
    assert _same(fast, slow)
    assert torch.equal(mf.minifloat_to_code(fast, mf.E4M3), mf.minifloat_to_code_generic(slow, mf.E4M3))
    a = x.abs()
    assert _same(fb.round_e4m3_mag(a), mf.round_minifloat_generic(a, mf.E4M3))
    # the corners by name: saturation, the largest finite, subnormals and their ties, float32 subnormals
    edge = torch.tensor([3e38, 464.0, 448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-126, 1e-45, -1e-45])
    want = torch.tensor([448.0, 448.0, 448.0, 2.0**-9, 0.0, 2.0**-9, 0.0, 0.0, -0.0])
    assert _same(mf.round_minifloat(edge, mf.E4M3), want)


def test_e4m3_element_codes_unchanged():
    """The E4M3 element's encode (sign from x, zero is code 0) is the old arithmetic encode."""
    x = _deciding_floats()[::7]
    r = fb.round_e4m3_mag(x.abs())
    old = mf.minifloat_to_code_generic(torch.where((x < 0) & (r > 0), -r, r), mf.E4M3)
    assert torch.equal(fb.E4M3_ELEMENT.encode(x, r), old)
    assert int(fb.E4M3_ELEMENT.encode(torch.tensor([-1e-30]), torch.tensor([0.0]))) == 0


def _old_e2m1(a: torch.Tensor) -> torch.Tensor:
    a = a.clamp_max(6.0)
    m = (a >= 2.0).float().add_(1.0).mul_((a >= 4.0).float().add_(1.0)).mul_(2.0**22)
    return (a + m).sub_(m)


def test_e2m1_rounding_and_index_unchanged():
    x = _deciding_floats()
    for a in (x.abs(), x):  # magnitudes, and negative inputs too (the old formula's value for them)
        assert _same(fb.round_e2m1_mag(a), _old_e2m1(a))
    assert torch.isnan(fb.round_e2m1_mag(torch.tensor([float("nan")]))).all()
    grid = torch.tensor(fb.E2M1_MAGNITUDES if hasattr(fb, "E2M1_MAGNITUDES") else (0, .5, 1, 1.5, 2, 3, 4, 6),
                        dtype=torch.float32)
    assert fb.e2m1_index(grid).tolist() == list(range(8))
    r = fb.round_e2m1_mag(x.abs())
    old = torch.minimum(torch.minimum(2.0 * r, r + 2.0), 0.5 * r + 4.0).to(torch.uint8)
    assert torch.equal(fb.e2m1_index(r), old)
