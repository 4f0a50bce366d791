"""Quantized inputs through the methods, checkpoints and exporters (tiny random models)."""

import json

import pytest
import torch
import torch.nn.functional as F
from ptq_helpers import block_names, calib, tiny_model, uniform

from lowbit.errors import ConfigError, SchemeError
from lowbit.formats import InputScheme, qdq_input
from lowbit.nn import QuantLinear, quant_layers
from lowbit.plans.plan import Plan
from lowbit.ptq import quantize_model


def quantized(recipe: str, method: str = "rtn", **settings):
    model, c = tiny_model(), calib()
    settings = settings or ({"search": False} if method == "rtn" else {"iters": 2, "batch_size": 4})
    quantize_model(model, uniform(model, recipe), method, settings, calib=c, progress=False)
    return model, c


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(seed))


def logits(model, x=None) -> torch.Tensor:
    with torch.no_grad():
        return model(ids() if x is None else x).logits


def test_quant_linear_quantizes_its_input_exactly():
    model, _ = quantized("w4a4-mxfp4")
    layer = quant_layers(model)["model.layers.0.mlp.down_proj"]
    x = torch.randn(3, 5, 128)
    with torch.no_grad():
        want = F.linear(qdq_input(x, InputScheme.parse("mxfp4")), layer.weight)
        assert torch.equal(layer(x), want)


def test_static_scales_come_from_the_calibration_inputs():
    from lowbit.models.activations import input_amax

    fp, c = tiny_model(), calib()
    want = input_amax(fp, c, block_names(fp))
    model, _ = quantized("w4a4-nvfp4")
    for name, layer in quant_layers(model).items():
        assert float(layer.input_quant.amax) == float(want[name]), name


@pytest.mark.parametrize("method", ["signround", "signround2"])
def test_signround_tunes_with_quantized_inputs(method):
    """The block is tuned on quantized inputs (TunedLinear runs the quantizer) and keeps it."""
    model, _ = quantized("w4a4-nvfp4", method)
    layers = quant_layers(model)
    assert all(m.input_quant is not None and m.input_quant.amax is not None for m in layers.values())
    rtn, _ = quantized("w4a4-nvfp4", method, iters=0)  # iters 0 is RTN (V2: searched): same quantizers
    assert torch.equal(logits(rtn), logits(quantized("w4a4-nvfp4", method, iters=0)[0]))
    assert torch.isfinite(logits(model)).all()


def test_tuned_linear_sees_quantized_inputs_and_loss_filter_on_at_4_bits():
    from lowbit.nn.input_quant import InputQuantizer
    from lowbit.ptq.blockwise import BlockJob
    from lowbit.ptq.signround import SignRoundSettings, SignRoundTuner, TunedLinear

    lin = torch.nn.Linear(64, 32, bias=False)
    iq = InputQuantizer(InputScheme.parse("mxfp4"))
    from lowbit.ptq.rounders import make_rounder

    r = make_rounder(lin.weight.detach(), uniform(tiny_model(), "mxfp4").weight(block_names(tiny_model())[0]),
                     None, False)
    t = TunedLinear(lin, r, None, iq)
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(t(x), F.linear(qdq_input(x, iq.scheme), r()))
    tuner = SignRoundTuner(SignRoundSettings(v2=False))
    job = BlockJob(0, torch.nn.Identity(), {}, x, x, {}, None, inputs={"a": iq})
    assert tuner._use_filter(job)
    job8 = BlockJob(0, torch.nn.Identity(), {}, x, x, {}, None, inputs={"a": InputQuantizer(InputScheme.parse("fp8"))})
    assert not tuner._use_filter(job8)


def test_deltaloss_activation_term_and_knapsack_over_wa_options():
    from lowbit.ptq.mixed import MixedSettings, mixed_plan
    from lowbit.ptq.sensitivity import delta_loss

    model, c = tiny_model(), calib()
    names = block_names(model)
    before = {n: model.get_submodule(n).weight.clone() for n in names}
    scores = delta_loss(model, names, ["w4a4-mxfp4", "w8a8-mxfp8"], c[:4], progress=False)
    assert all(v > 0 for v in scores["w4a4-mxfp4"].values())
    assert sum(scores["w4a4-mxfp4"].values()) > sum(scores["w8a8-mxfp8"].values())
    assert all(torch.equal(model.get_submodule(n).weight, before[n]) for n in names)
    # the activation term alone: the same as summing |g (.) (Q(x) - x)| by hand for one layer
    name = "model.layers.1.mlp.down_proj"
    grads, diffs = [], []

    def hook(mod, args):
        x = args[0].detach().requires_grad_(True)
        q = qdq_input(x, InputScheme.parse("mxfp4"))
        y = x + (q - x).detach()
        y.register_hook(grads.append)
        diffs.append(q - x)
        return (y,)

    from lowbit.formats import qdq

    with torch.no_grad():
        for n in names:
            model.get_submodule(n).weight.copy_(qdq(before[n], "mxfp4"))
    others = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, a: (qdq_input(a[0], InputScheme.parse("mxfp4")),)) for n in names if n != name]
    h = model.get_submodule(name).register_forward_pre_hook(hook)
    for chunk in c[:4].split(4):
        model(input_ids=chunk, labels=chunk, use_cache=False).loss.backward()
    h.remove()
    for o in others:
        o.remove()
    by_hand = float(sum((g * d).abs().sum() for g, d in zip(grads, diffs, strict=True)))
    assert scores["w4a4-mxfp4"][name] == pytest.approx(by_hand, rel=1e-4)
    with torch.no_grad():
        for n in names:
            model.get_submodule(n).weight.copy_(before[n])
    alloc = mixed_plan(model, uniform(model, "w4a4-mxfp4"),
                       MixedSettings(avg_bits=5, options=("w4a4-mxfp4", "w8a8-mxfp8"), count_scales=False), c,
                       progress=False)
    assert alloc.total_bits <= alloc.budget_bits and {r.name for r in alloc.plan.recipes()} <= {"w4a4-mxfp4",
                                                                                                  "w8a8-mxfp8"}


def test_native_checkpoint_keeps_input_schemes_and_scales(tmp_path):
    from lowbit.files.inspect import inspect
    from lowbit.files.native import load, save

    model, _ = quantized("w4a4-nvfp4")
    save(model, None, tmp_path / "q")
    loaded, _ = load(tmp_path / "q")
    assert torch.equal(logits(loaded), logits(model))
    for name, layer in quant_layers(loaded).items():
        assert float(layer.input_quant.amax) == float(quant_layers(model)[name].input_quant.amax)
    info = inspect(tmp_path / "q")
    assert info["inputs"] == {"nvfp4": 14} and info["layers"][0]["input_amax"] > 0


# ------------------------------------------------------------------ compressed-tensors
CT_EXACT = ["mxfp4@mxfp4:round=even", "mxfp8@mxfp8:round=even", "w8a8-fp8", "w8a8-fp8-static"]


@pytest.mark.parametrize("recipe", CT_EXACT)
def test_ct_export_bit_for_bit(tmp_path, recipe):
    """Where compressed-tensors computes the same operations, its logits are lowbit's bit for bit."""
    pytest.importorskip("compressed_tensors")
    from lowbit.files import compressed_tensors as ct

    model, _ = quantized(recipe)
    ct.export(model, None, tmp_path / "ct")
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert all(g["input_activations"] for g in cfg["config_groups"].values())
    assert torch.equal(logits(ct.load_decompressed(tmp_path / "ct")), logits(model))
    from lowbit.files.inspect import inspect

    info = inspect(tmp_path / "ct")
    assert info["quantized_layers"] == 14 and sum(info["inputs"].values()) == 14


def test_ct_export_nvfp4_inputs_exact_weights_in_bf16(tmp_path):
    """NVFP4: compressed-tensors decompresses the weights to bf16; the input path is exact."""
    from lowbit.files import compressed_tensors as ct

    model, _ = quantized("w4a4-nvfp4")
    ct.export(model, None, tmp_path / "ct")
    loaded = ct.load_decompressed(tmp_path / "ct")
    x = torch.randn(3, 7, 64)
    for name, layer in quant_layers(model).items():
        theirs = loaded.get_submodule(name)
        if layer.in_features != 64:
            continue
        assert torch.equal(theirs.weight, layer.weight.to(torch.bfloat16).float()), name
        with torch.no_grad():
            assert torch.equal(theirs(x), F.linear(layer.prepare_input(x), theirs.weight)), name
    ours, theirs = logits(model), logits(loaded)
    assert float((ours - theirs).norm() / ours.norm()) < 0.1


def test_ct_export_int8_differs_only_by_the_divisor(tmp_path):
    """compressed-tensors' reference divides an int8 token's max by 127.5, lowbit (and int8 kernels) by 127."""
    from lowbit.files import compressed_tensors as ct

    model, _ = quantized("w8a8-int8")
    ct.export(model, None, tmp_path / "ct")
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert {g["format"] for g in cfg["config_groups"].values()} == {"int-quantized"}
    loaded = ct.load_decompressed(tmp_path / "ct")
    layer, theirs = quant_layers(model)["model.layers.0.mlp.up_proj"], loaded.get_submodule("model.layers.0.mlp.up_proj")
    assert torch.equal(theirs.weight, layer.weight)
    x = torch.randn(2, 3, 64)  # [batch, tokens, hidden]: compressed-tensors' token strategy reduces dim 2
    s = x.abs().amax(-1, keepdim=True) / 127.5
    with torch.no_grad():
        assert torch.allclose(theirs(x), F.linear((x / s).round().clamp(-128, 127) * s, layer.weight), atol=1e-5)


@pytest.mark.parametrize("recipe", ["w4a4-nvfp4-46", "w4a4-mxfp4", "nvfp4@nvfp4-ue5m3", "w4a4-nvfp4-span"])
def test_ct_refuses_inputs_it_cannot_express(tmp_path, recipe):
    from lowbit.files import compressed_tensors as ct

    model, _ = quantized(recipe)
    with pytest.raises(SchemeError, match="It holds for inputs"):
        ct.export(model, None, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()


def test_gguf_refuses_activation_quantization(tmp_path):
    from lowbit.files.gguf_export import plan_types

    model, _ = quantized("w2g64-a8")
    with pytest.raises(SchemeError, match="GGUF cannot hold activation quantization"):
        plan_types(model, allow_requant=True)


# -------------------------------------------------------------------- bad input
def test_static_scales_without_calibration_change_nothing():
    model = tiny_model()
    before = logits(model)
    with pytest.raises(ConfigError, match="calibration"):
        quantize_model(model, uniform(model, "w4a4-nvfp4"), "rtn", {"search": False}, progress=False)
    assert not quant_layers(model) and torch.equal(logits(model), before)


def test_input_block_must_divide_the_width():
    from lowbit.nn import replace_linears

    model = tiny_model(inter=96)  # down_proj has 96 input columns: mxfp4's block of 64 does not divide it
    plan = Plan.uniform(block_names(model), "w4g32@mxfp4:block=64")
    with pytest.raises(SchemeError, match="does not divide the 96 input columns"):
        replace_linears(model, plan)
    assert not quant_layers(model)


def test_cli_recipe_runs_and_bad_inputs_are_one_error(tmp_path, capsys, tiny_hf_dir):
    from lowbit.cli import main

    common = [str(tiny_hf_dir), "--method", "rtn", "--no-search", "--nsamples", "4", "--seqlen", "32",
              "--no-eval", "--json"]
    assert main(["quantize", *common, "--scheme", "w4a4-nvfp4", "--out", str(tmp_path / "q")]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["scheme"] == "w4a4-nvfp4"
    loaded = quant_layers(__import__("lowbit").load(tmp_path / "q")[0])
    assert all(isinstance(m, QuantLinear) and m.input_quant is not None for m in loaded.values())
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": {"model.layers.0.mlp.nope": "w4a4-nvfp4"}}))
    assert main(["quantize", *common, "--plan", str(plan), "--out", str(tmp_path / "p")]) != 0
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "%|" not in line]  # no progress bars
    assert len(err) == 1 and "lacks" in err[0] and not (tmp_path / "p").exists()
    assert main(["export", str(tmp_path / "q"), "--to", "gguf", "--out", str(tmp_path / "m.gguf")]) != 0
    assert "GGUF cannot hold activation quantization" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()


# ------------------------------------------------------------------ the input block-size study
def test_input_study_rows_and_underflow():
    from lowbit.studies import input_block_study, w4a4_ppl_fn

    model, c = tiny_model(), calib()
    names = block_names(model)
    model.get_submodule(names[0]).register_forward_pre_hook(  # one outlier channel 1e7 x the rest
        lambda m, a: (a[0] * torch.cat([torch.full((1,), 1e7), torch.ones(63)]),))
    before = logits(model)
    calls = []
    rows = input_block_study(model, names, c, ("nvfp4", "nvfp4:guard=1", "nvfp4-46"), (8, 32), progress=False,
                             ppl_fn=lambda inputs, amax: calls.append(len(inputs)) or 1.0)
    assert len(rows) == 6 and calls == [len(names)] * 6
    by = {(r.label, r.block): r for r in rows}
    assert by[("nvfp4", 8)].underflow > 0 and by[("nvfp4", 8)].underflow >= by[("nvfp4", 32)].underflow
    assert by[("nvfp4:guard=1", 8)].underflow == by[("nvfp4", 8)].underflow  # counted before any guard
    assert by[("nvfp4-46", 8)].rel_error < by[("nvfp4", 8)].rel_error
    assert torch.equal(logits(model), before)  # the study never changes activations or weights
    fn = w4a4_ppl_fn(model, names, lambda: float(model(c[:2], labels=c[:2]).loss))
    fp_loss = float(model(c[:2], labels=c[:2]).loss)
    assert fn(dict.fromkeys(names, InputScheme.parse("mxfp4")), {}) != fp_loss
    assert torch.equal(logits(model), before)  # weights restored


def test_cli_formats_inputs(tmp_path, capsys, tiny_hf_dir):
    from lowbit.cli import main

    assert main(["formats", str(tiny_hf_dir), "--inputs", "--schemes", "nvfp4,mxfp4", "--block-sizes", "8,16",
                 "--nsamples", "2", "--seqlen", "16", "--plot", str(tmp_path / "p.png"), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["mode"] == "inputs" and len(r["rows"]) == 4 and "verdict_underflow" in r
    assert (tmp_path / "p.png").stat().st_size > 0
    assert main(["formats", str(tiny_hf_dir), "--nsamples", "2"]) != 0
    assert "add --inputs" in capsys.readouterr().err
    assert main(["formats", str(tiny_hf_dir), "--inputs", "--schemes", "w4g128"]) != 0
    assert "unknown input scheme" in capsys.readouterr().err


def test_cli_mixed_over_wa_options(tmp_path, capsys, tiny_hf_dir):
    from lowbit.cli import main

    assert main(["quantize", str(tiny_hf_dir), "--method", "rtn", "--no-search", "--avg-bits", "5", "--options",
                 "w4a4-mxfp4,w8a8-mxfp8", "--ignore-scale-bits", "--nsamples", "4", "--seqlen", "32", "--no-eval",
                 "--out", str(tmp_path / "m"), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["scheme"].startswith("mixed(")
    plan = Plan.load(tmp_path / "m" / "plan.json")
    assert {x.name for x in plan.recipes()} <= {"w4a4-mxfp4", "w8a8-mxfp8"} and plan.inputs()


def test_signround_plan_covering_only_some_blocks():
    model, c = tiny_model(), calib()
    names = [n for n in block_names(model) if ".layers.0." in n]
    quantize_model(model, Plan.uniform(names, "w4a4-mxfp4"), "signround2", {"iters": 1, "batch_size": 4},
                   calib=c, progress=False)
    assert sorted(quant_layers(model)) == sorted(names)


@pytest.mark.parametrize("cols,panel", [(50, 64), (200, 64), (577, 192), (256, 64)])
def test_gram_is_the_symmetric_product(cols, panel):
    """The panelled X^T X (GPTQ's Hessians, QWHA's second moments) equals the full product and is symmetric."""
    from lowbit.models.activations import gram

    x = torch.randn(300, cols, dtype=torch.float64)
    g = gram(x, panel)
    assert torch.equal(g, g.T)
    assert torch.allclose(g, x.T @ x, rtol=1e-12, atol=1e-10)


def test_xtx_sums_in_float64_a_band_of_rows_at_a_time(monkeypatch):
    """X^T X summed over batches band by band (no n x n float64 copy of each batch's float32 product) is the
    float64 sum of the float32 products, bit for bit."""
    from torch import nn

    from lowbit.models import activations

    monkeypatch.setattr(activations, "BAND", 16)
    lin = nn.Linear(100, 4)
    xs = [torch.randn(7, 100) * 3 for _ in range(3)]
    with torch.no_grad(), activations.activation_stats({"l": lin}, ("xtx",), torch.float32) as st:
        for x in xs:
            lin(x)
    want = sum(activations.gram(x).double() for x in xs)
    got = st.result("xtx", torch.float64)["l"]
    assert got.dtype == torch.float64 and torch.equal(got, want)
