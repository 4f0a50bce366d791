"""Same bytes before and after a refactor: digests of fixed quantize and export runs.

A reshaping of the code (issue 33) must leave every result unchanged. Perplexities agree
to the printed digit even when codes move, so this script records what is stronger: the
sha256 of every tensor a run writes (the native checkpoint's tensors by name, the GGUF
file's tensor data by name), with the run's perplexity beside it. Run it at the commit
before a change and at the commit after; ``--compare A B`` names every row whose digests
differ.

Rows (the bundled model; calibration and evaluation reduced so the whole set runs in a
few minutes on 2 cores, which changes nothing about which code runs):

* ``rtn-w4g128``: RTN with the importance-weighted scale search (the README's demo);
* ``gptq-w4g64``: GPTQ, activation order, W4 g64;
* ``sr2-w4g128``: SignRoundV2, 5 iterations;
* ``rtn-nvfp4-46``: NVFP4 4-over-6 (the fused groups' shared tensor scales);
* ``w4a4-mxfp4``: W4A4 MXFP4 with static input statistics;
* ``gguf-q4_k_m``: llama.cpp's Q4_K_M mix by GPTQ, exported to GGUF.

    python -m benchmarks.identity                       # rows at HEAD -> results/identity.json
    python -m benchmarks.identity --compare REV_A REV_B # rows that differ between two recorded commits
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, load_results, markdown_table, merge_row

RESULT = "identity"
# calibration and evaluation shared by every row (reduced from the PTQ protocol, see the module doc)
COMMON = ["--nsamples", "8", "--seqlen", "128", "--windows", "4", "--eval-seqlen", "256", "--threads", "1"]
ROWS: dict[str, list[str]] = {
    "rtn-w4g128": ["--scheme", "w4g128", "--method", "rtn"],
    "gptq-w4g64": ["--scheme", "w4g64", "--method", "gptq"],
    "sr2-w4g128": ["--scheme", "w4g128", "--method", "signround2", "--iters", "5"],
    "rtn-nvfp4-46": ["--scheme", "nvfp4-46", "--method", "rtn"],
    "w4a4-mxfp4": ["--scheme", "w4a4-mxfp4", "--method", "rtn"],
    "gguf-q4_k_m": ["--scheme", "q4_k_m", "--method", "gptq"],
}
GGUF_ROWS = ("gguf-q4_k_m",)


def head() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def tensor_digests_safetensors(path: Path) -> dict[str, str]:
    """sha256 of each tensor's bytes, by name (file-level digests would also cover metadata)."""
    import torch
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as f:
        for key in sorted(f.keys()):
            raw = f.get_tensor(key).contiguous().view(-1).view(torch.uint8)
            out[key] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
    return out


def tensor_digests_gguf(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    return {t.name: hashlib.sha256(bytes(t.data.tobytes())).hexdigest() + f":{t.tensor_type.name}"
            for t in r.tensors}


def combined(digests: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:16]


def run_row(name: str, work: Path) -> dict:
    out = work / name
    cmd = [sys.executable, "-m", "lowbit", "quantize", *ROWS[name], *COMMON, "--out", str(out), "--json"]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{name}: lowbit quantize failed (rc {res.returncode}):\n{res.stderr[-2000:]}")
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    digests = tensor_digests_safetensors(out / "model.safetensors")
    row = {"row": name, "ppl_fp": summary.get("ppl_fp"), "ppl": summary.get("ppl_q", summary.get("ppl")),
           "digest": combined(digests), "tensors": len(digests)}
    if name in GGUF_ROWS:
        gguf = work / f"{name}.gguf"
        res = subprocess.run([sys.executable, "-m", "lowbit", "export", str(out), "--to", "gguf", "--out", str(gguf),
                              "--json"], cwd=ROOT, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"{name}: lowbit export failed (rc {res.returncode}):\n{res.stderr[-2000:]}")
        g = tensor_digests_gguf(gguf)
        row.update(gguf_digest=combined(g), gguf_tensors=len(g))
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def compare(a: str, b: str) -> int:
    rows = load_results(RESULT)["rows"]
    by = {(r["commit"], r["row"]): r for r in rows}
    names = sorted({r["row"] for r in rows if r["commit"] in (a, b)})
    table, differ = [], 0
    for n in names:
        ra, rb = by.get((a, n)), by.get((b, n))
        if ra is None or rb is None:
            table.append([n, "missing at " + (a if ra is None else b), "", ""])
            differ += 1
            continue
        same = all(ra.get(k) == rb.get(k) for k in ("digest", "gguf_digest", "ppl"))
        differ += not same
        table.append([n, "same" if same else "DIFFERENT", ra["ppl"], rb["ppl"]])
    print(markdown_table(["row", f"{a} vs {b}", f"ppl {a}", f"ppl {b}"], table))
    return 1 if differ else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows (default: all)")
    ap.add_argument("--compare", nargs=2, metavar="REV", help="compare two commits' recorded rows, run nothing")
    args = ap.parse_args()
    if args.compare:
        raise SystemExit(compare(*args.compare))
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    commit = head()
    with tempfile.TemporaryDirectory(prefix="lowbit-identity-") as tmp:
        for name in rows:
            row = {"commit": commit, **run_row(name, Path(tmp))}
            merge_row(RESULT, row, key=("commit", "row"))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
