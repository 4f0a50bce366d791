"""The sparse product of QWHA's activation path, ``y = z F^T`` with ``F`` sparse at fixed positions.

A COO tensor through autograd re-sorts (coalesces) the positions on every call and
returns a sparse gradient that then has to be gathered back into the values; on CPU
that made the sparse path ~10x slower than the dense GEMM it should beat. The
positions of a QWHA adapter never change, so the sorting is done once here
(`SparseIndex`: CSR of ``F`` and CSR of ``F^T``, each with the permutation from the
adapter's storage order) and the three products of a training step are each one
sparse kernel:

* forward ``y^T = F z^T`` (CSR times dense),
* input gradient ``dz^T = F^T dy^T`` (the transposed CSR times dense),
* value gradient ``dF[i, j] = dy[:, i] . z[:, j]`` at the stored positions only
  (a sampled dense-dense product, `torch.sparse.sampled_addmm`).

Each costs ``tokens * nnz`` multiply-adds, as much as a rank-r LoRA of the same
parameter count. The kernels run in float32 (CPU CSR kernels do not take bf16);
the result is cast back to the input's dtype.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SparseIndex:
    """CSR layouts of ``F`` (``[out, n]``) and ``F^T`` for fixed positions ``(rows, cols)``.

    perm / perm_t: storage-order indices in CSR order, so ``values[perm]`` are the CSR
    values of F and ``values[perm_t]`` those of F^T.
    """

    shape: tuple[int, int]
    crow: torch.Tensor
    col: torch.Tensor
    perm: torch.Tensor
    crow_t: torch.Tensor
    col_t: torch.Tensor
    perm_t: torch.Tensor


def _csr(major: torch.Tensor, minor: torch.Tensor, size: int, n_minor: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    perm = torch.argsort(major * n_minor + minor)
    crow = torch.zeros(size + 1, dtype=torch.long, device=major.device)
    crow[1:] = torch.bincount(major, minlength=size).cumsum(0)
    return crow, minor[perm].contiguous(), perm


def sparse_index(rows: torch.Tensor, cols: torch.Tensor, out_features: int, n: int) -> SparseIndex:
    """Sort the positions once into the CSR layouts of F and F^T."""
    rows, cols = rows.long(), cols.long()
    crow, col, perm = _csr(rows, cols, out_features, n)
    crow_t, col_t, perm_t = _csr(cols, rows, n, out_features)
    return SparseIndex((out_features, n), crow, col, perm, crow_t, col_t, perm_t)


def _matrix(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the ops used here are tested
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)


def _spmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for CSR ``a`` and dense row-major ``b``, written into a fresh output.

    ``a @ b`` alone lets the CPU kernel allocate (and page-fault in) its own temporaries:
    at 1536 x 1024 outputs it ran at 10-22 ms against 2-5 ms into a supplied buffer.
    """
    out = torch.empty(a.shape[0], b.shape[1], dtype=b.dtype, device=b.device)
    return torch.addmm(out, a, b, beta=0.0, out=out)


class _SparseProduct(torch.autograd.Function):
    """``zT [n, T], values [nnz] -> F zT [out, T]`` with the three CSR kernels of the module doc.

    Token-last layout on both sides: each stored value then scales one contiguous row of
    ``T`` floats, and the value gradient is a dot product of two contiguous rows.
    """

    @staticmethod
    def forward(ctx, z_t, values, index):  # noqa: ANN001, ANN205 - autograd signature
        ctx.index = index
        ctx.save_for_backward(z_t, values)
        return _spmm(_matrix(index.crow, index.col, values[index.perm], index.shape), z_t)

    @staticmethod
    def backward(ctx, gy_t):  # noqa: ANN001, ANN205
        z_t, values = ctx.saved_tensors
        ix: SparseIndex = ctx.index
        gy_t = gy_t.contiguous()
        gz = gvals = None
        if ctx.needs_input_grad[0]:
            gz = _spmm(_matrix(ix.crow_t, ix.col_t, values[ix.perm_t], (ix.shape[1], ix.shape[0])), gy_t)
        if ctx.needs_input_grad[1]:
            pattern = _matrix(ix.crow, ix.col, values.new_zeros(values.shape), ix.shape)
            sampled = torch.sparse.sampled_addmm(pattern, gy_t, z_t.T, beta=0.0).values()
            gvals = torch.empty_like(values).index_copy_(0, ix.perm, sampled)
        return gz, gvals, None


class _Transpose(torch.autograd.Function):
    """``x.T.contiguous()`` whose gradient is contiguous too (autograd's would be a
    transposed view, and adding that to the base layer's input gradient is a slow strided add)."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.T.contiguous()

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g.T.contiguous()


def transpose(x: torch.Tensor) -> torch.Tensor:
    """A contiguous transpose of a 2-D tensor, with a contiguous gradient."""
    return _Transpose.apply(x)


def sparse_product(z_t: torch.Tensor, values: torch.Tensor, index: SparseIndex) -> torch.Tensor:
    """``F z_t`` (``[out, T]``) for token-last ``z_t [n, T]``; differentiable in both."""
    return _SparseProduct.apply(z_t.float(), values.float(), index).to(z_t.dtype)
