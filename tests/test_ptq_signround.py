"""SignRound / SignRoundV2 tuning: better than RTN, loss filter, rounder export, configs."""

import copy
import math

import pytest
import torch
from ptq_helpers import calib, tiny_model, uniform

from lowbit.errors import ConfigError, SchemeError
from lowbit.formats import Scheme, qdq
from lowbit.models.layers import decoder_blocks
from lowbit.ptq import MixedSettings, quantize_model
from lowbit.ptq.blockwise import capture_inputs
from lowbit.ptq.int_rounder import IntRounder
from lowbit.ptq.rtn import rtn_quantize
from lowbit.ptq.signround import (
    epoch_batches,
    filtered_mse,
    make_config,
    sign_step,
    signround_quantize,
)


def block0_mse(model, fp, c) -> float:
    x, kw = capture_inputs(fp, decoder_blocks(fp)[0], c, torch.device("cpu"))
    with torch.no_grad():
        return float((model.model.layers[0](x, **kw) - fp.model.layers[0](x, **kw)).pow(2).mean())


@pytest.mark.parametrize("scheme,v2,dtype", [("w2g32", False, "fp32"), ("w3g32a", False, "fp32"),
                                             ("w2g32", True, "fp32"), ("w2g32", True, "bf16")])
def test_tuning_reduces_block_output_mse_vs_rtn(scheme, v2, dtype):
    m = tiny_model(layers=1)
    c = calib(16, 32)
    rtn, sr = copy.deepcopy(m), copy.deepcopy(m)
    rtn_quantize(rtn, uniform(m, scheme), progress=False)
    cfg = make_config(iters=60, batch_size=8, v2=v2, tune_dtype=dtype)
    signround_quantize(sr, uniform(m, scheme), cfg, c, progress=False)
    assert block0_mse(sr, m, c) < 0.8 * block0_mse(rtn, m, c)


def test_bf16_tuning_runs_the_block_products_in_bf16(monkeypatch):
    """The bf16 option must really reach the block's Linears (and fp32 must not)."""
    import torch.nn.functional as F

    from lowbit.ptq import signround

    seen: list[torch.dtype] = []
    real = F.linear

    def spy(x, w, b=None):
        out = real(x, w, b)
        seen.append(out.dtype)
        return out

    from lowbit.nn import precision

    monkeypatch.setattr(signround.F, "linear", spy)
    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset({"avx512_bf16"}))
    m = tiny_model(layers=1)
    cases = (("bf16", "w4g32", True), ("fp32", "w4g32", False), ("auto", "w4g32", True), ("auto", "w2g32", False))
    for dtype, scheme, tuned_in_bf16 in cases:
        seen.clear()
        signround_quantize(copy.deepcopy(m), uniform(m, scheme), make_config(iters=2, tune_dtype=dtype),
                           calib(8, 16), progress=False)
        # targets and propagation stay fp32 either way; only the tuning products change
        assert torch.float32 in seen and (torch.bfloat16 in seen) == tuned_in_bf16


def test_auto_dtype_follows_the_cpu_flags(monkeypatch):
    from lowbit.nn import precision

    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert precision.resolve_dtype("auto", "cpu") == "bf16"
    # 2-bit blocks stay fp32 under auto (bf16 cost ~0.75 ppl at W2 g64); explicit bf16 is obeyed
    cfg = make_config()
    assert cfg.product_dtype(4, "cpu") == "bf16" and cfg.product_dtype(3, "cpu") == "bf16"
    assert cfg.product_dtype(2, "cpu") == "fp32"
    assert make_config(tune_dtype="bf16").product_dtype(2, "cpu") == "bf16"
    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset({"avx2"}))
    assert precision.resolve_dtype("auto", "cpu") == "fp32"
    assert cfg.product_dtype(4, "cpu") == "fp32" and make_config(tune_dtype="bf16").product_dtype(4, "cpu") == "bf16"
    assert precision.resolve_dtype("fp32", "cpu") == "fp32"


def test_filtered_mse_drops_exactly_k_largest():
    torch.manual_seed(0)
    pred, ref = torch.randn(4, 50, 10), torch.randn(4, 50, 10)  # 2000 elements -> k = 2
    err = (pred - ref).reshape(-1).pow(2).sort().values
    assert torch.allclose(filtered_mse(pred, ref, 1e-3), err[:-2].mean())
    assert torch.allclose(filtered_mse(pred, ref, 0.0), err.mean())
    big = torch.zeros(3000)
    big[[5, 17, 900]] = 100.0  # k = 3 outliers vanish entirely
    assert filtered_mse(big, torch.zeros(3000), 1e-3).item() == 0.0
    # outliers 1e12 times the rest must not swallow the rest, and get no gradient
    small = torch.full((3000,), 1e-3)
    small[[5, 17, 900]] = 1e3
    small.requires_grad_(True)
    loss = filtered_mse(small, torch.zeros(3000), 1e-3)
    assert math.isclose(loss.item(), 1e-6, rel_tol=1e-5)
    loss.backward()
    assert torch.all(small.grad[[5, 17, 900]] == 0) and torch.allclose(small.grad[:5], torch.tensor(2e-3 / 2997))


def test_sign_step_moves_by_lr_times_sign():
    p = torch.nn.Parameter(torch.tensor([1.0, 1.0, 1.0]))
    p.grad = torch.tensor([3.0, -0.1, 0.0])
    sign_step([p], 0.25)
    assert torch.equal(p.detach(), torch.tensor([0.75, 1.25, 1.0])) and p.grad is None


@pytest.mark.parametrize("scheme", ["w4g32", "w3g32a", "w2g64", "w8", "w4g32:full=0"])
def test_rounder_export_matches_forward_and_rtn_at_init(scheme):
    s = Scheme.parse(scheme)
    w = torch.randn(8, 80)  # ragged last group for g32
    r = IntRounder(w, s)
    assert torch.equal(r(), qdq(w, s))
    with torch.no_grad():
        r.v.uniform_(-0.5, 0.5)
        if hasattr(r, "alpha"):
            r.alpha.uniform_(0.7, 1.0)
            r.beta.uniform_(0.7, 1.0)
    assert torch.equal(r.export().dequantize(), r())


@pytest.mark.parametrize("scheme,v2", [("w4g32", False), ("w2g32", True), ("w3g32", True), ("w4g32:full=0", False)])
def test_fused_symmetric_rounder_equals_autograd_through_the_expression(scheme, v2):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(8, 80, generator=gen)  # ragged last group
    grads = []
    for fused in (True, False):
        r = IntRounder(w, Scheme.parse(scheme), imp=torch.rand(80, generator=torch.Generator().manual_seed(1)), v2=v2)
        with torch.no_grad():
            r.v.copy_(torch.rand(r.v.shape, generator=torch.Generator().manual_seed(2)) - 0.5)
            for p in r.parameters():
                if p is not r.v:
                    p.mul_(0.9)
        y = r() if fused else r.reference_forward()
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
        (y * g).sum().backward()
        grads.append([y.detach()] + [p.grad for p in r.parameters()])
    for got, ref in zip(grads[0], grads[1], strict=True):
        if ref is None:  # V1 symmetric never uses beta
            assert got is None
            continue
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_rounder_gradients_reach_v_and_clip_factors():
    r = IntRounder(torch.randn(4, 64), Scheme.parse("w3g32a"))
    r().pow(2).sum().backward()
    assert r.v.grad.abs().sum() > 0 and r.alpha.grad.abs().sum() > 0 and r.beta.grad.abs().sum() > 0
    r2 = IntRounder(torch.randn(4, 64), Scheme.parse("w2g32"), imp=torch.rand(64), v2=True)
    r2().pow(2).sum().backward()
    assert r2.m.grad.abs().sum() > 0
    with torch.no_grad():
        r2.m.fill_(5.0)
    r2.clamp_()
    assert r2.m.max() == 2.0


def test_presets_and_bad_options():
    assert make_config("light").iters == 50
    assert make_config("best").step_size(2) == 2e-3 and make_config("best").step_size(4) == 1e-3
    assert make_config(iters=200).step_size(4) == 5e-3 and make_config(iters=50).step_size(4) == 1 / 50
    assert make_config(iters=5).step_size(4) == 1 / 20  # issue 38: lr 0.2 at 5 iterations only made it worse
    assert make_config().tune_dtype == "auto" and make_config("best").tune_dtype == "fp32"
    with pytest.raises(ConfigError, match="preset"):
        make_config("fast")
    with pytest.raises(ConfigError, match="unknown signround options"):
        make_config(itres=3)
    with pytest.raises(ConfigError, match="iters"):
        make_config(iters=-1)
    with pytest.raises(ConfigError, match="tune_dtype"):
        make_config(tune_dtype="fp16")


def test_registered_methods_dispatch():
    m = tiny_model(layers=1)
    fast = {"iters": 2, "batch_size": 4}
    plan = quantize_model(copy.deepcopy(m), uniform(m, "w4g32"), "signround", fast, calib=calib(), progress=False)
    assert plan.is_uniform
    for method in ("rtn", "signround", "signround2"):  # a mixed plan first, then any method applies it
        mixed = quantize_model(copy.deepcopy(m), uniform(m, "w4g32"), method, None if method == "rtn" else fast,
                               calib=calib(), mixed=MixedSettings(3.5, ("w2g32", "w4g32")), progress=False)
        assert {s.replace(rule="absmax") for s in mixed.schemes()} <= {Scheme.parse("w2g32"), Scheme.parse("w4g32")}
        assert len(mixed) == len(plan)
    with pytest.raises(ConfigError, match="--iters does not apply to --method rtn; it applies to --method "
                                          "signround | signround2"):
        quantize_model(copy.deepcopy(m), uniform(m, "w4g32"), "rtn", {"iters": 3}, calib=calib())
    with pytest.raises(ConfigError, match="needs calibration"):
        quantize_model(copy.deepcopy(m), uniform(m, "w4g32"), "rtn")
    with pytest.raises(SchemeError, match="unknown scheme"):
        MixedSettings(3.0, ("w2g32", "int3"))


FP_SCHEMES = ["nvfp4", "nvfp4-46", "mxfp4", "mxfp8", "nvfp4-ue5m3"]


@pytest.mark.parametrize("scheme", FP_SCHEMES)
def test_fp_rounder_is_rtn_at_init_and_exports_its_forward(scheme):
    pytest.importorskip("lowbit.formats.float_blocks")
    from lowbit.ptq.fp_rounders import FpRounder

    s = Scheme.parse(scheme)
    w = torch.randn(16, 80) * 0.05
    r = FpRounder(w, s)
    assert torch.equal(r(), qdq(w, s))
    with torch.no_grad():
        r.v.uniform_(-0.5, 0.5)
        r.f.uniform_(0.8, 1.0)
    assert torch.equal(r.export().dequantize(), r())
    r2 = FpRounder(w, s, imp=torch.rand(80), v2=True)
    r2().pow(2).sum().backward()
    assert r2.f.grad.abs().sum() > 0 and r2.v.grad.abs().sum() > 0


@pytest.mark.parametrize("scheme", ["nvfp4-46", "mxfp4"])
def test_fp_tuning_beats_rtn(scheme):
    pytest.importorskip("lowbit.formats.float_blocks")
    m = tiny_model(layers=1)
    c = calib(16, 32)
    rtn, sr = copy.deepcopy(m), copy.deepcopy(m)
    rtn_quantize(rtn, uniform(m, scheme), progress=False)
    signround_quantize(sr, uniform(m, scheme), make_config(iters=40, v2=True), c, progress=False)
    assert block0_mse(sr, m, c) < 0.9 * block0_mse(rtn, m, c)


@pytest.mark.parametrize("n,bs", [(32, 8), (10, 4), (3, 8)])
def test_epoch_batches_use_every_sample_once_per_epoch(n, bs):
    batches = epoch_batches(n, bs, 13, torch.Generator().manual_seed(0))
    size = min(bs, n)
    per_epoch = n // size
    assert len(batches) == 13 and all(len(b) == size for b in batches)
    for e in range(13 // per_epoch):
        seen = torch.cat(batches[e * per_epoch:(e + 1) * per_epoch])
        assert seen.unique().numel() == seen.numel()  # no repeats inside an epoch
        if n % size == 0:
            assert sorted(seen.tolist()) == list(range(n))


def _block_io(model, c) -> list[tuple[torch.Tensor, dict, torch.Tensor]]:
    """(input, call kwargs, output) of every decoder block of ``model`` over the calibration batch ``c``."""
    seen: list = []

    def hook(_m, args, kwargs, out):
        seen.append((args[0].detach(), dict(kwargs), (out[0] if isinstance(out, tuple) else out).detach()))

    hs = [b.register_forward_hook(hook, with_kwargs=True) for b in decoder_blocks(model)]
    try:
        with torch.no_grad():
            model(c, use_cache=False)
    finally:
        for h in hs:
            h.remove()
    return seen


def _own_loss(block, x, kw, y, batch: int, frac: float) -> float:
    """SignRound's block loss over all samples: filtered MSE per consecutive mini-batch, weighted by size."""
    with torch.no_grad():
        out = block(x, **kw)
        out = out[0] if isinstance(out, tuple) else out
    return sum(filtered_mse(out[i:i + batch], y[i:i + batch], frac) * len(out[i:i + batch])
               for i in range(0, len(out), batch)).item() / len(out)


@pytest.mark.parametrize("scheme,v2", [("w2g32", True), ("w3g32a", False), ("nvfp4", True)])
def test_tuning_is_never_worse_than_its_start_on_its_own_loss(scheme, v2):
    """Issue 38: 5 iterations of SignRoundV2 ended far worse than searched RTN (ppl 26.7 vs 17.9).

    Each block's rounding after 1, 5 and 50 iterations is compared with the iters=0 rounding
    of the same block (which depends only on the FP model) on the same inputs, the tuned
    chain's, and the FP targets, under the loss the tuner minimises.
    """
    m = tiny_model(layers=2)
    # samples of very different difficulty: mini-batch losses then differ far more than steps change them
    c = calib(16, 32)
    c[::2] = c[::2] % 8
    frac = 1e-3 if v2 else 0.0
    start = copy.deepcopy(m)
    signround_quantize(start, uniform(m, scheme), make_config(iters=0, batch_size=4, v2=v2, tune_dtype="fp32"), c,
                       progress=False)
    fp_out = [y for _, _, y in _block_io(m, c)]
    for iters in (1, 5, 50):
        q = copy.deepcopy(m)
        cfg = make_config(iters=iters, batch_size=4, v2=v2, tune_dtype="fp32")
        infos = signround_quantize(q, uniform(m, scheme), cfg, c, progress=False)
        for k, ((x, kw, _), y) in enumerate(zip(_block_io(q, c), fp_out, strict=True)):
            tuned = _own_loss(decoder_blocks(q)[k], x, kw, y, 4, frac)
            base = _own_loss(decoder_blocks(start)[k], x, kw, y, 4, frac)
            assert tuned <= base * (1 + 1e-5), (iters, k, tuned, base)
            assert infos[k]["loss"] <= infos[k]["rtn_loss"]


@pytest.mark.parametrize("scheme,v2", [("w4g32", False), ("w3g32a", False), ("w2g32", True), ("nvfp4", True),
                                       ("mxfp4", False), ("q4_k", True)])
def test_restart_puts_every_rounder_back_at_its_start(scheme, v2):
    """What the tuner does when tuning made a block worse: the exported codes are the untuned ones again."""
    from lowbit.ptq.rounders import make_rounder, restart_

    g = torch.Generator().manual_seed(0)
    w, imp = torch.randn(8, 256, generator=g), torch.rand(256, generator=g) + 0.1
    fresh, r = make_rounder(w, Scheme.parse(scheme), imp, v2), make_rounder(w, Scheme.parse(scheme), imp, v2)
    with torch.no_grad():
        for p in r.parameters():
            p.add_(torch.rand(p.shape, generator=g) * 0.4 - 0.2)
    assert not torch.equal(r().detach(), fresh().detach())
    restart_(r, torch.tensor(False))  # a False condition leaves it alone
    assert not torch.equal(r().detach(), fresh().detach())
    restart_(r, torch.tensor(True))
    a, b = r.export(), fresh.export()
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
