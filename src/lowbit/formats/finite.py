"""Nothing non-finite is ever written: one check every writer runs before its rename.

A NaN or inf in a stored scale, code or weight makes every number derived from it NaN,
and with ``--no-eval`` nothing would show it. Each writer of tensors (native
checkpoints, compressed-tensors and GGUF exports, adapters, training checkpoints, PTQ
work files) passes what it is about to write through `require_finite` inside its
temporary folder or file, so a failure leaves nothing behind; `nonfinite` is the same
scan for a model's source weights (refused by name before any heavy work).

Integer tensors (packed codes, byte-coded scales, RNG states) hold no NaN and are
skipped; float8 tensors are widened for the check, since their NaN code is a value too.
The scan runs in slices so a large tensor never needs a second full-size copy.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from lowbit.errors import LowbitError, NonFiniteError

_SLICE = 1 << 24  # elements checked at once


def count_nonfinite(t: torch.Tensor | np.ndarray) -> int:
    """How many NaN / inf values ``t`` holds (0 for integer and boolean tensors)."""
    if isinstance(t, np.ndarray):
        if not np.issubdtype(t.dtype, np.floating):
            return 0
        flat = t.reshape(-1)
        return int(sum(int((~np.isfinite(flat[i:i + _SLICE])).sum()) for i in range(0, flat.size, _SLICE)))
    if not (t.is_floating_point() or t.is_complex()):
        return 0
    flat = t.detach().reshape(-1)
    wide = flat.element_size() == 1  # float8: isfinite is not implemented for it everywhere
    bad = 0
    for i in range(0, flat.numel(), _SLICE):
        part = flat[i:i + _SLICE]
        part = part.float() if wide else part
        if not t.is_complex() and _all_finite(part):
            continue
        bad += int((~torch.isfinite(part)).sum())
    return bad


def _all_finite(part: torch.Tensor) -> bool:
    """Whether a real slice holds no NaN / inf: its min and max are finite (both propagate NaN and reach
    +-inf), one read-only pass where ``isfinite`` + count wrote and read a mask (20x the time)."""
    lo, hi = torch.aminmax(part)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def nonfinite(tensors: Iterable[tuple[str, torch.Tensor | np.ndarray]]) -> list[tuple[str, int]]:
    """(name, count) of every tensor holding NaN or inf, in the order given."""
    out = []
    for name, t in tensors:
        n = count_nonfinite(t)
        if n:
            out.append((name, n))
    return out


def require_finite(tensors: Iterable[tuple[str, torch.Tensor | np.ndarray]], what: str, fix: str,
                   error: type[LowbitError] = NonFiniteError) -> None:
    """Raise ``error`` naming the first non-finite tensor of ``tensors`` (``what``: where they go; ``fix``: what to do)."""
    bad = nonfinite(tensors)
    if not bad:
        return
    name, n = bad[0]
    more = f" (and {len(bad) - 1} more tensor(s))" if len(bad) > 1 else ""
    raise error(f"{what}: tensor {name} holds {n} NaN/inf value(s){more}; {fix}")
