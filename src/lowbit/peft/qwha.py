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
from lowbit.peft.sparse import SparseIndex, sparse_index, sparse_product, transpose
from lowbit.transforms.hadamard import kron_factors, pad_last, plan_width, wht, wht_columns

PATHS = ("auto", "dense", "sparse")
# Costs in units of one GEMM multiply-add, fitted to the extra forward+backward time of
# each path over the bare base layer on CPU (the four Linear shapes of SmolLM2 at 128 to
# 2048 tokens, one thread): the dense path's batch-independent part (scatter, WHT of
# the [out, n] coefficients and of their gradient, the fold into the weight) costs ~7.5
# per coefficient per factor order; the activations' WHT ~4.7 per element per factor
# order (transposes included); the three CSR kernels together ~32 per stored value per token.
DENSE_WHT_COST = 7.5
ACT_WHT_COST = 4.7
SPARSE_COST = 32.0


def choose_path(tokens: int, out_features: int, in_features: int, n: int, nnz: int) -> str:
    """The cheaper training path for this call's shape (cost model, not a timing).

    dense: batch-independent WHT work on the coefficients plus the weight gradient
    ``tokens * out * in`` a folded delta needs. sparse: WHT of the activations and the
    CSR products, both per token. On SmolLM2's shapes the crossover is ~1000 tokens for
    the square and wide layers; narrow outputs (k/v, 192 rows) stay dense.
    """
    orders = sum(kron_factors(n))
    dense = DENSE_WHT_COST * orders * out_features * n + tokens * out_features * in_features
    sparse = tokens * (ACT_WHT_COST * orders * n + SPARSE_COST * nnz)
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
        self._index: SparseIndex | None = None
        self._index_key: tuple | None = None

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

    def sparse_index(self) -> SparseIndex:
        """The CSR layouts of the positions, rebuilt only when rows/cols change (load, device move)."""
        key = (self.rows.data_ptr(), self.rows._version, self.cols.data_ptr(), self.cols._version)
        if self._index_key != key:
            self._index = sparse_index(self.rows, self.cols, self.out_features, self.plan.n)
            self._index_key = key
        return self._index

    def delta_sparse(self, x: torch.Tensor) -> torch.Tensor:
        """Path b: ``(x H^-T) F^T`` = ``(x H) F^T / n`` through fixed-position CSR kernels (`peft.sparse`).

        Computed token-last (``F (H^T x^T)``): one transpose in, one out, none inside.
        """
        lead = x.shape[:-1]
        x_t = transpose(pad_last(x.reshape(-1, self.in_features), self.plan.n))
        z_t = wht_columns(x_t, transpose=True)
        y_t = sparse_product(z_t, self.values * (self.scale / self.plan.n), self.sparse_index())
        return transpose(y_t).reshape(*lead, self.out_features)

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
