"""The number-format families and the one registry that maps a scheme to its family.

A family owns everything that depends on how a format is built: which field values are
valid, how a weight becomes codes and back, how those are stored, what a weight costs in
bits and which element values its codes stand for. Everything else in lowbit asks the
scheme's family (``scheme.family``) instead of testing ``scheme.elem`` or
``scheme.super_block``:

* ``int`` (`lowbit.formats.integer`): integers of 2..8 bits in groups, fp16/bf16/fp32 scales;
* ``fp`` (`lowbit.formats.float_blocks`): FP elements (E2M1, E4M3, ...) in blocks with
  E4M3 / UE5M3 / E8M0 / float scales, NVFP4's tensor scale;
* ``kquant`` (`lowbit.formats.kquants`): llama.cpp's Q2_K ... Q6_K two-level super-blocks.

A new family is one module with a class meeting `Family` and one line in ``FAMILIES``; a new
element of an existing family (an MX type, say) is a change to that family's module only.
Algorithms that are not formats (SignRound's rounders, GPTQ's grids) register their own
per-family parts keyed by ``Family.name``, so formats never import them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from lowbit.errors import SchemeError
from lowbit.formats import float_blocks, integer, kquants

if TYPE_CHECKING:
    from lowbit.formats.inputs import InputScheme
    from lowbit.formats.qtensor import QTensor
    from lowbit.formats.scheme import Scheme


@runtime_checkable
class Family(Protocol):
    """What a number-format family provides (each method takes the scheme it serves)."""

    name: str  # registry key; also the key other packages register their per-family parts under

    @property
    def elements(self) -> tuple[str, ...]:
        """The ``elem`` values the family's schemes use."""

    def claims(self, elem: str, super_block: int) -> bool:
        """Whether a scheme with these fields is this family's."""

    def weight_presets(self) -> dict[str, dict[str, Any]]:
        """Preset name -> `Scheme` fields: the names ``--scheme`` takes for this family."""

    def input_presets(self) -> dict[str, dict[str, Any]]:
        """Preset name -> `InputScheme` fields (empty for weight-only families)."""

    def check(self, s: Scheme) -> None:
        """Refuse field values the family cannot hold (a `SchemeError` naming the fix)."""

    def check_input(self, s: InputScheme) -> None:
        """The same for an activation format."""

    def check_width(self, s: Scheme, in_features: int, where: str) -> None:
        """Refuse a row width the format cannot cut into its blocks."""

    scale_noun: str  # how messages name its scales ("group scales", "block scales", "super-block scales")

    def scale_capacity(self, s: Scheme) -> float:
        """The largest scale the format stores (`lowbit.formats.ranges`)."""

    def needed_scale(self, w: torch.Tensor, s: Scheme) -> float:
        """The largest scale any block of ``w`` needs before rounding (0 when a tensor scale bounds them)."""

    def wider_scale(self, s: Scheme) -> str | None:
        """A wider scale format for a layer beyond ``scale_capacity`` (None: none; the layer stays in 16 bits)."""

    def lost_rows(self, w: torch.Tensor, s: Scheme) -> int:
        """Rows whose every block scale would round to zero (the layer then stays in 16 bits)."""

    def bits_per_weight(self, s: Scheme, in_features: int | None, count_scales: bool) -> float:
        """Nominal storage bits per weight (scales and zeros included when ``count_scales``)."""

    def storage_bits(self, s: Scheme, shape: tuple[int, int], count_scales: bool) -> int:
        """Exact storage bits of one ``[out, in]`` weight."""

    def grid(self, s: Scheme | InputScheme) -> torch.Tensor:
        """Float32 element value of every code, indexed by code (scales not applied)."""

    def elem_max(self, s: Scheme | InputScheme) -> float:
        """Largest element magnitude a scale maps a block's maximum to (127 for INT8, 448 for E4M3)."""

    def round_input(self, t: torch.Tensor, s: InputScheme) -> torch.Tensor:
        """Activations already divided by their scale -> the nearest element values."""

    def quantize(self, w: torch.Tensor, s: Scheme, imp: torch.Tensor | None = None,
                 tensor_scale: torch.Tensor | None = None) -> QTensor:
        """Quantize a 2-D weight ``[out, in]`` (``imp [in]``: importance for the search rules)."""

    def dequantize(self, q: QTensor, dtype: torch.dtype) -> torch.Tensor:
        """The float weight ``[out, in]`` the codes stand for."""

    def pack(self, q: QTensor) -> dict[str, torch.Tensor]:
        """Exact storage form of ``q`` (what checkpoints hold)."""

    def unpack(self, d: dict[str, torch.Tensor], shape: tuple[int, int], s: Scheme) -> QTensor:
        """Inverse of `pack`, every part checked against ``shape`` and ``s``."""

    def packed_shapes(self, shape: tuple[int, int], s: Scheme) -> dict[str, tuple[int, ...]]:
        """The shape of each stored part, checkable from a file header alone."""


FAMILIES: dict[str, Family] = {f.name: f for f in (integer.FAMILY, float_blocks.FAMILY, kquants.FAMILY)}
ELEMS: tuple[str, ...] = tuple(dict.fromkeys(e for f in FAMILIES.values() for e in f.elements))


def family_of(elem: str, super_block: int = 0) -> Family:
    """The family that claims a scheme with these fields."""
    for f in FAMILIES.values():
        if f.claims(elem, super_block):
            return f
    raise SchemeError(f"elem must be one of {ELEMS}, got {elem!r}")
