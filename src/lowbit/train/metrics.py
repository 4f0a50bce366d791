"""Metrics log (JSONL), loss smoothing and the steps-to-loss speed-up.

The speed-up of a method over a baseline is measured on smoothed curves because
per-step losses of small batches are noisy: a trailing moving average of ``window``
steps (the first ``window-1`` points average what exists so far).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from lowbit.errors import CheckpointError, ConfigError
from lowbit.io import atomic_write_text, parse_json, read_regular

METRICS_MAX_BYTES = 1 << 30  # a record per step: a million steps take about 150 MB


def smooth(losses: Sequence[float], window: int = 10) -> list[float]:
    """Trailing moving average: point t is the mean of losses[max(0, t-window+1) : t+1]."""
    if not losses:
        return []
    x = torch.tensor(list(losses), dtype=torch.float64)
    c = torch.cat([torch.zeros(1, dtype=torch.float64), x.cumsum(0)])
    t = torch.arange(1, len(x) + 1)
    lo = (t - window).clamp(min=0)
    return ((c[t] - c[lo]) / (t - lo)).tolist()


def steps_to_reach(losses: Sequence[float], target: float, window: int = 10) -> int | None:
    """First step (1-based) where the smoothed loss is <= target; None if never."""
    s = torch.tensor(smooth(losses, window))
    hit = (s <= target + 1e-12).nonzero()
    return int(hit[0]) + 1 if len(hit) else None


def speedup(baseline: Sequence[float], other: Sequence[float], window: int = 10) -> dict:
    """(steps baseline needs to reach its own final smoothed loss) / (steps ``other`` needs)."""
    target = smooth(baseline, window)[-1]
    b = steps_to_reach(baseline, target, window)
    o = steps_to_reach(other, target, window)
    return {"target_loss": target, "baseline_steps": b, "other_steps": o,
            "speedup": (b / o) if (b and o) else None, "smoothing": f"trailing mean, window {window}"}


class MetricsLog:
    """Append-only JSONL, one object per line; resuming cuts lines past the checkpoint."""

    def __init__(self, path: Path | None) -> None:
        self.path = None if path is None else Path(path)

    def truncate_after(self, step: int) -> None:
        """Drop records of steps beyond ``step`` (logged after the last checkpoint)."""
        if self.path is None or not self.path.exists():
            return
        keep = [ln for ln, rec in _records(self.path) if rec["step"] <= step]
        atomic_write_text(self.path, "".join(ln + "\n" for ln in keep))

    def reset(self) -> None:
        if self.path is not None and self.path.exists():
            self.path.unlink()

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str | Path) -> list[dict]:
    """Every record of a metrics.jsonl; a damaged file is one `CheckpointError`."""
    return [rec for _, rec in _records(Path(path))]


def read_losses(path: str | Path) -> list[float]:
    """The training losses of a metrics.jsonl (or of the run folder holding one), in step order."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        raise ConfigError(f"{path} is neither a metrics.jsonl nor a run folder holding one")
    return [float(rec["loss"]) for rec in read_metrics(p) if isinstance(rec.get("loss"), (int, float))]


def _records(path: Path) -> list[tuple[str, dict]]:
    """(line, record) of each non-empty line; every record must be a JSON object with an int step.

    The log is read back on resume and as a --baseline, so a file that is not what lowbit
    wrote (damaged, or something else put there) must be refused, never half-parsed.
    """
    fix = "the log is damaged — delete it to start the log over"
    try:
        lines = read_regular(path, METRICS_MAX_BYTES, CheckpointError, fix).decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise CheckpointError(f"cannot read the metrics log {path} ({e}); delete it to start the log over") from None
    out = []
    for i, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            rec = parse_json(ln, f"{path}:{i}", CheckpointError, fix)
        except CheckpointError:
            rec = None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise CheckpointError(f"{path}:{i} is not a metrics record lowbit wrote; the log is damaged — delete "
                                  "it to start the log over")
        out.append((ln, rec))
    return out
