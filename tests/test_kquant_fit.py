"""The ``fit`` K-quant rule (`lowbit.formats.kquant_fit`): valid codes, row by row, more accurate than plain ranges,
at least as accurate as llama.cpp's own quantizer where that is installed, and the rule every path names."""

import gguf
import numpy as np
import pytest
import torch
from test_kquant_search import bits_of, hard_matrix
from test_kquants import _ggml_quantize_chunk

from lowbit.errors import SchemeError
from lowbit.formats import Scheme, kquants, quantize
from lowbit.formats.kquants import KTYPES


def _parts(w, bits, imp=None, **kw):
    return kquants.quantize_parts(w, kquants.ktype(bits), imp, search=False, fit=True, **kw)


def _rel_err(w, q):
    return float(((w.double() - q.double()) ** 2).sum() / (w.double() ** 2).sum())


@pytest.mark.parametrize("bits", sorted(KTYPES))
@pytest.mark.parametrize("weighted", [False, True])
def test_codes_are_the_nearest_under_the_stored_scales(bits, weighted):
    """Zeros, one sign, heavy tails, grid values, +-m ties, -0.0, tiny rows: every code is the one
    `kquants.final_codes` gives under the stored two-level scales, and every code is in range."""
    kt = kquants.ktype(bits)
    w = hard_matrix(bits)
    imp = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(bits)) ** 3 if weighted else None
    p = _parts(w, bits, imp)
    x = w.reshape(w.shape[0], -1, kt.nsub, kt.sub)
    assert torch.equal(p.codes.float(), kquants.final_codes(x, p.d, p.sc, p.dmin, p.m, kt) - kt.qmin)
    assert int(p.sc.min()) >= kt.sc_lo and int(p.sc.max()) <= kt.sc_hi
    assert p.m is None or (int(p.m.min()) >= 0 and int(p.m.max()) <= kt.m_hi)
    assert p.d.isfinite().all() and (p.dmin is None or (p.dmin >= 0).all())
    assert not p.codes[1].any() or bits in (3, 6)  # a zero row: all-zero codes (symmetric: the code of 0)


@pytest.mark.parametrize("bits", (3, 4, 6))
def test_each_row_is_its_own(bits):
    """The streamed and in-model paths may hand rows over in other slices, at other addresses: the parts of a
    row depend on that row alone, bit for bit (the sums BLAS does are of small integers, exact in any order)."""
    w = hard_matrix(bits + 1, rows=10)
    whole = _parts(w, bits)
    base = torch.zeros(w.numel() + 3)
    base[3:] = w.flatten()
    odd = base[3:].view(w.shape)  # float32 at an address 12 bytes off the allocator's alignment
    for other in (_parts(w, bits, chunk=1), _parts(w, bits, chunk=3), _parts(odd, bits)):
        for k in ("codes", "sc", "m", "d", "dmin"):
            a, b = getattr(whole, k), getattr(other, k)
            assert (a is None) == (b is None) and (a is None or torch.equal(bits_of(a.float()), bits_of(b.float()))), k


@pytest.mark.parametrize("bits", sorted(KTYPES))
def test_fit_is_between_plain_ranges_and_the_full_search(bits):
    """On normal weights the fit lowers plain rounding's error and stays near the full search's."""
    w = torch.randn(16, 2048, generator=torch.Generator().manual_seed(bits)) * 0.02
    err = {r: _rel_err(w, quantize(w, Scheme.parse(f"q{bits}_k:rule={r}")).dequantize()) for r in ("absmax", "search")}
    fit = _rel_err(w, quantize(w, Scheme.parse(f"q{bits}_k")).dequantize())
    assert fit < 0.97 * err["absmax"]
    assert fit < 1.12 * err["search"], (fit, err)


def test_importance_is_honoured():
    """With an importance, the weighted error is lower than that of the codes chosen without it."""
    w = torch.randn(16, 1024, generator=torch.Generator().manual_seed(7)) * 0.02
    imp = torch.rand(1024, generator=torch.Generator().manual_seed(8)) ** 4 + 1e-3
    s = Scheme.parse("q4_k")

    def werr(q):
        return float(((q.dequantize() - w) ** 2 * imp).sum())

    assert werr(quantize(w, s, imp)) < 0.97 * werr(quantize(w, s))


@pytest.mark.parametrize("bits", sorted(KTYPES))
def test_at_least_as_accurate_as_llama_cpp(bits):
    """The bar the rule was designed to: ggml's own quantizer without importance (make_qkx2_quants /
    make_qx_quants / make_q3_quants) on the same normal matrix, relative squared error."""
    fn = _ggml_quantize_chunk()
    if fn is None:
        pytest.skip("llama-cpp-python (with its libggml-base) is not installed: no ggml quantizer to compare with")
    rows, cols = 128, 4096
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(bits)) * 0.02
    qt = gguf.GGMLQuantizationType[f"Q{bits}_K"]
    raw = np.zeros((rows, cols // 256 * KTYPES[bits].block_bytes), dtype=np.uint8)
    wn = w.numpy().copy()
    fn(int(qt), wn.ctypes.data, raw.ctypes.data, 0, rows, cols, None)
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, qt).copy()).reshape(w.shape)
    ours = quantize(w, Scheme.parse(f"q{bits}_k")).dequantize()
    print(f"Q{bits}_K error fit / llama.cpp = {_rel_err(w, ours) / _rel_err(w, theirs):.4f}")
    assert _rel_err(w, ours) <= _rel_err(w, theirs)


def test_the_rule_is_the_k_quants_default_and_theirs_alone():
    assert Scheme.parse("q4_k").rule == "fit" and str(Scheme.parse("q4_k:rule=absmax")) == "q4_k:rule=absmax"
    for text in ("w4g128:rule=fit", "nvfp4:rule=fit"):
        with pytest.raises(SchemeError, match="fit"):
            Scheme.parse(text)
    # rows that are not a multiple of 256 fall back to llama.cpp's legacy type, plain ranges there
    assert kquants.fit_width(Scheme.parse("q4_k"), 96) == Scheme.parse("w5g32")
