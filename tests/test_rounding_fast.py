"""The fast plain-rounding paths give exactly what the straightforward formulas give.

The streaming quantizer spends its CPU in plain RTN, so those paths were rewritten for
memory traffic (min/max instead of abs+argmax, byte packing, one signed FP8 cast, row slices,
an aminmax finite check). Each is checked here against the formula it replaced, written out
in the test, on inputs chosen for the cases where a shortcut could differ: ties between +m and
-m, signed zeros, values rounding to zero, saturation, NaN / inf anywhere in a slice.
"""

import pytest
import torch

from lowbit.formats import Scheme, quantize
from lowbit.formats.finite import count_nonfinite
from lowbit.formats.float_blocks import _e4m3_codes, round_e4m3_mag
from lowbit.formats.groups import to_groups
from lowbit.formats.integer import extreme, group_range, needed_scale
from lowbit.formats.packing import pack


def _tie_heavy(rows: int = 64, cols: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-3, 4, (rows, cols), generator=g).float() / 2  # +-1.5 both in most groups
    w[0] = 0.0
    w[1] = -0.0
    w[2, :128] = -0.0
    w[3, 5] = 9.0
    w[3, 9] = -9.0  # +9 first
    w[4, 5] = -9.0
    w[4, 9] = 9.0  # -9 first
    return w


def _pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The little-endian bit stream through 64-bit words: the general packing rule."""
    *lead, n = codes.shape
    c = torch.nn.functional.pad(codes, (0, (-n) % 8)).reshape(*lead, -1, 8).to(torch.int64)
    word = (c << (torch.arange(8) * bits)).sum(-1, keepdim=True)
    return ((word >> (torch.arange(bits) * 8)) & 0xFF).reshape(*lead, -1).to(torch.uint8)


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("n", [8, 13, 256])
def test_byte_packing_matches_the_word_stream(bits, n):
    codes = torch.randint(0, 2**bits, (5, n), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
    assert torch.equal(pack(codes, bits), _pack_words(codes, bits))


def test_extreme_is_the_first_largest_magnitude():
    wg = to_groups(_tie_heavy(), 128)
    want = wg.gather(-1, wg.abs().argmax(-1, keepdim=True)).squeeze(-1)
    got = extreme(wg, wg.amin(-1), wg.amax(-1))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # signs of zero included
    assert float(got[3, 0]) == 9.0 and float(got[4, 0]) == -9.0


@pytest.mark.parametrize("name", ["w4g128", "w3g128", "w2g64", "w8"])
def test_plain_int_range_and_needed_scale_match_the_abs_formulas(name):
    s = Scheme.parse(name)
    w = torch.cat([_tie_heavy(), torch.randn(64, 256) * 0.02])
    wg = to_groups(w, s.group_for(256))
    if s.full_range:
        want = wg.gather(-1, wg.abs().argmax(-1, keepdim=True)).squeeze(-1) / s.qmin
    else:
        want = wg.abs().amax(-1) / s.qmax
    got, _ = group_range(wg, s)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert needed_scale(w, s) == float(want.abs().max())


def test_plain_int_in_row_slices_matches_whole_matrix(monkeypatch):
    import lowbit.formats.integer as integer

    w = torch.randn(37, 384) * 0.02
    whole = quantize(w, "w4g128a").pack()
    monkeypatch.setattr(integer, "PLAIN_CHUNK", 384 * 5)  # 5 rows a slice, the last one ragged
    sliced = quantize(w, "w4g128a").pack()
    assert all(torch.equal(whole[k], sliced[k]) for k in whole)
    bf16 = w.bfloat16()
    assert all(torch.equal(a, b) for a, b in zip(quantize(bf16, "w4g128").pack().values(),
                                                  quantize(bf16.float(), "w4g128").pack().values(), strict=True))


def test_signed_e4m3_cast_matches_the_magnitude_path():
    x = torch.tensor([[0.0, -0.0, 1e-12, -1e-12, 3.0, -3.0, 500.0, -500.0, 0.4375, -0.4375, 0.0021, -0.0021]])
    x = torch.cat([x, torch.randn(7, 12) * 100]).reshape(8, 1, 12)
    sc = torch.tensor([[1.0]] + [[0.5]] * 6 + [[0.0]])  # a zero scale: every code 0
    inv = torch.where(sc > 0, sc.reciprocal(), torch.zeros_like(sc))
    r = round_e4m3_mag(x.abs() * inv.unsqueeze(-1))
    want = torch.where((x < 0) & (r > 0), -r, r).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(_e4m3_codes(x, sc), want)
    assert int(_e4m3_codes(x, sc)[0, 0, 3]) == 0  # -1e-12 rounds to +0, code 0, not 0x80


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_check_finds_every_nan_and_inf(dtype):
    t = torch.randn(300_000).to(dtype)
    assert count_nonfinite(t) == 0
    for pos in (0, 1, 17, 65_539, t.numel() - 1):
        for bad in (float("nan"), float("inf"), float("-inf")):
            u = t.clone()
            u[pos] = bad
            assert count_nonfinite(u) == 1, (pos, bad)
    u = t.clone()
    u[::10_000] = float("nan")
    assert count_nonfinite(u) == len(range(0, t.numel(), 10_000))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
def test_kquant_search_in_small_slices_matches_big_slices(bits):
    """The searched K-quant runs in cache-sized row slices; every sum is within a row's sub- or super-block, so
    the parts are the ones 512-row slices gave, with and without an importance."""
    from lowbit.formats import kquants

    g = torch.Generator().manual_seed(bits)
    w = torch.randn(8, 512, generator=g) * 0.02
    w[3] = 0
    w[5, :300] *= 50
    kt = kquants.ktype(bits)
    for imp in (None, torch.rand(512, generator=g) ** 3):
        big = kquants.quantize_parts(w, kt, imp, True, chunk=512)
        small = kquants.quantize_parts(w, kt, imp, True, chunk=3)
        assert all(torch.equal(getattr(big, k), getattr(small, k)) for k in ("codes", "sc", "d"))
        assert big.m is None or (torch.equal(big.m, small.m) and torch.equal(big.dmin, small.dmin))


@pytest.mark.parametrize("bits", [3, 5, 6, 7])
def test_word_packing_in_slices_matches_the_whole_stream(bits, monkeypatch):
    """3/5/6/7-bit codes are packed a slice of 8-code words at a time (the int64 words are 8 bytes a code:
    a whole 8B matrix's Q6_K codes took a GB of temporaries); slice edges change no byte."""
    import lowbit.formats.packing as packing

    codes = torch.randint(0, 2**bits, (7, 100), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    monkeypatch.setattr(packing, "_WORDS", 5)
    assert torch.equal(pack(codes, bits), _pack_words(codes, bits))
