"""Quantized mixture-of-experts experts: each expert's matrices stored like a Linear's, run by the model's own forward.

transformers 5 keeps a MoE layer's experts as fused 3-D parameters of one ``...Experts``
module (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``; gpt-oss transposed,
``[E, H, 2I]`` / ``[E, I, H]``, with biases and its own clamped activation). Each
expert's slice is the ``[out, in]`` matrix of a Linear, so lowbit quantizes it as one:
`QuantStack` holds the E per-expert `QTensor` s of one fused parameter (codes, scales,
zeros and tensor scales stacked along a leading expert axis, one scheme, groups along
each expert's input), in any format a Linear can have.

`QuantExperts` replaces the experts module. It keeps the float module (unregistered, its
3-D parameters removed) and, in each forward, dequantizes the stacks into 3-D tensors in
the module's own layout and calls the module's own forward with them. That reuses the
model's routing dispatch, gating, activation, biases and ``experts_implementation``
(eager, grouped_mm, ...) as they are, for every architecture, instead of re-implementing
five variants of the expert loop: the forward equals the float module's forward run on
the dequantized weights, bit for bit. The float module's other parameters, buffers and
children (gpt-oss's biases) are registered on the wrapper under their own names, so the
state dict keeps the float model's keys, and each stack appears as ``<param>.codes``,
``<param>.scales``, ... (the names a quantized Linear ``<param>`` would have).

Cost: a forward holds one layer's experts in float transiently (dequantized, then dropped),
like `QuantLinear` does for one Linear; dequantizing only the experts a batch routes to
would need the per-expert loop re-implemented and is left for a fused kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lowbit.errors import CheckpointError, SchemeError
from lowbit.formats import QTensor, Scheme, quantize
from lowbit.formats.inputs import InputScheme, qdq_input


class QuantStack(nn.Module):
    """E quantized ``[out, in]`` matrices of one scheme (one fused experts parameter), stacked on a leading axis."""

    def __init__(self, experts: Sequence[QTensor]) -> None:
        super().__init__()
        if not experts:
            raise SchemeError("a quantized experts stack needs at least one expert")
        first = experts[0]
        if any(q.shape != first.shape or q.scheme != first.scheme for q in experts):
            raise SchemeError("every expert of a fused experts parameter must share one shape and one scheme")
        self.num_experts = len(experts)
        self.calibration: dict | None = None  # calibration tokens per expert, when a method measured them
        self.input_scheme: InputScheme | None = None  # the recipe's input quantization, if it has one
        self.register_buffer("input_amax", None)  # [E]: each expert's calibrated input abs-max (static schemes)
        self.out_features, self.in_features = first.shape
        self.scheme: Scheme = first.scheme
        for slot in ("codes", "scales", "zeros", "tensor_scale"):
            parts = [getattr(q, slot) for q in experts]
            self.register_buffer(slot, None if parts[0] is None else torch.stack(parts))

    @classmethod
    def from_float(cls, matrices: torch.Tensor, scheme: Scheme | str,
                   imp: Sequence[torch.Tensor | None] | None = None) -> QuantStack:
        """Round-to-nearest of each ``matrices[e]`` (``[E, out, in]``) exactly as `quantize` rounds a Linear's weight.

        imp: per expert, the ``[in]`` importance of its own input columns for the ``search``
        rule (None, or a None entry: uniform importance, the search on the weights alone).
        """
        if matrices.dim() != 3:
            raise SchemeError(f"experts are a [E, out, in] stack, got shape {tuple(matrices.shape)}")
        s = Scheme.parse(scheme)
        w = matrices.detach()
        imps = list(imp) if imp is not None else [None] * w.shape[0]
        if len(imps) != w.shape[0]:
            raise SchemeError(f"{len(imps)} importance vectors for {w.shape[0]} experts")
        return cls([quantize(w[e], s, imp=imps[e]) for e in range(w.shape[0])])

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.num_experts, self.out_features, self.in_features

    def with_input(self, scheme: InputScheme, amax: torch.Tensor | None) -> QuantStack:
        """Quantize each expert's input with ``scheme``; static schemes need ``amax [E]`` (one abs-max per expert)."""
        if scheme.needs_calibration:
            if amax is None or amax.shape != (self.num_experts,) or not bool(torch.isfinite(amax).all()) \
                    or not bool((amax > 0).all()):
                raise SchemeError(f"input scheme {scheme.name} needs one finite, positive calibrated abs-max per "
                                  f"expert ({self.num_experts}), got {None if amax is None else list(amax.shape)}")
            amax = amax.detach().float().to(self.codes.device)
        else:
            amax = None
        self.input_scheme = scheme
        self.input_amax = amax
        return self

    def quantize_input(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s input as its recipe quantizes it (``x`` itself for weight-only recipes)."""
        if self.input_scheme is None:
            return x
        return qdq_input(x, self.input_scheme, None if self.input_amax is None else self.input_amax[e])

    def expert(self, e: int) -> QTensor:
        """Expert ``e``'s quantized ``[out, in]`` matrix."""
        return QTensor(self.codes[e], self.scales[e], None if self.zeros is None else self.zeros[e],
                       None if self.tensor_scale is None else self.tensor_scale[e],
                       (self.out_features, self.in_features), self.scheme)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[E, out, in]``: every expert's matrix as its family dequantizes it."""
        return torch.stack([self.expert(e).dequantize(dtype) for e in range(self.num_experts)])

    def pack(self) -> dict[str, torch.Tensor]:
        """Storage form: each expert's `QTensor.pack` parts, stacked along the expert axis."""
        parts = [self.expert(e).pack() for e in range(self.num_experts)]
        return {k: torch.stack([p[k] for p in parts]) for k in parts[0]}

    @classmethod
    def from_packed(cls, d: Mapping[str, torch.Tensor], count: int, shape: tuple[int, int],
                    scheme: Scheme) -> QuantStack:
        """Inverse of `pack` (every expert's parts checked by its family); a wrong expert count is a `CheckpointError`."""
        for k, t in d.items():
            if t.dim() == 0 or t.shape[0] != count:
                raise CheckpointError(f"stored part {k!r} holds {t.shape[0] if t.dim() else 0} experts, "
                                      f"the manifest says {count}")
        return cls([QTensor.from_packed({k: t[e] for k, t in d.items()}, shape, scheme) for e in range(count)])

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, in_features={self.in_features}, out_features={self.out_features}, "
                f"scheme={self.scheme.name}")


def expert_matrices(param: torch.Tensor, transposed: bool) -> torch.Tensor:
    """A fused experts parameter as its experts' ``[E, out, in]`` Linear matrices (a view)."""
    return param.transpose(1, 2) if transposed else param


class QuantExperts(nn.Module):
    """A fused experts module whose 3-D parameters are `QuantStack` s; runs the float module's own forward."""

    def __init__(self, experts: nn.Module, stacks: Mapping[str, QuantStack]) -> None:
        super().__init__()
        if isinstance(experts, QuantExperts):
            raise SchemeError("these experts are quantized already")
        transposed = bool(getattr(experts, "is_transposed", False))
        for name, stack in stacks.items():
            p = experts._parameters.get(name)
            if p is None or p.dim() != 3:
                raise SchemeError(f"{type(experts).__name__} has no 3-D experts parameter {name!r}")
            if tuple(expert_matrices(p, transposed).shape) != stack.shape:
                raise SchemeError(f"experts {name}: a quantized stack of {list(stack.shape)} cannot replace "
                                  f"the {list(p.shape)} parameter{' (stored transposed)' if transposed else ''}")
        self.transposed = transposed
        self.float_class = type(experts).__name__
        # calibration tokens per expert (routed / behind its statistics), from the method that quantized it
        self.calibration: dict | None = next((s.calibration for s in stacks.values() if s.calibration), None)
        for name in stacks:
            del experts._parameters[name]  # the float copy goes; each forward lends the module dequantized ones
        object.__setattr__(self, "_float", experts)  # not a child: its state is registered below, under its names
        for name, p in experts._parameters.items():
            self.register_parameter(name, p)
        for name, b in experts._buffers.items():
            self.register_buffer(name, b, persistent=name not in experts._non_persistent_buffers_set)
        for name, m in experts._modules.items():
            self.add_module(name, m)
        for name, stack in stacks.items():
            self.add_module(name, stack)

    @classmethod
    def from_float(cls, experts: nn.Module, schemes: Mapping[str, Scheme | str],
                   imp: Mapping[str, Sequence[torch.Tensor | None]] | None = None) -> QuantExperts:
        """Round-to-nearest of the parameters ``schemes`` names (each expert's matrix as a Linear's), in place.

        imp: parameter -> per-expert ``[in]`` importance (`QuantStack.from_float`); absent = uniform.
        """
        transposed = bool(getattr(experts, "is_transposed", False))
        stacks = {}
        for name, scheme in schemes.items():
            p = experts._parameters.get(name)
            if p is None or p.dim() != 3:
                raise SchemeError(f"{type(experts).__name__} has no 3-D experts parameter {name!r}")
            stacks[name] = QuantStack.from_float(expert_matrices(p.detach(), transposed), scheme, (imp or {}).get(name))
        return cls(experts, stacks)

    def stacks(self) -> dict[str, QuantStack]:
        return {n: m for n, m in self.named_children() if isinstance(m, QuantStack)}

    def quantized_shapes(self) -> dict[str, tuple[int, ...]]:
        """parameter -> the float parameter's shape (its layout): what the accounting counts as quantized."""
        return {n: (s.num_experts, s.in_features, s.out_features) if self.transposed else s.shape
                for n, s in self.stacks().items()}

    def float_weights(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """parameter -> its dequantized 3-D tensor in the float module's layout (dequantized in float32, then cast)."""
        out = {}
        for name, stack in self.stacks().items():
            w = stack.dequantize(torch.float32).to(dtype)
            out[name] = w.transpose(1, 2).contiguous() if self.transposed else w
        return out

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if any(st.input_scheme is not None for st in self.stacks().values()):
            return self._expert_loop(hidden_states, *args, **kwargs)
        inner = self._float
        for name in inner._parameters:  # .to() / .cuda() may have replaced ours: lend the current ones
            inner._parameters[name] = self._parameters[name]
        for name in inner._buffers:
            inner._buffers[name] = self._buffers[name]
        weights = self.float_weights(hidden_states.dtype)
        for name, w in weights.items():
            object.__setattr__(inner, name, w)
        try:
            return inner(hidden_states, *args, **kwargs)
        finally:
            for name in weights:
                inner.__dict__.pop(name, None)

    def _expert_loop(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The experts forward with each expert's inputs quantized by its own static scale (`routed_experts`)."""
        stacks = self.stacks()
        w = {n: st.dequantize(torch.float32).to(hidden_states.dtype) for n, st in stacks.items()}
        for n in ("gate_up_proj", "down_proj"):
            if n not in w:  # a parameter the plan left in float
                p = self._parameters[n]
                w[n] = p.transpose(1, 2) if self.transposed else p
        ident = _IdentityStack()
        quant = {n: stacks.get(n, ident).quantize_input for n in ("gate_up_proj", "down_proj")}
        bias = {n: getattr(self, f"{n}_bias", None) for n in ("gate_up_proj", "down_proj")}
        return routed_experts(self._float, w, bias, quant, hidden_states, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"float_class={self.float_class}, transposed={self.transposed}"


def routed_experts(inner: nn.Module, w: Mapping[str, torch.Tensor], bias: Mapping[str, torch.Tensor | None],
                   quant: Mapping[str, Callable[[int, torch.Tensor], torch.Tensor]], hidden_states: torch.Tensor,
                   *args: Any, **kwargs: Any) -> torch.Tensor:
    """The routed experts sum with each expert's two inputs passed through ``quant[param](expert, x)`` first.

    The float module's forward cannot quantize per expert (it sees one input for all of
    them), so the routed sum is written out here as the eager forward of transformers'
    experts computes it: per expert hit, its tokens, ``gate_up`` (+ bias), the module's
    activation (``_apply_gate`` for gpt-oss, else ``act_fn(gate) * up``), ``down`` (+ bias),
    times the router's weight, summed with ``index_add_``. ``w``: ``[E, out, in]`` matrices of
    ``gate_up_proj`` / ``down_proj``; ``inner``: the float module (its activation). Only
    gate_up_proj / down_proj experts get here (`lowbit.ptq.expert_calib` checks the module).
    One loop for the frozen `QuantExperts` and the module SignRound tunes, so the two agree bit for bit.
    """
    idx = args[0] if args else next(kwargs[k] for k in ("top_k_index", "router_indices") if k in kwargs)
    weights = args[1] if len(args) > 1 else next(kwargs[k] for k in ("top_k_weights", "routing_weights")
                                                 if k in kwargs)
    out = torch.zeros_like(hidden_states)
    gu_bias, d_bias = bias.get("gate_up_proj"), bias.get("down_proj")
    for e in torch.unique(idx[(idx >= 0) & (idx < w["down_proj"].shape[0])]).tolist():
        tok, pos = torch.where(idx == e)
        h = torch.nn.functional.linear(quant["gate_up_proj"](e, hidden_states[tok]), w["gate_up_proj"][e],
                                       None if gu_bias is None else gu_bias[e])
        if hasattr(inner, "_apply_gate"):
            a = inner._apply_gate(h)
        else:
            g, u = h.chunk(2, dim=-1)
            a = inner.act_fn(g) * u
        y = torch.nn.functional.linear(quant["down_proj"](e, a), w["down_proj"][e], None if d_bias is None else d_bias[e])
        out.index_add_(0, tok, (y * weights[tok, pos, None]).to(out.dtype))
    return out


class _IdentityStack:
    """Stands in for a parameter left in float: its inputs are not quantized."""

    @staticmethod
    def quantize_input(_e: int, x: torch.Tensor) -> torch.Tensor:
        return x


def quant_stacks(model: nn.Module) -> dict[str, QuantStack]:
    """Every `QuantStack` of a model by name (``...experts.gate_up_proj``: the name its plan entry has)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantStack)}
