"""Power iteration on Hessian-vector products, against Hessians known in closed form or by brute force."""

from __future__ import annotations

import pytest
import torch

from lowbit.errors import ConfigError
from lowbit.train.curvature import hessian_vector_products, top_hessian_eigenvalue


def quadratic(eigs: list[float], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A = Q diag(eigs) Q^T with a random orthogonal Q, and a point x (the Hessian of 0.5 x.Ax is A anywhere)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(len(eigs), len(eigs), generator=g, dtype=torch.float64))
    a = q @ torch.diag(torch.tensor(eigs, dtype=torch.float64)) @ q.T
    return a, torch.randn(len(eigs), generator=g, dtype=torch.float64).requires_grad_()


def test_top_eigenvalue_of_a_quadratic():
    a, x = quadratic([5.0, 2.0, 1.0, -1.0, 0.5, 0.1])
    r = top_hessian_eigenvalue(lambda: 0.5 * x @ a @ x, [x], iters=200, tol=1e-10)
    assert r.converged and r.value == pytest.approx(5.0, rel=1e-6)
    assert len(r.history) == r.iterations


def test_dominant_negative_eigenvalue_comes_back_negative():
    a, x = quadratic([3.0, -6.0, 1.0])
    r = top_hessian_eigenvalue(lambda: 0.5 * x @ a @ x, [x], iters=300, tol=1e-10)
    assert r.value == pytest.approx(-6.0, rel=1e-6)


def test_several_parameter_tensors_form_one_vector():
    """Two blocks coupled by a cross term: the answer is the top eigenvalue of the joint 4x4 Hessian."""
    u = torch.tensor([0.3, -0.2], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[0.1], [0.4]], dtype=torch.float64, requires_grad=True)
    h = torch.tensor([[4.0, 1.0, 0.5, 0.0], [1.0, 3.0, 0.0, 0.2], [0.5, 0.0, 2.0, 0.3], [0.0, 0.2, 0.3, 1.0]],
                     dtype=torch.float64)

    def loss() -> torch.Tensor:
        z = torch.cat([u, w.reshape(-1)])
        return 0.5 * z @ h @ z + (z**3).sum() * 0  # a cubic term with zero weight keeps the graph non-trivial

    r = top_hessian_eigenvalue(loss, [u, w], iters=500, tol=1e-12)
    assert r.value == pytest.approx(torch.linalg.eigvalsh(h).max().item(), rel=1e-8)


def test_hvp_matches_the_brute_force_hessian_of_a_nonquadratic_loss():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, dtype=torch.float64, generator=g).requires_grad_()
    f = lambda t: torch.log(1 + torch.exp(t)).sum() * (t**2).sum()  # noqa: E731
    v = torch.randn(5, dtype=torch.float64, generator=g)
    full = torch.autograd.functional.hessian(f, x.detach())
    hv = hessian_vector_products(f(x), [x])([v])[0]
    assert torch.allclose(hv, full @ v, atol=1e-10)


def test_through_the_ste_it_is_the_masked_hessian_at_the_quantized_weights():
    """What the optimizer of a QAT layer sees: mask . H(L at Q(W)) . mask, H taken w.r.t. the weight values.

    Some weights are pushed outside the clipping range so the mask is not all ones.
    """
    from lowbit.qat import QATLinear, StretchedElastic

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, generator=g)
    layer = QATLinear(w, None, StretchedElastic())
    layer.alpha.data.mul_(0.8)  # max|W_r| is now beyond 0.99 alpha: the largest weight of each row is clipped
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 3, generator=g)
    loss = lambda weight: ((x @ weight.T - y) ** 2).mean() + (weight**4).sum() * 0.1  # noqa: E731
    q = layer.clean_quantized()
    mask = ((layer.weight / layer.alpha).abs() <= 0.99).float().reshape(-1)
    assert 0 < mask.sum() < mask.numel()
    h = torch.autograd.functional.hessian(lambda t: loss(t.reshape(3, 4)), q.reshape(-1).double().float())
    ref = torch.linalg.eigvalsh(mask[:, None] * h * mask[None, :])
    r = top_hessian_eigenvalue(lambda: loss(layer.quantized_weight()), [layer.weight], iters=500, tol=1e-9)
    top = ref[ref.abs().argmax()].item()
    assert r.value == pytest.approx(top, rel=1e-4)


def test_bad_arguments_and_a_flat_loss_are_errors():
    x = torch.zeros(3, requires_grad=True)
    with pytest.raises(ConfigError, match="iters"):
        top_hessian_eigenvalue(lambda: (x**2).sum(), [x], iters=0)
    with pytest.raises(ConfigError, match="require grad"):
        top_hessian_eigenvalue(lambda: (x**2).sum(), [torch.zeros(3)])
    with pytest.raises(ConfigError, match="flat"):
        top_hessian_eigenvalue(lambda: x.sum() * 2.0, [x])
