"""WinQ: periodic re-initialisation ("snap back") and noise injection ("shake").

Both are callbacks of the shared loop, each switchable for ablations; with both off the
run is the plain STE / ParetoQ baseline on the same loop.

- Re-init every K steps: ``W <- a*W + (1-a)*Q(W; alpha)`` (no noise; optimizer moments,
  alpha and the schedule are untouched). K defaults to steps // 4, giving three re-inits;
  none happens at the final step, so the last update is always a gradient step.
- Noise: each optimizer step draws one perturbation of W (sigma_w) and alpha (sigma_a),
  absolute or relative to each row's scale, seeded by (seed, step, layer) so resumed
  and distributed runs see the same draws.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from lowbit.configs import check_fields
from lowbit.errors import ConfigError
from lowbit.qat.convert import qat_layers
from lowbit.qat.layer import Noise
from lowbit.train.callbacks import Callback, TrainState


@dataclass(frozen=True)
class WinQConfig:
    reinit: bool = True
    a: float = 0.2
    every: int | None = None  # None = steps // 4
    noise: bool = True
    sigma_w: float = 1e-3
    sigma_a: float = 1e-3
    relative: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "WinQ setting", ranged=("a", "sigma_w", "sigma_a"))
        if not 0.0 <= self.a < 1.0:
            raise ConfigError(f"re-init mix a must be in [0, 1), got {self.a}")
        if self.every is not None and self.every < 1:
            raise ConfigError(f"re-init period must be >= 1 step, got {self.every}")
        if not all(math.isfinite(s) and s >= 0 for s in (self.sigma_w, self.sigma_a)):
            raise ConfigError(f"noise sigmas must be >= 0 (and finite), got sigma_w={self.sigma_w}, "
                              f"sigma_a={self.sigma_a}")

    def period(self, steps: int) -> int:
        k = self.every if self.every is not None else steps // 4
        if self.reinit and k < 1:
            raise ConfigError(f"a {steps}-step run is too short for re-init every steps/4; "
                              "pass every=K or more steps")
        if self.reinit and k >= steps:
            raise ConfigError(f"re-init period {k} is not shorter than the {steps}-step run, so no re-init "
                              "would happen; lower --reinit-every or pass --no-reinit")
        return k

    def reinit_steps(self, steps: int) -> list[int]:
        """The steps after which a run of ``steps`` steps re-initialises (never at the last step)."""
        if not self.reinit:
            return []
        k = self.period(steps)
        return list(range(k, steps, k))

    def to_dict(self) -> dict:
        return asdict(self)


STE = WinQConfig(reinit=False, noise=False)


@torch.no_grad()
def reinit_(model: nn.Module, a: float) -> int:
    """W <- a*W + (1-a)*Q(W; alpha) for every QAT layer; returns how many layers moved."""
    layers = qat_layers(model)
    for layer in layers.values():
        q = layer.clean_quantized().to(layer.weight.dtype)  # before scaling W: Q of the old weights
        layer.weight.mul_(a).add_(q, alpha=1 - a)
    return len(layers)


def noise_seed(seed: int, step: int, index: int) -> int:
    return (seed * 1_000_003 + step * 10_007 + index) % (2**63 - 1)


class WinQCallback(Callback):
    def __init__(self, config: WinQConfig) -> None:
        self.config = config
        self.reinits: list[int] = []

    def curve_settings(self) -> dict:
        return self.config.to_dict()

    def on_train_start(self, state: TrainState) -> None:
        c = self.config
        self.k = c.period(state.config.steps) if c.reinit else 0
        noise = Noise(c.sigma_w, c.sigma_a, c.relative) if c.noise else Noise()
        for layer in qat_layers(state.model).values():
            layer.noise = noise

    def on_step_start(self, state: TrainState) -> None:
        if not self.config.noise:
            return
        for i, layer in enumerate(qat_layers(state.model).values()):
            layer.noise_seed = noise_seed(self.config.seed, state.step, i)

    def on_after_optimizer_step(self, state: TrainState) -> None:
        if self.k and state.step % self.k == 0 and state.step < state.config.steps:
            reinit_(state.model, self.config.a)
            self.reinits.append(state.step)

    def on_train_end(self, state: TrainState) -> None:
        for layer in qat_layers(state.model).values():
            layer.noise_seed = None
