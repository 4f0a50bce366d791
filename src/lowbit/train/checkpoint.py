"""Training checkpoints that resume exactly.

A checkpoint holds everything the next step depends on: the trainable parameters (the
frozen ones are rebuilt by the caller from the same source), the AdamW moments, the
step (which fixes the learning rate and the data position, both pure functions of it),
the RNG states, the loss history and the config fingerprint. Written atomically, so a
crash mid-write keeps the previous checkpoint.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowbit.errors import CheckpointError, ConfigError
from lowbit.io import atomic_write_bytes

FILE = "checkpoint.pt"


def rng_state() -> dict[str, Any]:
    d: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        d["cuda"] = torch.cuda.get_rng_state_all()
    return d


def set_rng_state(d: dict[str, Any]) -> None:
    torch.set_rng_state(d["torch"])
    random.setstate(d["python"])
    if "cuda" in d and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(d["cuda"])


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(folder: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    losses: list[float], evals: list[dict], fingerprint: str, settings: dict) -> Path:
    payload = {"step": step, "params": trainable_state(model), "optimizer": optimizer.state_dict(),
               "rng": rng_state(), "losses": list(losses), "evals": list(evals),
               "fingerprint": fingerprint, "settings": settings}
    buf = io.BytesIO()
    torch.save(payload, buf)
    path = Path(folder) / FILE
    atomic_write_bytes(path, buf.getvalue())
    return path


def find_checkpoint(folder: Path | None) -> Path | None:
    if folder is None:
        return None
    p = Path(folder) / FILE
    return p if p.is_file() else None


def load_checkpoint(path: Path, fingerprint: str, settings: dict) -> dict[str, Any]:
    """Read a checkpoint and refuse it if it was made with different curve settings."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises many types for a damaged file
        raise CheckpointError(f"cannot read training checkpoint {path} ({e}); delete it to start over") from None
    if payload.get("fingerprint") != fingerprint:
        diff = _diff(payload.get("settings", {}), settings)
        raise ConfigError(f"{path} was written by a run with different settings ({diff}); resume with the "
                          "same settings, or pass a new output folder / --no-resume to start over")
    return payload


def restore(payload: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    params = dict(model.named_parameters())
    missing = [n for n in payload["params"] if n not in params]
    if missing:
        raise CheckpointError(f"checkpoint parameters {missing[:3]} are not in the model; "
                              "rebuild the model the checkpoint was trained from")
    with torch.no_grad():
        for n, t in payload["params"].items():
            params[n].copy_(t.to(params[n].device))
    optimizer.load_state_dict(payload["optimizer"])
    set_rng_state(payload["rng"])


def _diff(old: dict, new: dict) -> str:
    keys = sorted(set(old) | set(new))
    parts = [f"{k}: checkpoint {old.get(k)!r} vs now {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
    return "; ".join(parts[:6]) or "unknown difference"
