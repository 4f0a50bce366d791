"""`TrainConfig`: every setting that decides the loss curve of a run, frozen.

Because a resumed run must reproduce the uninterrupted curve bit for bit, the config is
fingerprinted into each checkpoint and a resume with any curve-changing difference is
refused; settings that only change where files go or how progress shows are excluded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from lowbit.configs import check_fields, from_dict_strict
from lowbit.errors import ConfigError

DTYPES = ("fp32", "bf16")
PARALLEL = ("ddp", "fsdp")
# fields that may differ between an interrupted run and its resumption
_RESUME_FREE = ("out_dir", "progress", "checkpoint_every", "plot")


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run.

    steps: optimizer steps. batch_size: sequences per optimizer step over all ranks and
        micro-batches (the global batch), split as ``batch_size = world * grad_accum * micro``.
    lr, warmup, min_lr: AdamW with linear warm-up over ``warmup`` steps, then cosine decay
        from ``lr`` to ``min_lr`` at the last step.
    grad_clip: max global gradient norm (0 = off). dtype: autocast dtype of the forward.
    eval_every / checkpoint_every: in steps (0 = only at the end / never).
    out_dir: metrics.jsonl, checkpoint/ and loss.png go here (None = keep nothing on disk).
    seed: data order and anything random the loop draws.
    """

    steps: int
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 2e-5
    min_lr: float = 0.0
    warmup: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    dtype: str = "fp32"
    eval_every: int = 0
    checkpoint_every: int = 0
    out_dir: str | None = None
    seed: int = 0
    parallel: str = "ddp"
    progress: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "training setting")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        _check(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        _check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        _check(self.grad_accum >= 1, f"grad_accum must be >= 1, got {self.grad_accum}")
        _check(self.batch_size % self.grad_accum == 0,
               f"batch_size {self.batch_size} is not divisible by grad_accum {self.grad_accum}; "
               "choose a batch size that is a multiple of it")
        _check(self.lr > 0 and self.min_lr >= 0, f"lr must be > 0 and min_lr >= 0, got {self.lr}, {self.min_lr}")
        _check(0 <= self.warmup < self.steps,
               f"warm-up ({self.warmup} steps) must be shorter than the run ({self.steps} steps); "
               "lower --warmup or raise --steps")
        _check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.parallel in PARALLEL, f"parallel must be one of {PARALLEL}, got {self.parallel!r}")
        _check(self.grad_clip >= 0, f"grad_clip must be >= 0, got {self.grad_clip}")
        _check(self.eval_every >= 0 and self.checkpoint_every >= 0, "eval_every/checkpoint_every must be >= 0")
        _check(not (self.checkpoint_every and self.out_dir is None),
               "checkpoint_every needs out_dir: checkpoints are written under it")

    def micro_batch(self, world: int) -> int:
        """Sequences per forward on one rank."""
        per = self.batch_size // self.grad_accum
        if per % world:
            raise ConfigError(f"batch_size {self.batch_size} / grad_accum {self.grad_accum} = {per} sequences "
                              f"per micro-step cannot be split over {world} ranks; use a multiple of {world}")
        return per // world

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        return from_dict_strict(cls, d, ConfigError, "training settings")

    def curve_settings(self) -> dict[str, Any]:
        """The settings a resume must share with the checkpoint (all but file/progress ones)."""
        return {k: v for k, v in self.to_dict().items() if k not in _RESUME_FREE}

    def fingerprint(self, extra: dict | None = None) -> str:
        text = json.dumps({"train": self.curve_settings(), "extra": extra or {}}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)
