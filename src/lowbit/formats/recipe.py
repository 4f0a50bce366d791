"""`Recipe`: everything one Linear layer is quantized with — weight, input, rotation.

A plan maps each Linear to a recipe: the weight `Scheme`, an optional `InputScheme`
for its activations (None = the input stays in the compute dtype) and a reserved slot
for an online rotation. The online rotation is not a recipe field: it changes the float
weight before any method runs, so it is a float pre-step (`lowbit.ptq.rotation`,
``--rotate-online``) that each rotated layer then carries (`lowbit.nn.input_rotation`).
A recipe that sets the slot is refused, so no plan can claim a rotation nothing applies.

Text forms (``Recipe.parse``):

* a weight scheme alone (``w4g128``, ``nvfp4-46``): weight-only, as before;
* a preset: ``w4a4-nvfp4``, ``w4a4-nvfp4-46``, ``w4a4-nvfp4-span``, ``w4a4-mxfp4``,
  ``w8a8-mxfp8``, ``w8a8-fp8``, ``w8a8-fp8-static``, ``w8a8-int8``;
* ``WEIGHT-a8`` / ``WEIGHT-afp8``: a weight scheme with INT8 / FP8 per-token inputs
  (``w2g64-a8``, ``w4g128-afp8``);
* ``WEIGHT@INPUT`` for anything else, each side in its own explicit form
  (``nvfp4-46:rule=span@nvfp4-46:rule=span``, ``mxfp4@mxfp4:round=even``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lowbit.errors import SchemeError
from lowbit.formats.inputs import InputScheme
from lowbit.formats.scheme import Scheme


@dataclass(frozen=True)
class Recipe:
    """weight: the weight format. input: the activation format (None = not quantized).
    rotation: reserved, must be None (online rotations are a float pre-step, see the module doc)."""

    weight: Scheme
    input: InputScheme | None = None
    rotation: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.weight, Scheme):
            raise SchemeError(f"a recipe's weight must be a Scheme, got {type(self.weight).__name__}")
        if self.input is not None and not isinstance(self.input, InputScheme):
            raise SchemeError(f"a recipe's input must be an InputScheme, got {type(self.input).__name__}")
        if self.rotation is not None:
            raise SchemeError(f"rotation {self.rotation!r}: a recipe does not carry the online rotation; drop "
                              "'rotation' from the recipe and rotate the float model's layers instead "
                              "(--rotate-online LAYERS, RotationSettings(online=...))")

    @property
    def name(self) -> str:
        """Canonical text: ``Recipe.parse(r.name) == r``."""
        for key, preset in PRESETS.items():
            if preset == self:
                return key
        if self.input is None:
            return self.weight.name
        for suffix, inp in SUFFIXES.items():  # WEIGHT-a8 reads back only without options (`parse`)
            if inp == self.input and ":" not in self.weight.name:
                return f"{self.weight.name}-{suffix}"
        return f"{self.weight.name}@{self.input.name}"

    @property
    def needs_calibration(self) -> bool:
        """Static input scales must be calibrated before the recipe can run."""
        return self.input is not None and self.input.needs_calibration

    @property
    def input_bits(self) -> int | None:
        return None if self.input is None else self.input.bits

    def check_width(self, in_features: int, where: str = "layer") -> None:
        self.weight.check_width(in_features, where)
        if self.input is not None:
            self.input.check_width(in_features, where)

    def to_dict(self) -> dict[str, Any]:
        return {"weight": self.weight.to_dict(), "input": None if self.input is None else self.input.to_dict(),
                "rotation": self.rotation}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        """The ``to_dict`` form; a plain dict of weight-scheme fields (old plans) is weight-only."""
        if "weight" not in d:
            return cls(Scheme.from_dict(dict(d)))
        unknown = set(d) - {"weight", "input", "rotation"}
        if unknown:
            raise SchemeError(f"unknown recipe fields {sorted(unknown)}; known: ['input', 'rotation', 'weight']")
        w, i = d["weight"], d.get("input")
        weight = Scheme.parse(w) if isinstance(w, str) else Scheme.from_dict(dict(w))
        inp = None if i is None else InputScheme.parse(i) if isinstance(i, str) else InputScheme.from_dict(dict(i))
        return cls(weight, inp, d.get("rotation"))

    @classmethod
    def parse(cls, text: str | Recipe | Scheme) -> Recipe:
        """A recipe preset, ``WEIGHT-a8``, ``WEIGHT@INPUT`` or a weight scheme alone."""
        if isinstance(text, Recipe):
            return text
        if isinstance(text, Scheme):
            return cls(text)
        text = text.strip().lower()
        if text in PRESETS:
            return PRESETS[text]
        if "@" in text:
            w, _, i = text.partition("@")
            return cls(Scheme.parse(w), InputScheme.parse(i))
        base, sep, opts = text.partition(":")
        for suffix, inp in SUFFIXES.items():
            if base.endswith("-" + suffix) and not sep:
                return cls(Scheme.parse(base[: -len(suffix) - 1]), inp)
        try:
            return cls(Scheme.parse(text))
        except SchemeError as e:
            if not str(e).startswith("unknown scheme"):  # a known scheme with a bad field: that field is the news
                raise
            raise SchemeError(f"{e}; recipes with quantized inputs: {', '.join(PRESETS)}, WEIGHT-a8, "
                              "WEIGHT-afp8 or WEIGHT@INPUT") from None

    def __str__(self) -> str:
        return self.name


def as_recipe(value: Recipe | Scheme | str) -> Recipe:
    """A recipe from a recipe, a weight scheme (weight-only) or text."""
    return Recipe.parse(value)


def _r(weight: str, inp: str | None) -> Recipe:
    return Recipe(Scheme.parse(weight), None if inp is None else InputScheme.parse(inp))


SUFFIXES: dict[str, InputScheme] = {"a8": InputScheme.parse("int8"), "afp8": InputScheme.parse("fp8")}

PRESETS: dict[str, Recipe] = {
    "w4a4-nvfp4": _r("nvfp4", "nvfp4"),
    "w4a4-nvfp4-46": _r("nvfp4-46", "nvfp4-46"),
    "w4a4-nvfp4-span": _r("nvfp4-46:rule=span", "nvfp4-46:rule=span"),
    "w4a4-nvfp4-ue5m3": _r("nvfp4-ue5m3", "nvfp4-ue5m3"),
    "w4a4-mxfp4": _r("mxfp4", "mxfp4"),
    "w8a8-mxfp8": _r("mxfp8", "mxfp8"),
    "w8a8-fp8": _r("fp8", "fp8"),
    "w8a8-fp8-static": _r("fp8", "fp8-static"),
    "w8a8-int8": _r("w8", "int8"),
}
