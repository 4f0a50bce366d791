"""The fused experts tensors of a mixture-of-experts model, as plan entries.

A plan names each fused experts parameter, ``model.layers.3.mlp.experts.gate_up_proj``
(and ``...down_proj``), not each expert: its recipe applies to every expert's ``[out, in]``
matrix, grouped along that matrix's input exactly like a Linear. That is the granularity
the targets hold (GGUF's 3-D ``ffn_*_exps`` tensors carry one type; vLLM's MoE needs one
scheme for all experts of a layer), it keeps a 128-expert model's plan at two entries per
layer instead of 384, and it is the name the accounting reports.

Found by structure (`lowbit.models.accounting.is_fused_experts`: a module owning 3-D
parameters), in the float module's layout; gpt-oss's transposed ones
(``is_transposed``) are read as ``[E, out, in]`` here, so every caller sees Linear matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lowbit.models.accounting import is_fused_experts


@dataclass(frozen=True)
class ExpertTensor:
    """One fused experts parameter: ``count`` matrices of ``[out_features, in_features]``."""

    module: str  # the experts module's name
    param: str  # its parameter (gate_up_proj, down_proj)
    count: int
    out_features: int
    in_features: int
    transposed: bool  # stored [E, in, out] (gpt-oss)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.param}"

    @property
    def numel(self) -> int:
        return self.count * self.out_features * self.in_features


def expert_tensors(model: nn.Module) -> dict[str, ExpertTensor]:
    """Plan name -> `ExpertTensor` for every float fused experts parameter of the model.

    Any model is walked (no decoder blocks needed): a model without experts simply has none.
    """
    out: dict[str, ExpertTensor] = {}
    for mname, mod in model.named_modules():
        if not is_fused_experts(mod) or isinstance(mod, nn.modules.conv._ConvNd):  # a Conv1d's [out, in, k] is no stack
            continue
        transposed = bool(getattr(mod, "is_transposed", False))
        for pname, p in mod.named_parameters(recurse=False):
            if p.dim() != 3:
                continue
            e, a, b = p.shape
            t = ExpertTensor(mname, pname, e, *((b, a) if transposed else (a, b)), transposed)
            out[t.name] = t
    return out


def expert_weight(model: nn.Module, t: ExpertTensor) -> torch.Tensor:
    """The float ``[E, out, in]`` matrices of ``t`` (a view of the parameter)."""
    p = model.get_submodule(t.module).get_parameter(t.param).detach()
    return p.transpose(1, 2) if t.transposed else p


def planned_shape(model: nn.Module, name: str) -> tuple[int, int]:
    """(rows, in) a plan entry quantizes: a Linear's (out, in), a fused experts tensor's E matrices as (E * out, in).

    What bit budgets count (a quantized `QuantStack` answers with its E matrices too).
    """
    t = expert_tensors(model).get(name)
    if t is not None:
        return (t.count * t.out_features, t.in_features)
    m = model.get_submodule(name)
    return (getattr(m, "num_experts", 1) * m.out_features, m.in_features)
