"""The one-level block layout the integer and float-block families share.

A row is cut into groups of ``group_size`` columns (the last one zero-padded), each with
one scale (and, for asymmetric integers, one zero point) and, for NVFP4, one tensor scale
``enc`` over all of them: ``w = (value(code) - zero) * scale / enc``. The families differ
only in how codes map to values (`value`) and how scales are chosen; storage, bit counts,
width checks and the dequantization itself are the same, so they live here once.
The K-quants' two-level layout (`lowbit.formats.kquants`) is a family of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lowbit.errors import CheckpointError, SchemeError
from lowbit.formats import minifloat, packing
from lowbit.formats.groups import from_groups
from lowbit.formats.minifloat import SCALE_BITS
from lowbit.formats.qtensor import QTensor

if TYPE_CHECKING:
    from lowbit.formats.scheme import Scheme


def check_width(s: Scheme, in_features: int, where: str) -> None:
    """Refuse a group larger than the row: it would silently become per-row."""
    if s.group_size > in_features:
        raise SchemeError(
            f"group size {s.group_size} is larger than the {in_features} input columns of "
            f"{where}; choose a group size <= {in_features} or -1 (per row)"
        )


def bits_per_weight(s: Scheme, in_features: int | None, count_scales: bool) -> float:
    """Element bits plus scale (and zero) bits per full group; the per-tensor fp32 scale of NVFP4 is ignored."""
    if not count_scales:
        return float(s.bits)
    g = s.group_size if s.group_size != -1 else (in_features or 4096)
    overhead = SCALE_BITS[s.scale] + (0 if s.sym else s.bits)
    return s.bits + overhead / g


def storage_bits(s: Scheme, shape: tuple[int, int], count_scales: bool) -> int:
    """Exact bits of one ``[out, in]`` weight: codes, and a scale (and zero) per group if counted."""
    out, cols = shape
    bits = s.bits * out * cols
    if count_scales:
        per_group = SCALE_BITS[s.scale] + (0 if s.sym else s.bits)
        bits += per_group * out * -(-cols // s.group_for(cols))
    return bits


def dequantize(q: QTensor, vals: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(vals - zero) * scale / enc`` per group, back to ``[out, in]``; ``vals`` the codes' element values."""
    if q.zeros is not None:
        vals = vals - q.zeros.unsqueeze(-1)
    scale = q.scales
    if q.tensor_scale is not None:
        scale = scale / q.tensor_scale
    w = vals * scale.unsqueeze(-1)
    return from_groups(w, q.shape[1]).to(dtype)


def pack(q: QTensor) -> dict[str, torch.Tensor]:
    """Exact storage form: packed codes, scales in the scheme's own dtype where lossless."""
    out, ng, g = q.codes.shape
    d = {"codes": packing.pack(q.codes.reshape(out, ng * g), q.scheme.bits),
         "scales": _store_scales(q.scales, q.scheme)}
    if q.zeros is not None:
        integral = bool(torch.equal(q.zeros, q.zeros.round()))  # QAT's 2-bit grid uses z = 1.5
        d["zeros"] = q.zeros.to(torch.uint8 if integral else torch.float16)
    if q.tensor_scale is not None:
        d["tensor_scale"] = q.tensor_scale.reshape(1).float()
    return d


def packed_shapes(shape: tuple[int, int], s: Scheme) -> dict[str, tuple[int, ...]]:
    out, cols = shape
    g = s.group_for(cols)
    ng = -(-cols // g)
    d = {"codes": (out, packing.packed_bytes(ng * g, s.bits)), "scales": (out, ng)}
    return d | ({"zeros": (out, ng)} if not s.sym else {})


def unpack(d: dict[str, torch.Tensor], shape: tuple[int, int], s: Scheme) -> QTensor:
    """Rebuild from `pack` output, every shape checked against ``shape`` and ``s`` (a `CheckpointError` if off)."""
    out, cols = shape
    g = s.group_for(cols)
    ng = -(-cols // g)
    missing = [k for k in ("codes", "scales") if k not in d]
    if missing:
        raise CheckpointError(f"stored quantized weight lacks {missing}; the file was edited or damaged")
    packed = d["codes"]
    want = packed_shapes(shape, s)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != want["codes"]:
        raise CheckpointError(f"packed codes are {packed.dtype} {tuple(packed.shape)}, expected uint8 "
                              f"{want['codes']} for shape {(out, cols)} and scheme {s.name}")
    codes = packing.unpack(packed, s.bits, ng * g).reshape(out, ng, g)
    scales = d["scales"].float()
    if scales.shape != want["scales"]:
        raise CheckpointError(f"scales have shape {tuple(scales.shape)}, expected {want['scales']}")
    zeros = d["zeros"].float() if "zeros" in d else None
    if (zeros is not None) != (not s.sym):
        raise CheckpointError(f"zero points are {'present' if zeros is not None else 'absent'}, contrary to "
                              f"scheme {s.name}")
    if zeros is not None and zeros.shape != (out, ng):
        raise CheckpointError(f"zero points have shape {tuple(zeros.shape)}, expected {(out, ng)}")
    ts = d.get("tensor_scale")
    if ts is not None and ts.numel() != 1:
        raise CheckpointError(f"the tensor scale has {ts.numel()} values, expected 1")
    return QTensor(codes, scales, zeros, None if ts is None else ts.float().reshape(()), (out, cols), s)


def _store_scales(scales: torch.Tensor, s: Scheme) -> torch.Tensor:
    """Scales in the narrowest torch dtype that holds them exactly."""
    if s.scale == "fp16":
        return scales.to(torch.float16)
    if s.scale == "bf16":
        return scales.to(torch.bfloat16)
    if s.scale == "e4m3":
        return scales.to(torch.float8_e4m3fn)
    return scales.float()  # ue5m3 / e8m0 / fp32: exported as codes by the exporters


class OneLevelBlocks:
    """What a family with this layout inherits: width check, bit counts, storage and the scale's capacity."""

    def check_width(self, s: Scheme, in_features: int, where: str) -> None:
        check_width(s, in_features, where)

    def bits_per_weight(self, s: Scheme, in_features: int | None, count_scales: bool) -> float:
        return bits_per_weight(s, in_features, count_scales)

    def storage_bits(self, s: Scheme, shape: tuple[int, int], count_scales: bool) -> int:
        return storage_bits(s, shape, count_scales)

    def scale_capacity(self, s: Scheme) -> float:
        return minifloat.max_scale(s.scale)

    def pack(self, q: QTensor) -> dict[str, torch.Tensor]:
        return pack(q)

    def unpack(self, d: dict[str, torch.Tensor], shape: tuple[int, int], s: Scheme) -> QTensor:
        return unpack(d, shape, s)

    def packed_shapes(self, shape: tuple[int, int], s: Scheme) -> dict[str, tuple[int, ...]]:
        return packed_shapes(shape, s)
