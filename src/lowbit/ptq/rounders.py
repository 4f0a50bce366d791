"""Which learnable rounder tunes which number-format family (INT groups, FP blocks, K-quants).

``ROUNDERS`` is keyed by the family's name (`lowbit.formats.families`): a new element of a
family is tuned by that family's rounder with no change here.

Every rounder starts from its grid's own rounding: offsets ``v`` at 0 and every other
parameter (clip factors, scale multipliers) at 1. `restart_` puts a rounder back there.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.errors import SchemeError
from lowbit.formats import Scheme
from lowbit.ptq.fp_rounders import FpRounder
from lowbit.ptq.int_rounder import IntRounder
from lowbit.ptq.kquant_rounder import KQuantRounder

ROUNDERS: dict[str, type[nn.Module]] = {"int": IntRounder, "fp": FpRounder, "kquant": KQuantRounder}


def make_rounder(w: torch.Tensor, scheme: Scheme, imp: torch.Tensor | None, v2: bool,
                 tensor_scale: torch.Tensor | None = None) -> nn.Module:
    """The rounder of ``w [out, in]`` for ``scheme``; ``imp [in]`` seeds V2's searched scales.

    tensor_scale: the fixed per-tensor scale of a scheme that has one (a fused group's shared one).
    """
    if tensor_scale is not None:
        return FpRounder(w, scheme, imp, v2, tensor_scale)
    family = scheme.family.name  # K-quants are tuned through their double-quantized scales
    if family not in ROUNDERS:
        raise SchemeError(f"SignRound has no rounder for {scheme.name} (a {family} format); "
                          f"use one of the families {sorted(ROUNDERS)} or --method rtn")
    return ROUNDERS[family](w, scheme, imp, v2)


def restart_(rounder: nn.Module, where: torch.Tensor | bool = True) -> None:
    """Put ``rounder``'s parameters back at their start (``v = 0``, factors 1) where ``where`` holds.

    ``rounder`` may hold several (an experts stack's per-expert rounders): every ``*.v`` is an offset.

    ``where`` may be a 0-d boolean tensor on the parameters' device, so a tuner can undo a
    tuning run without reading a value back to the host.
    """
    with torch.no_grad():
        for name, p in rounder.named_parameters():
            start = torch.zeros((), dtype=p.dtype, device=p.device) if name.rpartition(".")[2] == "v" else \
                torch.ones((), dtype=p.dtype, device=p.device)
            torch.where(torch.as_tensor(where, device=p.device), start, p, out=p.data)
