"""Exact bit packing of unsigned b-bit codes (b = 1..8) into bytes.

Layout: little-endian bit stream. Element i of a row occupies bits
``[i*b, (i+1)*b)`` of the row's stream, so for 4-bit codes the low nibble of each
byte is the even element (the convention of FP4 kernels and compressed-tensors),
four 2-bit codes fill a byte from the low bits up, and 3-bit codes are packed densely
(8 codes in 3 bytes). Rows are padded to a multiple of 8 codes so every row starts on a
byte boundary; ``unpack`` takes the true length back.
"""

from __future__ import annotations

import torch


def packed_bytes(n: int, bits: int) -> int:
    """Bytes per row of ``n`` codes (8-bit codes are stored as they are, unpadded)."""
    if bits == 8:
        return n
    return -(-n // 8) * bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``uint8`` codes ``[..., n]`` (each < 2**bits) to ``uint8 [..., packed_bytes(n)]``."""
    _check_bits(bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if bits == 8:
        return codes.clone()
    *lead, n = codes.shape
    pad = (-n) % 8
    c = torch.nn.functional.pad(codes, (0, pad)) if pad else codes
    if 8 % bits == 0:
        return _pack_bytes(c, bits)
    if bits == 6:
        return _pack_six(c).reshape(*lead, -1)
    if bits == 3:
        return _pack_three(c).reshape(*lead, -1)
    words = c.reshape(-1, 8)  # 8 codes = `bits` whole bytes; packed a slice at a time: the int64
    out = torch.empty(words.shape[0], bits, dtype=torch.uint8, device=c.device)  # words are 8 B per code
    for a in range(0, words.shape[0], _WORDS):
        out[a:a + _WORDS] = _pack_words(words[a:a + _WORDS], bits)
    return out.reshape(*lead, -1)


_WORDS = 1 << 17  # 8-code words per slice of the 3/5/6/7-bit path (8 MB of int64 temporaries)


def _pack_words(c: torch.Tensor, bits: int) -> torch.Tensor:
    """``[w, 8]`` codes -> ``[w, bits]`` bytes: the little-endian bit stream of each 8-code word."""
    c = c.to(torch.int64)
    shifts = torch.arange(8, dtype=torch.int64, device=c.device) * bits
    word = (c << shifts).sum(-1, keepdim=True)  # <= 56 bits: fits in int64
    byte_shifts = torch.arange(bits, dtype=torch.int64, device=c.device) * 8
    return ((word >> byte_shifts) & 0xFF).to(torch.uint8)


def _pack_six(c: torch.Tensor) -> torch.Tensor:
    """6-bit codes (Q6_K's): four codes are three whole bytes, OR-ed from byte shifts (a shift left drops the
    bits that belong to the next byte): the same bytes as the int64 word path at a fifth of its time."""
    c = c.reshape(-1, 4)
    out = torch.empty(c.shape[0], 3, dtype=torch.uint8, device=c.device)
    torch.bitwise_or(c[:, 0], c[:, 1] << 6, out=out[:, 0])
    torch.bitwise_or(c[:, 1] >> 2, c[:, 2] << 4, out=out[:, 1])
    torch.bitwise_or(c[:, 2] >> 4, c[:, 3] << 2, out=out[:, 2])
    return out


def _pack_three(c: torch.Tensor) -> torch.Tensor:
    """3-bit codes (Q3_K's): eight codes are three whole bytes, as `_pack_six` does for 6 bits."""
    c = c.reshape(-1, 8)
    out = torch.empty(c.shape[0], 3, dtype=torch.uint8, device=c.device)
    torch.bitwise_or(c[:, 0] | c[:, 1] << 3, c[:, 2] << 6, out=out[:, 0])
    torch.bitwise_or(c[:, 2] >> 2 | c[:, 3] << 1 | c[:, 4] << 4, c[:, 5] << 7, out=out[:, 1])
    torch.bitwise_or(c[:, 5] >> 1 | c[:, 6] << 2, c[:, 7] << 5, out=out[:, 2])
    return out


def _pack_bytes(c: torch.Tensor, bits: int) -> torch.Tensor:
    """1-, 2- and 4-bit codes (a whole number per byte): OR-ed in place on bytes, the same bytes as the
    int64 word path (no code crosses a byte), with an eighth of its memory traffic."""
    per = 8 // bits
    c = c.reshape(*c.shape[:-1], -1, per)
    out = c[..., 0].clone()
    for i in range(1, per):
        out |= c[..., i] << (i * bits)
    return out


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack``: ``uint8 [..., packed_bytes(n)] -> uint8 [..., n]``."""
    _check_bits(bits)
    *lead, nb = packed.shape
    if nb != packed_bytes(n, bits):
        raise ValueError(f"{nb} packed bytes cannot hold {n} codes of {bits} bits")
    if bits == 8:
        return packed.clone()
    p = packed.reshape(*lead, -1, bits).to(torch.int64)
    byte_shifts = torch.arange(bits, dtype=torch.int64, device=p.device) * 8
    word = (p << byte_shifts).sum(-1, keepdim=True)
    shifts = torch.arange(8, dtype=torch.int64, device=p.device) * bits
    codes = (word >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*lead, -1)[..., :n].to(torch.uint8)


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"can pack 1..8-bit codes, got {bits}")
