"""The inspect job: what a checkpoint or export holds (checksums verified first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def inspect(path: str | Path) -> dict[str, Any]:
    """Format, per-layer schemes, bits per weight from stored bytes, size against fp16."""
    from lowbit.files.inspect import inspect as read
    from lowbit.models.accounting import account_tensors

    return read(path, account=lambda entries: account_tensors(entries).to_dict())
