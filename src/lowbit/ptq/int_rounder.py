"""Learnable rounding of a weight to a group-wise INT scheme (SignRound's INT rounder).

Per group ``W_hat = s * (clip(round(W/s + V) + z, qmin, qmax) - z)`` where ``V`` (one per
weight, starts at 0) nudges each weight to the other rounding neighbour and the scale
``s`` comes from the group's range times learnable clip factors (alpha on the max side,
beta on the min side, in [0, 1]) for V1, or from the importance-searched scale times a
multiplier in [0, 2] for V2. ``forward()`` gives the differentiable fake-quantized
weight, ``export()`` the `QTensor` whose dequantization equals it; with ``V = 0`` and the
factors at 1 that is exactly round-to-nearest.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.formats import QTensor, Scheme
from lowbit.formats.groups import from_groups, pad_mask, to_groups
from lowbit.formats.integer import cast_scale, largest_magnitude, search_int_params
from lowbit.nn import round_ste


def cast_ste(scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """The scale rounded to its storage grid forward, identity gradient backward."""
    return scale + (cast_scale(scale.detach(), fmt) - scale).detach()


class _SymRound(torch.autograd.Function):
    """``clamp(round(wg / s + v * mask), qmin, qmax) * s`` with the STE through the rounding.

    Autograd through that expression saved ~6 weight-sized tensors per Linear and replayed
    each op backwards; this keeps only its inputs (``wg`` is the FP weight's own storage)
    and recomputes the levels in the backward. With ``r = round(wg/s + v*mask)`` and
    ``inside = qmin <= r <= qmax``: ``dv = g * s * inside`` (``g`` is zero on padded
    columns) and ``ds = sum_group g * (clamp(r) - inside * wg / s)``: what autograd derives
    from the expression (tests compare the two).
    """

    @staticmethod
    def forward(ctx, wg, v, mask, s, qmin, qmax):  # noqa: ANN001, ANN205 - autograd signature
        ctx.save_for_backward(wg, v, mask, s)
        ctx.qmin, ctx.qmax = qmin, qmax
        se = s.unsqueeze(-1)
        return (wg / se).addcmul_(v, mask).round_().clamp_(qmin, qmax).mul_(se)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        wg, v, mask, s = ctx.saved_tensors
        se = s.unsqueeze(-1)
        r = (wg / se).addcmul_(v, mask).round_()
        inside = (r >= ctx.qmin) & (r <= ctx.qmax)
        gi = torch.where(inside, g, 0.0)
        gv = gi * se if ctx.needs_input_grad[1] else None
        gs = None
        if ctx.needs_input_grad[3]:
            gs = torch.linalg.vecdot(g, r.clamp_(ctx.qmin, ctx.qmax)) - torch.linalg.vecdot(gi, wg) / s
        return None, gv, None, gs, None, None


class IntRounder(nn.Module):
    """Learnable rounding of one ``[out, in]`` weight to a group-wise INT scheme.

    V1: scale from the group range times clip factors alpha (max side) / beta (min side).
    V2 (symmetric only): scale = searched initial scale * multiplier m in [0, 2].
    """

    def __init__(self, w: torch.Tensor, scheme: Scheme, imp: torch.Tensor | None = None,
                 v2: bool = False) -> None:
        super().__init__()
        self.scheme = scheme
        self.shape = tuple(w.shape)
        g = scheme.group_for(w.shape[1])
        wg = to_groups(w.detach().float(), g)
        self.register_buffer("wg", wg)
        self.register_buffer("mask", pad_mask(w.shape[1], g, w.device).float())
        self.v = nn.Parameter(torch.zeros_like(wg))
        self.v2 = v2 and scheme.sym
        if self.v2:
            imp_g = to_groups((imp if imp is not None else torch.ones(w.shape[1])).float().reshape(1, -1)
                              .to(w.device), g)[0]
            # the searched and refitted scale: exactly searched RTN's, so tuning starts where RTN
            # ends (without the refit the start was 0.65 ppl worse at W4 g128 on the bundled model);
            # a distributed run gets the same scales because the pipeline reduces the importance in
            # float64 before the one cast to float32
            s0, _ = search_int_params(wg, scheme, imp_g)
            self.register_buffer("s0", s0)
            self.m = nn.Parameter(torch.ones_like(s0))
        else:
            self.alpha = nn.Parameter(torch.ones(wg.shape[:2], device=w.device))
            self.beta = nn.Parameter(torch.ones(wg.shape[:2], device=w.device))

    def clamp_(self) -> None:
        with torch.no_grad():
            if self.v2:
                self.m.clamp_(0.0, 2.0)
            else:
                self.alpha.clamp_(0.0, 1.0)
                self.beta.clamp_(0.0, 1.0)

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Differentiable (scale, zero) per group, mirroring `formats.integer.int_params`."""
        s, wg = self.scheme, self.wg
        if self.v2:
            return cast_ste(self.s0 * self.m, s.scale), None
        if s.sym:
            if s.full_range:
                ext = largest_magnitude(wg)
                return cast_ste(ext / s.qmin * self.alpha, s.scale), None
            return cast_ste(wg.abs().amax(-1) / s.qmax * self.alpha, s.scale), None
        lo = wg.amin(-1).clamp(max=0) * self.beta
        hi = wg.amax(-1).clamp(min=0) * self.alpha
        scale = cast_ste((hi - lo) / s.qmax, s.scale)
        zero = round_ste(-lo / scale).clamp(0, s.qmax)
        return scale, zero

    def levels(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        scale, zero = self.qparams()
        q = round_ste(self.wg / scale.unsqueeze(-1) + self.v * self.mask)
        if zero is not None:
            q = q + zero.unsqueeze(-1)
        return q.clamp(self.scheme.qmin, self.scheme.qmax), scale, zero

    def forward(self) -> torch.Tensor:
        scale, zero = self.qparams()
        if zero is None:  # symmetric: one fused pass pair instead of ~8 autograd-tracked ops
            s = self.scheme
            return from_groups(_SymRound.apply(self.wg, self.v, self.mask, scale, float(s.qmin), float(s.qmax)),
                               self.shape[1])
        return self.reference_forward()

    def reference_forward(self) -> torch.Tensor:
        """The quantized weight through plain autograd ops (asymmetric path; the fused one's reference)."""
        q, scale, zero = self.levels()
        if zero is not None:
            q = q - zero.unsqueeze(-1)
        return from_groups(q * scale.unsqueeze(-1), self.shape[1])

    def export(self) -> QTensor:
        with torch.no_grad():
            q, scale, zero = self.levels()
            codes = (q - self.scheme.qmin).to(torch.uint8)
            return QTensor(codes, scale.detach().clone(), None if zero is None else zero.detach().clone(),
                           None, self.shape, self.scheme)
