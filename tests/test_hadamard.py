"""Fast Walsh-Hadamard transform: dense reference, orthogonality, self-inverse, padding."""

import warnings

import pytest
import torch

from lowbit.errors import ConfigError
from lowbit.transforms.hadamard import METHODS, factor, hadamard, kron_factors, pad_last, plan_width, wht

# widths of SmolLM2 (576, 1536, 192), Gemma-3-270M (640), each Paley order, and powers of two
WIDTHS = [1, 2, 4, 8, 64, 12, 20, 24, 28, 36, 44, 48, 72, 192, 576, 640, 1536]


def sylvester_brute(n: int) -> torch.Tensor:
    """H[i, j] = (-1)^popcount(i & j): the Sylvester matrix without any recursion."""
    i = torch.arange(n)
    bits = torch.bitwise_and(i[:, None], i[None, :])
    parity = torch.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).double()


@pytest.mark.parametrize("n", WIDTHS)
def test_dense_matrix_is_hadamard(n):
    h = hadamard(n, torch.float64)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", WIDTHS)
def test_fast_transform_matches_dense(n, method):
    x = torch.randn(3, 5, n, dtype=torch.float64)
    h = hadamard(n, torch.float64)
    assert torch.allclose(wht(x, method=method), x @ h.T, atol=1e-10 * n)
    assert torch.allclose(wht(x, transpose=True, method=method), x @ h, atol=1e-10 * n)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [2, 16, 256, 1024])
def test_powers_of_two_are_sylvester(n, method):
    x = torch.randn(4, n, dtype=torch.float64)
    assert torch.allclose(wht(x, method=method), x @ sylvester_brute(n), atol=1e-9 * n)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [576, 1536, 192, 640, 20, 12 * 4096])
def test_self_inverse_up_to_n(n, method):
    x = torch.randn(7, n, dtype=torch.float64)
    assert torch.allclose(wht(wht(x, method=method), transpose=True, method=method) / n, x, atol=1e-12 * n)
    assert torch.allclose(wht(wht(x, transpose=True, method=method), method=method) / n, x, atol=1e-12 * n)


def test_kron_splits_into_bounded_factors():
    assert kron_factors(576) == (36, 16) and kron_factors(1536) == (24, 64) and kron_factors(640) == (20, 32)
    assert kron_factors(1024) == (16, 64) and kron_factors(8192) == (16, 32, 16) and kron_factors(1) == (1,)
    x = torch.randn(3, 576, dtype=torch.float64)
    assert torch.allclose(wht(x, scale=0.25), 0.25 * wht(x, method="butterfly"), atol=1e-10)
    assert torch.allclose(wht(x, scale=0.25, method="butterfly"), 0.25 * wht(x), atol=1e-10)
    with pytest.raises(ConfigError, match="unknown WHT method"):
        wht(torch.randn(2, 16), method="fft")


def test_factorisations_of_model_widths():
    assert factor(576) == 36 and factor(1536) == 12 and factor(192) == 12 and factor(640) == 20
    assert factor(1024) == 1


def test_float32_and_gradients():
    x = torch.randn(2, 24, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: wht(t, transpose=True), (x,))
    assert torch.autograd.gradcheck(lambda t: wht(t, method="butterfly"), (x,))
    y = wht(torch.randn(3, 576))
    assert y.dtype == torch.float32


def test_width_without_construction_pads_and_says_so():
    with pytest.warns(UserWarning, match="zero-padding to 12"):
        plan = plan_width(10)
    assert plan.padded and plan.n == 12
    with pytest.raises(ConfigError, match="no Hadamard construction"):
        plan_width(42, allow_pad=False)
    with pytest.raises(ConfigError, match="pad"):
        wht(torch.randn(2, 10))
    assert pad_last(torch.ones(2, 10), 12)[:, 10:].abs().sum() == 0


def test_supported_width_is_not_padded():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not plan_width(576).padded
