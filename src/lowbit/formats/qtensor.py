"""`QTensor`: a quantized weight matrix — codes, scales, zeros and the scheme that made them.

Codes are held unpacked (``uint8``, one per element, groups padded) so dequantization
and algorithms stay simple vectorised torch; ``pack``/``from_packed`` give the exact
storage form that checkpoints hold. Scales are float32 tensors whose values lie on the
scheme's scale grid (fp16, E4M3, E8M0, ...), so storing them in that format is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.errors import CheckpointError
from lowbit.formats import kquants, packing
from lowbit.formats.grids import decode_elements
from lowbit.formats.groups import from_groups
from lowbit.formats.scheme import Scheme


@dataclass(frozen=True, eq=False)
class QTensor:
    """A quantized ``[out, in]`` weight.

    codes: uint8 ``[out, ngroups, group]`` (last group zero-padded).
    scales: float32 ``[out, ngroups]``.
    zeros: float32 ``[out, ngroups]`` integer zero points (asymmetric INT) or None.
    tensor_scale: float32 scalar ``enc`` (NVFP4): values are ``q * s_b / enc``; or None.

    K-quant schemes (``scheme.super_block``, `lowbit.formats.kquants`) keep their two levels
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
        """The float weight the codes stand for, ``[out, in]``."""
        s = self.scheme
        if s.super_block:
            kt = kquants.ktype(s.bits)
            w = kquants.dequantize(self.codes, self.scales, self.zeros, self.tensor_scale, kt)
            return from_groups(w, self.shape[1]).to(dtype)
        vals = decode_elements(self.codes, s.elem, s.qmin if s.elem == "int" else 0)
        if self.zeros is not None:
            vals = vals - self.zeros.unsqueeze(-1)
        scale = self.scales
        if self.tensor_scale is not None:
            scale = scale / self.tensor_scale
        w = vals * scale.unsqueeze(-1)
        return from_groups(w, self.shape[1]).to(dtype)

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
        out, ng, g = self.codes.shape
        if self.scheme.super_block:
            return _pack_kquant(self)
        d = {"codes": packing.pack(self.codes.reshape(out, ng * g), self.scheme.bits),
             "scales": _store_scales(self.scales, self.scheme)}
        if self.zeros is not None:
            integral = bool(torch.equal(self.zeros, self.zeros.round()))  # QAT's 2-bit grid uses z = 1.5
            d["zeros"] = self.zeros.to(torch.uint8 if integral else torch.float16)
        if self.tensor_scale is not None:
            d["tensor_scale"] = self.tensor_scale.reshape(1).float()
        return d

    @classmethod
    def from_packed(cls, d: dict[str, torch.Tensor], shape: tuple[int, int], scheme: Scheme) -> QTensor:
        """Rebuild from ``pack()`` output; shapes are checked, never guessed.

        The tensors come from files (checkpoints, work folders), so any disagreement with
        ``shape`` and ``scheme`` is a `CheckpointError` naming what is off.
        """
        out, cols = shape
        if scheme.super_block:
            return _from_packed_kquant(cls, d, shape, scheme)
        g = scheme.group_for(cols)
        ng = -(-cols // g)
        missing = [k for k in ("codes", "scales") if k not in d]
        if missing:
            raise CheckpointError(f"stored quantized weight lacks {missing}; the file was edited or damaged")
        packed = d["codes"]
        want = packed_shapes(shape, scheme)
        if packed.dtype != torch.uint8 or tuple(packed.shape) != want["codes"]:
            raise CheckpointError(f"packed codes are {packed.dtype} {tuple(packed.shape)}, expected uint8 "
                                  f"{want['codes']} for shape {(out, cols)} and scheme {scheme.name}")
        codes = packing.unpack(packed, scheme.bits, ng * g).reshape(out, ng, g)
        scales = d["scales"].float()
        if scales.shape != want["scales"]:
            raise CheckpointError(f"scales have shape {tuple(scales.shape)}, expected {want['scales']}")
        zeros = d["zeros"].float() if "zeros" in d else None
        if (zeros is not None) != (not scheme.sym and scheme.elem == "int"):
            raise CheckpointError(f"zero points are {'present' if zeros is not None else 'absent'}, contrary to "
                                  f"scheme {scheme.name}")
        if zeros is not None and zeros.shape != (out, ng):
            raise CheckpointError(f"zero points have shape {tuple(zeros.shape)}, expected {(out, ng)}")
        ts = d.get("tensor_scale")
        if ts is not None and ts.numel() != 1:
            raise CheckpointError(f"the tensor scale has {ts.numel()} values, expected 1")
        return cls(codes, scales, zeros, None if ts is None else ts.float().reshape(()), (out, cols), scheme)


def packed_shapes(shape: tuple[int, int], scheme: Scheme) -> dict[str, tuple[int, ...]]:
    """The shape of each stored part (codes, scales, [zeros], [K-quant super-block scales]) of a
    ``shape`` weight under ``scheme``: what `QTensor.from_packed` accepts, checkable from a file's
    header alone (``inspect`` reads no tensor data)."""
    out, cols = shape
    if scheme.super_block:
        kt = kquants.ktype(scheme.bits)
        if cols % kquants.QK_K:
            raise CheckpointError(f"{scheme.name} weight of {cols} columns: K-quant rows are multiples of 256")
        nsub, nsup = cols // kt.sub, cols // kquants.QK_K
        d = {"codes": (out, packing.packed_bytes(nsub * kt.sub, kt.bits)), "scales": (out, nsub),
             "tensor_scale": (out, nsup, kt.nsuper_scales)}
        return d | ({} if kt.sym else {"zeros": (out, nsub)})
    g = scheme.group_for(cols)
    ng = -(-cols // g)
    d = {"codes": (out, packing.packed_bytes(ng * g, scheme.bits)), "scales": (out, ng)}
    return d | ({"zeros": (out, ng)} if not scheme.sym and scheme.elem == "int" else {})


def _store_scales(scales: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """Scales in the narrowest torch dtype that holds them exactly."""
    if scheme.scale == "fp16":
        return scales.to(torch.float16)
    if scheme.scale == "bf16":
        return scales.to(torch.bfloat16)
    if scheme.scale == "e4m3":
        return scales.to(torch.float8_e4m3fn)
    return scales.float()  # ue5m3 / e8m0 / fp32: exported as codes by the exporters


def _pack_kquant(q: QTensor) -> dict[str, torch.Tensor]:
    """Codes bit-packed, sub-scale codes int8 (they span -128..127 at most), min codes uint8,
    super-block scales fp16: every value stored exactly, nothing recomputed on load."""
    out = q.shape[0]
    d = {"codes": packing.pack(q.codes.reshape(out, -1), q.scheme.bits),
         "scales": q.scales.to(torch.int8), "tensor_scale": q.tensor_scale.to(torch.float16)}
    if q.zeros is not None:
        d["zeros"] = q.zeros.to(torch.uint8)
    return d


def _from_packed_kquant(cls, d: dict[str, torch.Tensor], shape: tuple[int, int], scheme: Scheme) -> QTensor:
    kt = kquants.ktype(scheme.bits)
    out, cols = shape
    nsub = cols // kt.sub
    dtypes = {"codes": torch.uint8, "scales": torch.int8, "tensor_scale": torch.float16, "zeros": torch.uint8}
    want = {k: (dtypes[k], shp) for k, shp in packed_shapes(shape, scheme).items()}
    extra = sorted(set(d) - set(want))
    if extra:
        raise CheckpointError(f"stored {scheme.name} weight has unexpected parts {extra}; the file was edited")
    for k, (dt, shp) in want.items():
        t = d.get(k)
        if t is None or t.dtype != dt or tuple(t.shape) != shp:
            got = "missing" if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise CheckpointError(f"{scheme.name} {k} is {got}, expected {dt} {shp} for shape {shape}")
    codes = packing.unpack(d["codes"], kt.bits, nsub * kt.sub).reshape(out, nsub, kt.sub)
    sc = d["scales"].float()
    m = d["zeros"].float() if "zeros" in d else None
    if codes.numel() and (int(codes.max()) > kt.qmax - kt.qmin or int(sc.min()) < kt.sc_lo or
                          int(sc.max()) > kt.sc_hi or (m is not None and int(m.max()) > kt.m_hi)):
        raise CheckpointError(f"{scheme.name} codes out of range; the file was edited or damaged")
    return cls(codes, sc, m, d["tensor_scale"].float(), (out, cols), scheme)
