"""The QWHA adapter: trainable Walsh-Hadamard coefficients at fixed positions.

``Delta_W = F H^-1`` with ``F`` sparse (``d_out x n``; a fixed set of positions per row)
and ``H`` the ``n x n`` Walsh-Hadamard matrix of `wht` (``H^-1 = H^T / n``). Only the
values of F at those positions train. Two equivalent forward paths:

* ``dense``: scatter F, one fast WHT per row gives Delta_W (cost independent of the
  batch); the host `QuantLinear` adds it to the dequantized base weight so base and
  adapter share one GEMM (`folds`);
* ``sparse``: transform the activations (``x H^-T``, cost tokens * n log n) and take
  the sparse product with F^T (cost tokens * nnz).

``path="auto"`` picks by a simple cost model (`choose_path`); both are exposed so the
benchmark can time them. A ``scale`` multiplies the stored values (FourierFT-style
learning-rate multiplier); `QWHAAdapter.rescale` changes it without changing Delta_W.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowbit.errors import ConfigError
from lowbit.peft.base import Adapter
from lowbit.peft.wht import kron_factors, pad_last, plan_width, wht

PATHS = ("auto", "dense", "sparse")
# Relative costs in units of one GEMM multiply-add, calibrated on CPU (the 7 Linears of a
# SmolLM2 block, forward+backward): the kron WHT's small batched matmuls run at about a
# third of GEMM speed, the sparse COO product (gather, coalesce) about 80x slower.
WHT_COST = 3.0
ELEMWISE_COST = 80.0


def choose_path(tokens: int, out_features: int, in_features: int, n: int, nnz: int) -> str:
    """The cheaper training path for this call's shape (cost model, not a timing).

    dense: WHT of the ``[out, n]`` coefficients, folded into the base GEMM, whose extra
    cost is the weight gradient ``tokens * out * in``. sparse: WHT of the activations
    plus the sparse product, both per token. Dense wins from ~100 tokens up.
    """
    per_elem = WHT_COST * sum(kron_factors(n))
    dense = per_elem * out_features * n + tokens * out_features * in_features
    sparse = per_elem * tokens * n + ELEMWISE_COST * tokens * nnz
    return "dense" if dense <= sparse else "sparse"


class QWHAAdapter(Adapter):
    """Sparse WHT-domain adapter on a frozen ``[out, in]`` base; positions are buffers."""

    kind = "qwha"

    def __init__(self, out_features: int, in_features: int, rows: torch.Tensor, cols: torch.Tensor,
                 values: torch.Tensor | None = None, scale: float = 1.0, path: str = "auto") -> None:
        super().__init__(out_features, in_features)
        if path not in PATHS:
            raise ConfigError(f"unknown QWHA forward path {path!r}; choose one of {PATHS}")
        if scale <= 0:
            raise ConfigError(f"QWHA scale must be positive, got {scale}")
        self.plan = plan_width(in_features)
        rows, cols = rows.long().flatten(), cols.long().flatten()
        _check_positions(rows, cols, out_features, self.plan.n)
        self.register_buffer("rows", rows)
        self.register_buffer("cols", cols)
        init = torch.zeros(rows.numel()) if values is None else values.detach().float().flatten() / scale
        if init.numel() != rows.numel():
            raise ConfigError(f"QWHA got {init.numel()} values for {rows.numel()} positions")
        self.values = nn.Parameter(init.clone())
        self.scale = float(scale)
        self.path = path

    @property
    def nnz(self) -> int:
        return self.rows.numel()

    def config(self) -> dict[str, Any]:
        return {**super().config(), "scale": self.scale, "path": self.path}

    def coefficients(self) -> torch.Tensor:
        """Dense ``F`` (``[out, n]``), differentiable in the values."""
        f = self.values.new_zeros(self.out_features, self.plan.n)
        return f.index_put((self.rows, self.cols), self.values * self.scale)

    def delta_weight(self) -> torch.Tensor:
        """``F H^-1`` cropped to ``in_features`` (only differs when the width was padded)."""
        return wht(self.coefficients(), scale=1.0 / self.plan.n)[:, : self.in_features]

    def delta_sparse(self, x: torch.Tensor) -> torch.Tensor:
        """Path b: ``F (H^T x^T) / n`` with a sparse COO product (no dense F or Delta_W)."""
        lead = x.shape[:-1]
        z = wht(pad_last(x.reshape(-1, self.in_features), self.plan.n), transpose=True)
        vals = (self.values * (self.scale / self.plan.n)).to(x.dtype)
        f = torch.sparse_coo_tensor(torch.stack((self.rows, self.cols)), vals, (self.out_features, self.plan.n),
                                    check_invariants=False, is_coalesced=False)
        y = torch.sparse.mm(f, z.T).T
        return y.reshape(*lead, self.out_features)

    def resolved_path(self, x: torch.Tensor) -> str:
        if self.path != "auto":
            return self.path
        tokens = x.numel() // self.in_features
        return choose_path(tokens, self.out_features, self.in_features, self.plan.n, self.nnz)

    def folds(self, x: torch.Tensor) -> bool:
        return self.resolved_path(x) == "dense"

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        if self.resolved_path(x) == "sparse":
            return self.delta_sparse(x)
        return super().delta(x)

    @torch.no_grad()
    def rescale(self, scale: float) -> None:
        """Change the learning-rate multiplier, keeping Delta_W exactly as it is."""
        if scale <= 0:
            raise ConfigError(f"QWHA scale must be positive, got {scale}")
        self.values.mul_(self.scale / scale)
        self.scale = float(scale)


def _check_positions(rows: torch.Tensor, cols: torch.Tensor, out_features: int, n: int) -> None:
    if rows.shape != cols.shape:
        raise ConfigError("QWHA rows and cols must have the same length")
    if rows.numel() == 0:
        return
    if int(rows.min()) < 0 or int(rows.max()) >= out_features or int(cols.min()) < 0 or int(cols.max()) >= n:
        raise ConfigError(f"QWHA positions out of range for a [{out_features}, {n}] coefficient matrix")
    flat = rows * n + cols
    if torch.unique(flat).numel() != flat.numel():
        raise ConfigError("QWHA positions contain duplicates; each (row, col) may appear once")


def from_dense(coefs: torch.Tensor, in_features: int, scale: float = 1.0, path: str = "auto") -> QWHAAdapter:
    """An adapter holding the non-zeros of a dense coefficient matrix ``F`` (``[out, n]``)."""
    rows, cols = torch.nonzero(coefs, as_tuple=True)
    return QWHAAdapter(coefs.shape[0], in_features, rows, cols, coefs[rows, cols], scale=scale, path=path)
