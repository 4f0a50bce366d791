"""Step events of the training loop and the state callbacks see.

A method that needs to act during training (WinQ re-initialisation and noise, an
adapter's refresh) subclasses `Callback` and overrides only the events it uses; the
loop calls every event on every rank so distributed runs stay in lockstep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lowbit.train.config import TrainConfig


@dataclass
class TrainState:
    """Mutable run state. ``model`` is the unwrapped module (never the DDP wrapper).

    step: optimizer steps completed so far (during ``on_step_start`` of step t it is
    t - 1; during ``on_after_optimizer_step`` it is t).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    config: TrainConfig
    step: int = 0
    rank: int = 0
    world: int = 1
    losses: list[float] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)


class Callback:
    """Override any of these; the defaults do nothing."""

    def curve_settings(self) -> dict[str, Any] | None:
        """Settings of this callback that change the loss curve (e.g. WinQ's re-init period), or None.

        The loop folds them into the checkpoint fingerprint, so a run resumed with a
        callback configured differently is refused instead of silently mixing two curves.
        """
        return None

    def on_train_start(self, state: TrainState) -> None: ...

    def on_step_start(self, state: TrainState) -> None: ...

    def on_after_optimizer_step(self, state: TrainState) -> None: ...

    def on_eval(self, state: TrainState, metrics: dict[str, Any]) -> None: ...

    def on_train_end(self, state: TrainState) -> None: ...
