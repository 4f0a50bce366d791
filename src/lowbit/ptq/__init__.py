"""Post-training quantization: one entry point, methods looked up in a plain registry.

Each method is ``fn(model, plan, *, calib, config, tokenizer, progress, **kw) -> Plan``
and replaces the planned Linear layers in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lowbit.errors import ConfigError
from lowbit.formats.plan import Plan
from lowbit.models.lazy import materialize
from lowbit.ptq.rtn import rtn_quantize

Method = Callable[..., Plan]


def _rtn(model: nn.Module, plan: Plan, *, calib: torch.Tensor | None = None, search: bool = False,
         progress: bool = True, **_: Any) -> Plan:
    return rtn_quantize(model, plan, calib=calib, search=search, progress=progress)


METHODS: dict[str, Method] = {"rtn": _rtn}


def register(name: str, fn: Method) -> None:
    METHODS[name] = fn


def quantize_model(model: nn.Module, plan: Plan, method: str = "rtn", keep16: bool = True, **kw: Any) -> Plan:
    """Quantize ``model`` in place with ``method``; returns the applied plan.

    keep16: round the embeddings and an unquantized lm_head to fp16 values, so the
    checkpoint stores them in 16 bits exactly (the numbers evaluated are the numbers saved).
    """
    _load_optional_methods()
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; choose one of {sorted(METHODS)}")
    if not streams_blocks(method, kw):
        materialize(model)  # a lazily loaded model, for a method that needs all of it at once
    applied = METHODS[method](model, plan, **kw)
    if keep16:
        round_unquantized_to_half(model)
    return applied


def streams_blocks(method: str, kw: dict[str, Any]) -> bool:
    """Whether ``method`` reads the model one block at a time (so a lazily loaded model stays lazy).

    The block-wise tuners do; RTN and the DeltaLoss sensitivity of mixed precision run
    whole-model passes.
    """
    return method in ("signround", "signround2") and kw.get("avg_bits") is None


def round_unquantized_to_half(model: nn.Module) -> None:
    """Embedding tables and a plain-Linear lm_head take fp16 values (dtype unchanged)."""
    heads = [model.get_output_embeddings()] if hasattr(model, "get_output_embeddings") else []
    for mod in [m for m in model.modules() if isinstance(m, nn.Embedding)] + heads:
        if isinstance(mod, (nn.Embedding, nn.Linear)) and mod.weight.dtype == torch.float32:
            with torch.no_grad():
                mod.weight.copy_(mod.weight.half().float())


def methods() -> list[str]:
    _load_optional_methods()
    return sorted(METHODS)


def _load_optional_methods() -> None:
    """Import the tuning methods, which register themselves (kept lazy: they are heavy)."""
    import importlib

    for mod in ("lowbit.ptq.signround", "lowbit.ptq.signround2"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
