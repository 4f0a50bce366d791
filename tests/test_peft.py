"""QWHA adapter, AdaAlloc, refinement and the LoRA/LoftQ/FourierFT baselines on bare tensors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit.errors import ConfigError
from lowbit.peft import (
    FourierFTAdapter,
    LoRAAdapter,
    QWHAAdapter,
    allocate,
    hadamard,
    init_qwha,
    loftq_adapter,
    lora_budget,
)
from lowbit.peft.qwha import choose_path


def random_adapter(out_f=24, in_f=48, nnz=200, seed=0, **kw) -> QWHAAdapter:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randperm(out_f * in_f, generator=g)[:nnz]
    return QWHAAdapter(out_f, in_f, flat // in_f, flat % in_f, torch.randn(nnz, generator=g), **kw)


@pytest.mark.parametrize("in_f", [48, 64, 576])
def test_qwha_delta_is_f_times_inverse_hadamard(in_f):
    a = random_adapter(16, in_f, 100)
    f = a.coefficients().detach().double()
    ref = f @ torch.linalg.inv(hadamard(in_f, torch.float64))
    assert torch.allclose(a.delta_weight().double(), ref, atol=1e-5)


@pytest.mark.parametrize("in_f", [48, 576])
def test_both_forward_paths_agree_with_gradients(in_f):
    x = torch.randn(2, 7, in_f)
    outs, grads = [], []
    for path in ("dense", "sparse"):
        a = random_adapter(20, in_f, 150, path=path)
        y = a(x)
        (y * torch.arange(20.0)).sum().backward()
        outs.append(y.detach())
        grads.append(a.values.grad.clone())
    ref = x.double() @ random_adapter(20, in_f, 150).delta_weight().double().detach().T
    assert torch.allclose(outs[0].double(), ref, atol=1e-4) and torch.allclose(outs[1].double(), ref, atol=1e-4)
    assert torch.allclose(grads[0], grads[1], atol=1e-3, rtol=1e-4)


def test_auto_path_chooses_sparse_for_few_tokens_dense_for_many():
    assert choose_path(1, 576, 576, 576, 9216) == "sparse"
    assert choose_path(4096, 576, 576, 576, 9216) == "dense"


def test_rescale_keeps_delta_and_scales_values():
    a = random_adapter()
    before = a.delta_weight().detach().clone()
    v = a.values.detach().clone()
    a.rescale(10.0)
    assert torch.allclose(a.delta_weight(), before, atol=1e-6)
    assert torch.allclose(a.values * 10.0, v, atol=1e-6)


def test_bad_positions_are_rejected():
    with pytest.raises(ConfigError, match="duplicates"):
        QWHAAdapter(4, 8, torch.tensor([0, 0]), torch.tensor([1, 1]))
    with pytest.raises(ConfigError, match="out of range"):
        QWHAAdapter(4, 8, torch.tensor([4]), torch.tensor([1]))


def test_padded_width_crops_delta():
    with pytest.warns(UserWarning, match="zero-padding"):
        a = QWHAAdapter(3, 10, torch.tensor([0, 2]), torch.tensor([11, 3]), torch.tensor([1.0, -2.0]))
    h = hadamard(12, torch.float64)
    ref = (a.coefficients().detach().double() @ torch.linalg.inv(h))[:, :10]
    assert a.delta_weight().shape == (3, 10) and torch.allclose(a.delta_weight().double(), ref, atol=1e-6)
    x = torch.randn(5, 10)
    a.path = "sparse"
    assert torch.allclose(a(x), x @ a.delta_weight().T, atol=1e-5)


# ------------------------------------------------------------------ AdaAlloc
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), width=st.integers(1, 50), k_min=st.integers(0, 3), frac=st.floats(0, 1),
       seed=st.integers(0, 10**6))
def test_allocation_sums_to_budget_within_bounds(rows, width, k_min, frac, seed):
    k_min = min(k_min, width)
    lo, hi = rows * k_min, rows * width
    budget = int(lo + frac * (hi - lo))
    norms = torch.rand(rows, generator=torch.Generator().manual_seed(seed)) ** 3
    k = allocate(norms, budget, width, k_min)
    assert int(k.sum()) == budget and int(k.min()) >= k_min and int(k.max()) <= width


def test_allocation_is_proportional_when_nothing_caps():
    norms = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert allocate(norms, 40 + 4, width=100, k_min=1).tolist() == [5, 9, 13, 17]


def test_allocation_redistributes_capped_rows():
    norms = torch.tensor([100.0, 1.0, 1.0])
    assert allocate(norms, 30, width=12, k_min=1).tolist() == [12, 9, 9]


def test_allocation_rejects_impossible_budgets():
    with pytest.raises(ConfigError, match="exceeds"):
        allocate(torch.ones(4), 4 * 9, width=8)
    with pytest.raises(ConfigError, match="k_min"):
        allocate(torch.ones(4), 7, width=8, k_min=2)


# ------------------------------------------------------------ refinement
def problem(out_f=32, in_f=48, tokens=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    err = torch.randn(out_f, in_f, generator=g) * torch.rand(out_f, 1, generator=g)
    x = torch.randn(tokens, in_f, generator=g) @ torch.randn(in_f, in_f, generator=g)
    return err, x


def out_error(x, err, delta):
    return float(((x @ (err - delta).T) ** 2).sum() / ((x @ err.T) ** 2).sum())


def test_full_budget_recovers_the_error_exactly():
    err, x = problem()
    for xtx in (None, x.T.double() @ x.double()):
        init = init_qwha(err, err.numel(), xtx)
        a = QWHAAdapter(*err.shape, init.rows, init.cols, init.values)
        assert torch.allclose(a.delta_weight(), err, atol=1e-4)


def test_least_squares_matches_brute_force_per_row():
    err, x = problem()
    xtx = x.T.double() @ x.double()
    init = init_qwha(err, 6 * err.shape[0], xtx, damp=0.0)
    inv_h = torch.linalg.inv(hadamard(err.shape[1], torch.float64))
    for r in (0, 7, 31):
        cols = init.cols[init.rows == r]
        basis = inv_h[cols]  # Delta_W row = values @ H^-1[S]
        sol = torch.linalg.lstsq(x.double() @ basis.T, (x.double() @ err[r].double())[:, None]).solution[:, 0]
        assert torch.allclose(init.values[init.rows == r].double(), sol, atol=1e-4, rtol=1e-4)


def test_refinement_beats_projection_on_output_error():
    err, x = problem()
    xtx = x.T.double() @ x.double()
    budget = 8 * err.shape[0]
    errs = {}
    for name, kw in {"weight": dict(xtx=None), "positions": dict(xtx=xtx, refine=False), "ls": dict(xtx=xtx)}.items():
        init = init_qwha(err, budget, **kw)
        errs[name] = out_error(x, err, QWHAAdapter(*err.shape, init.rows, init.cols, init.values).delta_weight().detach())
    assert errs["ls"] < errs["positions"] <= errs["weight"] * 1.05 and errs["ls"] < 0.9 * errs["weight"]


def test_adaalloc_counts_follow_row_error():
    err, _ = problem()
    err[0] *= 50
    init = init_qwha(err, 4 * err.shape[0], None, k_min=1)
    assert int(init.counts[0]) == err.shape[1] and int(init.counts.min()) >= 1
    assert torch.equal(torch.bincount(init.rows, minlength=err.shape[0]), init.counts)


# -------------------------------------------------------------- baselines
def test_lora_starts_at_zero_and_budget_matches():
    a = LoRAAdapter(24, 48, rank=4)
    assert a.num_trainable() == lora_budget(4, 24, 48) and a.delta_weight().abs().sum() == 0
    with torch.no_grad():
        a.lora_b.normal_()
    x = torch.randn(3, 48)
    assert torch.allclose(a(x), x @ a.delta_weight().T, atol=1e-5)
    with pytest.raises(ConfigError, match="rank"):
        LoRAAdapter(24, 48, rank=30)


def test_loftq_is_the_best_rank_r_fit():
    err, _ = problem()
    a = loftq_adapter(err, 4)
    s = torch.linalg.svdvals(err.double())
    assert abs(float(((err - a.delta_weight().detach()) ** 2).sum()) - float((s[4:] ** 2).sum())) < 1e-3


def test_fourierft_delta_is_inverse_fft():
    a = FourierFTAdapter(16, 24, 50, scaling=2.0, seed=3)
    with torch.no_grad():
        a.spectrum.normal_()
    dense = torch.zeros(16, 24, dtype=torch.complex128)
    dense[a.indices[0], a.indices[1]] = a.spectrum.detach().double().to(torch.complex128)
    ref = torch.fft.ifft2(dense).real * 2.0
    assert torch.allclose(a.delta_weight().double(), ref, atol=1e-6)
    assert torch.unique(a.indices[0] * 24 + a.indices[1]).numel() == 50


# ---------------------------------------------- peers: HF peft on a float Linear
def peft_wrap(kind: str, layer: torch.nn.Linear, **kw):
    peft = pytest.importorskip("peft")
    model = torch.nn.Sequential()
    model.add_module("lin", layer)
    cfg = {"lora": lambda: peft.LoraConfig(r=kw["rank"], lora_alpha=kw["rank"], target_modules=["lin"]),
           "fourierft": lambda: peft.FourierFTConfig(n_frequency=kw["n"], scaling=kw["scaling"],
                                                     random_loc_seed=kw["seed"], target_modules=["lin"])}[kind]()
    return peft.get_peft_model(model, cfg)


def test_fourierft_matches_peft_on_float_linear():
    base = torch.nn.Linear(24, 16, bias=False)
    wrapped = peft_wrap("fourierft", torch.nn.Linear(24, 16, bias=False), n=60, scaling=150.0, seed=777)
    layer = wrapped.base_model.model.lin
    layer.base_layer.weight.data.copy_(base.weight.data)
    ours = FourierFTAdapter(16, 24, 60, scaling=150.0, seed=777)
    assert torch.equal(ours.indices, layer.indices["default"])
    spec = torch.randn(60)
    with torch.no_grad():
        layer.fourierft_spectrum["default"].copy_(spec)
        ours.spectrum.copy_(spec)
    x = torch.randn(5, 24)
    assert torch.allclose(base(x) + ours(x), wrapped(x), atol=1e-5)


def test_lora_matches_peft_on_float_linear():
    base = torch.nn.Linear(24, 16, bias=False)
    wrapped = peft_wrap("lora", torch.nn.Linear(24, 16, bias=False), rank=4)
    layer = wrapped.base_model.model.lin
    layer.base_layer.weight.data.copy_(base.weight.data)
    ours = LoRAAdapter(16, 24, 4)
    with torch.no_grad():
        ours.lora_b.normal_()
        layer.lora_A["default"].weight.copy_(ours.lora_a)
        layer.lora_B["default"].weight.copy_(ours.lora_b)
    x = torch.randn(5, 24)
    assert torch.allclose(base(x) + ours(x), wrapped(x), atol=1e-5)
    assert sum(p.numel() for p in wrapped.parameters() if p.requires_grad) == ours.num_trainable()


@pytest.mark.parametrize("kind", ["qwha-dense", "qwha-sparse", "fourierft", "lora"])
def test_host_layer_folding_matches_separate_delta(kind):
    """A folding adapter is summed into the weight before the one GEMM; outputs and grads must not change."""
    from lowbit.nn import QuantLinear

    torch.manual_seed(0)
    base = torch.nn.Linear(48, 24)
    layer = QuantLinear.from_linear(base, "w4g16")
    if kind.startswith("qwha"):
        ad = random_adapter(24, 48, 150, path=kind.split("-")[1])
    elif kind == "fourierft":
        ad = FourierFTAdapter(24, 48, 60, scaling=1.0)
        with torch.no_grad():
            ad.spectrum.normal_()
    else:
        ad = LoRAAdapter(24, 48, rank=4)
        with torch.no_grad():
            ad.lora_b.normal_()
    layer.adapters["a"] = ad
    x = torch.randn(3, 5, 48, requires_grad=True)
    y = layer(x)
    (y * torch.arange(24.0)).sum().backward()
    got = (y.detach(), x.grad.clone(), [p.grad.clone() for p in ad.parameters()])
    assert ad.folds(x) == (kind in ("qwha-dense", "fourierft"))
    x2 = x.detach().clone().requires_grad_(True)
    for p in ad.parameters():
        p.grad = None
    y2 = torch.nn.functional.linear(x2, layer.weight, layer.bias) + ad.delta(x2)
    (y2 * torch.arange(24.0)).sum().backward()
    assert torch.allclose(got[0], y2.detach(), atol=1e-5)
    assert torch.allclose(got[1], x2.grad, atol=1e-4)
    for g, p in zip(got[2], ad.parameters(), strict=True):
        assert torch.allclose(g, p.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["qwha-dense", "lora"])
def test_training_after_an_inference_mode_eval(kind):
    """Caches filled during an inference_mode eval (dequantized base, WHT factors) must not
    break the next training step."""
    from lowbit.nn import QuantLinear
    from lowbit.transforms.hadamard import _factor_matrix

    _factor_matrix.cache_clear()  # so the eval below is what fills the WHT factor cache
    layer = QuantLinear.from_linear(torch.nn.Linear(48, 24), "w4g16")
    layer.adapters["a"] = random_adapter(24, 48, 100, path="dense") if kind != "lora" else LoRAAdapter(24, 48, 4)
    with torch.inference_mode():
        layer(torch.randn(2, 48))
    x = torch.randn(3, 48, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in layer.adapters["a"].parameters())


def test_csr_product_gradients_match_finite_differences():
    from lowbit.peft.sparse import _SparseProduct, sparse_index

    g = torch.Generator().manual_seed(3)
    flat = torch.randperm(7 * 12, generator=g)[:20]
    index = sparse_index(flat // 12, flat % 12, 7, 12)
    z_t = torch.randn(12, 5, dtype=torch.float64, requires_grad=True)
    values = torch.randn(20, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z, v: _SparseProduct.apply(z, v, index), (z_t, values))


def test_sparse_path_input_gradient_equals_dense():
    grads = []
    for path in ("dense", "sparse"):
        x = torch.randn(3, 9, 576, generator=torch.Generator().manual_seed(1), requires_grad=True)
        a = random_adapter(40, 576, 300, path=path)
        (a(x) * torch.linspace(-1, 1, 40)).sum().backward()
        grads.append(x.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-4)


def test_sparse_index_follows_loaded_positions():
    a = random_adapter(20, 48, 100, path="sparse")
    x = torch.randn(6, 48)
    a(x)  # builds the CSR index for the constructor's positions
    b = random_adapter(20, 48, 100, seed=5, path="sparse")
    a.load_state_dict(b.state_dict())
    assert torch.allclose(a(x), b(x), atol=1e-5) and torch.allclose(a(x), x @ b.delta_weight().T, atol=1e-5)
