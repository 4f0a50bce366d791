"""The block-size study: weight error (and perplexity) of FP4 schemes vs block size.

"Finer is Better (with the Right Scaling)" observes that with abs-max scaling and E4M3
block scales, smaller blocks can make a model *worse*; with the underflow guard and a
better scale rule (4-over-6, brute force) or wider UE5M3 scales, finer is better again.
This module measures that on any set of Linear weights: for every scheme and block size
the relative weight error ``sum (w_hat - w)^2 / sum w^2`` over all weights together,
and, given a model and eval tokens, the model's perplexity with those weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from lowbit.formats import Scheme, qdq

DEFAULT_BLOCKS = (8, 16, 32, 64)
DEFAULT_SCHEMES = ("nvfp4", "nvfp4:guard=1", "nvfp4-46", "nvfp4-46:rule=span", "nvfp4-46:rule=brute",
                   "nvfp4-ue5m3")


@dataclass(frozen=True)
class StudyRow:
    """One point of the study: ``label`` names the line, ``scheme`` the exact format."""

    label: str
    scheme: str
    block: int
    rule: str
    rel_error: float
    seconds: float
    ppl: float | None = None
    underflow: float | None = None  # inputs mode: share of non-zero blocks whose E4M3 scale rounds to 0

    def to_dict(self) -> dict:
        return asdict(self)


def weight_error(weights: Mapping[str, torch.Tensor], scheme: Scheme) -> float:
    """Relative squared error summed over all weights (large layers weigh more, as in a model)."""
    num = den = 0.0
    for w in weights.values():
        d = (qdq(w, scheme) - w).flatten().double()
        num += float(d @ d)
        w64 = w.flatten().double()
        den += float(w64 @ w64)
    return num / den if den > 0 else 0.0


def _grid(schemes: Iterable[str | Scheme], blocks: Iterable[int]) -> list[tuple[str, Scheme, int]]:
    out = []
    for text in schemes:
        base = Scheme.parse(text)
        label = text if isinstance(text, str) else base.name
        out += [(label, base.replace(group_size=b), b) for b in blocks]
    return out


def block_size_study(weights: Mapping[str, torch.Tensor], schemes: Iterable[str | Scheme] = DEFAULT_SCHEMES,
                     blocks: Iterable[int] = DEFAULT_BLOCKS,
                     ppl_fn: Callable[[Scheme], float] | None = None, progress: bool = True) -> list[StudyRow]:
    """Rows for every (scheme, block size); ``ppl_fn(scheme)`` adds a perplexity when given."""
    points = _grid(schemes, tuple(blocks))
    rows = []
    for label, s, b in tqdm(points, desc="formats", disable=not progress, unit="point"):
        t0 = time.perf_counter()
        err = weight_error(weights, s)
        secs = time.perf_counter() - t0
        ppl = ppl_fn(s) if ppl_fn is not None else None
        rows.append(StudyRow(label, s.name, b, s.rule, err, round(secs, 3), ppl))
    return rows


def model_block_study(model: nn.Module, schemes: Iterable[str | Scheme] = DEFAULT_SCHEMES,
                      blocks: Iterable[int] = DEFAULT_BLOCKS, tokens: torch.Tensor | None = None,
                      seqlen: int = 512, windows: int | None = 40, progress: bool = True,
                      names: Iterable[str] | None = None) -> tuple[list[StudyRow], float | None]:
    """The study over a model's quantized Linear layers; with ``tokens``, perplexities too.

    names: the Linears studied (and, for perplexities, quantized); None = every decoder
    Linear. Returns the rows and the full-precision perplexity (None without tokens).
    Weights are swapped in place for each point and always restored.
    """
    from lowbit.models import linear_layers

    layers = linear_layers(model)
    if names is not None:
        layers = {n: layers[n] for n in names}
    weights = {n: m.weight.detach().clone() for n, m in layers.items()}
    ppl_fn, fp_ppl = None, None
    if tokens is not None:
        from lowbit.eval import perplexity

        def ppl_fn(s: Scheme) -> float:
            try:
                for n, m in layers.items():
                    m.weight.data.copy_(qdq(weights[n], s))
                return perplexity(model, tokens, seqlen, windows, progress=False).ppl
            finally:
                for n, m in layers.items():
                    m.weight.data.copy_(weights[n])

        fp_ppl = perplexity(model, tokens, seqlen, windows, progress=False).ppl
    return block_size_study(weights, schemes, blocks, ppl_fn, progress), fp_ppl


def verdicts(rows: Iterable[StudyRow], key: str = "rel_error") -> dict[str, dict]:
    """Per line: the metric at the finest and coarsest block and whether finer is better."""
    by: dict[str, list[StudyRow]] = {}
    for r in rows:
        by.setdefault(r.label, []).append(r)
    out = {}
    for label, rs in by.items():
        rs = sorted(rs, key=lambda r: r.block)
        vals = [getattr(r, key) for r in rs]
        if len(rs) < 2 or any(v is None for v in vals):
            continue
        monotone = all(a <= b for a, b in zip(vals, vals[1:], strict=False))
        out[label] = {"finest": rs[0].block, "coarsest": rs[-1].block, key + "_finest": vals[0],
                      key + "_coarsest": vals[-1], "finer_is_better": vals[0] < vals[-1],
                      "monotone": monotone}
    return out
