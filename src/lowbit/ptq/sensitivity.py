"""DeltaLoss: how much each Linear's quantization with each candidate scheme costs the loss.

For a candidate scheme the whole model is quantized with it (RTN), the causal-LM loss
is back-propagated on a few calibration batches, and each layer is scored by the
first-order change of the loss between its FP and quantized weight:

* ``abs`` (default, as the reference code): ``sum |g (.) (W - Q(W))|``;
* ``signed`` (the paper's Taylor term): ``sum g (.) (Q(W) - W)`` with ``g`` taken at
  ``Q(W)``, i.e. the estimated loss increase, which may be negative.

Gradients are summed over the batches. Original weights are restored bit-exactly.

``dtype="bf16"`` runs the forward and backward under bf16 autocast. The scores only rank
layers against each other for the knapsack, so the products' precision matters little,
while the whole-model passes (the 49k-vocabulary head included) are most of a mixed
run's time; the weights, their gradients and the score sums stay fp32.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from lowbit.errors import ConfigError
from lowbit.formats import Scheme, qdq
from lowbit.formats.kquants import fit_width
from lowbit.models.placement import model_device

MODES = ("abs", "signed")
DTYPES = ("fp32", "bf16")


def delta_loss(model: nn.Module, layers: Iterable[str], schemes: Sequence[Scheme | str],
               batches: torch.Tensor, mode: str = "abs", batch_size: int = 4,
               progress: bool = True, dtype: str = "fp32") -> dict[str, dict[str, float]]:
    """Scores ``scheme name -> layer name -> DeltaLoss`` (lower = safer to quantize)."""
    if mode not in MODES:
        raise ConfigError(f"DeltaLoss mode must be one of {MODES}, got {mode!r}")
    if dtype not in DTYPES:
        raise ConfigError(f"DeltaLoss dtype must be one of {DTYPES}, got {dtype!r}")
    if batches.dim() != 2 or batches.shape[1] < 2:
        raise ConfigError("DeltaLoss needs token batches [n, seqlen >= 2]")
    names = list(layers)
    mods = {n: model.get_submodule(n) for n in names}
    _refuse_tied(model, mods)
    flags = [(p, p.requires_grad) for p in model.parameters()]
    originals = {n: m.weight.detach().clone() for n, m in mods.items()}
    out: dict[str, dict[str, float]] = {}
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        for s in tqdm([Scheme.parse(s) for s in schemes], desc="deltaloss", unit="scheme", disable=not progress):
            out[s.name] = _score_scheme(model, mods, originals, s, batches, mode, batch_size, dtype)
    finally:
        with torch.no_grad():
            for n, m in mods.items():
                m.weight.copy_(originals[n])
                m.weight.grad = None
        for p, flag in flags:
            p.requires_grad_(flag)
    return out


def _score_scheme(model: nn.Module, mods: dict[str, nn.Module], originals: dict[str, torch.Tensor],
                  scheme: Scheme, batches: torch.Tensor, mode: str, batch_size: int,
                  dtype: str = "fp32") -> dict[str, float]:
    with torch.no_grad():
        for n, m in mods.items():
            m.weight.copy_(qdq(originals[n], fit_width(scheme, originals[n].shape[1])))
    for m in mods.values():
        m.weight.requires_grad_(True)
        m.weight.grad = None
    device = model_device(model)
    for chunk in batches.split(batch_size):
        ids = chunk.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss.float() * (len(chunk) / len(batches))
        loss.backward()
    scores = {}
    with torch.no_grad():
        for n, m in mods.items():
            term = m.weight.grad * (m.weight - originals[n])  # g (.) (Q - W)
            scores[n] = float(term.abs().sum() if mode == "abs" else term.sum())
            m.weight.requires_grad_(False)
            m.weight.grad = None
    return scores


def _refuse_tied(model: nn.Module, mods: dict[str, nn.Module]) -> None:
    """A Linear sharing its weight with another module (tied lm_head) would corrupt it."""
    owners: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), name)
    for n, m in mods.items():
        owner = owners.get(id(m.weight), f"{n}.weight")
        if owner != f"{n}.weight":
            raise ConfigError(f"{n} shares its weight with {owner}; leave tied layers out of the "
                              "mixed-precision search (the lm_head is excluded by default)")
