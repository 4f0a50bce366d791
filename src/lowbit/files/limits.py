"""What each export can hold, judged from layer specs alone: before loading, and at quantize time.

`lowbit export` checks the checkpoint's manifest against its target before reading a
weight (it used to find out after a minute of loading), and `lowbit quantize` checks its
plan against every target before tuning: a warning names each export that cannot hold
the plan, and with ``export_to`` named the run is refused instead.
"""

from __future__ import annotations

from lowbit.errors import LowbitError
from lowbit.files import compressed_tensors, gguf_export
from lowbit.files.specs import LayerSpec

TARGETS = ("compressed-tensors", "gguf")


def check(to: str, specs: list[LayerSpec], model_type: str | None = None, allow_requant: bool = False) -> None:
    """Raise the export's own refusal when ``to`` cannot hold these layers (of a ``model_type`` model)."""
    if to == "compressed-tensors":
        compressed_tensors.check_specs(specs)
    elif to == "gguf":
        if model_type is not None:
            gguf_export.arch_for(model_type)
        gguf_export.check_specs(specs, allow_requant)
    else:
        raise ValueError(f"unknown export target {to!r}; one of {TARGETS}")


def refusals(specs: list[LayerSpec], model_type: str | None = None) -> dict[str, str]:
    """target -> why it cannot hold these layers, for every target that cannot (none: every export can)."""
    out = {}
    for to in TARGETS:
        try:
            check(to, specs, model_type)
        except LowbitError as e:
            out[to] = str(e)
    return out


def vllm_notes(specs: list[LayerSpec]) -> list[str]:
    """What keeps vLLM from loading a compressed-tensors file transformers does load (fused parts' recipes)."""
    return compressed_tensors.vllm_fused_notes(specs)
