"""The block-size study on activations: each Linear's calibration inputs, per input scheme and block size.

Activations are the heaviest-tailed tensors of a model (a few channels hundreds of times
larger than the rest), so they are where "finer is worse" under abs-max scaling with
E4M3 block scales should show: the block scale is ``448 * amax_block / amax_tensor``
(static tensor scale), and a block of small values next to an outlier channel's
tensor maximum rounds its scale to zero. For every (scheme, block size) point this
measures, over every planned Linear's inputs on calibration tokens:

* the relative error ``sum ||Q(x) - x||^2 / sum ||x||^2`` (pooled over layers);
* the share of non-zero blocks whose abs-max E4M3 scale underflows to zero;
* with ``ppl_fn``, the W4A4 perplexity (weights and inputs in the same format).

Two passes over the calibration batches: the first calibrates each layer's static
abs-max (the NVFP4 tensor scale), the second accumulates errors in forward pre-hooks
without changing the activations, so every point sees the float model's inputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from lowbit.formats import InputScheme, qdq, qdq_input
from lowbit.formats.inputs import underflow_counts
from lowbit.models.activations import input_amax
from lowbit.models.placement import model_device
from lowbit.studies.blocks import StudyRow

DEFAULT_INPUT_SCHEMES = ("nvfp4", "nvfp4:guard=1", "nvfp4-46", "nvfp4-46:rule=span", "nvfp4-ue5m3", "mxfp4")


@dataclass
class _Acc:
    num: float = 0.0
    den: float = 0.0
    dead: int = 0
    live: int = 0
    seconds: float = 0.0


def _points(schemes: Iterable[str], blocks: Iterable[int]) -> list[tuple[str, InputScheme, int]]:
    out = []
    for text in schemes:
        base = InputScheme.parse(text)
        out += [(text, base.replace(group_size=b), b) for b in blocks]
    return out


def _hook(name: str, points, amax: Mapping[str, torch.Tensor], acc: list[_Acc]):
    def hook(_mod: nn.Module, args: tuple) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        den = float((x.double() ** 2).sum())
        for k, (_, s, _) in enumerate(points):
            t0 = time.perf_counter()
            a = amax.get(name) if s.needs_calibration else None
            d = (qdq_input(x, s, a) - x).double()
            dead, live = underflow_counts(x, s, a)
            acc[k].num += float((d * d).sum())
            acc[k].den += den
            acc[k].dead += dead
            acc[k].live += live
            acc[k].seconds += time.perf_counter() - t0

    return hook


@torch.no_grad()
def input_block_study(model: nn.Module, layers: Iterable[str], calib: torch.Tensor,
                      schemes: Iterable[str] = DEFAULT_INPUT_SCHEMES, blocks: Iterable[int] = (8, 16, 32, 64),
                      ppl_fn: Callable[[Mapping[str, InputScheme], Mapping[str, torch.Tensor]], float] | None = None,
                      batch_size: int = 4, progress: bool = True) -> list[StudyRow]:
    """Rows for every (input scheme, block size) over ``layers``' inputs on ``calib`` (token ids)."""
    names = list(layers)
    blocks = tuple(blocks)
    for b in blocks:  # refuse before any pass: every layer's width must hold whole blocks
        for n in names:
            InputScheme.parse("mxfp4").replace(group_size=b).check_width(model.get_submodule(n).in_features, n)
    points = _points(schemes, blocks)
    amax = input_amax(model, calib, names, batch_size)
    acc = [_Acc() for _ in points]
    handles = [model.get_submodule(n).register_forward_pre_hook(_hook(n, points, amax, acc)) for n in names]
    device = model_device(model)
    try:
        for chunk in tqdm(calib.split(batch_size), desc="input errors", disable=not progress, unit="batch"):
            model(input_ids=chunk.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    rows = []
    for (label, s, b), a in tqdm(list(zip(points, acc, strict=True)), desc="w4a4 ppl", disable=not progress or
                                 ppl_fn is None, unit="point"):
        ppl = ppl_fn(dict.fromkeys(names, s), amax) if ppl_fn is not None else None
        rows.append(StudyRow(label, s.name, b, s.rule, a.num / a.den if a.den else 0.0, round(a.seconds, 3), ppl,
                             a.dead / a.live if a.live else 0.0))
    return rows


def w4a4_ppl_fn(model: nn.Module, layers: Iterable[str], perplexity: Callable[[], float]
                ) -> Callable[[Mapping[str, InputScheme], Mapping[str, torch.Tensor]], float]:
    """``ppl_fn`` for `input_block_study`: weights and inputs both in the point's format, then restored.

    The weight format is the input scheme's block scheme (same elements, block, scale
    format and rule), so a point is a W4A4 model of that format.
    """
    mods = {n: model.get_submodule(n) for n in layers}
    originals = {n: m.weight.detach().clone() for n, m in mods.items()}

    def fn(inputs: Mapping[str, InputScheme], amax: Mapping[str, torch.Tensor]) -> float:
        handles = []
        try:
            for n, m in mods.items():
                s = inputs[n]
                m.weight.data.copy_(qdq(originals[n], s.block_scheme()))
                a = amax.get(n) if s.needs_calibration else None
                handles.append(m.register_forward_pre_hook(
                    lambda _m, args, s=s, a=a: (qdq_input(args[0], s, a), *args[1:])))
            return perplexity()
        finally:
            for h in handles:
                h.remove()
            for n, m in mods.items():
                m.weight.data.copy_(originals[n])

    return fn
