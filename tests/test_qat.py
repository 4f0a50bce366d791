"""QAT quantizers (levels, clipped STE, LSQ gradient), WinQ moves, conversion to QuantLinear."""

from __future__ import annotations

import pytest
import torch
from test_train import cfg, tiny_model, tokens

from lowbit.errors import ConfigError, SchemeError
from lowbit.formats import QTensor, Scheme
from lowbit.nn import QuantLinear
from lowbit.qat import (
    LSQ,
    QATLinear,
    SchemeFakeQuant,
    Sign,
    StretchedElastic,
    WinQCallback,
    WinQConfig,
    qat_layers,
    reinit_,
    resolve,
    to_qat,
    to_quant_linear,
)
from lowbit.qat.layer import Noise
from lowbit.train import train

LEVELS = {  # in units of alpha
    "sign": [-1.0, 1.0],
    "ternary": [-2 / 3, 0.0, 2 / 3],
    "seq2": [-0.75, -0.25, 0.25, 0.75],
}
QUANTIZERS = [Sign(), StretchedElastic(ternary=True), StretchedElastic(), LSQ(3), LSQ(4),
              SchemeFakeQuant(Scheme.parse("w2g64")), SchemeFakeQuant(Scheme.parse("nvfp4"))]


def weight(out: int = 12, cols: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def brute_nearest(x: torch.Tensor, levels: list[float]) -> torch.Tensor:
    grid = torch.tensor(levels)
    return grid[(x.unsqueeze(-1) - grid).abs().argmin(-1)]


@pytest.mark.parametrize("q", [StretchedElastic(ternary=True), StretchedElastic()], ids=["ternary", "seq2"])
def test_stretched_elastic_is_nearest_level(q):
    w = weight()
    alpha = q.init_scale(w) * 0.7  # some entries clip
    got = q.fake(w, alpha) / alpha
    assert torch.allclose(got, brute_nearest(w / alpha, LEVELS[q.name]), atol=1e-6)


def test_sign_and_lsq_levels():
    w = weight()
    a = Sign().init_scale(w)
    assert torch.allclose(a, w.abs().mean(1, keepdim=True))
    assert torch.equal(Sign().fake(w, a) / a, torch.where(w >= 0, 1.0, -1.0))
    q = LSQ(3)
    a = q.init_scale(w) * 0.8
    ref = brute_nearest((w / a).clamp(-4, 3), list(map(float, range(-4, 4))))
    assert torch.allclose(q.fake(w, a) / a, ref, atol=1e-5)


@pytest.mark.parametrize("q", QUANTIZERS[:5], ids=lambda q: q.name)
def test_clipped_ste_passes_in_range_gradients_only(q):
    w = weight().requires_grad_()
    alpha = (q.init_scale(w.detach()) * 0.6).requires_grad_()
    g = torch.randn_like(w)
    (q.fake(w, alpha) * g).sum().backward()
    x = w.detach() / alpha.detach()
    lo, hi = {"sign": (-1, 1), "ternary": (-0.99, 0.99), "seq2": (-0.99, 0.99),
              "lsq3": (-4, 3), "lsq4": (-8, 7)}[q.name]
    inside = (x >= lo) & (x <= hi)
    assert 0 < inside.float().mean() < 1
    assert torch.allclose(w.grad, g * inside)


def _autograd_reference(q, w, alpha):
    """The quantizers as plain expressions with detach-STE: what the fused backward must equal."""
    def ste(x):
        return x + (torch.round(x) - x).detach()
    if q.name == "sign":
        x = torch.clamp(w / alpha, -1.0, 1.0)
        return (x + (torch.where(x >= 0, 1.0, -1.0) - x).detach()) * alpha
    if q.name in ("ternary", "seq2"):
        x = torch.clamp(w / alpha, -0.99, 0.99)
        return (ste(x * q.n - q.shift) + q.shift) / q.n * alpha
    gs = 1.0 / (w.shape[1] * q.qp) ** 0.5
    a = (alpha - alpha * gs).detach() + alpha * gs
    return ste(torch.clamp(w / a, -q.qn, q.qp)) * a


@pytest.mark.parametrize("q", QUANTIZERS[:5], ids=lambda q: q.name)
def test_fused_ste_equals_autograd_through_the_expression(q):
    w0 = weight(out=16, cols=96, seed=3)
    a0 = q.init_scale(w0) * 0.7
    g = torch.randn(w0.shape, generator=torch.Generator().manual_seed(4))
    grads = []
    for fn in (q.fake, lambda w, a: _autograd_reference(q, w, a)):
        w, a = w0.clone().requires_grad_(), a0.clone().requires_grad_()
        y = fn(w, a)
        (y * g).sum().backward()
        grads.append((y.detach(), w.grad, a.grad))
    for got, ref in zip(grads[0], grads[1], strict=True):
        # the scale gradient is a difference of two row sums: fp32 rounding of the largest term
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_lsq_step_gradient_is_scaled():
    q, w = LSQ(4), weight()
    alpha = q.init_scale(w).requires_grad_()
    g = torch.randn_like(w)
    (q.fake(w, alpha) * g).sum().backward()
    x = w / alpha.detach()
    xc = x.clamp(-8, 7)
    # d/d alpha of round(clamp(x)) * alpha with the STE: round(xc) - x inside, the clip level outside
    d = torch.where((x >= -8) & (x <= 7), torch.round(xc) - x, xc)
    ref = (g * d).sum(1, keepdim=True) / (64 * 7) ** 0.5
    assert torch.allclose(alpha.grad, ref, atol=1e-5)


@pytest.mark.parametrize("q", QUANTIZERS, ids=lambda q: q.name)
def test_qtensor_matches_fake_forward_and_packs_exactly(q):
    w = weight()
    alpha = q.init_scale(w) * 0.9
    qt = q.to_qtensor(w, alpha)
    assert torch.allclose(qt.dequantize(), q.fake(w, alpha), atol=1e-6)
    back = QTensor.from_packed(qt.pack(), qt.shape, qt.scheme)
    assert torch.equal(back.dequantize(), qt.dequantize())


def test_resolve_maps_schemes_and_refuses_what_a_quantizer_cannot_express():
    assert resolve("w1") == Sign() and resolve("ternary") == StretchedElastic(ternary=True)
    assert resolve("w2") == StretchedElastic() and resolve("w4") == LSQ(4) and resolve("w3") == LSQ(3)
    assert resolve("w2g64") == SchemeFakeQuant(Scheme.parse("w2g64"))
    assert resolve("w2", "fake") == SchemeFakeQuant(Scheme.parse("w2"))
    assert resolve("w1.58", "seq") == StretchedElastic(ternary=True)
    with pytest.raises(SchemeError, match="stretched elastic.*w4g128"):
        resolve("w4g128", "seq")
    with pytest.raises(SchemeError, match="LSQ"):
        resolve("nvfp4", "lsq")
    with pytest.raises(SchemeError, match="sign"):
        resolve("w1", "lsq")
    with pytest.raises(SchemeError, match="w1.58"):
        resolve("w9")
    with pytest.raises(SchemeError, match="quantizer"):
        resolve("w2", "magic")


def test_reinit_moves_latent_weights_towards_the_grid():
    m = tiny_model()
    to_qat(m, StretchedElastic())
    layer = next(iter(qat_layers(m).values()))
    w0 = layer.weight.detach().clone()
    q0 = layer.quantizer.fake(w0, layer.alpha.detach())
    reinit_(m, 0.2)
    assert torch.allclose(layer.weight, 0.2 * w0 + 0.8 * q0, atol=1e-7)


def test_noise_is_seeded_relative_or_absolute_and_off_in_eval():
    layer = QATLinear(weight(), None, StretchedElastic())
    layer.noise, layer.noise_seed = Noise(1e-3, 1e-3), 7
    w1, a1 = layer.noisy()
    w2, a2 = layer.noisy()
    assert torch.equal(w1, w2) and torch.equal(a1, a2)  # one draw per step, same on every forward
    assert (w1 - layer.weight).std().item() == pytest.approx(1e-3, rel=0.1)
    layer.noise = Noise(0.1, 0.0, relative=True)
    dw = layer.noisy()[0] - layer.weight
    ratio = dw.std(1) / layer.alpha.detach().squeeze(1)
    assert torch.allclose(ratio, torch.full_like(ratio, 0.1), rtol=0.35)
    layer.eval()
    assert layer.noisy()[0] is layer.weight


def test_winq_reinit_schedule_and_ste_baseline_is_plain():
    m = tiny_model()
    to_qat(m, StretchedElastic())
    cb = WinQCallback(WinQConfig())
    train(m, tokens(), cfg(steps=8), callbacks=[cb])
    assert cb.reinits == [2, 4, 6]  # K = steps/4, none at the last step
    with pytest.raises(ConfigError, match="too short"):
        WinQConfig().period(3)
    with pytest.raises(ConfigError):
        WinQConfig(a=1.5)


def test_qat_trains_and_saves_as_exact_quantlinear(tmp_path):
    from lowbit.files.native import load, save

    m = tiny_model()
    names = to_qat(m, resolve("w2"))
    assert len(names) == 14
    r = train(m, tokens(), cfg(steps=10, lr=1e-2), callbacks=[WinQCallback(WinQConfig(sigma_w=1e-3))])
    assert r.losses[-1] < r.losses[0]
    m.eval()
    batch = tokens(n=2)
    with torch.no_grad():
        ref = m(input_ids=batch).logits
    assert to_quant_linear(m) == names
    assert all(isinstance(m.get_submodule(n), QuantLinear) for n in names)
    with torch.no_grad():
        assert torch.allclose(m(input_ids=batch).logits, ref, atol=1e-5)
    save(m, None, tmp_path / "q")
    m2, _ = load(tmp_path / "q")
    with torch.no_grad():
        assert torch.equal(m2(input_ids=batch).logits, m(input_ids=batch).logits)


def test_winq_run_resumes_bit_identically(tmp_path):
    from test_train import Crash

    def run(callbacks, out=None, every=0):
        m = tiny_model()
        to_qat(m, StretchedElastic(ternary=True))
        c = cfg(steps=8, out_dir=out, checkpoint_every=every)
        return train(m, tokens(), c, callbacks=[WinQCallback(WinQConfig(sigma_w=1e-2)), *callbacks])

    full = run([]).losses
    with pytest.raises(KeyboardInterrupt):
        run([Crash(5)], str(tmp_path), 3)
    assert run([], str(tmp_path), 3).losses == full


def test_qat_starts_from_a_ptq_model_at_its_weights():
    """A PTQ result (QuantLinears) converts to QAT with the dequantized weights as latents;
    with the same scheme the fake-quantized start reproduces the PTQ model's outputs."""
    from lowbit.nn import replace_linears
    from lowbit.plans.plan import Plan

    m = tiny_model()
    names = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear) and "layers." in n]
    replace_linears(m, Plan.uniform(names, "w4g16"))
    batch = tokens(n=2)
    m.eval()
    with torch.no_grad():
        ref = m(input_ids=batch).logits
    deq = {n: m.get_submodule(n).weight.clone() for n in names}
    assert to_qat(m, resolve("w4g16")) == names
    for n in names:
        assert torch.equal(m.get_submodule(n).weight.detach(), deq[n])
    m.eval()
    with torch.no_grad():
        assert torch.allclose(m(input_ids=batch).logits, ref, atol=1e-4)


# ------------------------------------------------------------ bad WinQ input (issue 25): one clear error each
@pytest.mark.parametrize("kwargs, needle", [
    ({"a": 1.0}, "mix a must be in [0, 1)"),
    ({"a": -0.1}, "mix a must be in [0, 1)"),
    ({"a": float("nan")}, "mix a must be in [0, 1)"),
    ({"sigma_w": -1e-3}, "sigmas must be >= 0"),
    ({"sigma_a": -1.0}, "sigmas must be >= 0"),
    ({"sigma_w": float("inf")}, "sigmas must be >= 0"),
    ({"sigma_a": float("nan")}, "sigmas must be >= 0"),
    ({"every": 0}, "period must be >= 1"),
])
def test_bad_winq_settings_are_refused_when_built(kwargs, needle):
    with pytest.raises(ConfigError) as e:
        WinQConfig(**kwargs)
    assert needle in str(e.value)


@pytest.mark.parametrize("every, steps", [(8, 8), (50, 8)])
def test_a_reinit_period_not_shorter_than_the_run_is_refused_before_any_step(every, steps):
    with pytest.raises(ConfigError, match=f"not shorter than the {steps}-step run"):
        WinQConfig(every=every).period(steps)
    m = tiny_model()
    to_qat(m, StretchedElastic())
    w0 = next(iter(qat_layers(m).values())).weight.detach().clone()
    with pytest.raises(ConfigError, match="not shorter"):
        train(m, tokens(), cfg(steps=steps), callbacks=[WinQCallback(WinQConfig(every=every))])
    assert torch.equal(next(iter(qat_layers(m).values())).weight, w0)  # refused before the first step
    assert WinQConfig(reinit=False, every=every).reinit_steps(steps) == []  # no re-init: the period is moot


@pytest.mark.parametrize("changed", [{"a": 0.5}, {"every": 3}, {"noise": False}, {"sigma_a": 1e-2},
                                     {"relative": True}, {"reinit": False}, {"seed": 1}])
def test_resuming_with_other_winq_settings_is_refused(tmp_path, changed):
    """Through the library loop too (not only `lowbit qat`): WinQCallback declares its curve settings."""
    from test_train import Crash

    base = {"every": 2, "sigma_w": 1e-2}

    def run(winq: WinQConfig, callbacks=()):
        m = tiny_model()
        to_qat(m, StretchedElastic())
        c = cfg(steps=8, out_dir=str(tmp_path), checkpoint_every=2)
        return train(m, tokens(), c, callbacks=[WinQCallback(winq), *callbacks])

    with pytest.raises(KeyboardInterrupt):
        run(WinQConfig(**base), [Crash(5)])
    with pytest.raises(ConfigError) as e:
        run(WinQConfig(**{**base, **changed}))
    msg = str(e.value)
    assert "different settings" in msg and "callback.WinQCallback" in msg
    assert run(WinQConfig(**base)).resumed_from == 4  # the same settings still resume
