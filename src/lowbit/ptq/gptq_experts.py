"""GPTQ on fused mixture-of-experts experts: per-expert Hessians, each expert's matrix quantized like a Linear.

Expert ``e`` of an experts module is two Linears in a row: ``gate_up[e] [2I, H]`` reads
the hidden states the router sends it, ``down[e] [H, I]`` reads its own activation. So
its Hessians are ``X_e^T X_e`` of those inputs (`lowbit.ptq.expert_calib`: from every
token in all-experts calibration, else from its routed tokens) and `gptq_layers` runs
on each ``[out, in]`` matrix under its own Hessian exactly as it does for a Linear
(same scale rules, act-order, static groups, NVFP4 tensor scale per matrix as RTN gives
it). With ``true_sequential`` the down Hessians are taken with the quantized gate/up in
place (the inputs down will really see), as a block's Linears are. A recipe that quantizes
inputs (W4A4, W8A8) gives each expert's Hessians from its quantized inputs, with the
per-expert static scales the block-wise pass calibrated on the float inputs, as a Linear's
Hessian is taken behind its input quantizer.

With ``affinity`` (a floor; `GPTQSettings.expert_affinity`, the default) each expert's Hessian is router-weighted:
``sum_t g_{t,e}^2 x_t x_t^T`` over its routed tokens, ``g`` the routing weight its output is scaled by,
plus ``floor`` times that energy in the plain Hessian's shape (`lowbit.ptq.expert_calib.affinity_mix`:
the derivation, and why ``gate_up_proj`` gets the same weights); an expert the router sent fewer than
``min_tokens`` tokens keeps the plain Hessian.

An expert whose Hessian comes from fewer than ``min_tokens`` tokens is not GPTQ'd from a
near-empty Hessian (all-zero for an expert no token reached: GPTQ would be RTN with an
arbitrary column order); it gets RTN with its scheme's rule on the weights alone, and
one warning per block names those experts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from lowbit.formats import QTensor, Scheme, quantize
from lowbit.models.experts import expert_tensors
from lowbit.nn.quant_experts import QuantStack, expert_matrices
from lowbit.ptq.expert_calib import Coverage, ExpertInput, ExpertStats, input_fn, warn_starved, warn_unrouted

# GPTQ of one matrix under one Hessian: (weights, scheme, hessian, where) -> (QTensor, relative error)
MatrixGPTQ = Callable[[torch.Tensor, Scheme, torch.Tensor, str], tuple[QTensor, float]]


def experts_in(block: nn.Module, layers: Mapping[str, tuple[str, Scheme]]) -> dict[str, dict[str, tuple[str, Scheme]]]:
    """The block's planned experts tensors by experts module (relative name) -> {param -> (full name, scheme)}."""
    tensors = expert_tensors(block)
    out: dict[str, dict[str, tuple[str, Scheme]]] = {}
    for full, (rel, scheme) in layers.items():
        t = tensors.get(rel)
        if t is not None:
            out.setdefault(t.module, {})[t.param] = (full, scheme)
    return out


def gptq_experts(module: nn.Module, name: str, planned: Mapping[str, tuple[str, Scheme]],
                 run: Callable[[], None], one: MatrixGPTQ, all_experts: bool, min_tokens: int,
                 sequential: bool, inputs: Mapping[str, ExpertInput] | None = None, affinity: float | None = None
                 ) -> tuple[dict[str, QuantStack], list[float], Coverage]:
    """GPTQ of one experts module's planned parameters; ``run()`` pushes the calibration samples through its block.

    inputs: full name -> (input scheme, per-expert static abs-max) of the parameters whose recipe
    quantizes inputs: their Hessians are taken on the quantized inputs each expert will see.
    affinity: None = plain Hessians; a float = router-weighted ones with that floor (module doc).
    Returns full name -> `QuantStack`, the matrices' relative errors, and the coverage.
    The module's parameters are left as they were (float).
    """
    order = [p for p in ("gate_up_proj", "down_proj") if p in planned]
    passes = [[p] for p in order] if sequential else [order]
    transposed = bool(getattr(module, "is_transposed", False))
    original = {p: module._parameters[p] for p in order}
    quantizers = {p: input_fn(*inputs[full]) for p, (full, _) in planned.items() if full in (inputs or {})}
    stacks: dict[str, QuantStack] = {}
    errs: list[float] = []
    coverage: Coverage | None = None
    try:
        for params in passes:
            stats = ExpertStats(module, name, ("xtx",), tuple(params), all_experts, quantizers=quantizers,
                                affinity=affinity is not None)
            with stats:
                run()
            coverage = coverage or stats.coverage()
            low = set(coverage.starved(min_tokens))
            for p in params:
                full, scheme = planned[p]
                w = expert_matrices(original[p].detach(), transposed).float()
                h = stats.result("xtx", p) if affinity is None else stats.weighted("xtx", p, affinity, min_tokens)
                qts = []
                for e in range(w.shape[0]):
                    if e in low:
                        qts.append(quantize(w[e], scheme))
                        continue
                    qt, err = one(w[e], scheme, h[e], f"{full}[{e}]")
                    qts.append(qt)
                    errs.append(err)
                stacks[full] = QuantStack(qts)
                deq = stacks[full].dequantize(original[p].dtype).to(original[p].device)
                module._parameters[p] = nn.Parameter(deq.transpose(1, 2) if transposed else deq,
                                                     requires_grad=False)  # what the next pass's inputs see
    finally:
        for p, t in original.items():
            module._parameters[p] = t
    assert coverage is not None
    for s in stacks.values():
        s.calibration = coverage.to_dict()
    return stacks, errs, coverage


def report(coverage: list[Coverage], min_tokens: int) -> None:
    """The warnings of one block's experts: starved experts (RTN fallback) and, in all-experts mode, unrouted ones."""
    warn_starved(coverage, min_tokens, "RTN on their weights alone instead of GPTQ")
    warn_unrouted(coverage, min_tokens)
