"""DeltaLoss: how much each Linear's quantization with each candidate scheme costs the loss.

For a candidate scheme the whole model is quantized with it (RTN), the causal-LM loss
is back-propagated on a few calibration batches, and each layer is scored by the
first-order change of the loss between its FP and quantized weight:

* ``abs`` (default, as the reference code): ``sum |g (.) (W - Q(W))|``;
* ``signed`` (the paper's Taylor term): ``sum g (.) (Q(W) - W)`` with ``g`` taken at
  ``Q(W)``, i.e. the estimated loss increase, which may be negative.

Gradients are summed over the batches. Original weights are restored bit-exactly.

Options that quantize inputs (W4A4, W8A8 recipes) quantize the model's weights *and*
its Linear inputs, and score each layer by the activation term ``sum |g_Q (.) (x - Q(x))|``
with ``g_Q = dL/dQ(x)`` taken by a backward hook on the quantized input (a
straight-through copy of ``x``, so earlier layers still get gradients). As in the
reference implementation, when every option quantizes inputs the activation term is the
whole score (the weights then need no gradients at all); when some option is
weight-only, every option keeps the weight term and activation options add theirs, so
the scores stay comparable. Static input scales (NVFP4's tensor scale) are calibrated
on the same batches, on the float model, before any option is scored.

Fused mixture-of-experts tensors (``...mlp.experts.gate_up_proj``, `lowbit.models.experts`)
are scored like Linears: each expert's ``[out, in]`` matrix is quantized as RTN quantizes
it (`QuantStack.from_float`), and the tensor's score sums the weight term over all its
experts. One score per fused tensor, not per expert: a plan (and every target: GGUF's 3-D
``ffn_*_exps``, vLLM's per-layer MoE scheme) gives one recipe to all experts of a tensor,
so per-expert scores would only be summed again. Experts with no routed token have a zero
gradient and add nothing, which is their true first-order cost on these batches. Options
that quantize inputs (W4A4, W8A8) add each expert's activation term, as for a Linear: the
experts module runs the routed loop the quantized experts run (`routed_experts`), each expert's
two inputs (the hidden states it is routed, its own activation for ``down_proj``) quantized
straight-through with the term summed over experts; static input scales are one abs-max per
expert, calibrated on the float model with every token reaching every expert, as the experts
path calibrates them (`lowbit.ptq.expert_calib`).

``dtype="bf16"`` runs the forward and backward under bf16 autocast. The scores only rank
layers against each other for the knapsack, so the products' precision matters little,
while the whole-model passes (the 49k-vocabulary head included) are most of a mixed
run's time; the weights, their gradients and the score sums stay fp32.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from lowbit.errors import ConfigError
from lowbit.formats import Recipe, Scheme, qdq, qdq_input
from lowbit.formats.kquants import fit_width
from lowbit.formats.kv import KVScheme
from lowbit.models.activations import input_amax
from lowbit.models.experts import ExpertTensor, expert_tensors
from lowbit.models.placement import model_device
from lowbit.nn.quant_experts import expert_matrices, routed_experts
from lowbit.ptq.expert_calib import MIN_TOKENS, STAT_PARAMS, expert_stats
from lowbit.ptq.expert_calib import input_amax as expert_input_amax

MODES = ("abs", "signed")
DTYPES = ("fp32", "bf16")


def check_delta_args(mode: str, dtype: str, batches: torch.Tensor) -> None:
    """The arguments every DeltaLoss pass (whole-model or `lowbit.ptq.streamed_deltaloss`) refuses alike."""
    if mode not in MODES:
        raise ConfigError(f"DeltaLoss mode must be one of {MODES}, got {mode!r}")
    if dtype not in DTYPES:
        raise ConfigError(f"DeltaLoss dtype must be one of {DTYPES}, got {dtype!r}")
    if batches.dim() != 2 or batches.shape[1] < 2:
        raise ConfigError("DeltaLoss needs token batches [n, seqlen >= 2]")


def delta_loss(model: nn.Module, layers: Iterable[str], schemes: Sequence[Recipe | Scheme | str],
               batches: torch.Tensor, mode: str = "abs", batch_size: int = 4,
               progress: bool = True, dtype: str = "fp32") -> dict[str, dict[str, float]]:
    """Scores ``recipe name -> layer name -> DeltaLoss`` (lower = safer to quantize)."""
    check_delta_args(mode, dtype, batches)
    names = list(layers)
    tensors = weight_tensors(model, names)
    _refuse_tied(model, tensors)
    recipes = [Recipe.parse(s) for s in schemes]
    weight_term = any(r.input is None for r in recipes)
    static = any(r.needs_calibration for r in recipes)
    linears = [n for n in names if n not in tensors.experts]
    amax = input_amax(model, batches, linears, batch_size, progress) if static else {}
    if static:
        amax |= experts_input_amax(model, tensors, batches, batch_size)
    flags = [(p, p.requires_grad) for p in model.parameters()]
    originals = {n: w.detach().clone() for n, w in tensors.weights.items()}
    out: dict[str, dict[str, float]] = {}
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        # one tick per (scheme, batch): a scheme's pass over the batches is minutes on a CPU
        chunks = -(-len(batches) // batch_size)
        with tqdm(total=len(recipes) * chunks, desc="deltaloss", unit="batch", disable=not progress) as bar:
            for r in recipes:
                bar.set_postfix_str(r.name)
                out[r.name] = _score_scheme(model, tensors, originals, r, batches, mode, batch_size, dtype,
                                            weight_term=weight_term or r.input is None, amax=amax, bar=bar)
    finally:
        with torch.no_grad():
            for n, w in tensors.weights.items():
                w.copy_(originals[n])
                w.grad = None
        for p, flag in flags:
            p.requires_grad_(flag)
    return out


@dataclass(frozen=True)
class WeightTensors:
    """The scored weights by plan name: Linears' ``weight`` and fused experts' 3-D parameters (``experts``)."""

    weights: dict[str, nn.Parameter]
    experts: dict[str, ExpertTensor]

    def qdq(self, name: str, w: torch.Tensor, recipe: Recipe) -> torch.Tensor:
        """``w`` quantized and dequantized as ``name``'s quantizer would (each expert's matrix on its own)."""
        t = self.experts.get(name)
        if t is None:
            return qdq(w, fit_width(recipe.weight, w.shape[1]))
        scheme = fit_width(recipe.weight, t.in_features)
        mats = w.transpose(1, 2) if t.transposed else w
        out = torch.stack([qdq(m, scheme) for m in mats])
        return out.transpose(1, 2) if t.transposed else out


def weight_tensors(model: nn.Module, names: Iterable[str]) -> WeightTensors:
    """Each planned name's weight parameter (an experts tensor's 3-D parameter, a Linear's ``weight``)."""
    experts = expert_tensors(model)
    weights, found = {}, {}
    for n in names:
        if n in experts:
            t = found[n] = experts[n]
            weights[n] = model.get_submodule(t.module).get_parameter(t.param)
        else:
            weights[n] = model.get_submodule(n).weight
    return WeightTensors(weights, found)


def _score_scheme(model: nn.Module, tensors: WeightTensors, originals: dict[str, torch.Tensor],
                  recipe: Recipe, batches: torch.Tensor, mode: str, batch_size: int,
                  dtype: str = "fp32", weight_term: bool = True,
                  amax: dict[str, torch.Tensor] | None = None, bar: tqdm | None = None) -> dict[str, float]:
    weights = tensors.weights
    quantize_weights(tensors, originals, recipe)
    for w in weights.values():
        w.requires_grad_(weight_term)
        w.grad = None
    acts = {n: torch.zeros((), dtype=torch.float64) for n in weights}
    handles = input_hooks(model, tensors, recipe, amax or {}, mode, acts)
    device = model_device(model)
    try:
        for chunk in batches.split(batch_size):
            ids = chunk.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss.float() * (len(chunk) / len(batches))
            loss.backward()
            if bar is not None:
                bar.update()
    finally:
        for h in handles:
            h.remove()
    scores = weight_scores(tensors, originals, acts, weight_term, mode)
    for w in weights.values():
        w.requires_grad_(False)
        w.grad = None
    return scores


def quantize_weights(tensors: WeightTensors, originals: dict[str, torch.Tensor], recipe: Recipe) -> None:
    """Each scored weight replaced, in place, by its ``recipe`` quantization of the original (`WeightTensors.qdq`)."""
    with torch.no_grad():
        for n, w in tensors.weights.items():
            w.copy_(tensors.qdq(n, originals[n], recipe))


def input_hooks(root: nn.Module, tensors: WeightTensors, recipe: Recipe, amax: dict[str, torch.Tensor], mode: str,
                acts: dict[str, torch.Tensor]) -> list[Any]:
    """For a recipe that quantizes inputs: each scored layer's inputs (each expert's, for fused experts) quantized
    straight-through under ``root``, their activation term summed into ``acts``; the handles to remove."""
    if recipe.input is None:
        return []
    handles: list[Any] = [root.get_submodule(n).register_forward_pre_hook(_input_term(n, recipe, amax.get(n), mode,
                                                                                      acts))
                          for n in tensors.weights if n not in tensors.experts]
    return handles + _expert_input_terms(root, tensors, recipe, amax, mode, acts)


def weight_scores(tensors: WeightTensors, originals: dict[str, torch.Tensor], acts: dict[str, torch.Tensor],
                  weight_term: bool, mode: str) -> dict[str, float]:
    """Each scored weight's DeltaLoss once its gradients are in: the activation term plus, with ``weight_term``,
    ``g (.) (Q - W)`` summed (``abs``: of its absolute values)."""
    scores = {}
    with torch.no_grad():
        for n, w in tensors.weights.items():
            total = float(acts[n])
            if weight_term and w.grad is not None:  # no gradient: nothing on these batches reached it
                term = w.grad * (w - originals[n])  # g (.) (Q - W)
                total += float(term.abs().sum() if mode == "abs" else term.sum())
            scores[n] = total
    return scores


def _input_term(name: str, recipe: Recipe, amax: torch.Tensor | None, mode: str, acc: dict[str, torch.Tensor]):
    """Forward pre-hook: feed the layer ``Q(x)`` (straight-through) and, on backward, add
    ``g (.) (Q(x) - x)`` summed (abs or signed) to ``acc[name]``."""

    def hook(_mod: nn.Module, args: tuple):
        return (_scored_input(args[0], recipe, amax, name, mode, acc), *args[1:])

    return hook


def _scored_input(x: torch.Tensor, recipe: Recipe, amax: torch.Tensor | None, name: str, mode: str,
                  acc: dict[str, torch.Tensor]) -> torch.Tensor:
    """``Q(x)`` straight-through; on backward ``g (.) (Q(x) - x)`` summed (abs or signed) goes to ``acc[name]``."""
    if not x.requires_grad:  # nothing upstream needs gradients: a leaf is enough
        x = x.detach().requires_grad_(True)
    with torch.no_grad():
        q = qdq_input(x, recipe.input, amax)  # type: ignore[arg-type]
        # kept until backward for every layer: bf16 halves that memory (the scores only rank layers)
        diff = (q - x).to(torch.bfloat16)
    y = x + (q - x).detach()

    def grad_hook(g: torch.Tensor) -> None:
        term = g.float() * diff.float()
        acc[name] += (term.abs().sum() if mode == "abs" else term.sum()).double().cpu()

    y.register_hook(grad_hook)
    return y


def _by_module(tensors: WeightTensors) -> dict[str, dict[str, str]]:
    """Experts module -> {its scored parameter -> plan name}."""
    out: dict[str, dict[str, str]] = {}
    for n, t in tensors.experts.items():
        out.setdefault(t.module, {})[t.param] = n
    return out


def experts_input_amax(model: nn.Module, tensors: WeightTensors, batches: torch.Tensor, batch_size: int
                       ) -> dict[str, torch.Tensor]:
    """Plan name -> ``[E]`` static input abs-max of each expert of each scored experts tensor, from the float
    model's forward over ``batches`` with every token reaching every expert (the experts path's calibration)."""
    by_module = _by_module(tensors)
    if not by_module:
        return {}
    modules = {m: model.get_submodule(m) for m in by_module}
    device = model_device(model)
    with torch.no_grad(), expert_stats(modules, ("absmax",)) as stats:
        for chunk in batches.split(batch_size):
            model(input_ids=chunk.to(device), use_cache=False)
    return {n: expert_input_amax(stats[m], p, MIN_TOKENS) for m, ps in by_module.items() for p, n in ps.items()}


class _Restore:
    """Undoes `_expert_input_terms`' forward override (the ``remove`` of a hook handle)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


def _expert_input_terms(model: nn.Module, tensors: WeightTensors, recipe: Recipe, amax: dict[str, torch.Tensor],
                        mode: str, acc: dict[str, torch.Tensor]) -> list[_Restore]:
    """Run each scored experts module as the routed per-expert loop, each planned parameter's per-expert inputs
    quantized straight-through and scored (`_scored_input`); an unplanned parameter's inputs stay float."""
    out = []
    for mname, params in _by_module(tensors).items():
        mod = model.get_submodule(mname)

        def quant(param: str, e: int, x: torch.Tensor, params=params) -> torch.Tensor:
            name = params.get(param)
            if name is None:
                return x
            a = amax.get(name)
            return _scored_input(x, recipe, None if a is None else a[e], name, mode, acc)

        def forward(hidden_states: torch.Tensor, *args, _mod=mod, _quant=quant, **kwargs):
            transposed = bool(getattr(_mod, "is_transposed", False))
            w = {p: expert_matrices(getattr(_mod, p), transposed) for p in STAT_PARAMS}
            bias = {p: getattr(_mod, f"{p}_bias", None) for p in STAT_PARAMS}
            fns = {p: (lambda e, x, p=p: _quant(p, e, x)) for p in STAT_PARAMS}
            return routed_experts(_mod, w, bias, fns, hidden_states, *args, **kwargs)

        mod.forward = forward  # an instance attribute: `_Restore` drops it, the class's forward is back
        out.append(_Restore(mod))
    return out


def _refuse_tied(model: nn.Module, tensors: WeightTensors) -> None:
    """A Linear sharing its weight with another module (tied lm_head) would corrupt it."""
    owners: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), name)
    for n, w in tensors.weights.items():
        own = n if n in tensors.experts else f"{n}.weight"
        owner = owners.get(id(w), own)
        if owner != own:
            raise ConfigError(f"{n} shares its weight with {owner}; leave tied layers out of the "
                              "mixed-precision search (the lm_head is excluded by default)")


# ------------------------------------------------------------------ the KV cache's term
def kv_delta_loss(model: nn.Module, schemes: Sequence[KVScheme | str], batches: torch.Tensor, mode: str = "abs",
                  batch_size: int = 4, progress: bool = True, dtype: str = "fp32") -> dict[str, dict[str, float]]:
    """Scores ``KV scheme name -> attention name -> DeltaLoss`` of quantizing that attention's cache.

    The activation term of the inputs, applied to what the cache holds: each scheme is installed
    on every attention (static scales calibrated on the same batches), the causal-LM loss is
    back-propagated, and each attention is scored by ``sum |g (.) (Q(x) - x)|`` over its keys and
    values (`lowbit.nn.kv_quant.KVScore`; ``signed`` without the abs), ``g`` the gradient at
    the quantized keys / values it attends over. The weights stay as they are (float or
    already quantized) and get no gradient; the model leaves with no KV scheme installed.
    """
    from lowbit.nn.kv_quant import STATE, KVScore, calibrate_kv, remove_kv

    if mode not in MODES:
        raise ConfigError(f"DeltaLoss mode must be one of {MODES}, got {mode!r}")
    if batches.dim() != 2 or batches.shape[1] < 2:
        raise ConfigError("DeltaLoss needs token batches [n, seqlen >= 2]")
    kvs = list(dict.fromkeys(KVScheme.parse(s) for s in schemes))
    flags = [(p, p.requires_grad) for p in model.parameters()]
    device = model_device(model)
    out: dict[str, dict[str, float]] = {}
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        chunks = batches.split(batch_size)
        with tqdm(total=len(kvs) * len(chunks), desc="deltaloss kv", unit="batch", disable=not progress) as bar:
            for kv in kvs:
                attns = calibrate_kv(model, batches if kv.needs_calibration else None, kv)
                for a in attns.values():
                    getattr(a, STATE).score = KVScore(mode)
                for chunk in chunks:
                    ids = chunk.to(device)
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                        loss = model(input_ids=ids, labels=ids, use_cache=False).loss.float()
                    (loss * (len(chunk) / len(batches))).backward()
                    bar.update()
                out[kv.name] = {n: float(getattr(a, STATE).score.total) for n, a in attns.items()}
    finally:
        remove_kv(model)
        for p, flag in flags:
            p.requires_grad_(flag)
    return out
