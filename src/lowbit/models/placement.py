"""Where a model's passes run: the ``--device`` a user names, checked, and whole-model placement.

The block-wise tuners keep the model on the CPU and move one block at a time to the
compute device, so models larger than the GPU still quantize. Whole-model passes
(perplexity, the importance pass of searched RTN, DeltaLoss) need every layer at once:
`on_device` moves the model there for the pass and back afterwards, so each job hands
its caller the model where it found it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from lowbit.errors import ConfigError
from lowbit.models.lazy import is_lazy


def check_device(device: str | torch.device | None) -> torch.device | None:
    """``device`` parsed and known to exist here (None passes through), else one clear error."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: torch {torch.__version__} sees no CUDA device here; "
                              "use --device cpu, or install a CUDA build of torch on a machine with a GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible "
                              f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    elif dev.type != "cpu":
        raise ConfigError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    return dev


def free_bytes(device: torch.device) -> int | None:
    """Free memory on a GPU ``device`` (None on the CPU: host memory is not checked)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def check_fits(nbytes: int, device: torch.device | None, what: str) -> None:
    """A whole-model pass of ``nbytes`` of weights must fit the device with room for activations, or one error.

    Checked before any work, so a model too large for the GPU fails in seconds, not after
    an hour of tuning when its quantized perplexity is evaluated.
    """
    free = free_bytes(device) if device is not None else None
    if free is None or nbytes * 1.15 + 2**30 <= free:
        return
    raise ConfigError(f"{what} needs the whole model on {device}: ~{nbytes / 2**30:.1f} GiB of weights plus "
                      f"activations, and only {free / 2**30:.1f} GiB is free; pass --no-eval (the block-wise "
                      "methods tune one block at a time), or run it with --device cpu")


def model_bytes(model: nn.Module, packed: dict[str, int] | None = None) -> int:
    """Bytes of the model's tensors (meta ones counted by shape); ``packed``: name -> bytes per weight instead."""
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        per = (packed or {}).get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        total += t.numel() * (per if per is not None else t.element_size())
    return total


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without any)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


@contextlib.contextmanager
def on_device(model: nn.Module, device: str | torch.device | None) -> Iterator[nn.Module]:
    """Run the body with the whole model on ``device``; put it back where it was afterwards.

    None or the device it is already on: nothing moves. A lazily loaded model (blocks
    still on disk) cannot move whole: that is the caller's error to avoid.
    """
    dev = check_device(device)
    home = model_device(model)
    if dev is None or _same(dev, home):
        yield model
        return
    if is_lazy(model):
        raise ConfigError("a lazily loaded model (--offload-dir) cannot move to the device whole; "
                          "load it fully for whole-model passes")
    try:
        model.to(dev)
    except torch.cuda.OutOfMemoryError:
        model.to(home)
        raise ConfigError(f"the whole model ({_gib(model):.1f} GiB) does not fit on {dev} for its whole-model "
                          "passes (evaluation, RTN, DeltaLoss); pass --no-eval, or run them with --device cpu") from None
    try:
        yield model
    finally:
        model.to(home)


def _same(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def _gib(model: nn.Module) -> float:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors) / 2**30
