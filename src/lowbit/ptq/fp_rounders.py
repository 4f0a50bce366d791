"""Learnable rounding for FP4 block formats (NVFP4, MXFP4): SignRound on the E2M1 grid.

``W_hat = sign(t) * e2m1(|t|) * s_b / enc`` with ``t = W * enc / s_b + V``: the offset
``V`` moves a value across neighbouring E2M1 grid points (straight-through round), and
the block scale ``s_b`` is the scheme's initial scale (abs-max, 4-over-6, or for V2 the
importance-weighted search) times a learned factor, re-cast to the scale grid (E4M3,
E8M0, UE5M3) with a straight-through cast. V1 learns a clip factor in [0, 1], V2 a
multiplier in [0, 2]. The per-tensor scale ``enc`` of NVFP4 is fixed (a fused
group's shared one when given). With V = 0 and the
factor at 1 this is exactly the RTN quantizer of `formats.float_blocks`.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.formats import QTensor, Scheme, rules
from lowbit.formats.float_blocks import ELEM_GRIDS, encode_codes, given_encode
from lowbit.formats.groups import from_groups, pad_mask, to_groups


def _ste(x: torch.Tensor, hard: torch.Tensor) -> torch.Tensor:
    return x + (hard - x).detach()


class FpRounder(nn.Module):
    """Learnable rounding of one ``[out, in]`` weight to an E2M1 block scheme."""

    def __init__(self, w: torch.Tensor, scheme: Scheme, imp: torch.Tensor | None = None,
                 v2: bool = False, tensor_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.scheme, self.shape, self.v2 = scheme, tuple(w.shape), v2
        self.elem = ELEM_GRIDS[scheme.elem]
        g = scheme.group_for(w.shape[1])
        x = to_groups(w.detach().float(), g)
        a = x.abs()
        enc = rules.tensor_encode(a.amax(), scheme, self.elem) if tensor_scale is None else \
            given_encode(tensor_scale, scheme, w)
        self.register_buffer("x", x)
        self.register_buffer("enc", enc)
        self.register_buffer("mask", pad_mask(w.shape[1], g, w.device).float())
        s0 = self._init_scale(a if enc is None else a * enc, imp, g)
        self.register_buffer("s0", s0)
        self.register_buffer("hp0", _cell_centre(s0, scheme))
        self.v = nn.Parameter(torch.zeros_like(x))
        self.f = nn.Parameter(torch.ones_like(self.s0))

    def _init_scale(self, a: torch.Tensor, imp: torch.Tensor | None, g: int) -> torch.Tensor:
        s = self.scheme
        if self.v2 and s.rule != "4over6":
            s = s.replace(rule="search")
        weight = None
        if s.rule == "search" and imp is not None:
            weight = to_groups(imp.float().reshape(1, -1).to(a.device), g)[0]
        return rules.choose_scales(a, s, self.elem, weight)

    def clamp_(self) -> None:
        with torch.no_grad():
            self.f.clamp_(0.0, 2.0 if self.v2 else 1.0)

    def _scale(self) -> torch.Tensor:
        s = self.scheme
        hp = self.hp0 * self.f
        hard = rules.cast(hp.detach(), s)
        if s.guard:
            hard = rules.guard_scale(hard, self.x.abs().amax(-1), s.scale)
        return _ste(hp, hard)

    def _levels(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(signed grid values with STE, block scales, the pre-round values t)."""
        sc = self._scale()
        inv = torch.where(sc > 0, 1.0 / sc, torch.zeros_like(sc))
        xe = self.x if self.enc is None else self.x * self.enc
        t = xe * inv.unsqueeze(-1) + self.v * self.mask
        mag = self.elem.round_mag(t.detach().abs())
        if self.scheme.guard:
            mag = _keep_alive(xe.detach().abs(), mag, self.elem.tiny)
        hard = torch.where(t.detach() < 0, -mag, mag)
        return _ste(t, hard), sc, t

    def forward(self) -> torch.Tensor:
        q, sc, _ = self._levels()
        scale = sc if self.enc is None else sc / self.enc
        return from_groups(q * scale.unsqueeze(-1), self.shape[1])

    def export(self) -> QTensor:
        with torch.no_grad():
            q, sc, t = self._levels()
            codes = encode_codes(t, q.abs(), self.scheme.elem)
            enc = None if self.enc is None else self.enc.clone()
            return QTensor(codes, sc.detach().clone(), None, enc, self.shape, self.scheme)


def _cell_centre(s0: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """An unrounded scale in the middle (log scale) of the cast cell that rounds to ``s0``.

    Power-of-two scales rounded down (E8M0 ``floor``) would halve at any factor below 1
    if the factor multiplied ``s0`` itself; from the cell's centre a factor has to move
    by sqrt(2) either way before the stored scale changes. Grids rounded to nearest are
    centred on ``s0`` already.
    """
    if scheme.scale != "e8m0" or scheme.e8m0_round == "nearest":
        return s0
    c = 2.0**0.5 if scheme.e8m0_round == "floor" else 2.0**-0.5
    hp = s0 * c
    return torch.where(rules.cast(hp, scheme) == s0, hp, s0)


def _keep_alive(a: torch.Tensor, r: torch.Tensor, tiny: float) -> torch.Tensor:
    """As the RTN guard: a non-zero block rounded to all zeros keeps its largest element."""
    amax = a.amax(-1, keepdim=True)
    dead = (amax > 0) & (r.amax(-1, keepdim=True) == 0)
    return torch.where(dead & (a == amax), torch.full_like(r, tiny), r)

