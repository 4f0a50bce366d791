"""`Plan`: which scheme each Linear layer gets — the output of bit allocation.

A uniform run is a plan where every layer maps to one scheme; mixed precision is the
same object with different schemes. Keeping it a plain mapping (no model reference)
lets it be saved as JSON next to a checkpoint and applied to a fresh copy of the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from lowbit.errors import ConfigError, SchemeError
from lowbit.formats.scheme import Scheme


@dataclass(frozen=True)
class Plan:
    """Layer name -> Scheme (read-only)."""

    layers: Mapping[str, Scheme] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", MappingProxyType(dict(self.layers)))

    @classmethod
    def uniform(cls, names: Iterable[str], scheme: Scheme | str) -> Plan:
        s = Scheme.parse(scheme)
        return cls({n: s for n in names})

    def __getitem__(self, name: str) -> Scheme:
        return self.layers[name]

    def __contains__(self, name: object) -> bool:
        return name in self.layers

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def items(self):
        return self.layers.items()

    def schemes(self) -> list[Scheme]:
        """Distinct schemes in first-use order."""
        return list(dict.fromkeys(self.layers.values()))

    @property
    def is_uniform(self) -> bool:
        return len(self.schemes()) <= 1

    def describe(self) -> str:
        """Short human label: the scheme name, or ``mixed(a,b)``."""
        names = [s.name for s in self.schemes()]
        return names[0] if len(names) == 1 else f"mixed({','.join(names)})"

    def average_bits(self, sizes: Mapping[str, tuple[int, int]], count_scales: bool = True) -> float:
        """Parameter-weighted bits per weight over the planned layers; sizes: name -> (out, in)."""
        total = sum(o * i for o, i in (sizes[n] for n in self.layers))
        bits = sum(s.bits_per_weight(sizes[n][1], count_scales) * sizes[n][0] * sizes[n][1]
                   for n, s in self.layers.items())
        return bits / max(total, 1)

    def to_dict(self) -> dict:
        return {name: s.to_dict() for name, s in self.layers.items()}

    @classmethod
    def from_dict(cls, d: Mapping) -> Plan:
        """Layer name -> scheme, each given as a scheme name (``"w4g128"``) or its fields (``to_dict``)."""
        return cls({name: _scheme(name, v) for name, v in d.items()})

    def to_json(self) -> str:
        return json.dumps({"layers": self.to_dict()}, indent=1)

    def save(self, path: str | Path) -> None:
        from lowbit.io import atomic_write_text

        atomic_write_text(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"plan file {p} does not exist; pass the JSON written by `lowbit quantize`")
        try:
            d = json.loads(p.read_bytes().decode("utf-8"))
        except ValueError as e:  # UnicodeDecodeError included
            raise ConfigError(f"{p} is not valid JSON ({e}); a plan file looks like {PLAN_FORMAT}") from None
        layers = d.get("layers") if isinstance(d, dict) else None
        if not isinstance(layers, dict) or not all(isinstance(k, str) for k in layers):
            raise ConfigError(f"{p} has no 'layers' object; a plan file looks like {PLAN_FORMAT}")
        try:
            return cls.from_dict(layers)
        except SchemeError as e:
            raise ConfigError(f"{p}: {e}; a plan file looks like {PLAN_FORMAT}") from None


PLAN_FORMAT = ('{"layers": {"model.layers.0.self_attn.q_proj": "w4g128", ...}} (each value a scheme name, or the '
               "scheme's fields as in the plan.json `lowbit quantize --avg-bits` writes)")


def _scheme(name: str, value: object) -> Scheme:
    """One plan entry: a scheme name or a dict of scheme fields; anything else is a `SchemeError`."""
    try:
        if isinstance(value, str):
            return Scheme.parse(value)
        if isinstance(value, Mapping):
            return Scheme.from_dict(dict(value))
    except SchemeError as e:
        raise SchemeError(f"layer {name}: {e}") from None
    raise SchemeError(f"layer {name}: {value!r} is neither a scheme name nor an object of scheme fields")

