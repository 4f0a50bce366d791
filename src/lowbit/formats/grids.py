"""Element grids: decoding stored codes to values.

INT codes are stored unsigned (``u = q - qmin``) so every format packs the same way.
E2M1 (FP4) codes are the standard 4-bit pattern ``sign<<3 | magnitude index`` with
magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}. E4M3 (FP8) codes are the raw
``float8_e4m3fn`` bit pattern.
"""

from __future__ import annotations

import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0


def e2m1_table(device: torch.device | None = None) -> torch.Tensor:
    """The 16 values of the E2M1 codes, indexed by code (8..15 are the negatives)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    return e2m1_table(codes.device)[codes.long()]


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float()
