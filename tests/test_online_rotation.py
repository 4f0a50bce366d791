"""Online input rotations (QuaRot's Hadamard before down_proj): same function, every method, stored, refused."""

import copy

import pytest
import torch
from ptq_helpers import calib, uniform
from test_rotation import llama, same_function

from lowbit.errors import ConfigError, SchemeError
from lowbit.formats import Scheme, quantize
from lowbit.formats.inputs import InputScheme
from lowbit.nn import QuantLinear, quant_layers
from lowbit.nn.input_quant import InputQuantizer
from lowbit.nn.input_rotation import InputRotation, attach
from lowbit.ptq import quantize_model
from lowbit.ptq.rotation import RotationSettings, rotate_model
from lowbit.transforms.hadamard import hadamard

ONLINE = RotationSettings(residual=False, online=("down_proj",))


@pytest.mark.parametrize("width", [64, 96, 1536])
def test_the_rotation_is_orthogonal_and_is_the_hadamard(width):
    rot = InputRotation(width)
    x = torch.randn(5, width, dtype=torch.float64)
    h = hadamard(width, torch.float64) / width**0.5
    torch.testing.assert_close(rot(x), x @ h.T)
    torch.testing.assert_close(rot(x).norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize("settings", [ONLINE, RotationSettings(online=("down_proj",)),
                                      RotationSettings(residual=False, online=("down_proj", "o_proj"))])
def test_online_rotation_keeps_the_float_models_function(settings):
    m = llama()
    r = copy.deepcopy(m)
    info = rotate_model(r, settings)
    assert info["online_layers"] == 2 * len(settings.online)
    same_function(m, r)
    assert r.model.layers[0].mlp.down_proj.input_rotation is not None
    assert getattr(r.model.layers[0].mlp.up_proj, "input_rotation", None) is None


def test_statistics_hooks_see_the_rotated_input():
    """The rotation runs before any later hook, so importance / Hessians / static scales are of what the
    quantized layer will see."""
    lin = torch.nn.Linear(64, 8)
    attach(lin)
    seen = []
    lin.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
    x = torch.randn(3, 64)
    lin(x)
    torch.testing.assert_close(seen[0], lin.input_rotation(x))


def test_rotation_lowers_w4a4_error_on_an_outlier_input():
    """What it is for: an outlier input channel (down_proj's input has them) is spread before the
    FP4 input quantizer, so the layer's W4A4 output error drops."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * 0.05
    x = torch.randn(512, 256, generator=g)
    x[:, 7] *= 60
    ref = x @ w.T
    s, inp = Scheme.parse("mxfp4"), InputScheme.parse("mxfp4")

    def err(layer):
        with torch.no_grad():
            return float((layer(x) - ref).pow(2).mean() / ref.pow(2).mean())

    plain = QuantLinear(quantize(w, s), input_quant=InputQuantizer(inp))
    lin = torch.nn.Linear(256, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    rot = attach(lin)
    rotated = QuantLinear(quantize(lin.weight.detach(), s), input_quant=InputQuantizer(inp), input_rotation=rot)
    assert err(rotated) < 0.5 * err(plain)


@pytest.mark.parametrize("method", ["rtn", "gptq", "signround2"])
def test_every_method_keeps_the_rotation_on_its_quantized_layers(method):
    m = llama()
    q = copy.deepcopy(m)
    settings = {"iters": 5} if method == "signround2" else None
    quantize_model(q, uniform(q, "w4a4-mxfp4"), method, settings, calib=calib(4, 16), rotate=ONLINE,
                   progress=False)
    layers = quant_layers(q)
    rotated = {n for n, layer in layers.items() if layer.input_rotation is not None}
    assert rotated == {n for n in layers if n.endswith("down_proj")}
    # the rotation is applied where the stored (rotated) weights expect it: without it the outputs go wrong
    ids = calib(2, 16, seed=9)
    with torch.no_grad():
        ref = m(ids).logits
        good = float((q(ids).logits - ref).pow(2).mean())
        for n in rotated:
            q.get_submodule(n).set_input_rotation(None)
        wrong = float((q(ids).logits - ref).pow(2).mean())
    assert good < 0.5 * wrong


def test_awq_leaves_the_rotated_layers_group_alone():
    m = llama()
    q = copy.deepcopy(m)
    from lowbit.ptq import AWQSettings

    quantize_model(q, uniform(q, "w4g32"), "rtn", None, calib=calib(4, 16), rotate=ONLINE, awq=AWQSettings(),
                   progress=False)
    assert all(layer.input_rotation is not None for n, layer in quant_layers(q).items() if n.endswith("down_proj"))


def test_native_checkpoint_keeps_it_and_engine_exports_refuse_it(tmp_path, tiny_tokenizer):
    pytest.importorskip("gguf")
    pytest.importorskip("compressed_tensors")
    from lowbit.files import compressed_tensors as ct
    from lowbit.files import gguf_export as ge
    from lowbit.files.native import load, save

    m = llama()
    quantize_model(m, uniform(m, "w4g32"), "rtn", None, calib=calib(4, 16), rotate=ONLINE, progress=False)
    save(m, tiny_tokenizer, tmp_path / "q")
    back, _ = load(tmp_path / "q")
    assert back.model.layers[1].mlp.down_proj.input_rotation is not None
    ids = calib(2, 16, seed=9)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, back(ids).logits)
    for export in (lambda: ge.export(m, tiny_tokenizer, tmp_path / "m.gguf"),
                   lambda: ct.export(m, tiny_tokenizer, tmp_path / "ct")):
        with pytest.raises(SchemeError, match="cannot hold an online input rotation .* e.g. model.layers.0.mlp"):
            export()
    assert not (tmp_path / "m.gguf").exists() and not (tmp_path / "ct").exists()


def test_bad_online_rotations_are_refused():
    m = llama()
    with pytest.raises(ConfigError, match=r"every decoder block needs exactly one Linear of that name .*\['down_proj'"):
        rotate_model(m, RotationSettings(residual=False, online=("down",)))
    with pytest.raises(ConfigError, match="rotates nothing"):
        RotationSettings(residual=False)
    lin = torch.nn.Linear(64, 8)
    attach(lin)
    with pytest.raises(ConfigError, match="rotate each layer once"):
        attach(lin)
    with pytest.raises(ConfigError, match="no Hadamard construction for an input of width 7"):
        InputRotation(7)


def test_rotate_online_flag(tiny_hf_dir, tmp_path, capsys):
    from lowbit.cli import main

    base = ["quantize", str(tiny_hf_dir), "--scheme", "w4a4-mxfp4", "--no-eval", "--nsamples", "4", "--seqlen", "32"]
    assert main([*base, "--rotate-online", "down_proj", "--out", str(tmp_path / "q")]) == 0
    from lowbit.files.native import load

    back, _ = load(tmp_path / "q")
    assert sum(isinstance(getattr(x, "input_rotation", None), InputRotation) for x in back.modules()) == \
        back.config.num_hidden_layers
    capsys.readouterr()
    assert main([*base, "--rotate-online", "nope", "--out", str(tmp_path / "r")]) == 2
    assert "online rotation of 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
