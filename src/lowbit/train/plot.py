"""PNG of loss curves (raw and smoothed), e.g. ste vs winq over seeds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from lowbit.train.metrics import smooth


def plot_losses(curves: Mapping[str, Sequence[float]], path: str | Path, window: int = 10,
                title: str = "training loss") -> Path:
    """One line per curve: faint raw loss, solid trailing-mean smoothed loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lowbit.io import atomic_write_bytes

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, ys) in enumerate(curves.items()):
        steps = range(1, len(ys) + 1)
        color = f"C{i % 10}"
        ax.plot(steps, ys, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, smooth(ys, window), color=color, label=label, linewidth=1.6)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{title} (solid: trailing mean of {window} steps)")
    ax.legend()
    ax.grid(alpha=0.3)
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(Path(path), buf.getvalue())
    return Path(path)
