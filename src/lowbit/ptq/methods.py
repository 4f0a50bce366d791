"""The PTQ method registry: a method is a frozen settings dataclass plus a run function.

Each method module registers itself beside its code (``register(Method(...))``), so
adding one is one module plus the line in ``lowbit/ptq/__init__.py`` that imports it:
the fields it declares with `knob` become ``lowbit quantize`` flags (`method_flags`), and
``--method`` lists it. Settings are the method's own knobs only; what every method
shares (calibration tokens, device, work and offload folders, progress) travels in a
`RunContext`. Settings from text (the CLI's flags) go through `make_settings`, which
refuses any knob the chosen method does not have and names the methods that do: a flag
the chosen path cannot honour is an error, never silently dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lowbit.errors import ConfigError
from lowbit.plans.plan import Plan


@dataclass(frozen=True)
class RunContext:
    """What a method runs with, the same for every method.

    calib: LongTensor ``[n, seqlen]`` from the calibration split (None for data-free runs).
    device: compute device, resolved and checked once by the caller (None = where the model
    is; the block-wise methods then tune on the CPU, where a loaded model is). workdir: per-block results, so an
    interrupted block-wise run resumes. offload_dir: keep FP blocks on disk (block-wise only).
    cache_device: where a block-wise method keeps its cached activations: "device" (the
    compute device) or "cpu" (host memory streamed per mini-batch, the leanest mode).
    release: a lazily loaded model's finished blocks are written to offload_dir as the checkpoint
    stores them and emptied (`lowbit.ptq.blockwise.release`): nothing after the walk reads them.
    pre: the float pre-steps (rotation, AWQ) to apply to each block of a lazily loaded model as the walk
    reads it (`lowbit.ptq.block_prep.PreSteps`), instead of on the whole float model before the method.
    """

    calib: torch.Tensor | None = None
    device: torch.device | None = None
    workdir: str | None = None
    offload_dir: str | None = None
    progress: bool = True
    cache_device: str = "device"
    release: bool = False
    pre: Any = None


RunFn = Callable[[nn.Module, Plan, Any, RunContext], Plan]  # returns the plan it applied
# a block-wise method's (pipeline settings, PipelineOptions, plan it applies) for given settings and context:
# what its work folder records, so a resume with other settings is refused before any heavy work
WorkFn = Callable[[Any, Plan, RunContext], tuple[dict, Any, Plan]]


@dataclass(frozen=True)
class Method:
    """One PTQ method.

    settings: its frozen settings dataclass; ``fixed`` pins fields users cannot set
    (e.g. ``v2=True`` for signround2). blockwise: it reads the model one decoder block
    at a time (so it can start from a lazily loaded model, offload blocks to disk and
    resume from a work folder). needs_calib: whether these settings need calibration data.
    presets: named bases for the settings (``--preset``).
    check_plan: refuses settings that cannot apply a plan (called before any heavy work).
    work: (block-wise methods) what its work folder records for these settings (`WorkFn`).
    lazy_with_calib: a whole-model method that runs block by block on the block-wise engine when the run
    has calibration data (RTN: its statistics are per Linear, so a lazily loaded model never needs to be
    whole), or a rotation to apply per block without data; see `walks_blocks`.
    check_options: ``(options given, settings made)``: refuses an option given by name that these settings
    cannot honour where the settings alone cannot tell (a default-on knob that only some paths read: given
    explicitly on another path, it would be silently dropped). Called by `make_settings`.
    """

    name: str
    settings: type
    run: RunFn
    blockwise: bool
    needs_calib: Callable[[Any], bool]
    summary: str
    fixed: Mapping[str, Any] = field(default_factory=dict)
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    check_plan: Callable[[Any, Plan], None] | None = None
    work: WorkFn | None = None
    lazy_with_calib: bool = False
    check_options: Callable[[Mapping[str, Any], Any], None] | None = None

    def settable(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.settings) if f.name not in self.fixed]

    def default_settings(self) -> Any:
        return self.settings(**self.fixed)


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def walks_blocks(name: str, calibrated: bool, rotated: bool = False) -> bool:
    """Whether method ``name`` runs on the block-wise engine (so --offload-dir / --workdir apply): the block-wise
    methods always, RTN when the run has calibration data (its importance, static input scales, AWQ) or rotates
    (``rotated``: without data the walk only turns each block as it reads it, `lowbit.ptq.blockwise.rounding`)."""
    m = get(name)
    return m.blockwise or (m.lazy_with_calib and (calibrated or rotated))


def names() -> list[str]:
    return sorted(METHODS)


def get(name: str) -> Method:
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; choose one of {names()}")
    return METHODS[name]


def knob(default: Any, help: str, *, minimum: int | None = None, choices: tuple[str, ...] | None = None) -> Any:
    """A settings field that is also a ``lowbit quantize`` flag (``--name-with-dashes``).

    help: what it does, without the methods (prefixed from the registry) or the default
    (appended from the field). minimum: the smallest value an int flag takes. choices:
    the values a str flag takes. Fields declared without it have no flag.
    """
    return field(default=default, metadata={"flag": {"help": help, "minimum": minimum, "choices": choices}})


@dataclass(frozen=True)
class FlagSpec:
    """One method-settings flag of ``lowbit quantize``, built from the registry (`method_flags`).

    name: the settings field (``--name-with-dashes`` on the command line). kind: ``bool`` |
    ``int`` | ``float`` | ``str``. help: with the methods that take it and its default.
    """

    name: str
    kind: str
    help: str
    methods: tuple[str, ...]
    minimum: int | None = None
    choices: tuple[str, ...] | None = None


def method_flags() -> list[FlagSpec]:
    """Every flag the registered methods' settings declare (`knob`), in registration order, plus ``--preset``.

    A field several methods share is one flag; its kind, help and limits must agree (a
    registry that disagrees with itself is a bug, reported here rather than on a user's run).
    """
    found: dict[str, dict[str, Any]] = {}
    for m in METHODS.values():
        for f in dataclasses.fields(m.settings):
            meta = f.metadata.get("flag")
            if meta is None or f.name in m.fixed:
                continue
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            seen = found.setdefault(f.name, {"kind": kind, **meta, "defaults": {}})
            if (seen["kind"], seen["help"], seen["minimum"], seen["choices"]) != (kind, *meta.values()):
                raise TypeError(f"settings field {f.name!r} of {m.name} disagrees with another method's")
            seen["defaults"][m.name] = f.default
    out = [FlagSpec(name, d["kind"], f"{', '.join(d['defaults'])}: {d['help']} ({_default_text(d['defaults'])})",
                    tuple(d["defaults"]), d["minimum"], d["choices"]) for name, d in found.items()]
    presets = {m.name: tuple(m.presets) for m in METHODS.values() if m.presets}
    if presets:
        names = list(dict.fromkeys(p for ps in presets.values() for p in ps))
        out.append(FlagSpec("preset", "str", f"{', '.join(presets)}: {' | '.join(names)}", tuple(presets)))
    return out


def _default_text(defaults: Mapping[str, Any]) -> str:
    def text(v: Any) -> str:
        return ("on" if v else "off") if isinstance(v, bool) else str(v)

    values = list(dict.fromkeys(text(v) for v in defaults.values()))
    if len(values) == 1:
        return f"default {values[0]}"
    return "default " + ", ".join(f"{text(v)} for {n}" for n, v in defaults.items())


def flag(name: str) -> str:
    """The command-line spelling of a settings field (``tune_dtype`` -> ``--tune-dtype``)."""
    return "--" + name.replace("_", "-")


def takers(option: str) -> list[str]:
    """Methods that accept ``option`` (a settings field, or ``preset``)."""
    if option == "preset":
        return [m.name for m in METHODS.values() if m.presets]
    return [m.name for m in METHODS.values() if option in m.settable()]


def make_settings(name: str, options: Mapping[str, Any] | None = None) -> Any:
    """Settings of method ``name`` from ``options`` (field -> value; ``preset`` picks a base).

    Only the options given are applied; every other field keeps the preset's or the
    dataclass' default. An option the method lacks is an error naming the methods that
    take it.
    """
    method = get(name)
    opts = dict(options or {})
    base: dict[str, Any] = {}
    preset = opts.pop("preset", None)
    if preset is not None:
        _check_taken(method, "preset")
        if preset not in method.presets:
            raise ConfigError(f"unknown {name} preset {preset!r}; choose one of {sorted(method.presets)}")
        base.update(method.presets[preset])
    for key in opts:
        _check_taken(method, key)
    settings = method.settings(**{**base, **opts, **method.fixed})
    if method.check_options is not None:
        method.check_options(opts, settings)
    return settings


def _check_taken(method: Method, key: str) -> None:
    ok = bool(method.presets) if key == "preset" else key in method.settable()
    if ok:
        return
    who = takers(key)
    where = f"it applies to --method {' | '.join(who)}" if who else "no method takes it"
    raise ConfigError(f"{flag(key)} does not apply to --method {method.name}; {where}")


def coerce_settings(name: str, settings: Any) -> Any:
    """Settings for method ``name``: None = its defaults, a mapping = `make_settings`, else checked."""
    method = get(name)
    if settings is None:
        return method.default_settings()
    if isinstance(settings, Mapping):
        return make_settings(name, settings)
    if not isinstance(settings, method.settings):
        raise ConfigError(f"method {name} takes {method.settings.__name__}, got {type(settings).__name__}")
    wrong = {k: v for k, v in method.fixed.items() if getattr(settings, k) != v}
    if wrong:
        raise ConfigError(f"method {name} needs {wrong} in its settings")
    return settings
