"""Scale casts: E4M3 (OCP FP8), UE5M3 and E8M0, as values and as 8-bit codes.

Block formats store one narrow scale per block, so every scale lowbit produces must lie
exactly on its format's grid; these casts round float32 scales onto the grid (round to
nearest, ties to even mantissa, saturating at the format's maximum) and convert between
grid values and the byte codes that exporters write. E4M3 and UE5M3 are both "minifloats"
and share one exact rounding routine (division by a power of two is exact, so
``round(x / ulp) * ulp`` is the correctly rounded value); E4M3 agrees bit for bit with
``torch.float8_e4m3fn`` casts, which also saturate in torch >= 2.13.

E8M0 holds a power of two only. Its log2 rounding is a parameter: ``floor`` (the OCP MX
spec, used by MXFP4/MXFP8 as ``floor(log2 amax) - emax_elem``), ``ceil`` (never clips)
and ``nearest`` (round log2 to the nearest integer, i.e. the geometric midpoint
``sqrt(2) * 2^k`` is the boundary).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.errors import SchemeError


@dataclass(frozen=True)
class Minifloat:
    """An IEEE-like float with ``ebits`` exponent and ``mbits`` mantissa bits, no inf."""

    ebits: int
    mbits: int
    bias: int
    max: float
    signed: bool

    @property
    def min_normal_exp(self) -> int:
        return 1 - self.bias

    @property
    def smallest(self) -> float:
        """Smallest positive (subnormal) value."""
        return 2.0 ** (self.min_normal_exp - self.mbits)


E4M3 = Minifloat(ebits=4, mbits=3, bias=7, max=448.0, signed=True)
UE5M3 = Minifloat(ebits=5, mbits=3, bias=15, max=114688.0, signed=False)
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127
E8M0_ROUNDING = ("floor", "ceil", "nearest")
SCALE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "e4m3": 8, "ue5m3": 8, "e8m0": 8}  # storage bits of each scale format


# ------------------------------------------------------------------ minifloats
def round_minifloat(x: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """Round float32 ``x`` to the nearest value of ``fmt`` (ties to even), saturating.

    Unsigned formats map negative inputs to 0. NaN stays NaN. E4M3 is torch's own
    ``float8_e4m3fn`` cast after the saturating clamp: the same rounding (round to nearest
    even, subnormals, -0 kept; every finite float32 checked in tests/test_minifloat_cast.py)
    in one pass instead of ten, which is most of an FP8 quantization's time.
    """
    if fmt == E4M3:
        return x.float().clamp(-fmt.max, fmt.max).to(torch.float8_e4m3fn).float()
    return round_minifloat_generic(x, fmt)


def round_minifloat_generic(x: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """`round_minifloat` by arithmetic, for any ``fmt`` (the reference the E4M3 cast is tested against)."""
    x = x.float()
    a = x.abs() if fmt.signed else x.clamp_min(0.0)
    a = a.clamp_max(fmt.max)
    _, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    exp = (e - 1).clamp_min(fmt.min_normal_exp)
    ulp = torch.ldexp(torch.ones_like(a), exp - fmt.mbits)
    r = (torch.round(a / ulp) * ulp).clamp_max(fmt.max)
    return torch.copysign(r, x) if fmt.signed else r


def minifloat_to_code(v: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """Byte code of values already on the grid of ``fmt`` (sign<<7 | exp<<mbits | mant).

    E4M3: the bytes of torch's ``float8_e4m3fn`` cast (exact for grid values; the code is that bit pattern).
    """
    if fmt == E4M3:
        return v.float().to(torch.float8_e4m3fn).view(torch.uint8)
    return minifloat_to_code_generic(v, fmt)


def minifloat_to_code_generic(v: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """`minifloat_to_code` by arithmetic, for any ``fmt``."""
    a = v.float().abs()
    _, e = torch.frexp(a)
    exp = (e - 1).clamp_min(fmt.min_normal_exp)
    normal = a >= 2.0**fmt.min_normal_exp
    mant_units = torch.round(torch.ldexp(a, fmt.mbits - exp)).to(torch.int32)  # 8..15 normal
    ebits = torch.where(normal, exp + fmt.bias, torch.zeros_like(exp)).to(torch.int32)
    mant = torch.where(normal, mant_units - (1 << fmt.mbits), mant_units)
    code = (ebits << fmt.mbits) | mant
    if fmt.signed:
        code = code | (torch.signbit(v).to(torch.int32) << 7)
    return code.to(torch.uint8)


def minifloat_from_code(code: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """Float32 value of byte codes of ``fmt`` (the top code of E4M3 is NaN)."""
    c = code.to(torch.int32)
    mask = (1 << (fmt.ebits + fmt.mbits)) - 1
    ebits = (c & mask) >> fmt.mbits
    mant = (c & ((1 << fmt.mbits) - 1)).float()
    exp = torch.where(ebits == 0, torch.full_like(ebits, fmt.min_normal_exp), ebits - fmt.bias)
    frac = torch.where(ebits == 0, mant, mant + (1 << fmt.mbits))
    v = torch.ldexp(frac, exp - fmt.mbits)
    v = torch.where(v > fmt.max, torch.full_like(v, float("nan")), v)
    if fmt.signed:
        v = torch.where((c & 0x80) != 0, -v, v)
    return v


def minifloat_grid(fmt: Minifloat) -> torch.Tensor:
    """All positive finite values of ``fmt``, ascending (E4M3: 126 values)."""
    n = 1 << (fmt.ebits + fmt.mbits)
    v = minifloat_from_code(torch.arange(1, n, dtype=torch.int32), fmt)
    return v[torch.isfinite(v)]


# ------------------------------------------------------------------------ E8M0
def round_e8m0(x: torch.Tensor, mode: str = "floor") -> torch.Tensor:
    """Round positive ``x`` to a power of two (log2 rounded by ``mode``), saturating.

    Zero and negative inputs give the smallest E8M0 value 2^-127 (E8M0 has no zero).
    """
    if mode not in E8M0_ROUNDING:
        raise SchemeError(f"E8M0 rounding must be one of {E8M0_ROUNDING}, got {mode!r}")
    a = x.float()
    m, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    k = e - 1
    if mode == "ceil":
        k = torch.where(m > 0.5, k + 1, k)
    elif mode == "nearest":
        k = torch.where(m.double() >= 2**-0.5, k + 1, k)  # float64: 2^-0.5 is not a float32
    k = torch.where(a > 0, k, torch.full_like(k, E8M0_MIN_EXP))
    k = torch.where(torch.isinf(a), torch.full_like(k, E8M0_MAX_EXP), k)
    k = k.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    return torch.ldexp(torch.ones_like(a), k)


def e8m0_to_code(v: torch.Tensor) -> torch.Tensor:
    """Biased exponent byte (127 = 1.0) of powers of two."""
    _, e = torch.frexp(v.double())
    return (e - 1 + 127).clamp(0, 254).to(torch.uint8)


def e8m0_from_code(code: torch.Tensor) -> torch.Tensor:
    """Power-of-two value of E8M0 bytes (255 is NaN)."""
    c = code.to(torch.int32)
    v = torch.ldexp(torch.ones(c.shape, dtype=torch.float64), c - 127).float()
    return torch.where(c == 255, torch.full_like(v, float("nan")), v)


def e8m0_grid() -> torch.Tensor:
    return e8m0_from_code(torch.arange(0, 255))


# ---------------------------------------------------------------- by format name
MINIFLOATS = {"e4m3": E4M3, "ue5m3": UE5M3}


def cast_scale(x: torch.Tensor, fmt: str, e8m0_round: str = "floor") -> torch.Tensor:
    """Round block scales ``x`` onto the grid of the scale format ``fmt`` (float32 out)."""
    if fmt in MINIFLOATS:
        return round_minifloat(x, MINIFLOATS[fmt])
    if fmt == "e8m0":
        return round_e8m0(x, e8m0_round)
    if fmt == "fp32":
        return x.float()
    if fmt in ("fp16", "bf16"):  # saturating, as the minifloats: an inf scale would make NaN weights
        dt = torch.float16 if fmt == "fp16" else torch.bfloat16
        big = torch.finfo(dt).max
        return x.clamp(-big, big).to(dt).float()
    raise SchemeError(f"unknown scale format {fmt!r}; use e4m3, ue5m3, e8m0, fp16, bf16 or fp32")


def scale_grid(fmt: str) -> torch.Tensor:
    """Every positive finite value of a narrow scale format, ascending."""
    if fmt in MINIFLOATS:
        return minifloat_grid(MINIFLOATS[fmt])
    if fmt == "e8m0":
        return e8m0_grid()
    raise SchemeError(f"scale format {fmt!r} has no finite code grid; brute force needs e4m3, ue5m3 or e8m0")


def smallest_scale(fmt: str) -> float:
    """Smallest positive value: the floor the underflow guard clamps block scales to."""
    if fmt in MINIFLOATS:
        return MINIFLOATS[fmt].smallest
    if fmt == "e8m0":
        return 2.0**E8M0_MIN_EXP
    return {"fp16": 2.0**-24, "bf16": 2.0**-133, "fp32": 2.0**-149}[fmt]


def smallest_normal(fmt: str) -> float:
    """Smallest positive value with a full mantissa (below it a scale loses precision)."""
    if fmt in MINIFLOATS:
        return 2.0 ** MINIFLOATS[fmt].min_normal_exp
    if fmt == "e8m0":
        return 2.0**E8M0_MIN_EXP
    return {"fp16": 2.0**-14, "bf16": 2.0**-126, "fp32": 2.0**-126}[fmt]


def max_scale(fmt: str) -> float:
    if fmt in MINIFLOATS:
        return MINIFLOATS[fmt].max
    if fmt == "e8m0":
        return 2.0**E8M0_MAX_EXP
    return {"fp16": 65504.0, "bf16": 3.39e38, "fp32": 3.4e38}[fmt]


def scale_to_code(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """Byte codes of grid values (for exporters)."""
    if fmt in MINIFLOATS:
        return minifloat_to_code(v, MINIFLOATS[fmt])
    if fmt == "e8m0":
        return e8m0_to_code(v)
    raise SchemeError(f"scale format {fmt!r} has no byte code")


def scale_from_code(code: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt in MINIFLOATS:
        return minifloat_from_code(code, MINIFLOATS[fmt])
    if fmt == "e8m0":
        return e8m0_from_code(code)
    raise SchemeError(f"scale format {fmt!r} has no byte code")
