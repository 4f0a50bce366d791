"""Quantized source tensors dequantized to float32, one tensor (or one expert) at a time.

Users arrive with checkpoints that are already quantized and want them requantized
without a hand-made BF16 copy. The streaming quantizer reads such a source through here:

| source layout | stored | float value |
| --- | --- | --- |
| FP8, block-scaled (DeepSeek-V3: ``weight_scale_inv [ceil(out/128), ceil(in/128)]``) | ``weight`` F8_E4M3 | ``w * s[block]`` |
| FP8 per tensor / per channel (compressed-tensors ``float-quantized``: ``weight_scale`` ``[]``, ``[1]`` or ``[out, 1]``) | ``weight`` F8_E4M3 / F8_E5M2 | ``w * s`` |
| MXFP4 (gpt-oss: ``X_blocks [..., G, 16]`` + ``X_scales [..., G]``, E8M0 with bias 127) | two E2M1 codes a byte, low nibble first | ``LUT[code] * 2^(s - 127)`` |
| compressed-tensors ``pack-quantized`` INT (``weight_packed`` int32, ``weight_scale`` per group, [``weight_zero_point``]) | signed levels in a little-endian int32 bit stream (zero points packed along the rows) | ``(q - z) * s`` |
| compressed-tensors ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized`` (``weight_packed`` uint8) | E2M1 nibbles, E4M3 block scales and ``weight_global_scale`` / E8M0 exponents | ``LUT[code] * s / g`` / ``LUT[code] * 2^(e - 127)`` |

DeepSeek's ``weight_scale_inv`` is, despite its name, the factor the stored values are
multiplied by (its reference ``weight_dequant`` multiplies); so is compressed-tensors'
``weight_scale``. Each layout is recognised by the names beside the weight, so a
source's precision is known per tensor and recorded in the output's metadata.
"""

from __future__ import annotations

import torch

from lowbit.errors import ModelError
from lowbit.formats.grids import decode_e2m1
from lowbit.formats.minifloat import e8m0_from_code

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8(w: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """FP8 ``w [out, in]`` times its scale: one value, one per row, or one per 128x128 (any block) tile."""
    if w.dim() != 2:
        raise ModelError(f"{name}: FP8 weights of shape {list(w.shape)} are not a matrix; lowbit dequantizes 2-D FP8 "
                         "weights only")
    out, cols = w.shape
    s = scale.float()
    x = w.float()
    if s.numel() == 1:
        return x * s.reshape(())
    if s.dim() == 2 and s.shape == (out, 1):
        return x * s
    if s.dim() == 2:
        bo, bi = -(-out // s.shape[0]), -(-cols // s.shape[1])
        if -(-out // bo) != s.shape[0] or -(-cols // bi) != s.shape[1]:
            raise ModelError(f"{name}: its FP8 block scales {list(s.shape)} do not tile a {out}x{cols} weight; the "
                             "checkpoint is damaged or of a layout lowbit does not know")
        full = s.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :cols]
        return x * full
    raise ModelError(f"{name}: FP8 scale of shape {list(s.shape)} is neither per tensor, per channel nor per block; "
                     "lowbit cannot dequantize it")


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """gpt-oss MXFP4 ``blocks [..., G, 16]`` (uint8) and ``scales [..., G]`` (E8M0) as float32 ``[..., G * 32]``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16:
        raise ModelError(f"{name}: MXFP4 blocks {list(blocks.shape)} ({blocks.dtype}) and scales "
                         f"{list(scales.shape)} ({scales.dtype}) are not gpt-oss's layout (uint8 [..., G, 16] and "
                         "uint8 [..., G])")
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32)
    vals = decode_e2m1(codes) * e8m0_from_code(scales).unsqueeze(-1)
    return vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def ct_int(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, shape: tuple[int, int],
           name: str) -> torch.Tensor:
    """compressed-tensors ``pack-quantized`` INT weights as float32 (the bits per level from the packed width)."""
    from lowbit.files.compressed_read import require_compressed_tensors

    require_compressed_tensors()
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    out, cols = shape
    bits = packed.shape[1] * 32 // cols if cols else 0
    if bits not in (2, 3, 4, 8) or scale.dim() != 2 or scale.shape[0] != out:
        raise ModelError(f"{name}: compressed-tensors weight_packed {list(packed.shape)} with weight_scale "
                         f"{list(scale.shape)} is no INT layout lowbit reads (2/3/4/8 bits, scales per row or group)")
    q = unpack_from_int32(packed, bits, torch.Size(shape)).float()
    if zero is not None:
        q = q - _per_group(unpack_from_int32(zero, bits, torch.Size(scale.shape), packed_dim=0).float(), cols)
    return q * _per_group(scale.float(), cols)


def ct_fp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None, cols: int,
           name: str) -> torch.Tensor:
    """compressed-tensors NVFP4 (E4M3 block scales over a global scale) or MXFP4 (E8M0 exponents) as float32."""
    from lowbit.formats import packing

    out = packed.shape[0]
    codes = packing.unpack(packed.reshape(-1), 4, out * cols).reshape(out, cols)
    vals = decode_e2m1(codes)
    if scale.dtype == torch.uint8:  # MXFP4: biased power-of-two exponents
        s = e8m0_from_code(scale)
    elif scale.dtype == torch.float8_e4m3fn:
        s = scale.float() / (global_scale.float().reshape(()) if global_scale is not None else 1.0)
    else:
        raise ModelError(f"{name}: FP4 weight_scale of dtype {scale.dtype} is neither E4M3 (NVFP4) nor E8M0 (MXFP4)")
    return vals * _per_group(s, cols)


def _per_group(s: torch.Tensor, cols: int) -> torch.Tensor:
    """``[out, G]`` per-group values spread over ``cols`` columns (the last group may be short)."""
    g = -(-cols // s.shape[1])
    return s.repeat_interleave(g, 1)[:, :cols]
