"""Top Hessian eigenvalue of a training loss by power iteration on Hessian-vector products.

A training diagnostic: how curved the loss is where the optimizer stands, along its
sharpest direction. It answers questions like "does WinQ's re-initialisation move the
weights to where the curvature is larger?" (issue 25) without ever forming the Hessian.

Hessian-vector products come from double backward: ``g = grad(loss, params,
create_graph=True)`` once, then ``Hv = grad(g . v, params)`` per iteration (the graph of
``g`` is kept, so each product costs one extra backward pass, not a new forward).

What is differentiated is exactly the autograd graph of ``loss_fn``. Through a
straight-through estimator (lowbit's QAT layers) the weight gradient is
``mask * dL/dQ`` evaluated at ``Q(W)``, so its derivative — the Hessian the optimizer
sees — is ``diag(mask) . H_Q . diag(mask)``: the Hessian of the loss with respect to the
quantized weights at the quantized point, restricted to the entries inside the clipping
range. Power iteration converges to the eigenvalue of largest *magnitude*; the value
returned is its Rayleigh quotient, so a dominant negative eigenvalue comes back negative.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lowbit.errors import ConfigError


@dataclass(frozen=True)
class TopEigen:
    """value: Rayleigh quotient v.Hv of the final unit vector; history: one value per iteration."""

    value: float
    iterations: int
    converged: bool
    history: list[float] = field(default_factory=list)


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    return sum((x.double() * y.double()).sum() for x, y in zip(a, b, strict=True))


def _normalise(v: list[torch.Tensor]) -> list[torch.Tensor]:
    norm = _dot(v, v).sqrt().item()
    if not norm > 0:
        raise ConfigError("the Hessian-vector product vanished: the loss is flat (zero curvature) along every "
                          "direction tried, so there is no top eigenvalue to estimate")
    return [x / norm for x in v]


def hessian_vector_products(loss: torch.Tensor, params: Sequence[torch.Tensor]) -> Callable:
    """A function ``v -> H v`` for the Hessian of the scalar ``loss`` w.r.t. ``params`` (kept graph)."""
    grads = torch.autograd.grad(loss, list(params), create_graph=True)
    live = [i for i, g in enumerate(grads) if g.requires_grad]  # a gradient without a graph is constant
    if not live:
        raise ConfigError("the loss is linear in these parameters (its gradient does not depend on them), so "
                          "the Hessian is zero: it is flat, with no top eigenvalue to estimate")

    def hvp(v: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = torch.autograd.grad([grads[i] for i in live], list(params), grad_outputs=[v[i] for i in live],
                                  retain_graph=True, allow_unused=True)
        return [torch.zeros_like(p) if h is None else h.detach() for h, p in zip(out, params, strict=True)]

    return hvp


def top_hessian_eigenvalue(loss_fn: Callable[[], torch.Tensor], params: Sequence[torch.Tensor], iters: int = 20,
                           tol: float = 1e-3, seed: int = 0) -> TopEigen:
    """Power iteration for the dominant eigenvalue of d^2 loss_fn() / d params^2.

    loss_fn: computes the scalar loss (called once; fix its batch and any randomness).
    params: tensors that require grad; together they are the vector the Hessian acts on.
    Stops when two successive estimates differ by less than ``tol`` relative, or after
    ``iters`` products. The start vector is Gaussian from ``seed``, so estimates repeat.
    """
    params = list(params)
    if iters < 1 or not params or not all(p.requires_grad for p in params):
        raise ConfigError("top_hessian_eigenvalue needs iters >= 1 and parameters that require grad")
    hvp = hessian_vector_products(loss_fn(), params)
    g = torch.Generator().manual_seed(seed)
    v = _normalise([torch.randn(p.shape, generator=g, dtype=torch.float64).to(p) for p in params])
    history: list[float] = []
    for i in range(iters):
        hv = hvp(v)
        history.append(_dot(v, hv).item())
        if i and abs(history[-1] - history[-2]) <= tol * abs(history[-1]):
            return TopEigen(history[-1], i + 1, True, history)
        v = _normalise(hv)
    return TopEigen(history[-1], iters, False, history)
