"""Calibration statistics of fused mixture-of-experts experts, per expert, and how many tokens reached each.

A Linear's statistics are sums over the tokens that reach it (`lowbit.models.activations`);
an expert is reached only by the tokens its router sends it, so a calibration set of a
few thousand tokens leaves some experts of a 128-expert layer with a handful of tokens,
or none. `ExpertStats` hooks an experts module (the ``...Experts`` module transformers 5
fuses, `lowbit.models.experts`) and, for every forward, reads what the block hands it
(hidden states ``[T, H]`` and the router's top-k indices ``[T, k]``) and accumulates, per
expert ``e``:

* ``routed[e]``: tokens the router sent to ``e`` (always recorded: the coverage report);
* the statistics of ``e``'s two matrices' inputs: for ``gate_up_proj`` the hidden states,
  for ``down_proj`` the expert's own activation ``act(x W_gu[e]^T (+ b))`` (gate/up split
  or interleaved as the module's forward does; gpt-oss's clamped GLU via its
  ``_apply_gate``), as ``sumsq [E, in]`` (RTN's importance) and/or ``xtx [E, in, in]``
  (GPTQ's Hessians);
* ``seen[e]``: the tokens those statistics came from.

Router-weighted (affinity-weighted) statistics (``affinity=True``): the experts module's
output is ``sum_e g_{t,e} * expert_e(x_t)`` over the token's top-k, ``g`` the routing weights
the block hands the experts forward (every transformers 5 experts module multiplies its
expert's output, after ``down_proj`` and its bias, by them; Qwen3-MoE's are the top-k
softmax renormalised to sum to 1). So an error ``dW`` in expert ``e``'s ``down_proj`` reaches
the block output as ``g_{t,e} dW a_t`` and the layer-wise loss is ``sum_t g_{t,e}^2 ||dW a_t||^2``:
the Hessian ``sum_t g_{t,e}^2 a_t a_t^T`` over the routed tokens, zero weight for the others.
For ``gate_up_proj`` the error passes through the activation and ``down_proj`` before ``g``;
GPTQ already takes each matrix's own output error as its loss (the downstream Jacobian
``W_down diag(act')`` treated as the identity, as for every Linear feeding a nonlinearity),
and keeping that approximation leaves ``g_{t,e}^2`` as the token's weight there too. Those
weighted sums (``sum_t g^2 x_t x_t^T``, ``sum_t g^2 x_t^2``) are kept beside the plain ones,
and `ExpertStats.weighted` mixes them (`affinity_mix`).

All-experts mode (``all_experts=True``, the default of every method that reads
statistics): every token's statistics go to every expert, as if each expert were routed
all of them (llm-compressor's ``moe_calibrate_all_experts`` does the same), while the
block's output is untouched: the hook only reads, the module's own forward still adds
only the routed, router-weighted experts. Its cost is the statistics of ``E / k`` times
the routed tokens (an extra ``x W_gu[e]^T`` per expert and token for the down inputs),
measured in ``benchmarks/moe.py``. Off, each expert's statistics come from its routed
tokens only: the statistics of the tokens it will really see at inference.

Starved experts: an expert whose statistics came from fewer than ``min_tokens`` tokens
(possible only with all-experts mode off, or with fewer calibration tokens than the
threshold) gets the documented fallback of the method (RTN's search with uniform
importance, i.e. on its weights alone; GPTQ: that RTN instead of a Hessian-less GPTQ) and
`warn_starved` names them. Never a NaN or unit scale: the fallback's scales come from
the weights.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from lowbit.errors import ConfigError
from lowbit.formats.inputs import InputScheme, qdq_input

WEIGHTED = "affinity:"  # prefix of the router-weighted sums' kinds in `ExpertStats.sums`
ExpertInput = tuple[InputScheme, "torch.Tensor | None"]  # an experts tensor's input scheme, [E] static abs-max or None
InputFn = Callable[[int, torch.Tensor], torch.Tensor]  # (expert, its input) -> the input as its recipe quantizes it
MIN_TOKENS = 16  # default threshold: an expert with statistics from fewer tokens gets the fallback
STAT_PARAMS = ("gate_up_proj", "down_proj")  # the fused parameters whose inputs are known (see module doc)
ALL_EXPERTS_HELP = ("mixture-of-experts calibration: every token's statistics also reach every expert (the block's "
                    "output still uses the router's top-k); off = each expert's statistics from its routed tokens only")
MIN_TOKENS_HELP = ("experts whose statistics come from fewer calibration tokens than this get RTN on their weights "
                   "alone (uniform importance), with a warning naming them")
AFFINITY_FLOOR = 0.1  # the unweighted statistics' share in router-weighted expert statistics (`affinity_mix`)
# one flag for GPTQ's Hessians and RTN's --expert-importance (`lowbit.ptq.methods.method_flags` wants one help text)
AFFINITY_HELP = ("router-weighted expert statistics (GPTQ's Hessians; RTN's with --expert-importance): each "
                 "calibration token counts its routing weight squared in the experts the router picked for it (0 in "
                 "the others), plus --affinity-floor of every token's statistics")
AFFINITY_FLOOR_HELP = ("with --expert-affinity: the unweighted statistics' share, as a fraction of the router-weighted "
                       "ones' energy (trace)")



def check_affinity(expert_affinity: bool, affinity_floor: float, stats: str) -> None:
    """The settings of the router weighting that GPTQ and RTN share (``stats``: what each weights, for the message):
    a finite floor >= 0, and no floor set while the weighting is off."""
    if not (0 <= affinity_floor < float("inf")):
        raise ConfigError(f"affinity_floor must be a finite number >= 0, got {affinity_floor}")
    if affinity_floor != AFFINITY_FLOOR and not expert_affinity:
        raise ConfigError(f"--affinity-floor sets the floor of the router-weighted expert {stats}, which "
                          "--no-expert-affinity turns off: drop one of them")

@dataclass(frozen=True)
class Coverage:
    """Calibration tokens of one experts module: routed to each expert, and behind each expert's statistics."""

    module: str
    routed: tuple[int, ...]
    seen: tuple[int, ...]
    all_experts: bool

    def starved(self, min_tokens: int) -> list[int]:
        """Experts whose statistics came from fewer than ``min_tokens`` tokens."""
        return [e for e, n in enumerate(self.seen) if n < min_tokens]

    def to_dict(self) -> dict[str, Any]:
        return {"routed": list(self.routed), "statistics_tokens": list(self.seen), "all_experts": self.all_experts}


def check_stat_experts(module: nn.Module, name: str) -> None:
    """Refuse an experts module whose parameters' inputs this module cannot compute (one line naming them)."""
    params = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
    odd = [n for n in params if n not in STAT_PARAMS]
    if odd or "gate_up_proj" not in params:
        raise ConfigError(f"{name} ({type(module).__name__}) holds experts parameters {params}; per-expert "
                          f"calibration statistics know {list(STAT_PARAMS)} only; use --method rtn --no-search "
                          "for these experts, or --keep them in float")


def _matrices(module: nn.Module, param: str) -> torch.Tensor:
    """``[E, out, in]`` view of a fused parameter (gpt-oss stores ``[E, in, out]``)."""
    p = getattr(module, param)
    return p.transpose(1, 2) if getattr(module, "is_transposed", False) else p


def expert_activation(module: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s down-projection input for tokens ``x [T, H]``, computed as the module's forward does."""
    w = _matrices(module, "gate_up_proj")[e]
    h = F.linear(x, w.to(x.dtype))
    bias = getattr(module, "gate_up_proj_bias", None)
    if bias is not None:
        h = h + bias[e].to(h.dtype)
    if hasattr(module, "_apply_gate"):  # gpt-oss: interleaved gate/up, clamped GLU
        return module._apply_gate(h)
    gate, up = h.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def routing_args(args: tuple, kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states, top-k indices) from an experts forward's arguments (every transformers 5 signature)."""
    x = args[0] if args else kwargs["hidden_states"]
    idx = args[1] if len(args) > 1 else next(kwargs[k] for k in ("top_k_index", "router_indices") if k in kwargs)
    return x, idx


def routing_weights(args: tuple, kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The top-k routing weights ``[..., k]`` an experts forward multiplies its experts' outputs by (its third
    argument in every transformers 5 signature: ``top_k_weights`` / ``routing_weights``), or None if absent."""
    if len(args) > 2:
        return args[2]
    return next((kwargs[k] for k in ("top_k_weights", "routing_weights") if kwargs.get(k) is not None), None)


def affinity_mix(plain: torch.Tensor, weighted: torch.Tensor, routed: torch.Tensor, floor: float,
                 min_tokens: int) -> torch.Tensor:
    """Each expert's router-weighted statistics with a floor of its plain ones: ``weighted[e] + c_e * plain[e]``.

    plain / weighted: ``[E, in, in]`` (Hessians) or ``[E, in]`` (squared sums), the unweighted sums of
    the mode (every token in all-experts calibration, else the routed ones) and the ``g^2``-weighted sums of
    the routed tokens. ``c_e = floor * mass(weighted[e]) / mass(plain[e])`` (mass: the trace, or the sum),
    i.e. every token gets weight ``g^2`` (0 when not routed) plus the same small constant, chosen so the
    constant's part carries ``floor`` times the routed part's energy. Why a floor: the weighted loss gives a
    non-routed token zero weight, but calibration is a finite sample of what the router will send the
    expert at inference; a share of every token's statistics keeps the directions routed tokens barely
    visited from looking free (it acts as a data-shaped dampening, in place of GPTQ's identity one), and it
    fixes the mix independent of ``E / k``. An expert the router sent fewer than ``min_tokens`` tokens keeps
    its plain statistics (what it had without the weighting).
    """
    out = plain.clone()
    for e in range(plain.shape[0]):
        mp, mw = _mass(plain[e]), _mass(weighted[e])
        if int(routed[e]) < min_tokens or mp <= 0 or mw <= 0:
            continue
        out[e] = weighted[e] + (floor * mw / mp) * plain[e]
    return out


def _mass(t: torch.Tensor) -> float:
    return float(t.diagonal().sum() if t.dim() == 2 else t.sum())


class ExpertStats:
    """Per-expert statistics of one experts module (see the module doc); a context manager that hooks it.

    kinds: ``"sumsq"``, ``"xtx"`` and/or ``"absmax"`` (none: token counts only). params: the
    fused parameters whose inputs to accumulate (``gate_up_proj``, ``down_proj``). The sums are float64 on ``device``
    (default: the module's). quantizers: parameter -> ``(expert, x) -> x`` as the recipe quantizes that matrix's
    inputs (`QuantStack.quantize_input`): the statistics are then those of the inputs the quantized expert will
    see (its activation computed from the quantized hidden states), as a Linear's Hessian behind its
    `InputQuantizer` is. affinity: also accumulate the ``sumsq`` / ``xtx`` kinds over the routed tokens weighted
    by their routing weight squared (module doc; `weighted` reads them).
    """

    def __init__(self, module: nn.Module, name: str, kinds: tuple[str, ...] = ("sumsq",),
                 params: tuple[str, ...] = STAT_PARAMS, all_experts: bool = True,
                 device: torch.device | None = None, quantizers: Mapping[str, InputFn] | None = None,
                 affinity: bool = False) -> None:
        check_stat_experts(module, name)
        self.module, self.name, self.kinds, self.params = module, name, kinds, params
        self.all_experts, self.affinity = all_experts, affinity
        self.quantizers = dict(quantizers or {})
        w = _matrices(module, "gate_up_proj")
        self.count = w.shape[0]
        self.device = device or w.device
        self.routed = torch.zeros(self.count, dtype=torch.int64)
        self.seen = torch.zeros(self.count, dtype=torch.int64)
        self.sums: dict[tuple[str, str], torch.Tensor] = {}
        self._handle: Any = None

    def __enter__(self) -> ExpertStats:
        self._handle = self.module.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()

    def _hook(self, _m: nn.Module, args: tuple, kwargs: dict) -> None:
        x, idx = routing_args(args, kwargs)
        tokens = x.shape[:-1].numel()
        g = None
        if self.affinity:
            g = routing_weights(args, kwargs)
            if g is None:
                raise ConfigError(f"{self.name} ({type(self.module).__name__}) was called without routing weights, "
                                  "so its router-weighted statistics cannot be taken; pass --no-expert-affinity (plain "
                                  "Hessians)")
            g = g.detach().reshape(tokens, -1)
        with torch.no_grad():
            self.add(x.detach().reshape(-1, x.shape[-1]), idx.detach().reshape(tokens, -1), g)

    def add(self, x: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor | None = None) -> None:
        """Accumulate one batch: tokens ``x [T, H]`` routed to experts ``idx [T, k]`` with weights ``gate [T, k]``
        (needed with ``affinity``)."""
        if self.affinity and gate is None:
            raise ConfigError(f"{self.name}: router-weighted statistics need the routing weights of each batch")
        valid = idx[(idx >= 0) & (idx < self.count)]  # an expert-parallel sentinel (index E) is no expert
        self.routed += torch.bincount(valid.reshape(-1).cpu(), minlength=self.count)[:self.count]
        for e in range(self.count):
            hit = (idx == e).any(dim=-1)
            xe = x if self.all_experts else x[hit]
            if xe.shape[0] == 0:
                continue
            self.seen[e] += xe.shape[0]
            if not self.kinds:  # token counts only: no expert's activation to compute
                continue
            inputs = {"gate_up_proj": self._quantized("gate_up_proj", e, xe)}
            if "down_proj" in self.params:
                inputs["down_proj"] = self._quantized("down_proj", e,
                                                      expert_activation(self.module, e, inputs["gate_up_proj"]))
            for param in self.params:
                self._accumulate(param, e, inputs[param].float())
            if self.affinity and bool(hit.any()):
                w = (gate.float() * (idx == e)).sum(-1)  # type: ignore[union-attr]  # g_{t,e}, 0 if not routed
                rows = hit if self.all_experts else slice(None)  # the routed tokens among those of xe
                w2 = w[hit].pow(2)
                for param in self.params:
                    self._accumulate(param, e, inputs[param][rows].float(), w2)

    def _quantized(self, param: str, e: int, x: torch.Tensor) -> torch.Tensor:
        q = self.quantizers.get(param)
        return x if q is None else q(e, x)

    def _accumulate(self, param: str, e: int, x: torch.Tensor, w2: torch.Tensor | None = None) -> None:
        """Add expert ``e``'s inputs ``x [T, in]`` to its sums; with ``w2 [T]`` to the weighted sums instead."""
        n = x.shape[-1]
        for kind in self.kinds:
            if w2 is not None and kind == "absmax":
                continue
            key = (kind if w2 is None else WEIGHTED + kind, param)
            if key not in self.sums:
                self.sums[key] = torch.zeros(_shape(kind, self.count, n), dtype=torch.float64, device=self.device)
            if kind == "absmax":
                self.sums[key][e] = torch.maximum(self.sums[key][e], x.abs().amax().to(self.sums[key]))
                continue
            if w2 is None:
                part = x.pow(2).sum(0) if kind == "sumsq" else x.T @ x  # float32 product, float64 sum (as Linears)
            else:
                xw = x * w2[:, None]
                part = (xw * x).sum(0) if kind == "sumsq" else xw.T @ x
            self.sums[key][e] += part.to(self.sums[key])

    def result(self, kind: str, param: str) -> torch.Tensor:
        """``[E, in]`` (sumsq), ``[E, in, in]`` (xtx) float64 sums, or ``[E]`` abs-max of the input (absmax);
        zeros for an expert no token reached."""
        if (kind, param) not in self.sums:
            n = _matrices(self.module, param).shape[-1]
            return torch.zeros(_shape(kind, self.count, n), dtype=torch.float64, device=self.device)
        return self.sums[(kind, param)]

    def weighted(self, kind: str, param: str, floor: float, min_tokens: int) -> torch.Tensor:
        """The router-weighted ``sumsq`` / ``xtx`` of ``param`` with a ``floor`` of the plain ones (`affinity_mix`;
        an expert routed fewer than ``min_tokens`` tokens keeps the plain ones)."""
        if not self.affinity or kind not in ("sumsq", "xtx"):
            raise ValueError(f"{self.name}: no router-weighted {kind} (affinity={self.affinity})")
        plain = self.result(kind, param)
        w = self.sums.get((WEIGHTED + kind, param), torch.zeros_like(plain))
        return affinity_mix(plain, w, self.routed, floor, min_tokens)

    def coverage(self) -> Coverage:
        return Coverage(self.name, tuple(self.routed.tolist()), tuple(self.seen.tolist()), self.all_experts)

    def reduce(self, fn: Callable[[torch.Tensor, str], torch.Tensor]) -> None:
        """Combine with the other processes' statistics: ``fn(tensor, "sum" | "max")`` reduces one over the ranks
        (counts and sums summed, abs-max maxed), so every rank derives the same scales."""
        self.routed, self.seen = fn(self.routed, "sum"), fn(self.seen, "sum")
        self.sums = {k: fn(v, "max" if k[0] == "absmax" else "sum") for k, v in self.sums.items()}


def _shape(kind: str, count: int, n: int) -> tuple[int, ...]:
    return {"absmax": (count,), "sumsq": (count, n), "xtx": (count, n, n)}[kind]


def input_amax(stats: ExpertStats, param: str, min_tokens: int) -> torch.Tensor:
    """``[E]`` static input abs-max of each expert's ``param``; starved experts (fewer than ``min_tokens``
    statistics tokens) take the largest of the others' (the layer's range: a scale no token of theirs was seen to
    exceed, never a unit or zero one)."""
    amax = stats.result("absmax", param).float().clone()
    low = stats.coverage().starved(min_tokens)
    fed = [e for e in range(stats.count) if e not in low and amax[e] > 0]
    if not fed:
        raise ConfigError(f"{stats.name}: no expert got {min_tokens} calibration tokens to calibrate the static input "
                          f"scales of {param}; pass more calibration tokens (--nsamples) or all-experts calibration")
    amax[low] = amax[fed].max()
    return amax


def input_fn(scheme: InputScheme, amax: torch.Tensor | None) -> InputFn:
    """``(expert, x) -> x`` quantized as `QuantStack.quantize_input` does with ``scheme`` and per-expert ``amax [E]``."""
    return lambda e, x: qdq_input(x, scheme, None if amax is None else amax[e])


def static_input_amax(stats: Mapping[str, ExpertStats], params: Mapping[str, tuple[str, ...]], min_tokens: int
                      ) -> dict[str, torch.Tensor]:
    """``module.param`` -> ``[E]`` static input abs-max (`input_amax`) of each named parameter of each module's stats.

    params: experts module (the key of ``stats``) -> its parameters whose recipe has a static input scale.
    """
    return {f"{m}.{p}": input_amax(stats[m], p, min_tokens) for m, ps in params.items() for p in ps}


@contextlib.contextmanager
def expert_stats(modules: Mapping[str, nn.Module], kinds: tuple[str, ...] = ("sumsq",),
                 params: tuple[str, ...] = STAT_PARAMS, all_experts: bool = True,
                 affinity: bool = False) -> Iterator[dict[str, ExpertStats]]:
    """`ExpertStats` hooked on each named experts module for the forwards run inside the ``with`` (``affinity``:
    the router-weighted sums too)."""
    stats = {n: ExpertStats(m, n, kinds, params, all_experts, affinity=affinity) for n, m in modules.items()}
    with contextlib.ExitStack() as stack:
        for s in stats.values():
            stack.enter_context(s)
        yield stats


def warn_starved(coverage: list[Coverage], min_tokens: int, fallback: str) -> dict[str, list[int]]:
    """Warn (once, naming every one) about experts whose statistics came from fewer than ``min_tokens`` tokens.

    fallback: what they got instead (said in the warning). Returns module -> starved experts.
    """
    starved = {c.module: c.starved(min_tokens) for c in coverage}
    starved = {m: s for m, s in starved.items() if s}
    if starved:
        seen = {c.module: c.seen for c in coverage}
        listing = "; ".join(f"{m}: experts {s} ({', '.join(str(seen[m][e]) for e in s)} tokens)"
                            for m, s in starved.items())
        mode = "with" if all(c.all_experts for c in coverage) else "without"
        warnings.warn(f"{sum(len(s) for s in starved.values())} expert(s) got fewer than {min_tokens} calibration "
                      f"tokens ({mode} all-experts calibration) and were quantized by {fallback}: {listing}. More "
                      "calibration tokens (--nsamples), or all-experts calibration, reach them", stacklevel=2)
    return starved


def warn_unrouted(coverage: list[Coverage], min_tokens: int) -> None:
    """With all-experts calibration every expert has statistics; still say which the router itself starves."""
    low = {c.module: [e for e, n in enumerate(c.routed) if n < min_tokens] for c in coverage if c.all_experts}
    low = {m: s for m, s in low.items() if s}
    if low:
        listing = "; ".join(f"{m}: experts {s}" for m, s in low.items())
        warnings.warn(f"the router sent fewer than {min_tokens} calibration tokens to {sum(map(len, low.values()))} "
                      f"expert(s) (their statistics come from all-experts calibration): {listing}", stacklevel=2)
