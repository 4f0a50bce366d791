"""The one tensor scale shared by the Linears an engine fuses into one matmul (which ones: `lowbit.files.fused`).

vLLM loads a llama-style block's ``q_proj`` / ``k_proj`` / ``v_proj`` as one ``qkv_proj``
and ``gate_proj`` / ``up_proj`` as one ``gate_up_proj`` (its ``packed_modules_mapping``),
and a fused layer keeps one per-tensor scale: for NVFP4 (weights and the static input
scale) it takes the largest stored ``global_scale`` of the parts, in every kernel, and
only logs a warning when the parts disagree. A part quantized with a tensor scale of its
own would then be dequantized with a neighbour's, off by their ratio (ppl 13,513 instead
of 20.3 on the bundled model). So the parts of a fused group are quantized with one
shared tensor scale, the smallest of the parts' own (the one that covers the group's
largest weight without overflowing an E4M3 block scale), as llm-compressor does too;
lowbit's own evaluation and the exported file then hold the same numbers.

Only names matter here (``...self_attn.q_proj``), so the grouping serves plans, models
and checkpoints alike; a part missing from the mapping given is simply not grouped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from lowbit.files.fused import fused_groups
from lowbit.formats import Scheme, rules
from lowbit.formats.float_blocks import ELEM_GRIDS


def group_of(names: Iterable[str]) -> dict[str, list[str]]:
    """Each fused name -> its whole group."""
    return {n: g for g in fused_groups(names) for n in g}


def own_tensor_scale(w: torch.Tensor, scheme: Scheme) -> torch.Tensor | None:
    """The per-tensor scale ``enc`` a weight would get alone (None for schemes without one)."""
    if not scheme.tensor_scale:  # only FP block schemes have one
        return None
    return rules.tensor_encode(w.detach().abs().amax(), scheme, ELEM_GRIDS[scheme.elem])


def shared_tensor_scales(weights: Mapping[str, torch.Tensor], schemes: Mapping[str, Scheme]
                         ) -> dict[str, torch.Tensor]:
    """The tensor scale each layer of ``weights`` is to be quantized with (layers whose scheme has one).

    Computed on the float weights before any of them is quantized; see `shared_encodes`.
    """
    return shared_encodes({n: e for n, w in weights.items() if (e := own_tensor_scale(w, schemes[n])) is not None})


def shared_encodes(own: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-layer tensor scales, each fused group's parts at the group's smallest (its largest weight fits).

    A group shares only when all its parts have a tensor scale; others keep their own.
    """
    return _share(own, torch.amin)


def shared_amax(amax: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Static input abs-maxima with each fused group's parts at the group's largest (one input scale per matmul)."""
    return _share(amax, torch.amax)


def _share(values: Mapping[str, torch.Tensor], reduce) -> dict[str, torch.Tensor]:
    out = dict(values)
    for group in fused_groups(values):
        first = values[group[0]]
        out.update(dict.fromkeys(group, reduce(torch.stack([values[n].reshape(()).to(first.device) for n in group]))))
    return out
