"""Pack a K-quant `QTensor` into llama.cpp's block bytes (ggml-common.h's block_q2_K ... block_q6_K).

lowbit holds the two-level structure itself (element codes, sub-block scale and min codes,
fp16 super-block scales), so packing only moves bits: nothing is re-quantized. The byte
layouts, per 256-weight super-block (``c`` = unsigned element code of weight ``e``):

- Q2_K: scales[16] (``sc | m << 4``), qs[64] (weight ``128h + 32j + l`` in bits ``2j`` of
  ``qs[32h + l]``), d, dmin.
- Q3_K: hmask[32] (bit 2 of weight ``32j + l`` in bit ``j`` of ``hmask[l]``), qs[64] (low two
  bits, as Q2_K), scales[12] (sixteen 6-bit ``sc + 32``: low nibbles in bytes 0..7, two high
  bits of ``sc[4j + k]`` in bits ``2j`` of byte ``8 + k``), d.
- Q4_K: d, dmin, scales[12] (eight 6-bit scales and mins, see `_scale_min_bytes`),
  qs[128] (weight ``64g + 32h + l`` in nibble ``h`` of ``qs[32g + l]``).
- Q5_K: as Q4_K with qh[32] (bit 4 of weight ``32j + l`` in bit ``j`` of ``qh[l]``) before qs.
- Q6_K: ql[128] (low nibble of weight ``128h + 64s + l`` in nibble ``s`` of ``ql[64h + l]``),
  qh[64] (bits 4-5 of weight ``128h + 32j + l`` in bits ``2j`` of ``qh[32h + l]``),
  scales[16] int8, d.
"""

from __future__ import annotations

import numpy as np
import torch

from lowbit.errors import SchemeError
from lowbit.formats import QTensor
from lowbit.formats.kquants import QK_K, ktype


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.uint8)


def _f16(x: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` values -> ``[..., 2n]`` little-endian fp16 bytes."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


def _shift_pack(c: torch.Tensor, width: int) -> torch.Tensor:
    """``[..., k, n]`` small codes -> ``[..., n]`` bytes with code ``j`` in bits ``width*j``."""
    shifts = torch.arange(c.shape[-2], dtype=torch.int32).reshape(-1, 1) * width
    return _bytes((c.to(torch.int32) << shifts).sum(-2))


def _scale_min_bytes(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: eight 6-bit scales and mins ``[..., 8]`` -> 12 bytes.

    Bytes 0-3: ``sc[j]`` plus the top two bits of ``sc[j+4]`` in bits 6-7; bytes 4-7 the same
    for the mins; bytes 8-11: low nibbles of ``sc[j+4]`` and ``m[j+4]``.
    """
    sc, m = sc.to(torch.int32), m.to(torch.int32)
    lo_s = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    lo_m = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    mix = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    return _bytes(torch.cat([lo_s, lo_m, mix], -1))


def _q3_scale_bytes(sc: torch.Tensor) -> torch.Tensor:
    """Q3_K: sixteen signed 6-bit scales ``[..., 16]`` -> 12 bytes."""
    v = (sc.to(torch.int32) + 32)
    low = (v[..., :8] & 0xF) | ((v[..., 8:] & 0xF) << 4)
    high = _shift_pack(((v >> 4) & 3).reshape(*v.shape[:-1], 4, 4), 2)
    return _bytes(torch.cat([_bytes(low).to(torch.int32), high.to(torch.int32)], -1))


def pack_kquant(q: QTensor) -> np.ndarray:
    """GGUF block bytes ``uint8 [out, (in / 256) * block_bytes]`` of a K-quant QTensor."""
    s = q.scheme
    if s.family.name != "kquant":
        raise SchemeError(f"{s.name} is not a K-quant scheme")
    kt = ktype(s.bits)
    out, cols = q.shape
    nsup = cols // QK_K
    c = q.codes.reshape(out, nsup, QK_K).to(torch.int32)
    sc = q.scales.reshape(out, nsup, kt.nsub)
    m = None if q.zeros is None else q.zeros.reshape(out, nsup, kt.nsub)
    d = _f16(q.tensor_scale[..., :1])
    if kt.name == "Q2_K":
        scales = _bytes(sc.to(torch.int32) | (m.to(torch.int32) << 4))
        qs = _shift_pack(c.reshape(out, nsup, 2, 4, 32), 2).reshape(out, nsup, 64)
        parts = [scales, qs, d, _f16(q.tensor_scale[..., 1:])]
    elif kt.name == "Q3_K":
        hmask = _shift_pack((c >> 2).reshape(out, nsup, 8, 32), 1)
        qs = _shift_pack((c & 3).reshape(out, nsup, 2, 4, 32), 2).reshape(out, nsup, 64)
        parts = [hmask, qs, _q3_scale_bytes(sc), d]
    elif kt.name in ("Q4_K", "Q5_K"):
        qs = _shift_pack((c & 0xF).reshape(out, nsup, 4, 2, 32), 4).reshape(out, nsup, 128)
        qh = [_shift_pack((c >> 4).reshape(out, nsup, 8, 32), 1)] if kt.name == "Q5_K" else []
        parts = [d, _f16(q.tensor_scale[..., 1:]), _scale_min_bytes(sc, m), *qh, qs]
    else:  # Q6_K
        ql = _shift_pack((c & 0xF).reshape(out, nsup, 2, 2, 64), 4).reshape(out, nsup, 128)
        qh = _shift_pack((c >> 4).reshape(out, nsup, 2, 4, 32), 2).reshape(out, nsup, 64)
        parts = [ql, qh, sc.to(torch.int8).view(torch.uint8), d]
    blocks = torch.cat([p.to(torch.uint8) for p in parts], -1)
    if blocks.shape[-1] != kt.block_bytes:
        raise AssertionError(f"{kt.name} block is {blocks.shape[-1]} bytes, expected {kt.block_bytes}")
    return blocks.reshape(out, nsup * kt.block_bytes).numpy()
