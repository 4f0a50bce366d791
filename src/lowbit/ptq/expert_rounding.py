"""SignRound's path into mixture-of-experts experts: a rounder per expert matrix, and the experts module tuned on them.

A fused experts parameter (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``; gpt-oss
stores them transposed) is E Linear matrices ``[out, in]``. `StackRounder` gives each
expert's matrix the rounder a Linear of that scheme gets (`lowbit.ptq.rounders`: V offsets,
clip factors or V2's searched scale and multiplier, grouped along the expert's input), so
every format SignRound tunes for Linears (INT, FP4/FP8 blocks with their tensor scale,
K-quants) tunes experts too, each expert with its own tensor scale as RTN gives it
(`QuantStack.from_float`). Experts no mini-batch routes a token to get a zero gradient,
and ``sign(0) = 0`` leaves them where they started.

`TunedExperts` stands in for the float experts module while its block is tuned: each
forward lends the module the rounders' fake-quantized 3-D weights (in its own layout) and
calls the module's own forward, as `QuantExperts` does with its dequantized stacks. The
router is outside (the block's gate runs on its float weight, frozen like every float
parameter of the block), so routing follows the float router on the quantized inputs the
block receives, exactly as it will after freezing. The tuner puts the float module back
when it is done; the engine freezes it into a `QuantExperts` holding the ``export()`` s
(`lowbit.ptq.blockwise.access.install`): what the tuned forward computed, bit for bit.

The experts' products run in fp32 while tuning (the model's forward receives one dtype for
its inputs and weights; a bf16 product path like `TunedLinear`'s is left for a kernel).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lowbit.formats import Scheme
from lowbit.nn import set_module
from lowbit.nn.quant_experts import QuantStack, expert_matrices, routed_experts
from lowbit.ptq.expert_calib import ExpertInput, InputFn, input_fn
from lowbit.ptq.rounders import make_rounder


class StackRounder(nn.Module):
    """One rounder per expert matrix of ``w [E, out, in]``; ``forward()`` is the ``[E, out, in]`` fake-quantized stack.

    imp: ``[E, in]`` per-expert importance for V2's initial scale search, or ``[in]`` shared,
    or None = uniform (the weights-alone search RTN runs on experts today).
    """

    def __init__(self, w: torch.Tensor, scheme: Scheme, imp: torch.Tensor | None, v2: bool) -> None:
        super().__init__()
        self.parts = nn.ModuleList(make_rounder(w[e], scheme, _expert_imp(imp, e), v2) for e in range(w.shape[0]))

    def forward(self) -> torch.Tensor:
        return torch.stack([r() for r in self.parts])

    def clamp_(self) -> None:
        for r in self.parts:
            r.clamp_()

    def export(self) -> QuantStack:
        return QuantStack([r.export() for r in self.parts])


def _identity(_e: int, x: torch.Tensor) -> torch.Tensor:
    return x


def _expert_imp(imp: torch.Tensor | None, e: int) -> torch.Tensor | None:
    if imp is None or imp.dim() == 1:
        return imp
    return imp[e]


def expert_importance(imp: Mapping[str, torch.Tensor] | None, name: str) -> torch.Tensor | None:
    """The importance V2's scale search uses for expert tensor ``name``: ``[E, in]``, ``[in]`` or None (uniform).

    Today the block-wise pass collects input statistics for Linears only, so experts get
    None: every group's scale is searched on its own weights (what RTN does for experts).
    Per-expert statistics (routed tokens' sum of squares per expert) plug in here by name.
    """
    return None if imp is None else imp.get(name)


def rounder_parts(rounder: nn.Module) -> list[nn.Module]:
    """The per-matrix rounders inside ``rounder`` (itself for a Linear's)."""
    return list(rounder.parts) if isinstance(rounder, StackRounder) else [rounder]


class TunedExperts(nn.Module):
    """A fused experts module run on its rounders' fake-quantized weights (used while tuning).

    The float module stays a child (so the block moves it between devices and its biases
    keep their names); its tuned 3-D parameters are set aside during each forward and the
    fake-quantized tensors lent in their place.
    """

    def __init__(self, experts: nn.Module, rounders: Mapping[str, StackRounder],
                 inputs: Mapping[str, ExpertInput] | None = None) -> None:
        super().__init__()
        self.inner = experts
        self.transposed = bool(getattr(experts, "is_transposed", False))
        self.rounders = nn.ModuleDict(rounders)
        self.inputs = dict(inputs or {})  # parameter -> (input scheme, [E] static abs-max or None)

    def weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """parameter -> the fake-quantized 3-D tensor in the module's layout (as `QuantExperts.float_weights`)."""
        out = {}
        for name, r in self.rounders.items():
            w = r().to(dtype)
            out[name] = w.transpose(1, 2).contiguous() if self.transposed else w
        return out

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.inputs:
            return self._quantized_inputs(hidden_states, *args, **kwargs)
        inner = self.inner
        weights = self.weights(hidden_states.dtype)
        saved = {name: inner._parameters.pop(name) for name in weights}
        try:
            for name, w in weights.items():
                object.__setattr__(inner, name, w)
            return inner(hidden_states, *args, **kwargs)
        finally:
            for name, p in saved.items():
                inner.__dict__.pop(name, None)
                inner._parameters[name] = p

    def _quantized_inputs(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The routed sum with each expert's inputs quantized (`routed_experts`, the loop the frozen
        `QuantExperts` runs), on the rounders' weights; the input quantization passes gradients straight through."""
        inner, dtype = self.inner, hidden_states.dtype
        w = {n: r().to(dtype) for n, r in self.rounders.items()}
        for n in ("gate_up_proj", "down_proj"):
            if n not in w:  # left in float by the plan
                p = inner.get_parameter(n)
                w[n] = p.transpose(1, 2) if self.transposed else p
        quant = {n: _ste(input_fn(*self.inputs[n])) if n in self.inputs else _identity
                 for n in ("gate_up_proj", "down_proj")}
        bias = {n: getattr(inner, f"{n}_bias", None) for n in ("gate_up_proj", "down_proj")}
        return routed_experts(inner, w, bias, quant, hidden_states, *args, **kwargs)


def _ste(fn: InputFn) -> InputFn:
    """``fn``'s values forward, an identity gradient backward (as `InputQuantizer` passes a Linear's)."""
    def f(e: int, x: torch.Tensor) -> torch.Tensor:
        q = fn(e, x)
        return q if not x.requires_grad else x + (q - x).detach()
    return f


def stack_rounder(experts: nn.Module, param: str, scheme: Scheme, imp: torch.Tensor | None, v2: bool
                  ) -> StackRounder:
    """The `StackRounder` of ``experts.<param>`` read as ``[E, out, in]`` Linear matrices."""
    transposed = bool(getattr(experts, "is_transposed", False))
    return StackRounder(expert_matrices(experts.get_parameter(param).detach(), transposed), scheme, imp, v2)


def unwrap_experts(block: nn.Module) -> None:
    """Put every float experts module of ``block`` back in place of its `TunedExperts`."""
    for name, m in list(block.named_modules()):
        if isinstance(m, TunedExperts):
            set_module(block, name, m.inner)
