"""Which learnable rounder tunes which element grid (INT groups, FP4 / FP8 blocks)."""

from __future__ import annotations

import torch
from torch import nn

from lowbit.errors import SchemeError
from lowbit.formats import Scheme
from lowbit.ptq.fp_rounders import FpRounder
from lowbit.ptq.int_rounder import IntRounder

ROUNDERS: dict[str, type[nn.Module]] = {"int": IntRounder, "e2m1": FpRounder, "e4m3": FpRounder}


def make_rounder(w: torch.Tensor, scheme: Scheme, imp: torch.Tensor | None, v2: bool) -> nn.Module:
    """The rounder of ``w [out, in]`` for ``scheme``; ``imp [in]`` seeds V2's searched scales."""
    if scheme.elem not in ROUNDERS:
        raise SchemeError(f"SignRound has no rounder for {scheme.elem} elements; "
                          f"use one of {sorted(ROUNDERS)} or --method rtn")
    return ROUNDERS[scheme.elem](w, scheme, imp, v2)
