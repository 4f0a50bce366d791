"""GPTQ (OPTQ): quantize a Linear column by column, feeding each column's error into the columns not yet quantized.

With ``H = X^T X`` from the layer's calibration inputs, quantizing column ``i`` to ``q``
and updating the remaining columns by ``-(w_i - q_i) / [H^-1]_ii * [H^-1]_i,j`` keeps the
layer's output error ``||(W - Q) X^T||^2`` minimal given the rounding so far. As in the
paper: ``H`` is dampened by ``damp`` times its mean diagonal, the inverse is taken once
through its upper Cholesky factor, and updates are applied lazily in batches of
``lazy_batch`` columns (one GEMM per batch for the columns after it).

Every INT and FP scheme works, because a group's scale is chosen by the scheme's own rule
(`lowbit.formats`: abs-max, importance-weighted search with ``diag(H)`` as the
importance, 4-over-6, the E8M0 / E4M3 / UE5M3 grids, NVFP4's per-tensor scale fixed from
the float weights, one per group of Linears an engine fuses, `lowbit.models.fused`) and then every column of the group is rounded on that grid:

* without act-order, a group's scale is chosen when GPTQ reaches its first column, from
  the current weights of its columns (they carry the error of every column before them);
* act-order visits columns by decreasing ``diag(H)``, which scatters a group's columns
  over the run. Groups stay consecutive input columns (the only layout lowbit's QTensor,
  NVFP4 and MXFP4 blocks and the GGUF types can hold; a per-column group index is not
  stored), so their scales must be fixed before their columns are visited:
  ``static_groups`` chooses every scale up front from the float weights (the classic
  static groups). Act-order without static groups would need that index and is refused,
  unless ``group_aware``: group-aware reordering (GAR, Gafni et al., CVPRW 2025) visits whole
  groups, ordered by their largest ``diag(H)``, and a group's columns by decreasing
  ``diag(H)``, so each group's scale is chosen at its first column from the weights GPTQ
  will round (they carry the error of every group before), by the same rule (the search
  with ``diag(H)`` as importance, or abs-max). The groups kept whole are the parameter
  groups: a K-quant's 256-column super-block (its ``d`` / ``dmin`` and sub-block scales
  are chosen together). NVFP4's per-tensor scale stays fixed from the float weights (one
  per group of Linears an engine fuses): only the block scales follow the updated weights.

Sequential through the model (`lowbit.ptq.blockwise`): each block's Hessians come from its
inputs through the already quantized blocks, and with ``true_sequential`` a block's
Linears are quantized in the order they run (q/k/v, o, gate/up, down: layers reading the
same input share one Hessian and one factorisation), each group's Hessian taken with the
groups before it already quantized. Device placement, disk offload, resume and progress
are the pipeline's.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lowbit.configs import check_fields
from lowbit.errors import ConfigError
from lowbit.formats import QTensor, Scheme
from lowbit.formats.groups import to_groups
from lowbit.models.activations import activation_stats
from lowbit.models.fused import own_tensor_scale
from lowbit.models.lazy import materialize
from lowbit.nn.quant_experts import QuantStack
from lowbit.plans.plan import Plan
from lowbit.ptq.blockwise import BlockJob, PipelineOptions, quantize_blockwise
from lowbit.ptq.blockwise.access import block_linears
from lowbit.ptq.expert_calib import (
    AFFINITY_FLOOR,
    AFFINITY_FLOOR_HELP,
    AFFINITY_HELP,
    ALL_EXPERTS_HELP,
    MIN_TOKENS,
    MIN_TOKENS_HELP,
    check_affinity,
)
from lowbit.ptq.gptq_choice import choose_rule
from lowbit.ptq.gptq_experts import experts_in, gptq_experts, report
from lowbit.ptq.gptq_grids import Grid, KGrid, Tensors, make_grid
from lowbit.ptq.methods import Method, RunContext, knob, register
from lowbit.ptq.rtn import searched

# the Linears whose outputs are multiplied together into attention scores (matched on the last name component)
SCORE_PROJECTIONS = ("q_proj", "k_proj")
SCORE_RULES = ("search", "noclip", "absmax")
DAMP_RETRIES = (0.01, 0.1, 1.0)  # dampening tried, in order, when a Hessian is not positive definite
CHUNK = 8  # samples per block forward while collecting Hessians


@dataclass(frozen=True)
class GPTQSettings:
    """GPTQ's knobs (defaults: the common GPTQ recipe, act-order with static groups).

    damp: added to H's diagonal, as a fraction of its mean diagonal (raised, with a
        warning, for a layer whose Hessian is still singular).
    act_order: visit columns by decreasing ``diag(H)`` (the inputs with most energy first).
    static_groups: choose every group's scale from the float weights before GPTQ starts
        (required with act_order on grouped schemes unless ``group_aware``, see the module docstring).
    group_aware: with act_order, keep each group's columns together (groups by their largest
        ``diag(H)``, columns by decreasing ``diag(H)`` inside), so that without static_groups
        each group's scale comes from the error-updated weights GPTQ rounds (`group_aware_order`).
    lazy_batch: columns per lazy batch update.
    true_sequential: quantize a block's Linears in execution order, each group's Hessian
        from inputs through the already quantized ones (False: all Hessians from one pass).
    search: group scales by the importance-weighted search of `formats` (importance =
        ``diag(H)``), as RTN's default; False = the scheme's own rule (abs-max).
    clip: with ``search`` on INT groups, let the search choose scales below abs-max (clipping the
        largest weights); False searches only scales at or above abs-max, without the least-squares
        refit (`lowbit.formats.integer.search_int_params`): GPTQ's error feedback, not the scale,
        then absorbs the rounding error, and the largest weights stay whole.
    score_rule: with ``search``, the scale rule of the attention-score projections (``q_proj``,
        ``k_proj``; the other matrices keep the search): ``noclip`` searches only scales at or
        above abs-max (as ``clip=False``, INT only), ``absmax`` takes abs-max scales. Why: their
        outputs are multiplied together and go through a softmax, and clipping shrinks their
        largest weights coherently (q and k both lose magnitude along the directions that make
        attention sharp), a bias the layer-wise output error counts as noise (benchmarks/results/moe.md).
    choose_rule: with ``search``, choose between the searched and abs-max scales by the
        loss of trial runs on calibration windows they did not see (two folds), then quantize
        with the winner (`lowbit.ptq.gptq_choice`: no per-matrix measure ranks the two rules).
    all_experts / min_expert_tokens: mixture-of-experts experts' Hessians from every
        token (all-experts calibration) or from their routed tokens; experts below the
        threshold get RTN (`lowbit.ptq.gptq_experts`).
    expert_affinity / affinity_floor: router-weighted expert Hessians: a token's error in an
        expert reaches the block output scaled by its routing weight ``g``, so each token counts
        ``g^2`` (0 where the router did not pick the expert) plus a floor, ``affinity_floor`` times
        the routed part's energy spread over every token of the mode (`lowbit.ptq.expert_calib.affinity_mix`).
        On by default: on two builds of the MoE organism it lowered GPTQ's perplexity at W4, W3 and W2 on the
        means of 8 / 8 / 2-8 seeds (benchmarks/results/moe.md); a model without experts is not affected.
    """

    damp: float = knob(0.01, "dampening added to the Hessian's diagonal, a fraction of its mean (raised with a "
                             "warning for a layer whose Hessian stays singular)")
    act_order: bool = knob(True, "quantize columns by decreasing activation energy")
    static_groups: bool = knob(True, "fix every group's scale from the float weights before GPTQ runs (needed "
                                     "with --act-order on grouped schemes)")
    group_aware: bool = knob(False, "with --act-order: visit whole groups (by their largest activation energy, "
                                    "columns by decreasing energy inside); with --no-static-groups each group's "
                                    "scale is then chosen from the error-updated weights it rounds")
    lazy_batch: int = knob(128, "columns per lazy batch update", minimum=1)
    true_sequential: bool = knob(True, "quantize a block's Linears in execution order, each from inputs through "
                                       "the ones before it")
    search: bool = knob(True, "choose scales by the importance-weighted search on calibration activations; rtn --no-search = "
                  "plain round-to-nearest, no data needed")
    clip: bool = knob(True, "with --search on INT groups: let the scale search clip the largest weights (scales "
                            "below abs-max); --no-clip searches only scales at or above abs-max, no least-squares "
                            "refit")
    score_rule: str = knob("search", "with --search: the scale rule of the attention-score projections (q_proj, "
                                     "k_proj), the rest searched: search, noclip (scales at or above abs-max, INT "
                                     "only) or absmax", choices=SCORE_RULES)
    choose_rule: bool = knob(False, "with --search: GPTQ copies of the model with searched and with abs-max scales "
                                    "from half the calibration windows, compare their loss on the other half (two "
                                    "folds), then quantize with the better rule (3.5x the CPU time on the MoE organism, a second copy of "
                                    "the model in memory)")
    all_experts: bool = knob(True, ALL_EXPERTS_HELP)
    min_expert_tokens: int = knob(MIN_TOKENS, MIN_TOKENS_HELP, minimum=0)
    expert_affinity: bool = knob(True, AFFINITY_HELP)
    affinity_floor: float = knob(AFFINITY_FLOOR, AFFINITY_FLOOR_HELP)

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "GPTQ setting")
        check_affinity(self.expert_affinity, self.affinity_floor, "Hessians")
        if not 0 <= self.damp <= 1:
            raise ConfigError(f"damp must be in [0, 1] (a fraction of the Hessian's mean diagonal), got {self.damp}")
        if self.lazy_batch < 1:
            raise ConfigError(f"lazy_batch must be >= 1, got {self.lazy_batch}")
        if self.group_aware and not self.act_order:
            raise ConfigError("--group-aware orders the columns of --act-order; with --no-act-order GPTQ visits "
                              "columns in their natural order, which keeps groups whole already: drop one of them")
        if not self.clip and not self.search:
            raise ConfigError("--no-clip restricts the scale search; with --no-search the scales are abs-max "
                              "already: drop one of them")
        if self.score_rule not in SCORE_RULES:
            raise ConfigError(f"score_rule must be one of {SCORE_RULES}, got {self.score_rule!r}")
        if self.score_rule != "search" and not self.search:
            raise ConfigError("--score-rule changes the searched scales of q_proj / k_proj; with --no-search every "
                              "scale is abs-max already: drop one of them")
        if self.choose_rule and not self.search:
            raise ConfigError("--choose-rule chooses between the searched and abs-max scales; with --no-search there "
                              "is nothing to choose: drop one of them")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_plan(settings: GPTQSettings, plan: Plan) -> None:
    """Refuse act-order without static groups on grouped schemes (it needs a per-column group index) unless the
    order keeps groups whole (``group_aware``)."""
    if not settings.clip:
        other = sorted({s.name for s in plan.weights().values() if s.family.name != "int"})
        if other:
            raise ConfigError(f"--no-clip restricts the scale search of INT groups; {other[0]} chooses its scales "
                              "another way (block formats, K-quants): drop --no-clip or quantize it with an INT "
                              "scheme")
    if settings.score_rule != "search":
        _check_score_rule(settings.score_rule, plan)
    if not settings.act_order or settings.static_groups or settings.group_aware:
        return
    grouped = sorted({s.name for s in plan.weights().values() if s.group_size != -1})
    if grouped:
        raise ConfigError(f"--act-order without --static-groups puts columns of different groups of {grouped[0]} "
                          "under one scale, which needs a per-column group index that lowbit checkpoints, NVFP4 / "
                          "MXFP4 blocks and GGUF cannot hold; keep --static-groups (the default), add "
                          "--group-aware (act-order over whole groups) or pass --no-act-order")


def is_score_projection(name: str) -> bool:
    """Whether layer ``name``'s output is multiplied into attention scores (``...self_attn.q_proj`` / ``k_proj``)."""
    return name.rsplit(".", 1)[-1] in SCORE_PROJECTIONS


def _check_score_rule(rule: str, plan: Plan) -> None:
    """Refuse ``--score-rule`` where no planned layer is a score projection, or ``noclip`` on a non-INT one."""
    score = {n: s for n, s in plan.weights().items() if is_score_projection(n)}
    if not score:
        raise ConfigError(f"--score-rule {rule} applies to the attention-score projections "
                          f"({', '.join(SCORE_PROJECTIONS)}); the plan quantizes none: drop --score-rule")
    other = sorted({s.name for s in score.values() if s.family.name != "int"})
    if rule == "noclip" and other:
        raise ConfigError(f"--score-rule noclip restricts the scale search of INT groups; {other[0]} chooses its "
                          "scales another way (block formats, K-quants): use --score-rule absmax or an INT scheme")


def _variant(name: str, scheme: Scheme, settings: GPTQSettings) -> tuple[Scheme, GPTQSettings]:
    """The scheme whose rule chooses ``name``'s scales and the settings GPTQ runs it with (``score_rule``)."""
    if settings.score_rule == "search" or not is_score_projection(name) or scheme.rule != "search":
        return scheme, settings
    if settings.score_rule == "absmax":
        return scheme.replace(rule="absmax"), settings
    return scheme, dataclasses.replace(settings, clip=False)


# ----------------------------------------------------------------- hessian
BAND = 1024  # rows of the Hessian cast at once while the matrix to factor is built


def inverse_factor(h: torch.Tensor, damp: float, where: str, perm: torch.Tensor | None = None,
                   diag: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of ``(P^T H P + d * mean(diag H) * I)^-1`` and the dampening ``d`` that worked.

    perm: the column order (None: as is). diag: ``H``'s diagonal in float64 when ``h`` itself is
    held narrower (the dampened diagonal is formed in float64 either way). Columns whose input
    was always zero get a unit diagonal (their weights then move no other column). The
    factorisation runs in float32, as the reference GPTQ does (the dampening bounds the
    condition number by about ``in_features / d``), and is retried in float64 when float32
    fails; if the dampened H is still not positive definite, larger dampening is tried
    (`DAMP_RETRIES`) with a warning naming the layer; a Hessian no dampening repairs (NaN or
    inf inputs) is an error.

    Memory: the permuted, order-reversed, dampened matrix is built a band of rows at a time
    straight in the factor's dtype, so no ``n x n`` float64 copy is made (an 8B model's
    ``down_proj`` Hessian is 14336 wide: 1.6 GB per float64 copy), and the Cholesky factor and
    the triangular solve overwrite their inputs.
    """
    n = h.shape[0]
    perm = torch.arange(n, device=h.device) if perm is None else perm
    d64 = (h.diagonal() if diag is None else diag).double()[perm]  # the permuted diagonal
    d64[d64 == 0] = 1.0
    mean = _strided_mean(d64)
    order = perm.flip(0)  # J P^T H P J: the permuted matrix with its order reversed
    for d in (damp, *(x for x in DAMP_RETRIES if x > damp)):
        u = _factor(h, order, (d64 + d * mean).flip(0))
        if u is not None:
            if d != damp:
                warnings.warn(f"GPTQ: the Hessian of {where} is singular with dampening {damp} (fraction of its "
                              f"mean diagonal); used {d} for it. Pass a larger --damp to choose it yourself, or "
                              "more calibration tokens (--nsamples, --seqlen)", stacklevel=2)
            return u, d
    raise ConfigError(f"GPTQ: the Hessian of {where} is not positive definite even with dampening "
                      f"{DAMP_RETRIES[-1]} of its mean diagonal (its calibration inputs hold NaN or inf?); check the "
                      "model's float outputs on the calibration data")


def _strided_mean(v: torch.Tensor) -> torch.Tensor:
    """``v.mean()`` summed as torch sums a matrix's diagonal view (a strided vector), bit for bit.

    torch reduces a contiguous vector in another order than a strided one; GPTQ has always
    taken the mean of the diagonal view, and the factor must not move by an ulp for it.
    """
    buf = torch.empty(v.shape[0], 2, dtype=v.dtype, device=v.device)
    buf[:, 0] = v
    return buf[:, 0].mean()


def _reordered(h: torch.Tensor, order: torch.Tensor, diag: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``h[order][:, order]`` in ``dtype`` with ``diag`` (float64) on its diagonal, cast a band of rows at a time."""
    n = h.shape[0]
    out = torch.empty(n, n, dtype=dtype, device=h.device)
    for start in range(0, n, BAND):
        rows = order[start:start + BAND]
        out[start:start + BAND] = h.index_select(0, rows).index_select(1, order)
    out.diagonal().copy_(diag)
    return out


def _factor(h: torch.Tensor, order: torch.Tensor, diag: torch.Tensor) -> torch.Tensor | None:
    """float32 upper factor of ``H^-1`` from ``A = J H J`` (float32, else float64), or None if H is not positive
    definite.

    With ``A = L L^T``: ``H^-1 = (J L^-1 J)^T (J L^-1 J)`` and ``J L^-1 J`` is upper
    triangular, so it is the factor wanted: one Cholesky and one triangular solve.
    """
    for dt in (torch.float32, torch.float64):
        a = _reordered(h, order, diag, dt)
        info = torch.linalg.cholesky_ex(a, out=(a, torch.empty((), dtype=torch.int32, device=a.device)))[1]
        if int(info) == 0:
            # column-major, as torch lays out the solution of its own: the solve then runs in place on it and
            # gives the same bits as the out-of-place solve (a row-major one solves the transposed system)
            inv = torch.eye(a.shape[0], dtype=dt, device=a.device).t()
            torch.linalg.solve_triangular(a, inv, upper=False, out=inv)
            del a
            u = inv.flip(0, 1)
            del inv
            u = u.float()
            if bool(torch.isfinite(u).all()):
                return u
    return None


# -------------------------------------------------------------------- core
def gptq_matrix(w: torch.Tensor, h: torch.Tensor, scheme: Scheme, settings: GPTQSettings,
                enc: torch.Tensor | None = None, where: str = "a layer", diag: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, Tensors, float]:
    """GPTQ of ``w [rows, in]`` under Hessian ``h [in, in]``: (grid values, stored tensors, dampening used).

    enc: per-row NVFP4 tensor scales (None for other schemes). diag: ``h``'s diagonal in float64
    when ``h`` is held in float32 (see `inverse_factor`). The stored tensors are
    `Grid.tensors`' (codes, scales, zeros, K-quant super-block scales or None), rows as ``w``'s.
    """
    rows, n = w.shape
    grid = make_grid(scheme, enc, n)
    grid.clip = settings.clip
    imp = (h.diagonal() if diag is None else diag).float().clamp_min(0)
    if not settings.act_order:
        perm = torch.arange(n, device=w.device)
    elif settings.group_aware:
        perm = group_aware_order(imp, grid.param_g)
    else:
        perm = torch.argsort(imp, descending=True, stable=True)
    u, d = inverse_factor(h, settings.damp, where, perm, diag)
    ng = -(-n // grid.round_g)
    scale = torch.zeros(rows, ng, device=w.device)
    zero = torch.zeros(rows, ng, device=w.device) if grid.zeros else None
    static = settings.static_groups or n <= grid.param_g
    if static:
        scale, zero = grid.params(to_groups(w.float(), grid.param_g), to_groups(imp.reshape(1, -1), grid.param_g)[0])
    loop = _Loop(w.float()[:, perm], u, perm, grid, imp, scale, zero, static)
    q = loop.run(settings.lazy_batch)
    out = torch.empty_like(q)
    out[:, perm] = q
    return out, grid.tensors(out, *loop.scales()), d


def group_aware_order(imp: torch.Tensor, group: int) -> torch.Tensor:
    """Act-order that keeps groups of ``group`` consecutive columns whole: column indices in visiting order.

    Groups are visited by decreasing largest importance (ties: the earlier group first), a
    group's columns by decreasing importance (ties: the earlier column first); the last group
    may be shorter. With one group this is plain act-order (``argsort(imp, descending)``).
    The largest rather than the summed importance ranks groups as act-order ranks their
    first columns (GPTQModel's default for its ``act_group_aware``).
    """
    n = imp.shape[0]
    cols = torch.argsort(imp, descending=True, stable=True)  # act-order over all columns
    gid = torch.arange(n, device=imp.device) // group
    top = torch.full((int(gid[-1]) + 1,), -torch.inf, device=imp.device).scatter_reduce(0, gid, imp, "amax")
    rank = torch.empty_like(gid[:top.numel()])
    rank[torch.argsort(top, descending=True, stable=True)] = torch.arange(top.numel(), device=imp.device)
    return cols[torch.argsort(rank[gid[cols]], stable=True)]  # stable: act-order kept inside each group


class _Loop:
    """The column loop over permuted columns with lazy batch updates.

    Weights are held transposed (``[in, rows]``), so a column and every update of it is
    one contiguous row; scales likewise (``[ngroups, rows]``). A column is rounded under
    the parameters of its rounding group (``grid.round_g`` columns); without static groups
    those are chosen when the loop first reaches a column of their parameter group
    (``grid.param_g`` columns: a K-quant's super-block holds several sub-blocks).
    """

    def __init__(self, w, u, perm, grid: Grid | KGrid, imp, scale, zero, static) -> None:
        self.w, self.u, self.grid, self.imp = w.T.contiguous(), u, grid, imp
        self.g, self.pg = grid.round_g, grid.param_g
        self.scale = scale.T.contiguous()
        self.zero = None if zero is None else zero.T.contiguous()
        self.orig = perm.tolist()  # permuted position -> original column
        self.pos = torch.empty_like(perm)
        self.pos[perm] = torch.arange(perm.numel(), device=perm.device)
        self.decided = [static] * -(-perm.numel() // self.pg)

    def run(self, batch: int) -> torch.Tensor:
        """Grid values ``[rows, in]`` of the permuted columns."""
        w, u = self.w, self.u
        n = w.shape[0]
        diag = u.diagonal().tolist()
        q = torch.empty_like(w)
        for i1 in range(0, n, batch):
            i2 = min(i1 + batch, n)
            w1, u1 = w[i1:i2].clone(), u[i1:i2, i1:i2]
            e1 = torch.empty_like(w1)
            for i in range(i2 - i1):
                c = self.orig[i1 + i]
                if not self.decided[c // self.pg]:
                    self._choose(c // self.pg, w1, e1, i1, i2, i)
                j = c // self.g
                col = w1[i]
                qc = self.grid.qdq(col, self.scale[j], None if self.zero is None else self.zero[j])
                q[i1 + i] = qc
                err = (col - qc).div_(diag[i1 + i])
                w1[i + 1:].addr_(u1[i, i + 1:], err, alpha=-1.0)
                e1[i] = err
            if i2 < n:
                w[i2:].addmm_(u[i1:i2, i2:].T, e1, alpha=-1.0)
        return q.T

    def _choose(self, j: int, w1, e1, i1: int, i2: int, i: int) -> None:
        """Parameters of parameter group ``j`` from the current (error-updated) weights of its columns."""
        n = self.w.shape[0]
        cols = torch.arange(j * self.pg, min((j + 1) * self.pg, n), device=self.w.device)
        pos = self.pos[cols]
        cur = torch.empty(cols.numel(), self.w.shape[1], device=self.w.device)
        inside = pos < i2
        cur[inside] = w1[pos[inside] - i1]
        out = pos[~inside]
        if out.numel():
            cur[~inside] = self.w[out] - self.u[i1:i1 + i, out].T @ e1[:i]
        sc, z = self.grid.params(cur.T.unsqueeze(1), self.imp[cols].reshape(1, -1), first=j)
        k = sc.shape[1]  # rounding groups in this parameter group
        self.scale[j * k:(j + 1) * k] = sc.T
        if self.zero is not None:
            self.zero[j * k:(j + 1) * k] = z.T  # type: ignore[union-attr]
        self.decided[j] = True

    def scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.scale.T.contiguous(), None if self.zero is None else self.zero.T.contiguous()


def gptq_layers(weights: Mapping[str, tuple[torch.Tensor, Scheme]], h: torch.Tensor, settings: GPTQSettings,
                tensor_scales: Mapping[str, torch.Tensor] | None = None, diag: torch.Tensor | None = None
                ) -> tuple[dict[str, QTensor], dict[str, float]]:
    """GPTQ of several Linears that read the same input (one Hessian): name -> QTensor, and their errors.

    diag: ``h``'s float64 diagonal when ``h`` is held in float32 (`narrow_hessian`).

    Layers with one scheme (and one ``score_rule`` variant, `_variant`) are stacked row-wise (GPTQ treats rows independently, so this
    is the same result for one factorisation and one column loop). The error of each
    layer is ``tr(D H D^T) / tr(W H W^T)`` with ``D = W - Q``: its relative output error
    on the calibration inputs.
    """
    by_scheme: dict[tuple[Scheme, Scheme, GPTQSettings], list[str]] = {}
    for name, (_, s) in weights.items():
        by_scheme.setdefault((s, *_variant(name, s, settings)), []).append(name)
    out: dict[str, QTensor] = {}
    errs: dict[str, float] = {}
    damp_used = settings.damp
    for (scheme, rule_scheme, run), names in by_scheme.items():
        ws = [weights[n][0].detach().float() for n in names]
        given = tensor_scales or {}
        encs = [given[n] if n in given else own_tensor_scale(x, scheme) for n, x in zip(names, ws, strict=True)]
        enc_rows = None if encs[0] is None else torch.cat([e.expand(x.shape[0]) for e, x in zip(encs, ws, strict=True)])
        stack = torch.cat(ws)
        deq, (codes, scale, zero, sup), d = gptq_matrix(stack, h, rule_scheme, run, enc_rows, ", ".join(names), diag)
        damp_used = max(damp_used, d)
        r0 = 0
        for name, x, enc in zip(names, ws, encs, strict=True):
            r1 = r0 + x.shape[0]
            # K-quants: per-row super-block scales; NVFP4: the layer's own copy of its (maybe shared) tensor scale
            ts = sup[r0:r1].contiguous() if sup is not None else None if enc is None else enc.clone()
            out[name] = QTensor(codes[r0:r1].contiguous(), scale[r0:r1].contiguous(),
                                None if zero is None else zero[r0:r1].contiguous(), ts, tuple(x.shape), scheme)
            errs[name] = _relative_error(x, deq[r0:r1], h)
            r0 = r1
    return out, {"damp": damp_used, **{f"err/{n}": e for n, e in errs.items()}}


def _relative_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    hf = h.float()
    d = w - q
    return float((d @ hf * d).sum() / (w @ hf * w).sum().clamp_min(1e-30))


# ------------------------------------------------------------ block tuner
class _Stop(Exception):
    """Raised by a hook once the inputs it needs have been seen (the rest of the block need not run)."""


def input_groups(block: nn.Module, mods: Mapping[str, nn.Module], x: torch.Tensor, kwargs: Mapping[str, Any]
                 ) -> list[list[str]]:
    """The planned Linears grouped by shared input tensor, groups in the order the block runs them."""
    seen: list[tuple[str, torch.Tensor]] = []

    def hook(name: str):
        def fn(_m: nn.Module, args: tuple) -> None:
            if all(n != name for n, _ in seen):
                seen.append((name, args[0]))
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in mods.items()]
    try:
        with torch.no_grad():
            block(x, **kwargs)
    finally:
        for hd in handles:
            hd.remove()
    missing = [n for n in mods if all(n != s for s, _ in seen)]
    if missing:
        raise ConfigError(f"GPTQ: {missing[:3]} never ran in a forward pass of their block; they cannot be "
                          "quantized from calibration inputs")
    groups: list[tuple[torch.Tensor, list[str]]] = []
    for name, inp in seen:
        for t, names in groups:
            if t is inp:
                names.append(name)
                break
        else:
            groups.append((inp, [name]))
    return [names for _, names in groups]


def hessians(block: nn.Module, mods: Mapping[str, nn.Module], x: torch.Tensor, kwargs: Mapping[str, Any],
             stop: bool, chunk: int = CHUNK, device: torch.device | None = None,
             dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``X^T X`` (float64) of each module's input over all samples; ``stop`` ends each forward there.

    ``x`` may be a compact cache (bf16, or in host memory): each chunk is moved to
    ``device`` in ``dtype`` (the block's) before it runs.
    """
    handles = []
    if stop:
        def halt(_m: nn.Module, _a: tuple) -> None:
            raise _Stop
    with torch.no_grad(), activation_stats(mods, ("xtx",), torch.float32) as st:
        if stop:
            handles = [m.register_forward_pre_hook(halt) for m in mods.values()]
        try:
            for part in x.split(chunk):
                part = part.to(device or part.device, non_blocking=True).to(dtype or part.dtype)
                try:
                    block(part, **kwargs)
                except _Stop:
                    pass
        finally:
            for hd in handles:
                hd.remove()
    return st.result("xtx", torch.float64, device or x.device)  # with the weights, wherever the cache is


def narrow_hessian(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 Hessian as (float32 matrix, float64 diagonal): half the memory, the same GPTQ.

    The float32 factorisation, the importance and the error read the matrix through float32
    anyway; only the dampened diagonal is formed in float64, so it keeps its own copy. Only
    the rare float64 retry of a factorisation that failed in float32 sees float32-rounded
    off-diagonal entries.
    """
    diag = h.diagonal().clone()
    return h.float(), diag


class GPTQTuner:
    """The pipeline's per-block tuner: GPTQ of each group of Linears, in execution order."""

    needs_importance = False
    needs_targets = False  # GPTQ reads only the quantized inputs: the pipeline skips the FP chain

    def __init__(self, settings: GPTQSettings) -> None:
        self.settings = settings

    def __call__(self, job: BlockJob) -> tuple[dict[str, QTensor | QuantStack], dict[str, float]]:
        mods = {n: job.block.get_submodule(rel) for n, (rel, _) in block_linears(job.block, job.layers).items()}
        experts = experts_in(job.block, job.layers)
        if not mods and not experts:
            return {}, {}
        first = job.fetch(job.x, torch.arange(1, device=job.x.device))
        # a recipe that quantizes a layer's input: its Hessian is built from the inputs it will see
        quantizers = [mods[n].register_forward_pre_hook(_input_hook(q)) for n, q in job.inputs.items() if n in mods]
        groups = input_groups(job.block, mods, first, job.kwargs) if mods else []
        original = {n: m.weight for n, m in mods.items()}
        seq = self.settings.true_sequential
        qts: dict[str, QTensor | QuantStack] = {}
        errs: list[float] = []
        damp = self.settings.damp
        try:
            where = {"device": job.device, "dtype": job.dtype}
            hs = {} if seq or not groups else hessians(job.block, {g[0]: mods[g[0]] for g in groups}, job.x,
                                                       job.kwargs, False, **where)
            for group in groups:
                h, diag = narrow_hessian(
                    hessians(job.block, {group[0]: mods[group[0]]}, job.x, job.kwargs, True, **where)[group[0]]
                    if seq else hs.pop(group[0]))
                out, info = gptq_layers({n: (mods[n].weight, job.layers[n][1]) for n in group}, h, self.settings,
                                        job.tensor_scales, diag)
                del h
                damp = max(damp, info["damp"])
                errs += [v for k, v in info.items() if k.startswith("err/")]
                for n in group:
                    qts[n] = out[n]
                    mods[n].weight = nn.Parameter(out[n].dequantize(original[n].dtype), requires_grad=False)
            # experts after the Linears: their Hessians from inputs through the quantized attention
            stacks, expert_errs, expert_damp = self._experts(job, experts)
            qts |= stacks
            errs += expert_errs
            damp = max(damp, expert_damp)
        finally:
            for n, m in mods.items():
                m.weight = original[n]
            for hd in quantizers:
                hd.remove()
        return qts, {"loss": sum(errs) / max(len(errs), 1), "damp": damp}

    def _experts(self, job: BlockJob, experts: Mapping[str, Mapping[str, tuple[str, Scheme]]]
                 ) -> tuple[dict[str, QuantStack], list[float], float]:
        """GPTQ of the block's planned experts modules (per-expert Hessians, `lowbit.ptq.gptq_experts`)."""
        s = self.settings
        damp = [s.damp]

        def run() -> None:
            with torch.no_grad():
                for part in job.x.split(CHUNK):
                    job.block(part.to(job.device or part.device).to(job.dtype or part.dtype), **job.kwargs)

        def one(w: torch.Tensor, scheme: Scheme, h: torch.Tensor, where: str) -> tuple[QTensor, float]:
            out, info = gptq_layers({where: (w, scheme)}, h, s)
            damp.append(info["damp"])
            return out[where], info[f"err/{where}"]

        stacks: dict[str, QuantStack] = {}
        errs: list[float] = []
        coverage = []
        for rel, planned in experts.items():
            full = next(iter(planned.values()))[0].rsplit(".", 1)[0]  # the model's name of the experts module
            got, e, cov = gptq_experts(job.block.get_submodule(rel), full, planned, run, one, s.all_experts,
                                       s.min_expert_tokens, s.true_sequential, job.expert_inputs,
                                       s.affinity_floor if s.expert_affinity else None)
            stacks |= got
            errs += e
            coverage.append(cov)
        if coverage:
            report(coverage, s.min_expert_tokens)
        return stacks, errs, max(damp)


def _input_hook(quantizer: nn.Module):
    """A forward pre-hook that hands the layer (and the statistics hooks after it) its quantized input."""
    def fn(_m: nn.Module, args: tuple) -> tuple:
        return (quantizer(args[0]), *args[1:])
    return fn


def gptq_quantize(model: nn.Module, plan: Plan, settings: GPTQSettings, calib: torch.Tensor,
                  **context: Any) -> tuple[Plan, list[dict[str, float]]]:
    """Quantize ``model`` in place with GPTQ block by block; returns the plan applied and per-block info.

    context: the other `RunContext` fields (device, workdir, offload_dir, cache_device,
    progress). With ``search`` the plan's schemes take the ``search`` rule (as RTN's),
    which is what their stored scales were chosen by.
    """
    return _quantize(model, plan, settings, RunContext(calib=calib, **context))


def _quantize(model: nn.Module, plan: Plan, settings: GPTQSettings, ctx: RunContext
              ) -> tuple[Plan, list[dict[str, float]]]:
    if ctx.calib is None or ctx.calib.numel() == 0:
        raise ConfigError("GPTQ needs calibration batches (LongTensor [nsamples, seqlen])")
    check_plan(settings, plan)
    if settings.search and settings.choose_rule:
        if ctx.workdir or ctx.offload_dir:
            raise ConfigError("--choose-rule quantizes two copies of the model in memory and compares them; it cannot "
                              "resume from --workdir or offload to --offload-dir: drop those or --choose-rule")
        materialize(model)  # both copies whole: the loss needs every block
        return choose_rule(model, lambda m, c, search: _quantize(
            m, plan if search else _absmax(plan), dataclasses.replace(
                settings, search=search, choose_rule=False, score_rule=settings.score_rule if search else "search"),
            dataclasses.replace(ctx, calib=c)), ctx.calib, ctx.device)
    recorded, opts, plan = _work(settings, plan, ctx)
    return plan, quantize_blockwise(model, plan, GPTQTuner(settings), recorded, ctx, opts)


def _absmax(plan: Plan) -> Plan:
    """The plan with searched schemes on abs-max scales (the other candidate of ``choose_rule``)."""
    return plan.with_weights({n: s.replace(rule="absmax") if s.rule == "search" else s
                              for n, s in plan.weights().items()})


def _work(settings: GPTQSettings, plan: Plan, _ctx: RunContext) -> tuple[dict, PipelineOptions, Plan]:
    """What GPTQ hands the engine: recorded settings, options, and the plan it applies (searched rule)."""
    opts = PipelineOptions(chunk=CHUNK)
    return {"method": "gptq", "config": settings.to_dict()}, opts, searched(plan) if settings.search else plan


def _run(model: nn.Module, plan: Plan, settings: GPTQSettings, ctx: RunContext) -> Plan:
    return _quantize(model, plan, settings, ctx)[0]


register(Method("gptq", GPTQSettings, _run, blockwise=True, needs_calib=lambda _s: True,
                summary="GPTQ: column-by-column rounding with Hessian error feedback, block by block",
                check_plan=check_plan, work=_work))
