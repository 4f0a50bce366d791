"""GPTQ's scale search weighted by the loss GPTQ books per column (``importance="gptq"``: ``1 / u_jj^2``)."""

import pytest
import torch
from test_gptq import correlated

from lowbit.errors import ConfigError
from lowbit.formats import Scheme
from lowbit.formats.groups import to_groups
from lowbit.ptq.gptq import GPTQSettings, gptq_importance, gptq_matrix, inverse_factor

GPTQ_IMP = GPTQSettings(importance="gptq")


def schur_importance(h: torch.Tensor, perm: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """Brute force in float64: for each column, its dampened ``H_jj`` less what the columns GPTQ visits after it can
    absorb (the Schur complement ``H_jj - H_jL H_LL^-1 H_Lj``), in the columns' own order."""
    hd = h + damp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype)
    out = torch.empty(h.shape[0], dtype=torch.float64)
    for k, j in enumerate(perm.tolist()):
        later = perm[k + 1:]
        hjl = hd[j, later]
        out[j] = hd[j, j] - (hjl @ torch.linalg.solve(hd[later][:, later], hjl) if len(later) else 0.0)
    return out


@pytest.mark.parametrize("act_order", [True, False])
def test_importance_is_the_schur_complement_on_the_columns_not_yet_rounded(act_order):
    h = correlated(n=48, tokens=2048)
    perm = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order else torch.arange(48)
    u, _ = inverse_factor(h.float(), 0.01, "test", perm)
    got = gptq_importance(u, perm).double()
    want = schur_importance(h, perm)
    assert torch.allclose(got, want, rtol=2e-3), (got / want).aminmax()
    # the last column visited keeps its whole (dampened) diagonal; correlated earlier ones weigh less
    last = int(perm[-1])
    assert got[last] == pytest.approx(float(h[last, last] + 0.01 * h.diagonal().mean()), rel=1e-3)
    assert bool((got <= (h.diagonal() + 0.01 * h.diagonal().mean()) * (1 + 1e-4)).all())
    assert float((got / h.diagonal()).min()) < 0.5


def test_gptq_importance_changes_only_the_searched_scales_and_books_no_more_loss_in_aggregate():
    """With an identity-like Hessian both importances agree (nothing can compensate); on correlated inputs the scales
    move, and GPTQ's output error stays in the same range (it is a different weighting, not a different algorithm)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=g)
    eye = torch.eye(128, dtype=torch.float64)
    s = Scheme.parse("w4g128").replace(rule="search")
    a, ta, _ = gptq_matrix(w, eye.float(), s, GPTQSettings())
    b, tb, _ = gptq_matrix(w, eye.float(), s, GPTQ_IMP)
    assert torch.equal(a, b)  # 1 / u_jj^2 = (1 + damp) for every column: the same weighting up to a constant
    h = correlated(n=128, tokens=4096)
    a, ta, _ = gptq_matrix(w, h.float(), s, GPTQSettings())
    b, tb, _ = gptq_matrix(w, h.float(), s, GPTQ_IMP)
    assert not torch.equal(a, b)
    for q in (a, b):
        d = (w - q).double()
        assert float((d @ h * d).sum() / (w.double() @ h * w.double()).sum()) < 0.02


def test_importance_is_refused_without_the_search():
    with pytest.raises(ConfigError, match="--importance"):
        GPTQSettings(search=False, importance="gptq")
    with pytest.raises(ConfigError, match="importance must be one of"):
        GPTQSettings(importance="hessian")


def test_group_scales_see_the_gptq_importance():
    """The static group scales are the search's with ``1 / u_jj^2`` as importance (checked against a direct call)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 64, generator=g)
    h = correlated(n=64, tokens=2048, seed=3)
    s = Scheme.parse("w4g32").replace(rule="search")
    perm = torch.argsort(h.diagonal().float(), descending=True, stable=True)
    u, _ = inverse_factor(h.float(), 0.01, "test", perm)
    imp = gptq_importance(u, perm)
    from lowbit.ptq.gptq_grids import make_grid

    grid = make_grid(s, None, 64)
    want, _ = grid.params(to_groups(w, 32), to_groups(imp.reshape(1, -1), 32)[0])
    _, tensors, _ = gptq_matrix(w, h.float(), s, GPTQ_IMP)
    assert torch.allclose(tensors[1].float().reshape(want.shape), want.float())
