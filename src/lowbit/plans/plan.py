"""`Plan`: which recipe each Linear layer gets — the output of bit allocation.

A uniform run is a plan where every layer maps to one recipe; mixed precision is the
same object with different recipes. A recipe (`lowbit.formats.recipe`) is the weight
scheme, an optional input (activation) scheme and a reserved rotation slot. Keeping it
a plain mapping (no model reference) lets it be saved as JSON next to a checkpoint and
applied to a fresh copy of the model.

JSON: ``{"layers": {name: entry}}`` where an entry is a recipe name (``"w4a4-nvfp4"``),
a weight scheme name (``"w4g128"``), a recipe object (``{"weight": {...}, "input":
{...} | null, "rotation": null}``) or, as older plans wrote, the weight scheme's fields.
Weight-only layers are still written in that older form, so their plans read the same.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from lowbit.errors import ConfigError, SchemeError
from lowbit.formats.inputs import InputScheme
from lowbit.formats.recipe import Recipe, as_recipe
from lowbit.formats.scheme import Scheme


@dataclass(frozen=True)
class Plan:
    """Layer name -> Recipe (read-only). Schemes and recipe texts given as values become recipes."""

    layers: Mapping[str, Recipe] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", MappingProxyType({n: as_recipe(v) for n, v in self.layers.items()}))

    @classmethod
    def uniform(cls, names: Iterable[str], recipe: Recipe | Scheme | str) -> Plan:
        r = as_recipe(recipe)
        return cls({n: r for n in names})

    def __getitem__(self, name: str) -> Recipe:
        return self.layers[name]

    def weight(self, name: str) -> Scheme:
        return self.layers[name].weight

    def weights(self) -> dict[str, Scheme]:
        """Layer -> weight scheme: what the weight quantizers (RTN, SignRound) work from."""
        return {n: r.weight for n, r in self.layers.items()}

    def inputs(self) -> dict[str, InputScheme]:
        """Layer -> input scheme, for the layers whose inputs are quantized."""
        return {n: r.input for n, r in self.layers.items() if r.input is not None}

    def needs_calibration(self) -> list[str]:
        """Layers whose input schemes have static scales (calibrated on calibration data)."""
        return [n for n, r in self.layers.items() if r.needs_calibration]

    def with_weights(self, weights: Mapping[str, Scheme]) -> Plan:
        """The same recipes with the weight schemes of ``weights`` (inputs and rotations kept)."""
        return Plan({n: Recipe(weights.get(n, r.weight), r.input, r.rotation) for n, r in self.layers.items()})

    def __contains__(self, name: object) -> bool:
        return name in self.layers

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def items(self):
        return self.layers.items()

    def recipes(self) -> list[Recipe]:
        """Distinct recipes in first-use order."""
        return list(dict.fromkeys(self.layers.values()))

    def schemes(self) -> list[Scheme]:
        """Distinct weight schemes in first-use order."""
        return list(dict.fromkeys(r.weight for r in self.layers.values()))

    @property
    def is_uniform(self) -> bool:
        return len(self.recipes()) <= 1

    def describe(self) -> str:
        """Short human label: the recipe name, or ``mixed(a,b)``."""
        names = [r.name for r in self.recipes()]
        return names[0] if len(names) == 1 else f"mixed({','.join(names)})"

    def average_bits(self, sizes: Mapping[str, tuple[int, int]], count_scales: bool = True) -> float:
        """Parameter-weighted bits per weight over the planned layers; sizes: name -> (out, in)."""
        total = sum(o * i for o, i in (sizes[n] for n in self.layers))
        bits = sum(r.weight.bits_per_weight(sizes[n][1], count_scales) * sizes[n][0] * sizes[n][1]
                   for n, r in self.layers.items())
        return bits / max(total, 1)

    def to_dict(self) -> dict:
        """Weight-only layers as their scheme's fields (the older form), others as recipe objects."""
        return {name: r.weight.to_dict() if r.input is None and r.rotation is None else r.to_dict()
                for name, r in self.layers.items()}

    @classmethod
    def from_dict(cls, d: Mapping) -> Plan:
        """Layer name -> a recipe or scheme name, a recipe object, or a scheme's fields (``to_dict``)."""
        return cls({name: _recipe(name, v) for name, v in d.items()})

    def to_json(self) -> str:
        return json.dumps({"layers": self.to_dict()}, indent=1)

    def save(self, path: str | Path) -> None:
        from lowbit.io import atomic_write_text

        atomic_write_text(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        from lowbit.io import read_json

        p = Path(path)
        if not p.exists():
            raise ConfigError(f"plan file {p} does not exist; pass the JSON written by `lowbit quantize`")
        d = read_json(p, ConfigError, f"a plan file looks like {PLAN_FORMAT}")
        layers = d.get("layers") if isinstance(d, dict) else None
        if not isinstance(layers, dict) or not all(isinstance(k, str) for k in layers):
            raise ConfigError(f"{p} has no 'layers' object; a plan file looks like {PLAN_FORMAT}")
        try:
            return cls.from_dict(layers)
        except SchemeError as e:
            raise ConfigError(f"{p}: {e}; a plan file looks like {PLAN_FORMAT}") from None


PLAN_FORMAT = ('{"layers": {"model.layers.0.self_attn.q_proj": "w4g128", "model.layers.0.mlp.up_proj": '
               '"w4a4-nvfp4", ...}} (each value a scheme or recipe name, or the objects of the plan.json '
               "`lowbit quantize --avg-bits` writes)")


def _recipe(name: str, value: object) -> Recipe:
    """One plan entry: a name, a recipe object or a dict of scheme fields; anything else is a `SchemeError`."""
    try:
        if isinstance(value, str):
            return Recipe.parse(value)
        if isinstance(value, Mapping):
            return Recipe.from_dict(dict(value))
    except (SchemeError, TypeError) as e:
        raise SchemeError(f"layer {name}: {e}") from None
    raise SchemeError(f"layer {name}: {value!r} is neither a scheme name, a recipe name nor an object of their fields")

