"""Reduced-precision compute: where bf16 matrix products pay off.

The SignRound tuning loop keeps its learnable state in fp32 and can run only the tuned
Linears' products in bf16. Whether that is faster depends on the hardware: CPUs with native bf16
dot products (AVX512-BF16, AMX) run bf16 GEMMs several times faster than fp32 (4.5x on
one Zen 4 core, measured by ``benchmarks/ptq_speed.py``); CPUs without them emulate bf16
and gain nothing, so "auto" picks bf16 only where the instructions exist.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def _cpuinfo_field(key: str) -> str:
    """The first ``key : value`` line of /proc/cpuinfo ("" where there is none, e.g. not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith(key):
            return line.split(":", 1)[1].strip()
    return ""


def _cpu_flags() -> frozenset[str]:
    """The CPU feature flags Linux reports (empty elsewhere: then "auto" means fp32)."""
    return frozenset(_cpuinfo_field("flags").split())


def cpu_description() -> str:
    """Model name and bf16 flags of this CPU: benchmark rates (and ratios) only compare on one."""
    flags = sorted(f for f in _cpu_flags() if f in _BF16_CPU_FLAGS)
    name = _cpuinfo_field("model name") or "unknown"
    return f"{name} ({', '.join(flags) or 'no bf16 products'}), {os.cpu_count()} cores"


def fast_bf16(device: torch.device | str) -> bool:
    """True where bf16 matrix products run natively on ``device``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if dev.type == "cpu":
        return any(f in _cpu_flags() for f in _BF16_CPU_FLAGS)
    return False


def resolve_dtype(dtype: str, device: torch.device | str) -> str:
    """"auto" -> "bf16" or "fp32" for ``device``; "bf16" / "fp32" pass through."""
    if dtype == "auto":
        return "bf16" if fast_bf16(device) else "fp32"
    return dtype
