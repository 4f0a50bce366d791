"""Native lowbit checkpoints load through transformers' from_pretrained, bit for bit, or fail loudly."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from lowbit.errors import CheckpointError
from lowbit.files import hf_quantizer
from lowbit.files.native import load, save
from lowbit.formats import QTensor, Scheme
from lowbit.nn import QuantLinear, quant_layers, set_module

hf_quantizer.register()


def tiny(tie: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, tie_word_embeddings=tie, attention_bias=True)
    return LlamaForCausalLM(cfg).eval()


def fake_fp4(out: int, cols: int, scheme: str, seed: int) -> QTensor:
    s = Scheme.parse(scheme)
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, cols // s.group_size, s.group_size), dtype=torch.uint8, generator=g)
    if s.scale == "e8m0":
        scales, ts = 2.0 ** torch.randint(-12, 2, codes.shape[:2], generator=g).float(), None
    else:
        scales = (torch.rand(codes.shape[:2], generator=g) * 300 + 0.01).to(torch.float8_e4m3fn).float()
        ts = torch.tensor(1536.0 / 0.3)
    return QTensor(codes, scales, None, ts, (out, cols), s)


def quantized(tie: bool = True) -> LlamaForCausalLM:
    model = tiny(tie)
    options = ["w4g32", "w3g32a", "nvfp4-46", "mxfp4", "w8", "w2g16"]
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    for i, name in enumerate(names):
        lin, s = model.get_submodule(name), options[i % len(options)]
        q = fake_fp4(lin.out_features, lin.in_features, s, i) if Scheme.parse(s).is_fp else None
        layer = QuantLinear(q, lin.bias) if q is not None else QuantLinear.from_linear(lin, s)
        set_module(model, name, layer)
    return model


def logits(model) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture
def ckpt(tmp_path) -> tuple[LlamaForCausalLM, Path]:
    model = quantized()
    save(model, None, tmp_path / "q")
    return model, tmp_path / "q"


@pytest.mark.parametrize("tie", [True, False])
def test_from_pretrained_equals_lowbit_bit_for_bit(tmp_path, tie):
    model = quantized(tie)
    save(model, None, tmp_path / "q")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert loaded.config.quantization_config.quant_method == "lowbit"
    ours = quant_layers(model)
    theirs = quant_layers(loaded)
    assert set(theirs) == set(ours)
    for name, layer in ours.items():
        assert theirs[name].scheme == layer.scheme
        assert torch.equal(theirs[name].weight, layer.weight), name
        assert (theirs[name].bias is None) == (layer.bias is None), name
        if layer.bias is not None:
            assert torch.equal(theirs[name].bias, layer.bias), name
    assert torch.equal(logits(loaded), logits(model))
    assert torch.equal(logits(loaded), logits(load(tmp_path / "q")[0]))


def _edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def test_unknown_format_version_is_loud(ckpt):
    _, d = ckpt
    _edit_json(d / "config.json", lambda c: c["quantization_config"].update(format_version=99))
    with pytest.raises(CheckpointError, match="version 99"):
        AutoModelForCausalLM.from_pretrained(d)


def test_unknown_config_key_is_loud(ckpt):
    _, d = ckpt
    _edit_json(d / "config.json", lambda c: c["quantization_config"].update(bits=3))
    with pytest.raises(CheckpointError, match="unknown keys"):
        AutoModelForCausalLM.from_pretrained(d)


def test_manifest_shape_edit_is_loud(ckpt):
    _, d = ckpt
    _edit_json(d / "lowbit.json", lambda m: m["layers"]["model.layers.0.self_attn.q_proj"].update(shape=[32, 64]))
    with pytest.raises(CheckpointError, match="q_proj"):
        AutoModelForCausalLM.from_pretrained(d)


def test_manifest_unknown_layer_is_loud(ckpt):
    _, d = ckpt
    _edit_json(d / "lowbit.json", lambda m: m["layers"].update(
        {"model.layers.9.mlp.up_proj": m["layers"]["model.layers.0.mlp.up_proj"]}))
    with pytest.raises(CheckpointError, match="does not exist"):
        AutoModelForCausalLM.from_pretrained(d)


def test_missing_manifest_and_bad_checksum_are_loud(ckpt):
    _, d = ckpt
    data = bytearray((d / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (d / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        AutoModelForCausalLM.from_pretrained(d)
    (d / "lowbit.json").unlink()
    with pytest.raises(CheckpointError, match="lowbit.json"):
        AutoModelForCausalLM.from_pretrained(d)


def test_import_lowbit_registers_before_transformers_is_imported(ckpt):
    _, d = ckpt
    code = ("import sys, lowbit\nassert 'transformers' not in sys.modules and 'torch' not in sys.modules\n"
            "from transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(d)!r})\n"
            "print(type(m.model.layers[0].self_attn.q_proj).__name__)")
    src = str(Path(__file__).resolve().parents[1] / "src")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": src, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "QuantLinear"
