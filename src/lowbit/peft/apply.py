"""Model-level PEFT: put one adapter on every quantized layer, freeze the rest, merge.

Adapters go into each `QuantLinear`'s ``adapters`` ModuleDict under the key ``"peft"``
(a float ``nn.Linear`` base is supported too, for checks against HF peft), so the frozen
base and the model's own code stay untouched. Every adapter kind gets the same
parameter budget, ``rank * (in + out)`` per layer (a rank-r LoRA's count).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from lowbit.configs import check_fields
from lowbit.errors import ConfigError
from lowbit.formats import Scheme, quantize
from lowbit.models.fused import own_tensor_scale, shared_encodes
from lowbit.nn import QuantLinear
from lowbit.peft.adaalloc import lora_budget
from lowbit.peft.base import Adapter
from lowbit.peft.fourierft import FourierFTAdapter
from lowbit.peft.loftq import LoftQAdapter, loftq_adapter
from lowbit.peft.lora import LoRAAdapter
from lowbit.peft.qwha import PATHS, QWHAAdapter
from lowbit.peft.refine import init_qwha

KEY = "peft"
KINDS = ("qwha", "lora", "loftq", "fourierft")
CLASSES: dict[str, type[Adapter]] = {"qwha": QWHAAdapter, "lora": LoRAAdapter, "loftq": LoftQAdapter,
                                     "fourierft": FourierFTAdapter}
NEEDS_ERROR = ("qwha", "loftq")  # inits that need the full-precision weights


@dataclass(frozen=True)
class PeftConfig:
    """One adapter recipe for every target layer (JSON round trip via to_dict/from_dict)."""

    adapter: str = "qwha"
    rank: int = 8  # budget in LoRA terms: rank * (in + out) trainable values per layer
    k_min: int = 1  # QWHA AdaAlloc: coefficients every row gets at least
    damp: float = 1e-4  # QWHA refinement: XtX + damp * mean(diag) * I
    refine: bool = True  # QWHA: least-squares values on calibration activations
    # QWHA: learning-rate multiplier of the values (Delta_W unchanged). 10, not 1: with the
    # unnormalised H a coefficient moves Delta_W by only 1/n per unit, and at the adapters'
    # shared lr a scale of 1 left QWHA behind LoftQ after training (bundled model, w2g64,
    # 12 steps: eval ppl 854 at scale 1, 175 at scale 10; LoftQ 353, LoRA 881).
    scale: float = 10.0
    path: str = "auto"  # QWHA forward path: auto | dense | sparse
    alpha: float | None = None  # LoRA/LoftQ alpha (default = rank, scaling 1)
    fourier_scaling: float = 150.0  # FourierFT scaling (peft's default)
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "adapter setting")
        if self.adapter not in KINDS:
            raise ConfigError(f"unknown adapter {self.adapter!r}; choose one of {', '.join(KINDS)}")
        if self.rank < 1:
            raise ConfigError(f"--rank must be a positive integer, got {self.rank}")
        if self.path not in PATHS:
            raise ConfigError(f"unknown QWHA path {self.path!r}; choose one of {PATHS}")
        if self.k_min < 0 or self.damp < 0 or self.scale <= 0:
            raise ConfigError("k_min and damp must be >= 0 and scale > 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PeftConfig:
        return cls(**dict(d))


# which adapters read each PeftConfig field (fields not listed apply to every adapter)
FIELD_ADAPTERS: dict[str, tuple[str, ...]] = {
    "k_min": ("qwha",), "damp": ("qwha",), "refine": ("qwha",), "scale": ("qwha",), "path": ("qwha",),
    "alpha": ("lora", "loftq"), "fourier_scaling": ("fourierft",),
}


def peft_config(adapter: str, **given: Any) -> PeftConfig:
    """A `PeftConfig` from the fields a user set; a field the adapter does not read is an error.

    ``--k-min`` with ``--adapter lora`` would otherwise be ignored without a word.
    """
    for name in given:
        users = FIELD_ADAPTERS.get(name)
        if users is not None and adapter not in users:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} does not apply to --adapter {adapter}; it applies to "
                              f"--adapter {' | '.join(users)}")
    return PeftConfig(adapter, **given)


def target_layers(model: nn.Module, names: Iterable[str] | None = None) -> dict[str, nn.Module]:
    """The layers adapters go on: every `QuantLinear` (default) or the named Linears."""
    if names is None:
        found = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        if not found:
            raise ConfigError("the model has no QuantLinear layers; quantize it first (`lowbit quantize`)")
        return found
    out = {}
    for n in names:
        m = model.get_submodule(n)
        if not isinstance(m, (QuantLinear, nn.Linear)):
            raise ConfigError(f"layer {n!r} is a {type(m).__name__}, not a Linear or QuantLinear")
        out[n] = m
    return out


def check_shapes(cfg: PeftConfig, shapes: Mapping[str, tuple[int, int]]) -> None:
    """Fail before any heavy work if the rank does not fit some layer (``name -> (out, in)``)."""
    for name, (out_f, in_f) in shapes.items():
        budget = lora_budget(cfg.rank, out_f, in_f)
        if cfg.adapter in ("lora", "loftq") and cfg.rank > min(out_f, in_f):
            raise ConfigError(f"{name}: rank {cfg.rank} exceeds min(out, in) = {min(out_f, in_f)}; "
                              "use a smaller --rank")
        if cfg.adapter in ("qwha", "fourierft") and budget > out_f * in_f:
            raise ConfigError(f"{name}: rank {cfg.rank} budget {budget} exceeds the layer's {out_f}x{in_f} "
                              "weights; use a smaller --rank")
        if cfg.adapter == "qwha" and cfg.k_min * out_f > budget:
            raise ConfigError(f"{name}: k_min={cfg.k_min} per row needs {cfg.k_min * out_f} coefficients but "
                              f"the budget is {budget}; lower --k-min or raise --rank")


def base_weight(layer: nn.Module) -> torch.Tensor:
    return layer.weight.detach()


def build_adapter(cfg: PeftConfig, layer: nn.Module, name: str = "layer", err: torch.Tensor | None = None,
                  xtx: torch.Tensor | None = None) -> Adapter:
    """One adapter for ``layer`` under ``cfg`` (``err = W_fp - W_q`` for the QWHA/LoftQ inits)."""
    out_f, in_f = layer.out_features, layer.in_features
    budget = lora_budget(cfg.rank, out_f, in_f)
    check_shapes(cfg, {name: (out_f, in_f)})
    if cfg.adapter in NEEDS_ERROR and err is None:
        raise ConfigError(f"{cfg.adapter} needs the full-precision weights of {name} to initialise; "
                          "pass the source model (e.g. --base-model) or use --adapter lora")
    if cfg.adapter == "qwha":
        init = init_qwha(err.float(), budget, xtx if cfg.refine else None, cfg.k_min, cfg.damp, cfg.refine)
        return QWHAAdapter(out_f, in_f, init.rows, init.cols, init.values, scale=cfg.scale, path=cfg.path)
    if cfg.adapter == "fourierft":
        return FourierFTAdapter(out_f, in_f, budget, cfg.fourier_scaling, seed=cfg.seed + 777)
    if cfg.adapter == "loftq":
        return loftq_adapter(err.float(), cfg.rank, cfg.alpha)
    return LoRAAdapter(out_f, in_f, cfg.rank, cfg.alpha, seed=cfg.seed)


def apply_adapters(model: nn.Module, cfg: PeftConfig, fp_weights: Mapping[str, torch.Tensor] | None = None,
                   xtx: Mapping[str, torch.Tensor] | None = None, names: Iterable[str] | None = None,
                   progress: bool = False) -> dict[str, Adapter]:
    """Add an adapter to every target layer; freeze everything else. Returns name -> adapter."""
    layers = target_layers(model, names)
    made = {}
    for name, layer in tqdm(layers.items(), desc=f"init {cfg.adapter}", disable=not progress, unit="layer"):
        err = None
        if fp_weights is not None and name in fp_weights:
            w = fp_weights[name].detach().float().to(base_weight(layer).device)
            if w.shape != base_weight(layer).shape:
                raise ConfigError(f"{name}: full-precision weight {tuple(w.shape)} does not match the quantized "
                                  f"layer {tuple(base_weight(layer).shape)}; pass the model it was quantized from")
            err = w - base_weight(layer).float()
        adapter = build_adapter(cfg, layer, name, err, None if xtx is None else xtx.get(name))
        attach(layer, adapter.to(base_weight(layer).device))
        made[name] = adapter
    freeze_base(model)
    return made


def attach(layer: nn.Module, adapter: Adapter) -> None:
    """Put ``adapter`` on a QuantLinear (its hook point) or a float Linear (forward hook)."""
    if isinstance(layer, QuantLinear):
        layer.adapters[KEY] = adapter
        return
    layer.add_module(f"{KEY}_adapter", adapter)
    layer.register_forward_hook(lambda mod, args, out: out + getattr(mod, f"{KEY}_adapter")(args[0]))


def adapters_of(model: nn.Module) -> dict[str, Adapter]:
    """Layer name -> its lowbit adapter."""
    found = {}
    for name, m in model.named_modules():
        a = m.adapters[KEY] if isinstance(m, QuantLinear) and KEY in m.adapters else getattr(m, f"{KEY}_adapter", None)
        if isinstance(a, Adapter):
            found[name] = a
    return found


def freeze_base(model: nn.Module) -> list[nn.Parameter]:
    """requires_grad only on adapter parameters; returns them (the optimiser's list)."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for a in adapters_of(model).values() for p in a.parameters()]
    for p in params:
        p.requires_grad_(True)
    return params


def count_trainable(model: nn.Module) -> int:
    return sum(a.num_trainable() for a in adapters_of(model).values())


@torch.no_grad()
def merge(model: nn.Module, scheme: Scheme | str | None = None) -> dict[str, float]:
    """Fold every adapter into its base; QuantLinear bases are re-quantized (lossy).

    The original quantized weight is kept on the adapter so `unmerge` restores it
    exactly. Returns per layer the relative error of the re-quantized merged weight.
    """
    errs = {}
    todo = {n: a for n, a in adapters_of(model).items() if not a.merged}
    schemes = {n: Scheme.parse(scheme) if scheme is not None else model.get_submodule(n).scheme for n in todo
               if isinstance(model.get_submodule(n), QuantLinear)}
    scales = _merged_tensor_scales(model, todo, schemes)
    for name, adapter in todo.items():
        layer = model.get_submodule(name)
        target = _merged(layer, adapter)
        if isinstance(layer, QuantLinear):
            adapter._unmerged_q = layer.qweight
            q = quantize(target, schemes[name], tensor_scale=scales.get(name))
            layer.set_qweight(q)
            got = q.dequantize()
        else:
            layer.weight.data.copy_(target.to(layer.weight.dtype))
            got = layer.weight.float()
        errs[name] = float((got - target).square().sum() / target.square().sum().clamp_min(1e-30))
        adapter.merged = True
    return errs


def _merged(layer: nn.Module, adapter: Adapter) -> torch.Tensor:
    return base_weight(layer).float() + adapter.delta_weight().float()


def _merged_tensor_scales(model: nn.Module, adapters: Mapping[str, Adapter], schemes: Mapping[str, Scheme]
                          ) -> dict[str, torch.Tensor]:
    """Tensor scales of the merged weights (NVFP4), shared by the parts of a matmul engines fuse.

    Each merged weight is built here once for its scale and again when it is quantized, so
    no more than one float weight is held at a time.
    """
    return shared_encodes({n: own_tensor_scale(_merged(model.get_submodule(n), adapters[n]), s)
                           for n, s in schemes.items() if s.tensor_scale})


@torch.no_grad()
def unmerge(model: nn.Module) -> None:
    """Undo `merge`: the exact original base weights come back, adapters act again."""
    for name, adapter in adapters_of(model).items():
        if not adapter.merged:
            continue
        layer = model.get_submodule(name)
        if isinstance(layer, QuantLinear):
            layer.set_qweight(adapter._unmerged_q)
            del adapter._unmerged_q
        else:
            layer.weight.data.sub_(adapter.delta_weight().to(layer.weight.dtype))
        adapter.merged = False


@torch.no_grad()
def merge_and_requantize(model: nn.Module, scheme: Scheme | str | None = None) -> dict[str, float]:
    """Merge, then drop the adapters: the model is a plain quantized model that exports as any other."""
    errs = merge(model, scheme)
    for name in list(adapters_of(model)):
        layer = model.get_submodule(name)
        if isinstance(layer, QuantLinear):
            del layer.adapters[KEY]
    return errs
