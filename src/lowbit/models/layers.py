"""Finding decoder blocks and their Linear layers without naming an architecture.

Llama, Qwen, Mistral and Gemma-3 all keep their decoder blocks in one ``nn.ModuleList``
of identical modules (``model.layers``, or ``model.language_model.layers`` for
multimodal wrappers). lowbit looks for the longest ModuleList whose children share one
class and each contain Linear layers, so a new architecture of the same family works
without code changes, and a model without such a list is an error.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

import torch
from torch import nn

from lowbit.errors import ModelError


def block_path(model: nn.Module) -> str:
    """Dotted name of the ModuleList holding the decoder blocks."""
    best, best_len = None, 0
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        kinds = {type(child) for child in mod}
        if len(kinds) != 1 or not all(_has_linear(child) for child in mod):
            continue
        if len(mod) > best_len:
            best, best_len = name, len(mod)
    if best is None:
        raise ModelError(f"{type(model).__name__} has no decoder blocks (no list of repeated modules with "
                         "Linear layers); lowbit quantizes transformer decoders such as Llama, Qwen, "
                         "Mistral and Gemma")
    return best


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    return model.get_submodule(block_path(model))


def _has_linear(mod: nn.Module) -> bool:
    return any(_is_linear_like(m) for m in mod.modules())


def _is_linear_like(mod: nn.Module) -> bool:
    from lowbit.nn import QuantLinear

    return isinstance(mod, (nn.Linear, QuantLinear))


def linear_layers(model: nn.Module, include_lm_head: bool = False) -> OrderedDict[str, nn.Module]:
    """Full name -> Linear for every Linear inside the decoder blocks (+ the lm_head if asked).

    Embeddings are never included; the lm_head stays 16-bit unless asked, because it is
    small relative to its effect on the output distribution.
    """
    prefix = block_path(model) + "."
    out: OrderedDict[str, nn.Module] = OrderedDict(
        (n, m) for n, m in model.named_modules() if n.startswith(prefix) and _is_linear_like(m))
    if include_lm_head:
        head = _lm_head_name(model)
        if head is None:
            raise ModelError(f"{type(model).__name__} has no Linear lm_head to quantize")
        out[head] = model.get_submodule(head)
    return out


def _lm_head_name(model: nn.Module) -> str | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get else None
    if head is None:
        return None
    for n, m in model.named_modules():
        if m is head and _is_linear_like(m):
            return n
    return None


def weight_digest(model: nn.Module, names: Iterable[str]) -> str:
    """sha256 over the named layers' weights: a float Linear's weight, a QuantLinear's stored parts.

    Identifies the exact numbers a checkpoint or an adapter was made from, so work that
    depends on them (an adapter, the quantization error a fine-tune starts from) is never
    applied to other weights with the same shapes.
    """
    from lowbit.nn import QuantLinear
    from lowbit.nn.quant_experts import QuantStack

    h = hashlib.sha256()
    for name in sorted(names):
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        if isinstance(owner._parameters.get(leaf), torch.Tensor):  # a float fused experts tensor (its plan name)
            p = owner._parameters[leaf]
            h.update(f"{name}:{'x'.join(map(str, p.shape))};".encode())
            h.update(p.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
            continue
        layer = model.get_submodule(name)
        shape = f"{layer.out_features}x{layer.in_features}"
        h.update(f"{name}:{layer.num_experts}x{shape};".encode() if isinstance(layer, QuantStack)
                 else f"{name}:{shape};".encode())
        parts = ([layer.codes, layer.scales, layer.zeros, layer.tensor_scale]
                 if isinstance(layer, (QuantLinear, QuantStack)) else [layer.weight])
        for t in parts:
            if t is not None:
                h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
