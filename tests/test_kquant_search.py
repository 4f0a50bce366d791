"""The fast searched K-quant path (`lowbit.formats.kquant_search`) gives the reference search's parts bit for bit."""

import pytest
import torch

from lowbit.formats import kquants
from lowbit.formats.kquants import KTYPES


def hard_matrix(seed: int, rows: int = 12, cols: int = 512) -> torch.Tensor:
    """Normal weights with the rows that stress ties and clamps: zeros, one sign, a heavy tail, sparse zeros,
    grid values (already on a K-quant grid), equal +m / -m."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[1] = 0
    w[2] = w[2].abs()
    w[3] = -w[3].abs()
    w[4, :300] *= 50
    w[5, ::7] = 0
    w[6] = torch.randint(-8, 8, (cols,), generator=g).float() * 0.003
    w[7, ::2], w[7, 1::2] = 0.01, -0.01
    w[8] = torch.randn(cols, generator=g) * 1e-6
    w[9, :256] = -0.0
    return w


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("bits", sorted(KTYPES))
@pytest.mark.parametrize("weighted", [False, True])
def test_fast_search_gives_the_reference_parts_bit_for_bit(bits, weighted):
    """One random draw per case (the two draws alternate over the cases): the hard rows are in every draw."""
    kt = kquants.ktype(bits)
    for seed in ((bits + weighted) % 2,):
        w = hard_matrix(seed + 10 * bits)
        imp = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(seed)) ** 3 if weighted else None
        ref = kquants.quantize_parts(w, kt, imp, search=True, chunk=5, fast=False)
        fast = kquants.quantize_parts(w, kt, imp, search=True, chunk=5, fast=True)
        for k in ("codes", "sc", "m", "d", "dmin"):
            a, b = getattr(ref, k), getattr(fast, k)
            assert (a is None) == (b is None), k
            if a is not None:  # float bits, signs of zero included
                assert a.shape == b.shape and torch.equal(bits_of(a), bits_of(b)), (k, seed)


def test_fast_search_is_the_default(monkeypatch):
    """`Scheme` quantization (what the streaming and in-model paths call) goes through the fast path."""
    from lowbit.formats import Scheme, quantize

    w = hard_matrix(3, rows=10)
    s = Scheme.parse("q4_k").replace(rule="search")
    kt = kquants.ktype(4)
    codes, sc, m, sup = kquants.parts_to_tensors(kquants.quantize_parts(w, kt, None, True, fast=False), kt)

    def refuse(*a, **k):
        raise AssertionError("the reference search ran")

    monkeypatch.setattr(kquants, "sub_block_params", refuse)
    monkeypatch.setattr(kquants, "double_quantize", refuse)
    q = quantize(w, s)
    assert torch.equal(q.codes, codes) and torch.equal(q.scales, sc) and torch.equal(q.zeros, m)
    assert torch.equal(q.tensor_scale, sup)


def test_batched_choice_is_the_sequential_fold():
    """The candidates' choice (argmin over a candidate dimension) keeps what the reference's ``if e < best``
    loop keeps: the first of equal errors, never a NaN, nothing after a NaN start."""
    from lowbit.formats.kquant_search import _first_min

    nan, inf = float("nan"), float("inf")
    cols = [[3.0, 2.0, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0], [nan, 0.5, 0.1, 0.2], [2.0, nan, 1.0, nan],
            [inf, nan, inf, 5.0], [inf, inf, nan, inf], [0.0, -0.0, 0.0, 0.0], [nan, nan, nan, nan]]
    errs = torch.tensor(cols).T.contiguous()
    for j in range(errs.shape[1]):
        best, keep = errs[0, j], 0
        for i in range(1, errs.shape[0]):
            if errs[i, j] < best:
                best, keep = errs[i, j], i
        assert int(_first_min(errs)[0, j]) == keep, cols[j]
