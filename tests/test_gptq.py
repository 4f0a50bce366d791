"""GPTQ: a textbook reference, RTN at an identity Hessian, every scheme, the block pipeline, bad input."""

import copy

import pytest
import torch
from ptq_helpers import calib, tiny_model, uniform

from lowbit.errors import ConfigError
from lowbit.formats import Scheme, quantize
from lowbit.models.fused import own_tensor_scale
from lowbit.models.layers import decoder_blocks
from lowbit.nn import quant_layers
from lowbit.plans.plan import Plan
from lowbit.ptq import quantize_model
from lowbit.ptq.blockwise import BlockJob, PipelineOptions, capture_inputs, quantize_blockwise
from lowbit.ptq.gptq import (
    GPTQSettings,
    GPTQTuner,
    check_plan,
    gptq_layers,
    gptq_matrix,
    input_groups,
    inverse_factor,
    narrow_hessian,
)
from lowbit.ptq.methods import RunContext

ALL_SCHEMES = ["w4g32", "w3g32a", "w2g64", "w8", "nvfp4", "nvfp4-46", "mxfp4", "mxfp8", "nvfp4-ue5m3"]


def correlated(n=96, tokens=4096, seed=0) -> torch.Tensor:
    """``X^T X`` of inputs with correlated channels (where GPTQ's error feedback pays)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n, n, generator=g) / n**0.5
    x = torch.randn(tokens, n, generator=g) @ mix + 0.3 * torch.randn(tokens, n, generator=g)
    x[:, 3] *= 8  # an outlier channel
    return (x.T @ x).double()


def output_error(w, q, h) -> float:
    d = (w - q).double()
    return float((d @ h * d).sum() / (w.double() @ h * w.double()).sum())


def textbook_gptq(w, h, scheme, damp=0.01):
    """The OBS form in float64: an explicit inverse Hessian, downdated after every column; a group's scale
    from its current weights when the loop reaches its first column (INT schemes)."""
    w = w.double().clone()
    n = w.shape[1]
    g = scheme.group_for(n)
    hinv = torch.linalg.inv(h + damp * h.diagonal().mean() * torch.eye(n, dtype=h.dtype))
    q = torch.zeros_like(w)
    for i in range(n):
        if i % g == 0:
            qt = quantize(w[:, i:i + g].float(), scheme.replace(group_size=-1))
            scale = qt.scales[:, 0].double()
            zero = torch.zeros_like(scale) if qt.zeros is None else qt.zeros[:, 0].double()
        level = (torch.round(w[:, i] / scale) + zero).clamp(scheme.qmin, scheme.qmax)
        q[:, i] = (level - zero) * scale
        err = (w[:, i] - q[:, i]) / hinv[i, i]
        w[:, i:] -= err[:, None] * hinv[i, i:][None, :]
        hinv = hinv - hinv[:, i:i + 1] @ hinv[i:i + 1, :] / hinv[i, i]
    return q


@pytest.mark.parametrize("scheme", ["w4g32", "w3g32a", "w2g32", "w3"])
@pytest.mark.parametrize("lazy", [1, 5, 128])
def test_matches_the_textbook_algorithm(scheme, lazy):
    """Cholesky factor + lazy batches give the textbook result (the same values, not just a similar error)."""
    s = Scheme.parse(scheme)
    h = correlated()
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(1))
    ref = textbook_gptq(w, h, s)
    got, *_ = gptq_matrix(w, h, s, GPTQSettings(act_order=False, static_groups=False, search=False, lazy_batch=lazy))
    # float32 against float64 may flip one rounding tie, which then moves the rest of that row only
    rows_off = (~torch.isclose(got.double(), ref, atol=1e-5)).any(1).sum()
    assert rows_off <= 1
    assert output_error(w, got, h) == pytest.approx(output_error(w, ref, h), rel=1e-3)
    assert output_error(w, got, h) < 0.8 * output_error(w, quantize(w, s).dequantize(), h)


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
@pytest.mark.parametrize("search", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_identity_hessian_is_round_to_nearest(scheme, search, static):
    """Uncorrelated inputs of equal energy leave nothing to feed back: GPTQ's codes are RTN's, bit for bit."""
    s = Scheme.parse(scheme)
    s = s.replace(rule="search") if search and s.rule != "4over6" else s
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(2))
    out, _ = gptq_layers({"a": (w, s)}, torch.eye(96, dtype=torch.float64), GPTQSettings(static_groups=static))
    ref = quantize(w, s, torch.ones(96) if search else None)
    q = out["a"]
    assert torch.equal(q.codes, ref.codes) and torch.equal(q.scales, ref.scales)
    assert (q.zeros is None) == (ref.zeros is None) and (q.zeros is None or torch.equal(q.zeros, ref.zeros))
    assert (q.tensor_scale is None) == (ref.tensor_scale is None)


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
@pytest.mark.parametrize("act_order", [False, True])
def test_every_scheme_beats_rtn_and_its_codes_hold_the_values(scheme, act_order):
    s = Scheme.parse(scheme)
    h = correlated(n=128)
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(3))
    settings = GPTQSettings(act_order=act_order, search=False)
    enc = own_tensor_scale(w, s)  # NVFP4's per-tensor scale, one per row here
    deq, *_ = gptq_matrix(w, h, s, settings, None if enc is None else enc.expand(w.shape[0]))
    out, info = gptq_layers({"a": (w, s)}, h, settings)
    assert torch.equal(out["a"].dequantize(), deq)  # the stored codes are exactly the values GPTQ used
    assert info["err/a"] == pytest.approx(output_error(w, deq, h), rel=1e-4)
    assert output_error(w, deq, h) < output_error(w, quantize(w, s).dequantize(), h)


def test_stacked_layers_equal_separate_runs():
    """q/k/v share a Hessian and run as one stack; each keeps its own NVFP4 tensor scale."""
    h = correlated(n=64)
    g = torch.Generator().manual_seed(4)
    ws = {"q": torch.randn(32, 64, generator=g), "k": torch.randn(16, 64, generator=g) * 5}
    for name in ("w3g32", "nvfp4"):
        s = Scheme.parse(name)
        together, _ = gptq_layers({n: (w, s) for n, w in ws.items()}, h, GPTQSettings())
        for n, w in ws.items():
            alone, _ = gptq_layers({n: (w, s)}, h, GPTQSettings())
            assert torch.equal(together[n].codes, alone[n].codes) and torch.equal(together[n].scales, alone[n].scales)
            assert (alone[n].tensor_scale is None) or torch.equal(together[n].tensor_scale, alone[n].tensor_scale)


def test_singular_hessian_raises_dampening_and_says_so():
    x = torch.randn(8, 64, dtype=torch.float64)  # 8 tokens, 64 channels: rank 8
    h = x.T @ x
    w = torch.randn(16, 64)
    with pytest.warns(UserWarning, match=r"singular with dampening 0.0.*used 0.01 for it. Pass a larger --damp"):
        _, _, used = gptq_matrix(w, h, Scheme.parse("w4g32"), GPTQSettings(damp=0.0), where="layer L")
    assert used == 0.01
    h[0, 0] = float("nan")
    with pytest.raises(ConfigError, match="not positive definite even with dampening 1.0"):
        gptq_matrix(w, h, Scheme.parse("w4g32"), GPTQSettings())


def reference_factor(h: torch.Tensor, perm: torch.Tensor, damp: float) -> torch.Tensor:
    """The factor as GPTQ has always formed it, with every n x n copy made: the permuted float64 Hessian with unit
    diagonal for dead columns, its order reversed (J H J), dampened by the mean of its diagonal view, a float32
    Cholesky, a triangular solve of the identity, the order reversed back."""
    hp = h.double()[perm][:, perm].clone()
    diag = hp.diagonal()
    diag[diag == 0] = 1.0
    a = hp.flip(0, 1).clone()
    a.diagonal().add_(damp * diag.mean())
    chol = torch.linalg.cholesky(a.float())
    return torch.linalg.solve_triangular(chol, torch.eye(len(h)), upper=False).flip(0, 1)


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The most bytes held at once by tensors created inside (views and in-place results of the inputs excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.cur = self.top = 0
        self.refs: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import functools
        import weakref

        from torch.utils._pytree import tree_leaves

        kwargs = kwargs or {}
        owned = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            s = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            if s is None or not s.data_ptr() or s.data_ptr() in owned or s.data_ptr() in self.live:
                continue
            key = s.data_ptr()
            self.live[key] = s.nbytes()
            self.cur += s.nbytes()
            self.top = max(self.top, self.cur)
            self.refs.append(weakref.ref(s, functools.partial(self._gone, key)))
        return out

    def _gone(self, key: int, _ref: object = None) -> None:
        self.cur -= self.live.pop(key, 0)


@pytest.mark.parametrize("dead", [0, 3])
def test_inverse_factor_is_the_reference_bit_for_bit_from_a_float32_hessian(dead, monkeypatch):
    """The factor built band by band, in place, from the float32 Hessian and its float64 diagonal is the one the
    reference makes with every float64 copy (results at the identity rows must not move), and holds at most
    3 float32 copies of H at once where the reference held 7 (the 8B shape's down_proj: 14336 wide)."""
    import lowbit.ptq.gptq as gptq_mod

    monkeypatch.setattr(gptq_mod, "BAND", 64)
    n = 512
    x = torch.randn(3 * n, n, dtype=torch.float64) * torch.rand(n, dtype=torch.float64) * 3
    x[:, :dead] = 0
    h = x.T @ x
    perm = torch.argsort(h.diagonal().float(), descending=True, stable=True)
    narrow, diag = narrow_hessian(h)
    assert narrow.dtype == torch.float32 and diag.dtype == torch.float64
    want = reference_factor(h, perm, 0.01)
    got = []
    for args in ((h, 0.01, "L", perm), (narrow, 0.01, "L", perm, diag)):
        f, used = inverse_factor(*args)
        assert used == 0.01
        got.append(f)
    assert torch.equal(got[0], got[1])  # the narrow float32 Hessian changes nothing
    # equal to the reference bit for bit where LAPACK blocks the band as it blocks the whole (the Intel Xeon of
    # the earlier sessions); on an AMD EPYC its kernels round a quarter of the entries one float32 ULP apart
    # (max 1.9e-9 on entries up to 0.15): a wrong band or diagonal is off by orders of magnitude more
    torch.testing.assert_close(got[0], want, rtol=1e-6, atol=1e-8)
    unit = n * n * 4
    with _LiveBytes() as new:
        inverse_factor(narrow, 0.01, "L", perm, diag)
    with _LiveBytes() as old:
        reference_factor(h, perm, 0.01)
    assert new.top <= 3 * unit < 6 * unit <= old.top, (new.top / unit, old.top / unit)


def test_dead_input_columns_do_not_move_others():
    h = correlated(n=64)
    h[7, :] = 0
    h[:, 7] = 0
    w = torch.randn(8, 64)
    deq, *_ = gptq_matrix(w, h, Scheme.parse("w4g32"), GPTQSettings())
    assert torch.isfinite(deq).all()


def test_act_order_without_static_groups_is_refused_for_grouped_schemes():
    m = tiny_model(layers=1)
    bad = GPTQSettings(act_order=True, static_groups=False)
    with pytest.raises(ConfigError, match="per-column group index .* keep --static-groups"):
        check_plan(bad, uniform(m, "w4g32"))
    check_plan(bad, uniform(m, "w4"))  # one group per row: no group order to keep
    with pytest.raises(ConfigError, match="per-column group index"):
        quantize_model(m, uniform(m, "nvfp4"), "gptq", bad, calib=calib())


def test_block_groups_follow_execution_order():
    m = tiny_model(layers=1)
    block = decoder_blocks(m)[0]
    x, kw = capture_inputs(m, block, calib(2, 8), torch.device("cpu"))
    names = {f"b.{n}": mod for n, mod in block.named_modules() if isinstance(mod, torch.nn.Linear)}
    groups = input_groups(block, names, x[:1], kw)
    short = [[n.split(".")[-1] for n in g] for g in groups]
    assert short == [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]


def _tune_block(seq: bool):
    m = tiny_model(layers=1)
    block = decoder_blocks(m)[0]
    x, kw = capture_inputs(m, block, calib(), torch.device("cpu"))
    plan = uniform(m, "w3g32")
    layers = {n: (n.split("layers.0.", 1)[1], s) for n, s in plan.weights().items()}
    job = BlockJob(0, block, layers, x, block(x, **kw)[0], kw, None)
    before = {n: block.get_submodule(r).weight.clone() for n, (r, _) in layers.items()}
    qts, info = GPTQTuner(GPTQSettings(true_sequential=seq))(job)
    assert set(qts) == set(layers) and 0 < info["loss"] < 0.2
    assert all(torch.equal(block.get_submodule(r).weight, before[n]) for n, (r, _) in layers.items())  # restored
    return qts


def test_true_sequential_takes_later_hessians_through_quantized_layers():
    """o_proj's Hessian comes from q/k/v already quantized (true_sequential), or from the float block."""
    a, b = _tune_block(True), _tune_block(False)
    first = [n for n in a if n.endswith(("q_proj", "k_proj", "v_proj"))]
    assert all(torch.equal(a[n].codes, b[n].codes) for n in first)  # same input: the block's input
    assert not torch.equal(a["model.layers.0.self_attn.o_proj"].codes, b["model.layers.0.self_attn.o_proj"].codes)


class Interrupt(Exception):
    pass


def _run(model, workdir, stop_after=None):
    def on_block(i):
        if stop_after is not None and i == stop_after:
            raise Interrupt

    s = GPTQSettings()
    return quantize_blockwise(model, uniform(model, "w3g32"), GPTQTuner(s), {"method": "gptq", "config": s.to_dict()},
                              RunContext(calib=calib(), workdir=workdir, progress=False), PipelineOptions(),
                              on_block=on_block)


def test_resume_after_interrupt_gives_the_same_model(tmp_path):
    m = tiny_model(layers=3)
    full = copy.deepcopy(m)
    _run(full, None)
    part = copy.deepcopy(m)
    with pytest.raises(Interrupt):
        _run(part, tmp_path / "w", stop_after=1)
    resumed = copy.deepcopy(m)
    infos = _run(resumed, tmp_path / "w")
    assert [i.get("resumed") for i in infos] == [1.0, 1.0, None]
    qa, qb = quant_layers(full), quant_layers(resumed)
    assert all(torch.equal(qa[n].codes, qb[n].codes) and torch.equal(qa[n].scales, qb[n].scales) for n in qa)


def test_gptq_method_beats_rtn_on_the_model_output():
    m = tiny_model(layers=2).requires_grad_(False)
    c, ids = calib(16, 32), calib(4, 32, seed=11)
    ref = m(ids).logits
    errs = {}
    for method, settings in (("rtn", {"search": False}), ("gptq", {"search": False})):
        q = copy.deepcopy(m)
        plan = quantize_model(q, uniform(m, "w3g32"), method, settings, calib=c, progress=False)
        assert isinstance(plan, Plan)
        errs[method] = float((q(ids).logits - ref).pow(2).mean())
    assert errs["gptq"] < errs["rtn"]


def test_hessian_comes_from_the_inputs_a_recipe_quantizes(monkeypatch):
    """A W+A recipe: GPTQ minimises the error on the quantized inputs the layer will see."""
    import lowbit.ptq.gptq as gptq_mod
    from lowbit.formats import InputScheme
    from lowbit.nn.input_quant import InputQuantizer

    m = tiny_model(layers=1)
    block = decoder_blocks(m)[0]
    x, kw = capture_inputs(m, block, calib(), torch.device("cpu"))
    layers = {n: (n.split("layers.0.", 1)[1], s) for n, s in uniform(m, "w4g32").weights().items()}
    name = "model.layers.0.mlp.down_proj"
    iq = InputQuantizer(InputScheme.parse("mxfp4"))
    seen = {}
    real = gptq_mod.gptq_layers

    def spy(weights, h, settings, tensor_scales=None, diag=None):
        seen[tuple(weights)] = h.double()
        return real(weights, h, settings, tensor_scales, diag)

    monkeypatch.setattr(gptq_mod, "gptq_layers", spy)
    job = BlockJob(0, block, layers, x, block(x, **kw)[0], kw, None, inputs={name: iq})
    GPTQTuner(GPTQSettings(true_sequential=False))(job)
    assert not block.mlp.down_proj._forward_pre_hooks  # the quantizing hook is gone afterwards
    got = []
    hd = block.mlp.down_proj.register_forward_pre_hook(lambda _m, a: got.append(a[0].detach()))
    with torch.no_grad():
        block(x, **kw)
    hd.remove()
    flat = torch.cat([t.reshape(-1, t.shape[-1]) for t in got]).double()
    quantized = torch.cat([iq(t).reshape(-1, t.shape[-1]) for t in got]).double()
    h = seen[(name,)]
    unit = lambda a: a / a.norm()  # noqa: E731  (the Hessian's scale convention does not matter here)
    assert torch.allclose(unit(h), unit(quantized.T @ quantized), atol=1e-6)
    assert not torch.allclose(unit(h), unit(flat.T @ flat), atol=1e-4)


def test_gptq_skips_the_fp_chain_and_gets_the_same_model():
    """GPTQ reads only the quantized inputs: the pipeline runs no FP targets (one block forward per block
    fewer) and the result is the one with the FP chain run anyway."""
    m = tiny_model(layers=2)
    forwards = {}

    class Tuner(GPTQTuner):
        def __init__(self, targets: bool) -> None:
            super().__init__(GPTQSettings())
            self.needs_targets = targets
            self.ys = []

        def __call__(self, job):
            self.ys.append(job.y)
            return super().__call__(job)

    models = {}
    for targets in (False, True):
        q = copy.deepcopy(m)
        tuner = Tuner(targets)
        block0 = decoder_blocks(q)[0]
        count = []
        hd = block0.register_forward_hook(lambda *_, seen=count: seen.append(1))
        quantize_blockwise(q, uniform(q, "w3g32"), tuner, {"method": "gptq"}, RunContext(calib=calib(), progress=False),
                           PipelineOptions(chunk=4))
        hd.remove()
        forwards[targets] = len(count)
        assert all((y is None) != targets for y in tuner.ys)
        models[targets] = quant_layers(q)
    a, b = models[False], models[True]
    assert all(torch.equal(a[n].codes, b[n].codes) and torch.equal(a[n].scales, b[n].scales) for n in a)
    assert forwards[False] < forwards[True]


KQUANTS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]


@pytest.mark.parametrize("scheme", KQUANTS)
@pytest.mark.parametrize("static", [False, True])
def test_kquant_identity_hessian_is_the_rtn_search(scheme, static):
    """Per super-block (dynamic) or per row (static), the K-quant parameters GPTQ chooses are RTN's search."""
    s = Scheme.parse(scheme).replace(rule="search")
    w = torch.randn(8, 512, generator=torch.Generator().manual_seed(5)) * 0.05
    out, _ = gptq_layers({"a": (w, s)}, torch.eye(512, dtype=torch.float64),
                         GPTQSettings(act_order=static, static_groups=static))
    ref, q = quantize(w, s, torch.ones(512)), out["a"]
    assert torch.equal(q.codes, ref.codes) and torch.equal(q.scales, ref.scales)
    assert torch.equal(q.tensor_scale, ref.tensor_scale)
    assert (q.zeros is None) == (ref.zeros is None) and (q.zeros is None or torch.equal(q.zeros, ref.zeros))


@pytest.mark.parametrize("scheme", KQUANTS)
@pytest.mark.parametrize("act_order", [False, True])
def test_kquant_gptq_beats_the_search_and_writes_exact_gguf_blocks(scheme, act_order):
    """GPTQ through llama.cpp's two-level scales: lower output error than the importance-weighted
    RTN search, and the stored blocks dequantize (in gguf-py too) to exactly the values GPTQ fed back."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from lowbit.files.gguf_kquants import pack_kquant

    s = Scheme.parse(scheme).replace(rule="search")
    h = correlated(n=512, seed=6)
    w = torch.randn(16, 512, generator=torch.Generator().manual_seed(6)) * 0.05
    settings = GPTQSettings(act_order=act_order, static_groups=act_order)
    deq, *_ = gptq_matrix(w, h, s, settings)
    out, _ = gptq_layers({"a": (w, s)}, h, settings)
    q = out["a"]
    assert torch.equal(q.dequantize(), deq)
    ref = gguf.quants.dequantize(pack_kquant(q), gguf.GGMLQuantizationType[scheme.upper()])
    assert np.array_equal(ref, deq.numpy())
    rtn = quantize(w, s, h.diagonal().float()).dequantize()
    assert output_error(w, deq, h) < 0.8 * output_error(w, rtn, h)
