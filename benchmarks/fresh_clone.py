"""The README's two commands as a newcomer runs them: fresh clones, empty pip and lowbit caches.

    python -m benchmarks.fresh_clone [--commands test,demo] [--workdir /tmp/lowbit-fresh]

Each command runs in its own clone of this repository's HEAD with ``PIP_NO_CACHE_DIR=1``
and an empty ``XDG_CACHE_HOME`` (so the bundled model is converted again), one after the
other so they do not share the cores. Wall seconds, exit code and the last lines of output
(the test count, the demo's perplexities) go to benchmarks/results/fresh_clone.json; these
are the times the README states. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
from pathlib import Path

from benchmarks.common import ROOT, machine, save_results


def run(command: str, workdir: Path) -> dict:
    """``make COMMAND`` in a fresh clone with empty caches: seconds, exit code, output tail."""
    clone, cache = workdir / command, workdir / f"cache-{command}"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    cache.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PIP_NO_CACHE_DIR="1", XDG_CACHE_HOME=str(cache))
    t0 = time.perf_counter()
    out = subprocess.run(["make", command], cwd=clone, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    # stdout holds the results (pytest's summary, the demo's perplexities); stderr pip's warnings and bars
    tail = [line for line in out.stdout.splitlines() if line.strip()][-12:]
    return {"command": f"make {command}", "returncode": out.returncode, "seconds": round(seconds, 1), "tail": tail}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commands", default="test,demo")
    p.add_argument("--workdir", default="/tmp/lowbit-fresh")
    a = p.parse_args()
    workdir = Path(a.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    rows = []
    for command in a.commands.split(","):
        rows.append(run(command, workdir))
        r = rows[-1]
        print(f"make {command}: rc {r['returncode']}, {r['seconds']:.0f} s", flush=True)
    save_results("fresh_clone", {"commit": commit, "machine": machine(), "rows": rows})
    if any(r["returncode"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
