"""CPU cost of lowbit's K-quant rounding per weight: plain (``--no-search``) and searched, this tree vs another.

One seeded 4096 x 4096 normal matrix (std 0.02) per row, quantized and packed (`QTensor.pack`) in a
child process pinned to one torch thread; the row is that child's CPU seconds (user + system)
for the quantization alone, divided by the weights. ``--baseline-src`` names the ``src`` folder of
another lowbit checkout (``git archive COMMIT src | tar -x -C DIR``), run the same way beside
this tree's in the same invocation, so both see the same machine load. The children print a hash
of the packed bytes: both trees must give the same bytes (the speed work changes none).

    python -m benchmarks.kquant_speed --baseline-src /tmp/base/src --baseline-name 6d40bbf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "kquant_speed.json"
CHILD = """import hashlib, sys, time, torch
torch.set_num_threads(1)
from lowbit.formats import Scheme, quantize
w = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)) * 0.02
s = Scheme.parse(sys.argv[1])
s = s.replace(rule="search") if sys.argv[2] == "search" else s
t = time.process_time()
packed = quantize(w, s).pack()
cpu = time.process_time() - t
h = hashlib.sha256(b"".join(v.contiguous().view(torch.uint8).numpy().tobytes() for _, v in sorted(packed.items())))
print(cpu, h.hexdigest()[:16])
"""


def row(scheme: str, rule: str, src: str | None, name: str) -> dict:
    env = {**os.environ, "PYTHONPATH": src} if src else None
    out = subprocess.run([sys.executable, "-c", CHILD, scheme, rule], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    cpu = float(out[0])
    return {"tree": name, "scheme": scheme, "rule": rule, "shape": [4096, 4096], "threads": 1,
            "cpu_seconds": round(cpu, 3), "us_per_weight": round(cpu / 4096**2 * 1e6, 4), "bytes_sha256": out[1],
            "load_avg_1m": round(os.getloadavg()[0], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default="q4_k,q6_k")
    ap.add_argument("--rules", default="plain,search")
    ap.add_argument("--baseline-src", default=None)
    ap.add_argument("--baseline-name", default="baseline")
    ap.add_argument("--name", default="this tree")
    ap.add_argument("--out", default=str(RESULTS), help="the JSON file the rows go to")
    args = ap.parse_args()
    trees = [(args.baseline_src, args.baseline_name)] if args.baseline_src else []
    trees.append((None, args.name))
    rows = [row(s, r, src, name) for s in args.schemes.split(",") for r in args.rules.split(",")
            for src, name in trees]
    Path(args.out).write_text(json.dumps({"note": "CPU seconds of quantize + pack of one 4096 x 4096 matrix, "
                                              "one thread", "rows": rows}, indent=1))
    print(f"{'tree':12} {'scheme':7} {'rule':7} {'cpu s':>7} {'us/weight':>10} {'bytes':>17}")
    for r in rows:
        print(f"{r['tree']:12} {r['scheme']:7} {r['rule']:7} {r['cpu_seconds']:7.2f} {r['us_per_weight']:10.4f} "
              f"{r['bytes_sha256']:>17}")


if __name__ == "__main__":
    main()
