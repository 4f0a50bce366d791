"""Reshape a weight row-wise into groups along the input axis, padding a ragged tail.

Every quantizer works on ``[out, ngroups, group]`` views, so per-row, per-group and
per-block formats are one code path (the torchao block-size idea). Padding uses
zeros, which never raise a group's max and dequantize to zero, and is cut off again
by ``from_groups``: no column is ever dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def to_groups(w: torch.Tensor, group: int) -> torch.Tensor:
    """``[out, in] -> [out, ceil(in/group), group]``, zero-padding the last group."""
    out, cols = w.shape
    pad = (-cols) % group
    if pad:
        w = F.pad(w, (0, pad))
    return w.reshape(out, -1, group)


def from_groups(wg: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of ``to_groups``: ``[out, ng, group] -> [out, cols]``."""
    return wg.reshape(wg.shape[0], -1)[:, :cols]


def pad_mask(cols: int, group: int, device: torch.device | None = None) -> torch.Tensor:
    """``[ng, group]`` bool mask of real (not padded) columns."""
    ng = -(-cols // group)
    idx = torch.arange(ng * group, device=device).reshape(ng, group)
    return idx < cols
