"""PNG plot of a block-size study: one line per scheme / scale rule (matplotlib Agg)."""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path

from lowbit.io import atomic_write_bytes
from lowbit.studies.blocks import StudyRow


def plot_study(rows: Iterable[StudyRow], path: str | Path, metric: str = "rel_error",
               title: str | None = None, fp_ppl: float | None = None) -> Path:
    """Draw ``metric`` (``rel_error`` or ``ppl``) against block size and write ``path`` atomically."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    lines: dict[str, list[StudyRow]] = {}
    for r in rows:
        lines.setdefault(r.label, []).append(r)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, rs in lines.items():
        rs = sorted(rs, key=lambda r: r.block)
        ax.plot([r.block for r in rs], [getattr(r, metric) for r in rs], marker="o", label=label)
    if metric == "ppl" and fp_ppl is not None:
        ax.axhline(fp_ppl, color="grey", linestyle="--", label=f"full precision ({fp_ppl:.2f})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size")
    ax.set_ylabel("relative weight MSE" if metric == "rel_error" else "perplexity")
    ax.set_title(title or "FP4 block size vs error: finer is better with the right scaling")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    path = Path(path)
    atomic_write_bytes(path, buf.getvalue())
    return path
