"""The grids GPTQ rounds columns onto: one per scheme family, behind one interface.

GPTQ rounds one input column at a time onto a fixed grid and needs, per grid, three
things: the parameters of a group of columns (chosen when GPTQ reaches the group, or up
front with static groups), the rounding of one column under them, and the stored tensors
of the finished weight. Two grids differ in where those parameters live:

* `Grid` (INT and FP block schemes: `IntGrid`, `FpGrid`): one scale (and zero) per group
  of consecutive columns; parameters are chosen and rounded per group.
* `KGrid` (llama.cpp's K-quants): a column is rounded under its sub-block's effective
  scale ``d*sc`` (and min ``dmin*m``), but those come from a 256-column super-block whose
  fp16 ``d`` / ``dmin`` and integer sub-block codes are chosen together
  (`lowbit.formats.kquants.quantize_parts`), so parameters are chosen per super-block
  and rounding happens per sub-block. The grid values are the fp32 products ggml forms,
  so the stored blocks dequantize to exactly what GPTQ fed back as error.

``GRIDS`` registers one grid class per number-format family (`lowbit.formats.families`),
keyed by the family's name: the formats never know GPTQ, and GPTQ never tests a scheme's fields.
"""

from __future__ import annotations

import torch

from lowbit.errors import SchemeError
from lowbit.formats import Scheme, kquants, minifloat, rules
from lowbit.formats.float_blocks import ELEM_GRIDS, encode_codes
from lowbit.formats.groups import to_groups
from lowbit.formats.integer import int_codes, int_dequant, int_params, search_int_params

Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class Grid:
    """One INT / FP scheme's grid for a stack of weight rows (the two subclasses hold the element rounding).

    enc: NVFP4's per-tensor scale per row (each row keeps its own layer's), else None.
    round_g / param_g: columns per rounding group and per parameter choice (equal here).
    zeros: whether the grid has zero points (asymmetric INT).
    clip: whether the search may choose scales below abs-max (INT only: `check_plan` refuses the others).
    """

    clip = True

    def __init__(self, scheme: Scheme, enc: torch.Tensor | None, in_features: int) -> None:
        self.s, self.enc = scheme, enc
        self.round_g = self.param_g = scheme.group_for(in_features)
        self.zeros = not scheme.sym


class IntGrid(Grid):
    """Integer groups: scales (and zeros) by abs-max / range or the importance search."""

    def params(self, wg: torch.Tensor, imp_g: torch.Tensor, first: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scales (and zeros) ``[rows, ng]`` for groups ``wg [rows, ng, g]`` by the scheme's rule.

        first: index of the first parameter group in ``wg`` (unused: nothing is kept).
        """
        s = self.s
        parts = [search_int_params(c, s, imp_g, clip=self.clip) if s.rule == "search" else int_params(c, s)
                 for c in wg.split(1024)]
        return torch.cat([p[0] for p in parts]), (None if s.sym else torch.cat([p[1] for p in parts]))

    def qdq(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """Column ``w [rows]`` rounded on the grid of its group: the values `QTensor.dequantize` gives."""
        return int_dequant(int_codes(w.unsqueeze(-1), scale, zero, self.s), scale, zero).squeeze(-1)

    def tensors(self, deq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> Tensors:
        """(uint8 codes ``[rows, ng, g]``, scales, zeros, None) of grid values ``deq`` (exact: ``deq`` lies on the grid)."""
        s = self.s
        x = to_groups(deq, s.group_for(deq.shape[1]))
        return (int_codes(x, scale, zero, s) - s.qmin).to(torch.uint8), scale, zero, None


class FpGrid(Grid):
    """FP element blocks: block scales by the scheme's rule, under NVFP4's per-row tensor scale if any."""

    def __init__(self, scheme: Scheme, enc: torch.Tensor | None, in_features: int) -> None:
        super().__init__(scheme, enc, in_features)
        self.elem = ELEM_GRIDS[scheme.elem]

    def params(self, wg: torch.Tensor, imp_g: torch.Tensor, first: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block scales ``[rows, ng]`` for blocks ``wg [rows, ng, g]`` by the scheme's rule (no zeros)."""
        s = self.s
        a = wg.abs()
        amax = a.amax(-1)
        hp = rules.absmax_hp(amax, s, self.elem)
        if self.enc is not None:
            a, hp = a * self.enc[:, None, None], hp * self.enc[:, None]
        weight = imp_g if s.rule == "search" else None
        sc = rules.choose_scales(a, s, self.elem, weight, rules.BRUTE_WINDOW, hp)
        if s.guard:
            sc = torch.where((amax > 0) & (sc == 0), torch.full_like(sc, minifloat.smallest_scale(s.scale)), sc)
        return sc, None

    def qdq(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """Column ``w [rows]`` rounded on the grid of its block: the values `QTensor.dequantize` gives."""
        a = w.abs() if self.enc is None else w.abs() * self.enc
        r = rules.elem_mags(a.unsqueeze(-1), scale, self.elem, False).squeeze(-1)
        step = scale if self.enc is None else scale / self.enc
        return torch.where((w < 0) & (r > 0), -r, r) * step

    def tensors(self, deq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> Tensors:
        """(uint8 codes ``[rows, ng, g]``, scales, None, None) of grid values ``deq``.

        Exact: ``deq`` lies on the grid. The per-tensor NVFP4 scale is the caller's (one per layer).
        """
        s = self.s
        x = to_groups(deq, s.group_for(deq.shape[1]))
        a = x.abs() if self.enc is None else x.abs() * self.enc[:, None, None]
        return encode_codes(x, rules.elem_mags(a, scale, self.elem, False), s.elem), scale, zero, None


class KGrid:
    """A llama.cpp K-quant's grid: parameters per 256-column super-block, rounding per sub-block.

    ``params`` returns the effective sub-block scales ``d*sc`` and mins ``dmin*m``
    (``[rows, nsub]``) and keeps the integer codes and fp16 super-block scales they came
    from, per super-block, for `tensors`.
    """

    def __init__(self, scheme: Scheme, enc: torch.Tensor | None, in_features: int) -> None:
        self.s, self.kt = scheme, kquants.ktype(scheme.bits)
        self.round_g, self.param_g = self.kt.sub, kquants.QK_K
        self.zeros = not self.kt.sym
        self.parts: dict[int, kquants.KParts] = {}  # first super-block index -> its parts

    def params(self, wg: torch.Tensor, imp_g: torch.Tensor, first: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Effective scales (and mins) ``[rows, nsup * nsub]`` of super-blocks ``wg [rows, nsup, 256]``."""
        rows = wg.shape[0]
        search = self.s.rule == "search"
        p = kquants.quantize_parts(wg.reshape(rows, -1), self.kt, imp_g.reshape(-1) if search else None, search)
        self.parts[first] = p
        _, sc, m, sup = kquants.parts_to_tensors(p, self.kt)
        ds, dm = kquants.effective_scales(sc, m, sup, self.kt)
        return ds, dm

    def qdq(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """Column ``w [rows]`` under its sub-block's ``d*sc`` (and ``dmin*m``), in ggml's product order."""
        mn = torch.zeros_like(scale) if zero is None else zero
        q = kquants.element_codes(w.unsqueeze(-1), scale, mn, self.kt).squeeze(-1)
        q = scale * q
        return q if zero is None else q - zero

    def tensors(self, deq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> Tensors:
        """(codes ``[rows, nsub, sub]``, sub-scale codes, min codes, super-block scales) of ``deq``."""
        kt = self.kt
        x = deq.reshape(deq.shape[0], -1, kt.sub)
        mn = torch.zeros_like(scale) if zero is None else zero
        codes = (kquants.element_codes(x, scale, mn, kt) - kt.qmin).to(torch.uint8)
        ordered = [self.parts[k] for k in sorted(self.parts)]
        cat = (lambda f: torch.cat([getattr(p, f) for p in ordered], 1))  # noqa: E731
        whole = kquants.KParts(cat("codes"), cat("sc"), None if kt.sym else cat("m"), cat("d"),
                               None if kt.sym else cat("dmin"))
        _, sc, m, sup = kquants.parts_to_tensors(whole, kt)
        return codes, sc, m, sup


GRIDS: dict[str, type[Grid] | type[KGrid]] = {"int": IntGrid, "fp": FpGrid, "kquant": KGrid}


def make_grid(scheme: Scheme, enc: torch.Tensor | None, in_features: int) -> Grid | KGrid:
    """The grid GPTQ rounds ``scheme``'s columns onto (its family's)."""
    try:
        cls = GRIDS[scheme.family.name]
    except KeyError:
        raise SchemeError(f"GPTQ has no grid for {scheme.name} (a {scheme.family.name} format); use one of the "
                          f"families {sorted(GRIDS)} or --method rtn") from None
    return cls(scheme, enc, in_features)
