"""K-quants (Q2_K ... Q6_K): schemes, the two-level QTensor, exact GGUF blocks and round trips."""

import numpy as np
import pytest
import torch

from lowbit.errors import CheckpointError, SchemeError
from lowbit.formats import QTensor, Scheme, quantize
from lowbit.formats.kquants import KTYPES, QK_K

gguf = pytest.importorskip("gguf")
from lowbit.files.gguf_kquants import pack_kquant  # noqa: E402

BPW = {2: 2.625, 3: 3.4375, 4: 4.5, 5: 5.5, 6: 6.5625}


def random_kquant(bits: int, out: int = 6, cols: int = 512, seed: int = 0) -> QTensor:
    """Every code, scale code and min code of the layout, with fp16 super scales of both signs."""
    kt = KTYPES[bits]
    g = torch.Generator().manual_seed(seed)
    nsub, nsup = cols // kt.sub, cols // QK_K
    codes = torch.randint(0, kt.qmax - kt.qmin + 1, (out, nsub, kt.sub), generator=g, dtype=torch.uint8)
    sc = torch.randint(kt.sc_lo, kt.sc_hi + 1, (out, nsub), generator=g).float()
    m = None if kt.sym else torch.randint(0, kt.m_hi + 1, (out, nsub), generator=g).float()
    sup = (torch.randn(out, nsup, kt.nsuper_scales, generator=g) * 10.0 ** torch.randint(-6, 2, (out, nsup, 1),
                                                                                         generator=g))
    return QTensor(codes, sc, m, sup.half().float(), (out, cols), Scheme.parse(f"q{bits}_k"))


def gguf_dequant(raw: np.ndarray, bits: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[f"Q{bits}_K"])


def bit_equal(a, b) -> bool:
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.int32), b.view(np.int32))


@pytest.mark.parametrize("bits", sorted(KTYPES))
def test_scheme_names_and_bits_per_weight(bits):
    s = Scheme.parse(f"q{bits}_k")
    assert s.name == f"q{bits}_k" and s.super_block == 256
    assert s.bits_per_weight(4096) == BPW[bits]
    assert Scheme.parse(s.replace(rule="search").name) == s.replace(rule="search")
    assert Scheme.from_dict(s.to_dict()) == s
    # bytes per block as gguf counts them
    assert KTYPES[bits].block_bytes == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[f"Q{bits}_K"]][1]


def test_kquant_fields_are_fixed():
    with pytest.raises(SchemeError, match="K-quants only"):
        Scheme.parse("q4_k:block=64")
    with pytest.raises(SchemeError, match="K-quants only"):
        Scheme.parse("q3_k:sym=0")


@pytest.mark.parametrize("bits", sorted(KTYPES))
def test_every_code_dequantizes_as_gguf_py(bits):
    q = random_kquant(bits)
    assert bit_equal(gguf_dequant(pack_kquant(q), bits), q.dequantize())


@pytest.mark.parametrize("bits", sorted(KTYPES))
@pytest.mark.parametrize("rule", ["absmax", "search"])
def test_quantized_weights_are_exact_in_gguf_and_native_packing(bits, rule):
    torch.manual_seed(bits)
    w = torch.randn(5, 512) * torch.rand(5, 1) * 0.1
    w[0] = 0.0  # an all-zero row: zero scales, never NaN
    w[1, :256] = 0.0
    s = Scheme.parse(f"q{bits}_k").replace(rule=rule)
    q = quantize(w, s, torch.rand(512))
    deq = q.dequantize()
    assert torch.isfinite(deq).all() and (deq[0] == 0).all()
    assert bit_equal(gguf_dequant(pack_kquant(q), bits), deq)
    back = QTensor.from_packed(q.pack(), q.shape, s)
    assert bit_equal(back.dequantize(), deq)


@pytest.mark.parametrize("bits", sorted(KTYPES))
def test_search_beats_plain_ranges_and_error_shrinks_with_bits(bits):
    torch.manual_seed(0)
    w = torch.randn(64, 512)
    imp = torch.rand(512) ** 4
    plain = quantize(w, Scheme.parse(f"q{bits}_k"), imp).dequantize()
    searched = quantize(w, Scheme.parse(f"q{bits}_k:rule=search"), imp).dequantize()

    def err(x):
        return float(((x - w) ** 2 * imp).sum())

    assert err(searched) < err(plain)


def test_width_not_multiple_of_256_is_refused_with_the_fallback():
    with pytest.raises(SchemeError, match="Q5_0.*w5g32"):
        quantize(torch.randn(4, 576), "q4_k")


def test_damaged_packed_parts_are_refused():
    q = random_kquant(4)
    d = q.pack()
    d["zeros"] = d["zeros"][:, :-1]
    with pytest.raises(CheckpointError, match="zeros"):
        QTensor.from_packed(d, q.shape, q.scheme)
    d = q.pack()
    d["codes"] = d["codes"].clone().fill_(255)
    with pytest.raises(CheckpointError, match="out of range"):
        QTensor.from_packed(dict(d, scales=(d["scales"].int() * 0 + 100).to(torch.int8)), q.shape, q.scheme)


def _ggml_quantize_chunk():
    """ggml's quantizer from an installed llama-cpp-python (its libggml-base), or None."""
    import ctypes
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llama_cpp")
    lib = None if spec is None else Path(spec.origin).parent / "lib" / "libggml-base.so"
    if lib is None or not lib.exists():
        return None
    fn = ctypes.CDLL(str(lib)).ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p]
    return fn


@pytest.mark.parametrize("bits", sorted(KTYPES))
def test_search_beats_llama_cpps_importance_quantizer(bits):
    """The bar: ggml's own K quantizer (make_qkx*/make_qx_quants) given the same importance matrix."""
    fn = _ggml_quantize_chunk()
    if fn is None:
        pytest.skip("llama-cpp-python (with its libggml-base) is not installed: no ggml quantizer to compare with")
    g = torch.Generator().manual_seed(bits)
    w = (torch.distributions.StudentT(5.0).sample((128, 1024)) * 0.02).float()
    imp = torch.rand(1024, generator=g) ** 3 + 1e-3
    qt = gguf.GGMLQuantizationType[f"Q{bits}_K"]
    raw = np.zeros((128, 1024 // 256 * KTYPES[bits].block_bytes), dtype=np.uint8)
    wn, impn = w.numpy().copy(), imp.numpy().copy()
    fn(int(qt), wn.ctypes.data, raw.ctypes.data, 0, 128, 1024, impn.ctypes.data)
    theirs = torch.from_numpy(gguf_dequant(raw, bits)).reshape(w.shape)
    ours = quantize(w, Scheme.parse(f"q{bits}_k:rule=search"), imp).dequantize()

    def err(x):
        return float(((x - w) ** 2 * imp).sum())

    print(f"Q{bits}_K importance-weighted error lowbit/ggml = {err(ours) / err(theirs):.3f}")
    assert err(ours) < err(theirs)


def test_element_weights_follow_llama_cpps_convention():
    """imp * sqrt(c * mean(x^2) + x^2) per super-block: larger weights count more, Q6_K keeps the importance."""
    from lowbit.formats.kquants import KTYPES, element_weights

    x = torch.randn(3, 2, 16, 16)
    wt = torch.rand(1, 2, 16, 16) + 0.1
    q2, q4, q6 = (element_weights(x, wt, KTYPES[b]) for b in (2, 4, 6))
    sigma2 = x.pow(2).mean((-1, -2), keepdim=True)
    assert torch.allclose(q2, wt * (sigma2 + x * x).sqrt())
    assert torch.allclose(q4, wt * (2 * sigma2 + x * x).sqrt())
    assert torch.equal(q6, wt.expand_as(x))
