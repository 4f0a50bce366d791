"""Fast Walsh-Hadamard transform for widths n = m * 2^k.

QWHA needs ``v -> H v`` for the model's own widths (SmolLM2: 576, 1536, 192; Gemma-3:
640), which are not powers of two. We build ``H = H_m (x) H_{2^k}`` (Kronecker product)
where ``H_m`` is a small Hadamard matrix from a Paley construction and ``H_{2^k}`` the
Sylvester matrix. H is unnormalised, entries +-1, and ``H H^T = n I``, so ``H^-1 = H^T / n``.

Two ways to apply it, equal up to float rounding:

* ``butterfly``: log2(2^k) passes of additions and subtractions (the textbook
  O(n log n)) plus one small matmul for ``H_m``;
* ``kron`` (default): H is split further into Kronecker factors of order <= 64
  (``H_m`` and Sylvester chunks, since ``H_{2^a} (x) H_{2^b} = H_{2^(a+b)}``) and each
  factor is one matmul over a view of the data (no transposed copies): O(n * sum of
  factor orders), still O(n log n) for a bounded chunk size, but 2-3 BLAS passes
  instead of up to ten memory-bound elementwise ones. On CPU it is several times
  faster, which is what makes the QWHA dense path cheap.

Convention: ``wht(x)`` maps every row vector ``v`` of ``x`` to ``H v`` (i.e. ``x @ H^T``);
``wht(x, transpose=True)`` maps it to ``H^T v`` (``x @ H``). Widths with no construction
can be zero-padded to the next width that has one (`plan_width`), which is reported,
never silent.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch

from lowbit.errors import ConfigError


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % p for p in range(2, math.isqrt(q) + 1))


def _legendre_table(q: int) -> torch.Tensor:
    """chi(a) for a in 0..q-1: 0 at 0, +1 on quadratic residues, -1 otherwise."""
    chi = -torch.ones(q, dtype=torch.int64)
    chi[0] = 0
    chi[torch.arange(1, q) ** 2 % q] = 1
    return chi


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[a, b] = chi(b - a) over GF(q), q prime."""
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return _legendre_table(q)[idx]


def _paley1(q: int) -> torch.Tensor:
    """Order q+1 for a prime q = 3 mod 4: H = I + S with S the skew bordered Jacobsthal."""
    s = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = _jacobsthal(q)
    return s + torch.eye(q + 1, dtype=torch.int64)


def _paley2(q: int) -> torch.Tensor:
    """Order 2(q+1) for a prime q = 1 mod 4, from the symmetric bordered Jacobsthal."""
    c = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    c[0, 1:] = 1
    c[1:, 0] = 1
    c[1:, 1:] = _jacobsthal(q)
    plus = torch.tensor([[1, -1], [-1, -1]])
    minus = torch.tensor([[1, 1], [1, -1]])
    zero = (c == 0).to(torch.int64)
    return torch.kron(c, plus) + torch.kron(zero, minus)


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.int64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.cache
def _small_order(m: int) -> torch.Tensor | None:
    """A Hadamard matrix of order m (m = 1, 2 or a multiple of 4), or None if we have none."""
    if m in (1, 2):
        return _sylvester(m)
    if m % 4:
        return None
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return _paley1(m - 1)
    if m % 2 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return _paley2(m // 2 - 1)
    for a in range(4, math.isqrt(m) + 1, 4):  # Kronecker of two constructible orders
        if m % a == 0:
            ha, hb = _small_order(a), _small_order(m // a)
            if ha is not None and hb is not None:
                return torch.kron(ha, hb)
    return None


@dataclass(frozen=True)
class WidthPlan:
    """How a width is transformed: ``n = m * 2^k`` (after padding ``width`` up to ``n``)."""

    width: int
    n: int
    m: int

    @property
    def padded(self) -> bool:
        return self.n != self.width

    @property
    def pow2(self) -> int:
        return self.n // self.m


@functools.cache
def factor(n: int) -> int | None:
    """The smallest constructible m with n = m * 2^k, or None."""
    k = (n & -n).bit_length() - 1  # largest power of two dividing n
    for j in range(k, -1, -1):
        m = n >> j
        if _small_order(m) is not None:
            return m
    return None


@functools.cache
def _next_width(width: int) -> int:
    n = width + 1
    while factor(n) is None:
        n += 1
    return n


def plan_width(width: int, allow_pad: bool = True) -> WidthPlan:
    """Find a Hadamard construction for ``width``; pad up (with a warning) only if none exists."""
    if width < 1:
        raise ConfigError(f"WHT width must be positive, got {width}")
    m = factor(width)
    if m is not None:
        return WidthPlan(width, width, m)
    if not allow_pad:
        raise ConfigError(f"no Hadamard construction for width {width} (needs m*2^k with a Paley order m); "
                          "allow padding or choose a layer with a supported width")
    n = _next_width(width)
    warnings.warn(f"no Hadamard construction for width {width}; zero-padding to {n} "
                  f"(= {factor(n)}*{n // factor(n)}), the adapter basis is truncated", stacklevel=2)
    return WidthPlan(width, n, factor(n))


def hadamard(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense n x n matrix H that `wht` applies (a reference for tests and small solves)."""
    m = factor(n)
    if m is None:
        raise ConfigError(f"no Hadamard construction for order {n}; use plan_width() to pad")
    return torch.kron(_small_order(m), _sylvester(n // m)).to(dtype)


def _butterflies(x: torch.Tensor) -> torch.Tensor:
    """Sylvester transform over the last dim (a power of two), in log2 passes of +/-."""
    s = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < s:
        y = x.reshape(*lead, s // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, s)
        h *= 2
    return x


METHODS = ("kron", "butterfly")
_MIN_FACTOR, _MAX_FACTOR = 16, 64


@functools.cache
def kron_factors(n: int) -> tuple[int, ...]:
    """Orders of the Kronecker factors ``kron`` applies, outermost first.

    The first is ``H_m`` grown by Sylvester doublings to at least 16 (tiny GEMMs are
    inefficient), the rest split the remaining power of two into near-equal chunks of
    at most 64.
    """
    m = factor(n)
    if m is None:
        raise ConfigError(f"no Hadamard construction for width {n}; pad with plan_width() first")
    k = (n // m).bit_length() - 1
    while m < _MIN_FACTOR and k:
        m, k = m * 2, k - 1
    chunks = -(-k // (_MAX_FACTOR.bit_length() - 1)) if k else 0
    bits = [k // chunks + (i < k % chunks) for i in range(chunks)] if chunks else []
    return (m, *(1 << b for b in bits))


@functools.cache
def _factor_matrix(n: int, i: int, transpose: bool, scale: float, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """Factor ``i`` of `kron_factors` (transposed if asked, times ``scale``), cached per dtype/device."""
    f = kron_factors(n)[i]
    if i == 0:
        m = factor(n)
        h = torch.kron(_small_order(m), _sylvester(f // m))
    else:
        h = _sylvester(f)
    h = h.T if transpose else h
    with torch.inference_mode(False):  # cached: must stay usable by autograd after an eval
        return (h.to(torch.float64) * scale).to(dtype=dtype, device=device)


def _kron_apply(x: torch.Tensor, transpose: bool, scale: float) -> torch.Tensor:
    """Apply ``H`` (or ``H^T``) one Kronecker factor at a time, each as one matmul on a view.

    With ``x`` viewed as ``[rows, f_1, ..., f_k]``, factor i contracts axis i: a batched
    ``H_i @ view(left, f_i, right)`` (the last factor: one plain GEMM), so no pass ever
    copies a transposed tensor. ``scale`` (e.g. 1/n) rides on the first factor for free.
    """
    n = x.shape[-1]
    lead = x.shape[:-1]
    return _kron_axes(x.reshape(-1, n), n, 1, transpose, scale).reshape(*lead, n)


def _kron_axes(y: torch.Tensor, n: int, trailing: int, transpose: bool, scale: float) -> torch.Tensor:
    """The factor loop of `_kron_apply` on ``y`` viewed as ``[lead, f_1, ..., f_k, trailing]``."""
    left, right = y.numel() // (n * trailing), n * trailing
    for i, f in enumerate(kron_factors(n)):
        h = _factor_matrix(n, i, transpose, scale if i == 0 else 1.0, y.dtype, y.device)
        right //= f
        if right == 1:
            y = y.reshape(-1, f) @ h.T
        else:
            y = torch.matmul(h, y.reshape(left, f, right))
        left *= f
    return y


def wht_columns(x: torch.Tensor, transpose: bool = False, scale: float = 1.0) -> torch.Tensor:
    """`wht` of every column of ``x`` (``[n, T]``), i.e. ``wht(x.T, ...).T`` without transposing.

    QWHA's sparse path keeps activations token-last (``[n, T]``, the layout its sparse
    kernels want); applying the factors to the leading axes avoids two transposed copies.
    """
    n, cols = x.shape  # an unplanned n is refused by kron_factors, with the same message as wht's
    return _kron_axes(x, n, cols, transpose, scale).reshape(n, cols)


def wht(x: torch.Tensor, transpose: bool = False, method: str = "kron", scale: float = 1.0) -> torch.Tensor:
    """``scale * H v`` (or ``scale * H^T v``) for every row vector v of ``x``; the last dim must be a planned n.

    Differentiable (plain torch ops); dtype and device follow ``x``. ``method`` picks
    the GEMM-Kronecker (default) or butterfly implementation of the same H; ``scale``
    (e.g. ``1/n`` for the inverse) costs nothing extra on the kron path.
    """
    n = x.shape[-1]
    m = factor(n)
    if m is None:
        raise ConfigError(f"no Hadamard construction for width {n}; pad with plan_width() first")
    if method == "kron":
        return _kron_apply(x, transpose, scale)
    if method != "butterfly":
        raise ConfigError(f"unknown WHT method {method!r}; choose one of {METHODS}")
    s = n // m
    lead = x.shape[:-1]
    y = _butterflies(x.reshape(*lead, m, s))  # H_s is symmetric: same for transpose
    if m > 1:
        hm = _small_order(m).to(dtype=x.dtype, device=x.device)
        y = torch.matmul(hm.T if transpose else hm, y)  # [m, m] @ [..., m, s]
    y = y.reshape(*lead, n)
    return y if scale == 1.0 else y * scale


def pad_last(x: torch.Tensor, n: int) -> torch.Tensor:
    """Zero-pad the last dim of ``x`` to ``n``."""
    extra = n - x.shape[-1]
    return x if extra == 0 else torch.nn.functional.pad(x, (0, extra))
