"""The README's two commands as a newcomer runs them: fresh clones, empty pip and lowbit caches.

    python -m benchmarks.fresh_clone [--commands test,demo] [--workdir /tmp/lowbit-fresh]

Each command runs in its own clone of this repository's HEAD with ``PIP_NO_CACHE_DIR=1``
and an empty ``XDG_CACHE_HOME`` (so the bundled model is converted again), one after the
other so they do not share the cores. Wall seconds, exit code and the last lines of output
(the test count, the demo's perplexities) go to benchmarks/results/fresh_clone.json; these
are the times the README states. Run it on an otherwise idle machine: each row records the
1-minute load average before the command and its mean and maximum while it ran (sampled every
5 s), because the same commands take 2-7x longer on a busy machine, and the README states the
load its times hold for.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

from benchmarks.common import ROOT, machine, out_path, save_results


class LoadSampler:
    """The machine's 1-minute load average, sampled every ``every`` seconds in a thread while a command runs."""

    def __init__(self, every: float = 5.0) -> None:
        self.every, self.samples = every, [os.getloadavg()[0]]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def summary(self) -> dict:
        during = self.samples[1:] or self.samples
        return {"load_before": round(self.samples[0], 2), "load_mean": round(sum(during) / len(during), 2),
                "load_max": round(max(during), 2), "cpus": os.cpu_count()}


def run(command: str, workdir: Path) -> dict:
    """``make COMMAND`` in a fresh clone with empty caches: seconds, exit code, load average, output tail."""
    clone, cache = workdir / command, workdir / f"cache-{command}"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    cache.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PIP_NO_CACHE_DIR="1", XDG_CACHE_HOME=str(cache))
    with LoadSampler() as load:
        t0 = time.perf_counter()
        out = subprocess.run(["make", command], cwd=clone, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
    # stdout holds the results (pytest's summary, the demo's perplexities); stderr pip's warnings and bars
    tail = [line for line in out.stdout.splitlines() if line.strip()][-16:]
    # the whole output beside the clone: a failure's traceback does not fit the tail (pytest -q drops its message)
    (workdir / f"{command}.log").write_text(out.stdout + "\n--- stderr ---\n" + out.stderr)
    return {"command": f"make {command}", "returncode": out.returncode, "seconds": round(seconds, 1),
            **load.summary(), "tail": tail}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commands", default="test,demo")
    p.add_argument("--workdir", default="/tmp/lowbit-fresh")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/fresh_clone.json)")
    a = p.parse_args()
    workdir = Path(a.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    rows = []
    for command in a.commands.split(","):
        rows.append(run(command, workdir))
        r = rows[-1]
        print(f"make {command}: rc {r['returncode']}, {r['seconds']:.0f} s, load average {r['load_before']} before, "
              f"{r['load_mean']} mean / {r['load_max']} max while running ({r['cpus']} CPUs)", flush=True)
    save_results(out_path(a.out, "fresh_clone.json"), {"commit": commit, "machine": machine(), "rows": rows})
    if any(r["returncode"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
