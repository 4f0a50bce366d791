"""`LayerSpec`: what an export needs to know of a quantized layer to say whether it can hold it.

The weight scheme, the input scheme, the shape and whether the input is rotated online
decide every refusal an export makes (only GGUF's Q4_1 rounding check needs the numbers).
A checkpoint's manifest gives them without loading a weight, a plan gives them before
quantizing, and a loaded model gives them too, so each export checks one list the same
way at every point: `lowbit export` before loading, `lowbit quantize` before tuning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from lowbit.errors import CheckpointError, SchemeError
from lowbit.formats import InputScheme, Recipe, Scheme
from lowbit.nn import quant_layers
from lowbit.nn.input_rotation import refuse_rotated
from lowbit.nn.quant_experts import quant_stacks


@dataclass(frozen=True)
class LayerSpec:
    """One quantized Linear as an export sees it."""

    name: str
    scheme: Scheme
    input: InputScheme | None
    shape: tuple[int, int]  # (out, in)
    rotated: bool = False  # its input is rotated online at run time
    experts: int = 0  # a fused experts tensor of this many [out, in] matrices (0: a Linear)

    @property
    def in_features(self) -> int:
        return self.shape[1]


def from_model(model: nn.Module) -> list[LayerSpec]:
    return [LayerSpec(n, m.scheme, None if m.input_quant is None else m.input_quant.scheme,
                      (m.out_features, m.in_features), m.input_rotation is not None)
            for n, m in quant_layers(model).items()] + [
        LayerSpec(n, m.scheme, _stack_input(m), (m.out_features, m.in_features), False, m.num_experts)
        for n, m in quant_stacks(model).items()]


def _stack_input(stack: nn.Module) -> InputScheme | None:
    """The input scheme of an experts stack that quantizes its inputs (`QuantStack.input_scheme`), or None."""
    return getattr(stack, "input_scheme", None)


def from_manifest(manifest: Mapping) -> list[LayerSpec]:
    """The layers a checkpoint's ``lowbit.json`` lists (`files.native.read_manifest` checked its shape)."""
    specs = []
    for name, spec in manifest["layers"].items():
        try:
            scheme = Scheme.from_dict(dict(spec["scheme"]))
            inp = None if spec.get("input") is None else InputScheme.from_dict(dict(spec["input"]))
        except (SchemeError, TypeError) as e:
            raise CheckpointError(f"layer {name}: its scheme cannot be read ({e}); re-create the checkpoint") from None
        specs.append(LayerSpec(name, scheme, inp, tuple(spec["shape"]), spec.get("input_rotation") is not None,
                               int(spec.get("experts", 0))))
    return specs


def from_plan(plan: Mapping[str, Recipe], shapes: Mapping[str, tuple[int, int]],
              rotated: frozenset[str] = frozenset(), experts: Mapping[str, int] | None = None) -> list[LayerSpec]:
    """The layers a plan (``Plan.layers``: layer -> recipe) will make, with their ``(out, in)`` shapes
    (``rotated``: inputs rotated online; ``experts``: fused experts tensors -> their expert count). A mapping,
    not a ``plans.Plan``: files sit below plans."""
    experts = experts or {}
    return [LayerSpec(n, r.weight, r.input, tuple(shapes[n]), n in rotated, experts.get(n, 0))
            for n, r in plan.items()]


def refuse_experts(specs: list[LayerSpec], target: str) -> None:
    """A target that cannot hold quantized fused experts yet refuses them by name."""
    names = [s.name for s in specs if s.experts]
    if names:
        raise SchemeError(f"{target} cannot hold quantized mixture-of-experts experts yet ({names[0]}, ...); "
                          "lowbit's native checkpoint holds them (`lowbit eval` and `lowbit inspect` read it)")


def refuse_rotations(specs: list[LayerSpec], target: str) -> None:
    """An export that cannot hold an online input rotation refuses layers that have one."""
    refuse_rotated([s.name for s in specs if s.rotated], target)
