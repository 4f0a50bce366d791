"""CPU cost of lowbit's K-quant rounding per weight: plain ranges, ``fit`` and searched, this tree vs another.

One seeded 4096 x 4096 normal matrix (std 0.02) per row, quantized and packed (`QTensor.pack`) in a
child process pinned to one torch thread; the row is that child's CPU seconds (user + system)
for the quantization alone, divided by the weights. Rules (``--rules``): ``plain`` (``rule=absmax``), ``fit``
(`lowbit.formats.kquant_fit`, the K-quants' default since session 5 of bigmodel.md) and ``search``; a tree
older than the ``fit`` rule runs only the other two. ``--baseline-src`` names the ``src`` folder of
another lowbit checkout (``git archive COMMIT src | tar -x -C DIR``), run the same way beside
this tree's in the same invocation, so both see the same machine load. The children print a hash
of the packed bytes: both trees must give the same bytes (the speed work changes none). ``--repeats N``
runs every child N times, interleaved with the other trees' (a row is the median; ``runs`` lists all).

``--llama-lib`` names llama-cpp-python's ``libggml-base.so``: the same matrix is then also rounded by
llama.cpp's own ``ggml_quantize_chunk`` (Q4_K: ``make_qkx2_quants``; Q6_K: ``make_qx_quants``; no
importance) in a child of its own, one thread: the per-weight reference the searched rows are compared with.

    python -m benchmarks.kquant_speed --baseline-src /tmp/base/src --baseline-name 6d40bbf --repeats 3 \
        --llama-lib .../site-packages/llama_cpp/lib/libggml-base.so
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "kquant_speed.json"
CHILD = """import hashlib, sys, time, torch
torch.set_num_threads(1)
from lowbit.formats import Scheme, quantize
w = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)) * 0.02
s = Scheme.parse(sys.argv[1])
s = s.replace(rule={"plain": "absmax"}.get(sys.argv[2], sys.argv[2]))
t = time.process_time()
packed = quantize(w, s).pack()
cpu = time.process_time() - t
h = hashlib.sha256(b"".join(v.contiguous().view(torch.uint8).numpy().tobytes() for _, v in sorted(packed.items())))
print(cpu, h.hexdigest()[:16])
"""


LLAMA_CHILD = """import ctypes, sys, time, torch
lib = ctypes.CDLL(sys.argv[2])
f = lib.ggml_quantize_chunk
f.restype = ctypes.c_size_t
f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
              ctypes.c_void_p]
kind = {"q2_k": 10, "q3_k": 11, "q4_k": 12, "q5_k": 13, "q6_k": 14}[sys.argv[1]]  # GGML_TYPE_Q2_K ... Q6_K
w = (torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)) * 0.02).numpy()
out = bytearray(4096 * 4096)
buf = (ctypes.c_char * len(out)).from_buffer(out)
lib.ggml_quantize_init(kind)
t = time.process_time()
n = f(kind, w.ctypes.data, ctypes.addressof(buf), 0, 4096, 4096, None)
print(time.process_time() - t, n)
"""


def run_child(scheme: str, rule: str, src: str | None, llama_lib: str | None) -> tuple[float, str]:
    """(CPU seconds, bytes hash or size) of one child: lowbit's rounding from ``src``, or llama.cpp's."""
    env = {**os.environ, "PYTHONPATH": src} if src else None
    argv = ["-c", LLAMA_CHILD, scheme, llama_lib] if rule == "llama.cpp" else ["-c", CHILD, scheme, rule]
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, check=True).stdout.split()
    return float(out[0]), out[1]


def row(scheme: str, rule: str, name: str, runs: list[tuple[float, str]], loads: list[float]) -> dict:
    cpu = statistics.median(c for c, _ in runs)
    return {"tree": name, "scheme": scheme, "rule": rule, "shape": [4096, 4096], "threads": 1,
            "cpu_seconds": round(cpu, 3), "us_per_weight": round(cpu / 4096**2 * 1e6, 4), "bytes_sha256": runs[0][1],
            "runs": [round(c, 3) for c, _ in runs], "same_bytes_every_run": len({h for _, h in runs}) == 1,
            "load_avg_1m": round(statistics.median(loads), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default="q4_k,q6_k")
    ap.add_argument("--rules", default="plain,fit,search")
    ap.add_argument("--baseline-src", default=None)
    ap.add_argument("--baseline-name", default="baseline")
    ap.add_argument("--name", default="this tree")
    ap.add_argument("--repeats", type=int, default=1, help="children per row (the row is their median)")
    ap.add_argument("--llama-lib", default=None, help="llama-cpp-python's libggml-base.so: llama.cpp's rows too")
    ap.add_argument("--out", default=str(RESULTS), help="the JSON file the rows are merged into")
    args = ap.parse_args()
    trees = [(args.baseline_src, args.baseline_name)] if args.baseline_src else []
    trees.append((None, args.name))
    jobs = [(s, r, src, name) for s in args.schemes.split(",") for r in args.rules.split(",") for src, name in trees
            if not (r == "fit" and src)]  # the baseline tree predates the fit rule
    jobs += [(s, "llama.cpp", None, "llama.cpp") for s in args.schemes.split(",")] if args.llama_lib else []
    runs: dict[tuple, list] = {}
    loads: dict[tuple, list] = {}
    for _ in range(args.repeats):  # interleaved: every tree and tool sees the same spread of machine load
        for s, r, src, name in jobs:
            runs.setdefault((s, r, name), []).append(run_child(s, r, src, args.llama_lib))
            loads.setdefault((s, r, name), []).append(os.getloadavg()[0])
    rows = [row(s, r, name, runs[s, r, name], loads[s, r, name]) for s, r, _, name in jobs]
    out = Path(args.out)
    old = json.loads(out.read_text())["rows"] if out.is_file() else []
    key = lambda x: (x["tree"], x["scheme"], x["rule"])  # noqa: E731
    merged = {key(x): x for x in old} | {key(x): x for x in rows}
    out.write_text(json.dumps({"note": "CPU seconds of quantize + pack of one 4096 x 4096 matrix, one thread "
                                       "(median of the rows' runs); rule llama.cpp: ggml_quantize_chunk, no importance",
                               "rows": list(merged.values())}, indent=1))
    print(f"{'tree':12} {'scheme':7} {'rule':7} {'cpu s':>7} {'us/weight':>10} {'bytes':>17}")
    for r in rows:
        print(f"{r['tree']:12} {r['scheme']:7} {r['rule']:7} {r['cpu_seconds']:7.2f} {r['us_per_weight']:10.4f} "
              f"{r['bytes_sha256']:>17}")


if __name__ == "__main__":
    main()
