"""What every benchmark script shares: where results go, how rows are merged, how runs are timed.

Conventions (benchmarks/README.md): each script prints a table and writes JSON under
``benchmarks/results/``; rows are merged into that file as they finish (atomically, under
a lock, so two sweeps may run side by side and an interrupted one keeps what it measured);
every row records the machine it ran on; speed is reported as ratios against a peer or a
physical limit measured in the same run, from medians of several runs in fresh processes.
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def result_path(name: str) -> Path:
    """``benchmarks/results/NAME`` (``.json`` added when NAME has no suffix)."""
    p = RESULTS / name
    return p if p.suffix else p.with_suffix(".json")


def load_results(name: str, empty: dict | None = None) -> dict:
    p = result_path(name)
    return json.loads(p.read_text()) if p.exists() else dict(empty or {"rows": []})


def save_results(name: str, data: dict) -> Path:
    """Write a results file atomically (temp file beside it, then rename)."""
    from lowbit.io import atomic_write_text

    p = result_path(name)
    atomic_write_text(p, json.dumps(data, indent=1, default=str))
    return p


def merge_row(name: str, row: dict, key: Sequence[str], **fields: Any) -> dict:
    """Replace the row with the same ``key`` values (or append), set top-level ``fields``; returns the data.

    Serialised with a lock file, so sweeps running side by side never lose each other's rows.
    """
    p = result_path(name)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = load_results(name)
        ident = tuple(row.get(k) for k in key)
        data["rows"] = [r for r in data.get("rows", []) if tuple(r.get(k) for k in key) != ident] + [row]
        data.update(fields)
        save_results(name, data)
    return data


def machine() -> dict[str, Any]:
    """The hardware a row was measured on: rates and ratios only compare within one machine."""
    import torch

    from lowbit.nn.precision import cpu_description

    info: dict[str, Any] = {"cpu": cpu_description(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def peak_gpu_mib() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def timed(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall seconds of ``fn()`` over ``repeats`` runs after ``warmup`` untimed ones (and all runs)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return median(times), times


def gemm_gflops(m: int = 2048, k: int = 576, n: int = 1536, dtype: str = "fp32", repeats: int = 30,
                device: str = "cpu") -> float:
    """Median GEMM throughput on one ``[m, k] x [k, n]`` product: the physical limit rows are held to."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a, b = torch.randn(m, k, dtype=dt, device=device), torch.randn(k, n, dtype=dt, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def run() -> None:
        a @ b
        sync()

    seconds, _ = timed(run, repeats, warmup=3)
    return 2 * m * k * n / seconds / 1e9


def run_child(module: str, args: Sequence[str], timeout: float | None = None, env: dict | None = None,
              threads: int | None = None) -> dict:
    """Run ``python -m benchmarks.MODULE ARGS`` in a fresh process; returns the JSON of its last stdout line.

    A fresh process per measured run gives each its own wall time and peak memory, and
    no warm caches from the run before.
    """
    full_env = {**os.environ, **(env or {})}
    if threads is not None:
        full_env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", f"benchmarks.{module}", *args]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
