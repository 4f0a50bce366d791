"""SignRound (V1): learned rounding offsets and clip factors, tuned by signed gradient descent.

Per group ``W_hat = s * (clip(round(W/s + V) + z, qmin, qmax) - z)`` where ``V`` (one per
weight, starts at 0) nudges each weight to the other rounding neighbour and the scale
``s`` comes from the group's range times learnable clip factors (alpha on the max side,
beta on the min side, in [0, 1]). The block's output MSE against its FP output is
minimised with ``theta -= lr * sign(grad)``, lr = 1/iters decayed linearly to 0, so the
total movement of V stays below 0.5 without clamping. The parameters of the best loss
seen are kept. With ``iters=0`` the result is exactly round-to-nearest.

The rounders here are small ``nn.Module`` s: ``forward()`` gives the differentiable
fake-quantized weight, ``export()`` the `QTensor` whose dequantization equals it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.errors import ConfigError, SchemeError
from lowbit.formats import QTensor, Scheme
from lowbit.formats.groups import from_groups, pad_mask, to_groups
from lowbit.formats.integer import cast_scale, search_int_params
from lowbit.formats.plan import Plan
from lowbit.nn import round_ste, set_module
from lowbit.nn.precision import resolve_dtype
from lowbit.ptq import register
from lowbit.ptq.pipeline import BlockJob, PipelineOptions, quantize_blockwise, run_block

TUNE_DTYPES = ("auto", "bf16", "fp32")
# "auto" keeps blocks of <= this many bits in fp32: at W2 the bf16 products cost ~0.75 ppl on average
AUTO_FP32_BITS = 2


@dataclass(frozen=True)
class SignRoundConfig:
    """Tuning settings (defaults follow the reference: 200 iters, batch 8).

    lr: None = 1/iters. lr_low_bits: lr used instead for schemes of <= 3 bits (preset best).
    v2: SignRoundV2 — importance-searched initial scale and a learned multiplier in [0, 2].
    loss_filter: drop the largest ``filter_frac`` of |pred - ref| from the MSE;
        None = on for V2 at every width (the reference turns it on below 4 bits only;
        measured on the bundled model at W4 g128, 50 iters: ppl 15.99 off, 15.80 on).
    tune_dtype: the precision of the tuned Linears' products while tuning. "bf16" runs those
        GEMMs (forward and both gradients) in bf16 while everything else stays fp32: the
        rounding offsets and scales, norms, attention, residuals, targets and loss. Only the
        sign of each gradient is used. On CPUs with AVX512-BF16 (and on GPUs) bf16 GEMMs run
        several times faster than fp32. "fp32" is the exact reference; "auto" (the default) =
        bf16 where the hardware has fast bf16 products, for blocks whose schemes all have
        more than 2 bits, else fp32. Measured on the bundled model (50 iters, ppl): W4 g128
        bf16 15.87 / 15.79 (2 seeds) vs 15.80 fp32, W3 g128 18.22 vs 18.51, but W2 g64 bf16
        27.58-28.92 (5 runs, mean 28.2) vs fp32 27.26 / 26.91 / 28.13 (mean 27.4; auto-round
        V2 27.53 fp32, 27.68 amp), so 2-bit blocks stay fp32 under "auto". Preset "best"
        pins fp32. SignRoundV2's DeltaLoss passes (mixed precision) follow the hardware rule
        only: they rank layers, and bf16 ranked them as fp32 did.
    """

    iters: int = 200
    lr: float | None = None
    lr_low_bits: float | None = None
    batch_size: int = 8
    seed: int = 0
    v2: bool = False
    loss_filter: bool | None = None
    filter_frac: float = 1e-3
    fp_scale_lr: float = 0.1
    fp_inputs: bool = False
    tune_dtype: str = "auto"
    device: str = "cpu"
    offload_dir: str | None = None

    def __post_init__(self) -> None:
        if self.tune_dtype not in TUNE_DTYPES:
            raise ConfigError(f"tune_dtype must be one of {sorted(TUNE_DTYPES)}, got {self.tune_dtype!r}")
        if self.iters < 0:
            raise ConfigError(f"iters must be >= 0, got {self.iters}")
        if self.batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {self.batch_size}")
        if not 0 <= self.filter_frac < 1:
            raise ConfigError(f"filter_frac must be in [0, 1), got {self.filter_frac}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def product_dtype(self, bits: int, device: torch.device | str) -> str:
        """"bf16" or "fp32" for a block whose narrowest scheme has ``bits`` bits."""
        if self.tune_dtype == "auto" and bits <= AUTO_FP32_BITS:
            return "fp32"
        return resolve_dtype(self.tune_dtype, device)

    def step_size(self, bits: int) -> float:
        if self.lr_low_bits is not None and bits <= 3:
            return self.lr_low_bits
        return self.lr if self.lr is not None else 1.0 / max(self.iters, 1)


PRESETS: dict[str, dict[str, Any]] = {
    "light": {"iters": 50},
    "default": {"iters": 200},
    "best": {"iters": 1000, "lr_low_bits": 2e-3, "tune_dtype": "fp32"},
}
PRESET_NSAMPLES = {"light": 128, "default": 128, "best": 512}


def make_config(preset: str | None = None, **overrides: Any) -> SignRoundConfig:
    """A config from a preset name plus explicit overrides (None values ignored)."""
    base: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown signround preset {preset!r}; choose one of {sorted(PRESETS)}")
        base.update(PRESETS[preset])
    fields = {f.name for f in dataclasses.fields(SignRoundConfig)}
    unknown = sorted(k for k, v in overrides.items() if v is not None and k not in fields)
    if unknown:
        raise ConfigError(f"unknown signround options {unknown}; known: {sorted(fields)}")
    base.update({k: v for k, v in overrides.items() if v is not None})
    return SignRoundConfig(**base)


# ------------------------------------------------------------------ rounders
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
                ext = wg.gather(-1, wg.abs().argmax(-1, keepdim=True)).squeeze(-1)
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


ROUNDERS: dict[str, type[nn.Module]] = {"int": IntRounder}


def make_rounder(w: torch.Tensor, scheme: Scheme, imp: torch.Tensor | None, v2: bool) -> nn.Module:
    _load_fp_rounders()
    if scheme.elem not in ROUNDERS:
        raise SchemeError(f"SignRound has no rounder for {scheme.elem} elements yet; "
                          f"use one of {sorted(ROUNDERS)} or --method rtn")
    return ROUNDERS[scheme.elem](w, scheme, imp, v2)


def _load_fp_rounders() -> None:
    try:
        import lowbit.ptq.fp_rounders  # noqa: F401  (registers e2m1 when the FP4 formats exist)
    except ImportError:
        pass


class TunedLinear(nn.Module):
    """A Linear whose weight is its rounder's fake-quantized output (used while tuning).

    ``dtype`` (e.g. bf16) casts input, weight and bias for the product only and returns the
    input's dtype, so just the GEMMs run in low precision. Autocast over the whole block was
    measured worse at W2 g64 (ppl 28.98 vs 27.26 in fp32), likely from bf16 attention.
    """

    def __init__(self, linear: nn.Linear, rounder: nn.Module, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.rounder = rounder
        self.dtype = dtype
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.rounder(), self.bias
        if self.dtype is None or self.dtype == x.dtype:
            return F.linear(x, w, b)
        b = None if b is None else b.to(self.dtype)
        return F.linear(x.to(self.dtype), w.to(self.dtype), b).to(x.dtype)


# ------------------------------------------------------------------- tuning
def filtered_mse(pred: torch.Tensor, ref: torch.Tensor, frac: float) -> torch.Tensor:
    """MSE without the ``k = floor(numel * frac)`` elements of largest |pred - ref|."""
    err = (pred - ref).reshape(-1).pow(2)
    k = int(err.numel() * frac)
    if k == 0:
        return err.mean()
    # zero the k largest in place of a boolean mask (whose indexing copies twice and costs
    # a nonzero); summing all and subtracting the top would cancel away the small errors
    # when the outliers are ~1e6 times larger, which is exactly when filtering matters
    top = err.detach().topk(k, sorted=False).indices
    return err.index_fill(0, top, 0.0).sum() / (err.numel() - k)


def epoch_batches(n: int, batch_size: int, steps: int, gen: torch.Generator) -> list[torch.Tensor]:
    """``steps`` mini-batches of sample indices, drawn without replacement within an epoch.

    Every sample is used once per epoch (a shuffle cut into batches; a remainder smaller
    than a batch is dropped and the next epoch reshuffles), so 50 steps over 32 samples
    see each sample ~12 times instead of a random-with-replacement count.
    """
    bs = min(batch_size, n)
    out: list[torch.Tensor] = []
    while len(out) < steps:
        perm = torch.randperm(n, generator=gen)
        out.extend(perm[i: i + bs] for i in range(0, n - bs + 1, bs))
    return out[:steps]


def sign_step(params: list[nn.Parameter], lr: float) -> None:
    """``p -= lr * sign(grad)`` for every parameter, then clear the gradients.

    One multi-tensor sign and one multi-tensor add for the whole list: per-parameter ops
    cost three kernel launches each, which on a GPU is most of a small block's step.
    ``p + (-lr) * sign`` is bitwise ``p - lr * sign`` (the product is exact).
    """
    live = [p for p in params if p.grad is not None]
    if not live:
        return
    with torch.no_grad():
        signs = torch._foreach_sign([p.grad for p in live])
        torch._foreach_add_(live, signs, alpha=-lr)
    for p in live:
        p.grad = None


def narrowest_bits(job: BlockJob) -> int:
    """The fewest bits among the block's schemes: step size and product dtype follow it."""
    return min(s.bits for _, s in job.layers.values())


class SignRoundTuner:
    """The pipeline's per-block tuner (SignRound V1 or V2 by ``config.v2``)."""

    def __init__(self, config: SignRoundConfig) -> None:
        self.config = config
        self.needs_importance = config.v2

    def __call__(self, job: BlockJob) -> tuple[dict[str, QTensor], dict[str, float]]:
        cfg = self.config
        frozen = [(p, p.requires_grad) for p in job.block.parameters()]
        for p, _ in frozen:
            p.requires_grad_(False)
        rounders = self._wrap(job)
        try:
            info = self._tune(job, rounders) if cfg.iters > 0 and rounders else {}
            return {n: r.export() for n, r in rounders.items()}, info
        finally:
            for p, flag in frozen:
                p.requires_grad_(flag)

    def _wrap(self, job: BlockJob) -> dict[str, nn.Module]:
        rounders = {}
        bits = narrowest_bits(job)
        dtype = torch.bfloat16 if self.config.product_dtype(bits, job.x.device) == "bf16" else None
        for name, (rel, scheme) in job.layers.items():
            lin = job.block.get_submodule(rel)
            imp = None if job.imp is None else job.imp[name]
            r = make_rounder(lin.weight.detach(), scheme, imp, self.config.v2)
            set_module(job.block, rel, TunedLinear(lin, r, dtype))
            rounders[name] = r
        return rounders

    def _use_filter(self, job: BlockJob) -> bool:
        if self.config.loss_filter is not None:
            return self.config.loss_filter
        return self.config.v2  # every width, not only < 4 bits: at W4 it took ppl 15.99 -> 15.80

    def _groups(self, rounders: Mapping[str, nn.Module]) -> list[tuple[list[nn.Parameter], float]]:
        """(parameters, lr multiplier): rounding offsets at lr, FP block-scale factors at fp_scale_lr."""
        groups = []
        for r in rounders.values():
            if r.scheme.is_fp:
                groups.append(([r.v], 1.0))
                groups.append(([p for p in r.parameters() if p is not r.v], self.config.fp_scale_lr))
            else:
                groups.append((list(r.parameters()), 1.0))
        return groups

    def _tune(self, job: BlockJob, rounders: Mapping[str, nn.Module]) -> dict[str, float]:
        cfg = self.config
        params = [p for r in rounders.values() for p in r.parameters()]
        groups = self._groups(rounders)
        lr0 = cfg.step_size(narrowest_bits(job))
        frac = cfg.filter_frac if self._use_filter(job) else 0.0
        gen = torch.Generator().manual_seed(cfg.seed * 100003 + job.index)
        batches = epoch_batches(job.x.shape[0], cfg.batch_size, cfg.iters, gen)
        # the best parameters so far live in buffers allocated once: re-cloning on every
        # improvement briefly held two copies of every rounding offset
        best, best_state, first = float("inf"), [torch.empty_like(p) for p in params], None
        for t in range(cfg.iters):
            idx = batches[t].to(job.x.device)
            pred = run_block(job.block, job.x[idx], job.kwargs, cfg.batch_size)
            loss = filtered_mse(pred, job.y[idx], frac)
            value = float(loss.detach())
            first = value if first is None else first
            if value < best:
                best = value
                with torch.no_grad():
                    torch._foreach_copy_(best_state, params)
            loss.backward()
            lr = lr0 * (1.0 - t / cfg.iters)
            for ps, mult in groups:
                sign_step(ps, lr * mult)
            for r in rounders.values():
                r.clamp_()
        with torch.no_grad():
            if best < float("inf"):  # a NaN loss never improves: keep the parameters as they are
                torch._foreach_copy_(params, best_state)
        return {"rtn_loss": first or 0.0, "loss": best}


def signround_quantize(model: nn.Module, tokenizer: Any, plan: Plan, config: SignRoundConfig,
                       calib_batches: torch.Tensor, workdir: str | None = None, progress: bool = True
                       ) -> list[dict[str, float]]:
    """Quantize ``model`` in place with SignRound (``config.v2`` for V2); returns per-block info.

    tokenizer is unused by the tuning itself (kept for a uniform method signature).
    """
    del tokenizer
    if calib_batches is None or calib_batches.numel() == 0:
        raise ConfigError("SignRound needs calibration batches (LongTensor [nsamples, seqlen])")
    method = "signround2" if config.v2 else "signround"
    opts = PipelineOptions(fp_inputs=config.fp_inputs, chunk=config.batch_size, device=config.device,
                           offload_dir=config.offload_dir)
    settings = {"method": method, "config": {k: v for k, v in config.to_dict().items()
                                             if k not in ("device", "offload_dir")}}
    return quantize_blockwise(model, plan, calib_batches, SignRoundTuner(config), settings, opts,
                              workdir=workdir, progress=progress)


def method_config(preset: str | None, v2: bool, **kw: Any) -> SignRoundConfig:
    """Config from the keyword arguments `quantize_model` passes (unknown keys ignored)."""
    keys = {"iters", "lr", "batch_size", "seed", "loss_filter", "fp_inputs", "tune_dtype", "device", "offload_dir"}
    return make_config(preset, v2=v2, **{k: v for k, v in kw.items() if k in keys})


def _method(model: nn.Module, plan: Plan, *, calib: torch.Tensor | None = None, tokenizer: Any = None,
            progress: bool = True, preset: str | None = None, workdir: str | None = None,
            config: SignRoundConfig | None = None, **kw: Any) -> Plan:
    cfg = config or method_config(preset, False, **kw)
    signround_quantize(model, tokenizer, plan, cfg, calib, workdir=workdir, progress=progress)
    return plan


register("signround", _method)
