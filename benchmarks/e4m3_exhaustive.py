"""Every float32 bit pattern through both E4M3 roundings: torch's float8 cast and lowbit's arithmetic one.

lowbit rounds FP8 elements and E4M3 scales with torch's ``float8_e4m3fn`` cast (one pass,
4x faster than the arithmetic rounding it replaced). tests/test_minifloat_cast.py checks the
6.3M float32 values that decide every rounding; this script checks all 2^32 bit patterns
(the finite ones: values, signs of zero, and codes), in chunks, and records the count of
mismatches (0 expected) with the seconds each path took.

    python -m benchmarks.e4m3_exhaustive     # -> results/e4m3_exhaustive.json
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from benchmarks.common import save_results
from lowbit.formats import minifloat as mf

CHUNK = 1 << 24


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args()
    checked = mismatched = 0
    fast_s = slow_s = 0.0
    for start in range(0, 1 << 32, CHUNK):
        bits = torch.arange(start, start + CHUNK, dtype=torch.int64).to(torch.int32)
        x = bits.view(torch.float32)
        x = x[torch.isfinite(x)]
        t0 = time.process_time()
        fast = mf.round_minifloat(x, mf.E4M3)
        fcode = mf.minifloat_to_code(fast, mf.E4M3)
        t1 = time.process_time()
        slow = mf.round_minifloat_generic(x, mf.E4M3)
        scode = mf.minifloat_to_code_generic(slow, mf.E4M3)
        t2 = time.process_time()
        fast_s, slow_s = fast_s + t1 - t0, slow_s + t2 - t1
        bad = (fast != slow) | (torch.signbit(fast) != torch.signbit(slow)) | (fcode != scode)
        checked += x.numel()
        mismatched += int(bad.sum())
    row = {"finite_float32_checked": checked, "mismatches": mismatched, "torch": torch.__version__,
           "cpu_seconds_cast": round(fast_s, 1), "cpu_seconds_arithmetic": round(slow_s, 1),
           "machine": platform.machine()}
    print(row)
    save_results("e4m3_exhaustive", {"note": "all finite float32 through torch's float8_e4m3fn cast and lowbit's "
                                             "arithmetic E4M3 rounding (values, zero signs, codes)", "rows": [row]})


if __name__ == "__main__":
    main()
