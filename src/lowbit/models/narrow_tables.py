"""Float tables outside the decoder blocks kept in the checkpoint's own dtype in a lazily loaded model.

Besides the block being worked on, the largest tensors a block-by-block run holds are the
embedding table and an untied lm_head: at the Llama-3.1-8B shape two tables of 525 M entries,
3.9 GiB in float32 for what a bf16 checkpoint stores in 1.96 GiB. Both stay float in the output
(a planned lm_head is widened before it is rounded), and a bf16 number widened to float32 is that
number exactly, so a lazily loaded model keeps them as stored and widens where they are used:

- an embedding's output is cast to the compute dtype (a forward hook): the lookup of a narrow row
  widened gives the values the lookup of the widened table gave;
- the output Linear multiplies by its weight widened for the call (the float32 copy lives during
  that call only: evaluation), the same product as before.

Everything that needs the whole float model (`lowbit.models.lazy.materialize`: rotations, AWQ,
whole-model methods, which may rewrite the tables in float32) widens them back for good
(`widen`). Norms and other small tensors are read in the compute dtype as before.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

ATTR = "_lowbit_narrow"  # on a module whose table is kept narrow: (compute dtype, hook handle or None)


def table_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module of the float tables kept narrow: every nn.Embedding and a plain-Linear output head."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    return {n: m for n, m in model.named_modules()
            if isinstance(m, nn.Embedding) or (m is head and type(m) is nn.Linear)}


def narrower(stored: torch.dtype, compute: torch.dtype) -> bool:
    """Whether a tensor stored as ``stored`` is kept so rather than widened to ``compute`` (a float of fewer bytes)."""
    return stored.is_floating_point and compute.is_floating_point and stored.itemsize < compute.itemsize


def fits_half(w: torch.Tensor, rows: int = 8192) -> bool:
    """Whether a non-empty table holds no value beyond fp16's range (nor a NaN), so that rounding it to fp16 values
    changes no value into inf: the condition under which the run's end rounds float tables to fp16
    (`conductor.round_unquantized_to_half`, and `block_prep.LazyRotation.narrow` ahead of it). The abs-max is
    taken ``rows`` rows at a time, never as an abs copy of the whole table (2 GiB for a 128k x 4096 float32 one)."""
    if not w.numel():
        return False
    with torch.no_grad():
        top = torch.stack([w[r: r + rows].abs().amax() for r in range(0, w.shape[0], rows)]).amax()
    return bool(top <= torch.finfo(torch.float16).max)

def keep_narrow(model: nn.Module, compute: torch.dtype) -> list[str]:
    """Make the table modules whose weights are narrower than ``compute`` compute in ``compute``; returns their names."""
    done = []
    for name, mod in table_modules(model).items():
        w = mod.weight
        if w.device.type == "meta" or not narrower(w.dtype, compute) or hasattr(mod, ATTR):
            continue
        if isinstance(mod, nn.Embedding):
            handle = mod.register_forward_hook(lambda _m, _i, out, dt=compute: out.to(dt))
        else:
            handle = None
            mod.forward = types.MethodType(_widened_linear, mod)
        setattr(mod, ATTR, (compute, handle))
        done.append(name)
    return done


def _widened_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` with the narrow weight (and bias) widened to the compute dtype for this call."""
    dt = getattr(self, ATTR)[0]
    return F.linear(x, self.weight.to(dt), None if self.bias is None else self.bias.to(dt))


def is_narrow(module: nn.Module) -> bool:
    return hasattr(module, ATTR)


def widen(root: nn.Module) -> None:
    """Widen every narrow table under ``root`` (``root`` included) to its compute dtype for good, hooks removed.

    Tables sharing one parameter (a tied lm_head) keep sharing its widened copy when both are under ``root``;
    widening the head alone (a planned lm_head about to be rounded) leaves the embedding as it is."""
    new: dict[int, nn.Parameter] = {}
    for mod in [m for m in root.modules() if is_narrow(m)]:
        compute, handle = getattr(mod, ATTR)
        if handle is not None:
            handle.remove()
        else:
            del mod.forward  # the class's own forward again
        delattr(mod, ATTR)
        w = mod.weight
        if id(w) not in new:
            new[id(w)] = nn.Parameter(w.detach().to(compute), requires_grad=w.requires_grad)
        mod.weight = new[id(w)]
        if getattr(mod, "bias", None) is not None and mod.bias.dtype != compute:
            mod.bias = nn.Parameter(mod.bias.detach().to(compute), requires_grad=mod.bias.requires_grad)
