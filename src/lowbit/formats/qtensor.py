"""`QTensor`: a quantized weight matrix — codes, scales, zeros and the scheme that made them.

Codes are held unpacked (``uint8``, one per element, groups padded) so dequantization
and algorithms stay simple vectorised torch; ``pack``/``from_packed`` give the exact
storage form that checkpoints hold. Scales are float32 tensors whose values lie on the
scheme's scale grid (fp16, E4M3, E8M0, ...), so storing them in that format is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lowbit.formats.scheme import Scheme


@dataclass(frozen=True, eq=False)
class QTensor:
    """A quantized ``[out, in]`` weight.

    codes: uint8 ``[out, ngroups, group]`` (last group zero-padded).
    scales: float32 ``[out, ngroups]``.
    zeros: float32 ``[out, ngroups]`` integer zero points (asymmetric INT) or None.
    tensor_scale: float32 scalar ``enc`` (NVFP4): values are ``q * s_b / enc``; or None.

    What the slots hold, how they dequantize and how they are stored is the scheme's
    family's (`lowbit.formats.families`): the K-quants (`lowbit.formats.kquants`) keep their two levels
    in the same slots: ``scales`` / ``zeros`` hold the integer sub-block scale / min codes and
    ``tensor_scale`` the fp16 super-block scales ``[out, nsuper, 1 or 2]`` (d, dmin).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    tensor_scale: torch.Tensor | None
    shape: tuple[int, int]
    scheme: Scheme

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight the codes stand for, ``[out, in]`` (its family's rule)."""
        return self.scheme.family.dequantize(self, dtype)

    @property
    def group(self) -> int:
        return self.codes.shape[-1]

    def bits_per_weight(self) -> float:
        return self.scheme.bits_per_weight(self.shape[1])

    def storage_bytes(self) -> int:
        """Bytes the packed form takes (codes + scales + zeros + tensor scale)."""
        return sum(t.numel() * t.element_size() for t in self.pack().values())

    # --------------------------------------------------------------- storage
    def pack(self) -> dict[str, torch.Tensor]:
        """Exact storage form: packed codes, scales in the scheme's own dtype where lossless."""
        return self.scheme.family.pack(self)

    @classmethod
    def from_packed(cls, d: dict[str, torch.Tensor], shape: tuple[int, int], scheme: Scheme) -> QTensor:
        """Rebuild from ``pack()`` output; shapes are checked, never guessed.

        The tensors come from files (checkpoints, work folders), so any disagreement with
        ``shape`` and ``scheme`` is a `CheckpointError` naming what is off.
        """
        return scheme.family.unpack(d, shape, scheme)


def packed_shapes(shape: tuple[int, int], scheme: Scheme) -> dict[str, tuple[int, ...]]:
    """The shape of each stored part (codes, scales, [zeros], [K-quant super-block scales]) of a
    ``shape`` weight under ``scheme``: what `QTensor.from_packed` accepts, checkable from a file's
    header alone (``inspect`` reads no tensor data)."""
    return scheme.family.packed_shapes(shape, scheme)
