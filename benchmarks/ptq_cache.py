"""Do bf16 activation caches change SignRoundV2's quality? fp32 vs bf16 caches on the bundled model.

The block-wise pipeline keeps the block inputs and FP targets between passes; storing them
in bf16 halves that memory (issue 22). Protocol: the bundled SmolLM2-135M (a Q4_1 GGUF
dequantized: its "float" weights are themselves 4-bit values), signround2 at W4 g128 and
W2 g64, 50 iterations, calibration 32 x 256 tokens, the default perplexity protocol (40 x
512 tokens of the evaluation split), tune_dtype auto (bf16 products at W4 on CPUs with
bf16 dot products, fp32 at W2), one thread per run, each run in a fresh process, tuning
seeds 0 and 1. W2 perplexities move ~1 between seeds: compare means.

    python -m benchmarks.ptq_cache --jobs 3          # every missing row
    python -m benchmarks.ptq_cache --table           # print the table

Rows go to benchmarks/results/ptq_cache.json as they finish.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common import ROOT, load_results, machine, markdown_table, median, merge_row

NAME = "ptq_cache.json"
SCHEMES = ("w4g128", "w2g64")
DTYPES = ("fp32", "bf16")
SEEDS = (0, 1)


def one(scheme: str, dtype: str, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "lowbit", "quantize", "--method", "signround2", "--scheme", scheme,
               "--iters", "50", "--seed", str(seed), "--cache-dtype", dtype, "--json", "--out", f"{tmp}/q"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    row = {"scheme": scheme, "cache_dtype": dtype, "seed": seed, "ppl": out["ppl_q"], "ppl_fp": out.get("ppl_fp"),
           "quantize_seconds": out["quantize_seconds"], **machine()}
    merge_row(NAME, row, ("scheme", "cache_dtype", "seed"),
              protocol="bundled SmolLM2-135M (Q4_1 GGUF dequantized), signround2, 50 iters, calib 32x256, "
                       "eval 40x512, tune_dtype auto, 1 thread per run")
    print(json.dumps(row), flush=True)
    return row


def table() -> None:
    rows = load_results(NAME)["rows"]
    out = []
    for s in SCHEMES:
        for d in DTYPES:
            got = sorted((r["seed"], r["ppl"]) for r in rows if r["scheme"] == s and r["cache_dtype"] == d)
            if got:
                mean = sum(p for _, p in got) / len(got)
                out.append([s, d, ", ".join(f"{p:.2f} (seed {k})" for k, p in got), f"{mean:.2f}",
                            f"{median(r['quantize_seconds'] for r in rows if r['scheme'] == s and r['cache_dtype'] == d):.0f}"])
    print(markdown_table(["scheme", "cache dtype", "ppl per seed", "mean", "median s"], out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=2, help="runs side by side (one thread each)")
    p.add_argument("--table", action="store_true")
    a = p.parse_args()
    if a.table:
        table()
        return
    done = {(r["scheme"], r["cache_dtype"], r["seed"]) for r in load_results(NAME)["rows"]}
    todo = [(s, d, k) for k in SEEDS for s in SCHEMES[::-1] for d in DTYPES if (s, d, k) not in done]
    with ThreadPoolExecutor(a.jobs) as pool:
        for f in [pool.submit(one, *t) for t in todo]:
            f.result()
    table()


if __name__ == "__main__":
    main()
