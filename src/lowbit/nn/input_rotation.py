"""`InputRotation`: an orthogonal Hadamard rotation of a Linear's input, applied at run time (online).

A Linear computes the same function when its input is rotated by an orthogonal ``R`` and
its weight rows by the same ``R`` (``(x R)(W R)^T = x W^T``): the rotation spreads an
outlier input channel over every channel, which is what an input quantizer needs on
heavy-tailed activations (down_proj's input, the product of SwiGLU's two branches, is the
classic case; QuaRot rotates it online). Unlike the residual-stream rotation
(`lowbit.ptq.rotation`), nothing upstream can absorb ``R`` here, so it runs in the forward:
``R = H^T / sqrt(n)`` with the fast Walsh-Hadamard transform of `lowbit.transforms.hadamard`
(widths ``m * 2^k``, e.g. 1536 = 12 * 128), O(n log n) per token.

A float Linear carries it as a forward pre-hook (`attach`), registered before any other
hook, so calibration statistics, GPTQ's Hessians and static input scales all see the
rotated input; `QuantLinear` and SignRound's tuned layer apply it in front of their input
quantizer. The weight stored for such a layer is ``W R``: only lowbit's native format can
say that its input must be rotated, so the exports that cannot hold it refuse it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lowbit.errors import ConfigError, SchemeError
from lowbit.transforms.hadamard import factor, wht

KINDS = ("hadamard",)


class InputRotation(nn.Module):
    """``x -> x H^T / sqrt(n)`` over the last dimension (orthogonal: its inverse is its transpose)."""

    def __init__(self, width: int, kind: str = "hadamard") -> None:
        super().__init__()
        if kind not in KINDS:
            raise ConfigError(f"online rotation kind must be one of {KINDS}, got {kind!r}")
        if factor(width) is None:
            raise ConfigError(f"no Hadamard construction for an input of width {width} (needs m * 2^k with a "
                              "known Hadamard order m); leave this layer out of the online rotation")
        self.width, self.kind = width, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return wht(x, scale=1.0 / math.sqrt(self.width))

    def spec(self) -> dict[str, int | str]:
        """What the native format stores to rebuild it."""
        return {"kind": self.kind, "width": self.width}

    @classmethod
    def from_spec(cls, spec: dict) -> InputRotation:
        return cls(int(spec["width"]), str(spec.get("kind", "hadamard")))

    def extra_repr(self) -> str:
        return f"{self.kind}, width={self.width}"


def _rotate_hook(module: nn.Module, args: tuple) -> tuple:
    return (module.input_rotation(args[0]), *args[1:])


@torch.no_grad()
def attach(linear: nn.Linear, kind: str = "hadamard") -> InputRotation:
    """Rotate a float Linear's weight rows and make it rotate its input at run time (same function).

    The pre-hook is registered first on the layer (``prepend``), so every hook added later
    (statistics, GPTQ's input quantizer) sees the rotated input the quantized layer will.
    """
    if getattr(linear, "input_rotation", None) is not None:
        raise ConfigError("this Linear already rotates its input online; rotate each layer once")
    rot = InputRotation(linear.in_features, kind).to(linear.weight.device)
    w = linear.weight
    linear.weight.copy_(rot(w.double()).to(w.dtype))
    linear.input_rotation = rot
    linear.register_forward_pre_hook(_rotate_hook, prepend=True)
    return rot


def rotation_of(layer: nn.Module) -> InputRotation | None:
    """The online input rotation a layer carries, or None."""
    rot = getattr(layer, "input_rotation", None)
    return rot if isinstance(rot, InputRotation) else None


def refuse_online_rotations(model: nn.Module, target: str) -> None:
    """One clear error when ``model`` has layers an export ``target`` cannot run: rotated-input layers.

    Their stored weight is ``W R``; a file without the rotation would compute ``x R^T W^T``
    for ``x W^T`` (wrong outputs with no error), so such a model is refused, never exported.
    """
    refuse_rotated([n for n, m in model.named_modules() if rotation_of(m) is not None], target)


def refuse_rotated(rotated: list[str], target: str) -> None:
    """The refusal of `refuse_online_rotations` for the named rotated-input layers (none: nothing to refuse)."""
    if rotated:
        raise SchemeError(f"{target} cannot hold an online input rotation ({len(rotated)} layer(s) rotate their "
                          f"input at run time, e.g. {rotated[0]}; their stored weights are rotated too). Keep "
                          "lowbit's native format (lowbit quantize --out, loadable by transformers through "
                          "lowbit), or quantize without --rotate-online")
