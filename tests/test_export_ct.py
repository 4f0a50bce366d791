"""compressed-tensors export: transformers + compressed-tensors decompress lowbit's exact weights."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402

from lowbit.errors import LowbitError, SchemeError  # noqa: E402
from lowbit.files import compressed_tensors as ct  # noqa: E402
from lowbit.formats import QTensor, Scheme, quantize  # noqa: E402
from lowbit.nn import QuantLinear, quant_layers, set_module  # noqa: E402


def tiny(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
    return LlamaForCausalLM(cfg).eval()


def block_linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]


def fake_mxfp4(out: int, cols: int, seed: int = 0) -> QTensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, cols // 32, 32), dtype=torch.uint8, generator=g)
    scales = 2.0 ** torch.randint(-20, 4, (out, cols // 32), generator=g).float()
    return QTensor(codes, scales, None, None, (out, cols), Scheme.parse("mxfp4"))


def fake_nvfp4(out: int, cols: int, scheme: str = "nvfp4-46", seed: int = 0) -> QTensor:
    """An NVFP4 QTensor with every E2M1 code and a wide spread of E4M3 block scales."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, cols // 16, 16), dtype=torch.uint8, generator=g)
    scales = (torch.rand(out, cols // 16, generator=g) * 380 + 2**-9).to(torch.float8_e4m3fn).float()
    return QTensor(codes, scales, None, torch.tensor(6 * 256 / 0.07), (out, cols), Scheme.parse(scheme))


def quantized(plan: dict[str, str], seed: int = 0) -> LlamaForCausalLM:
    model = tiny(seed)
    for i, (name, scheme) in enumerate(plan.items()):
        lin = model.get_submodule(name)
        if scheme == "mxfp4":
            layer = QuantLinear(fake_mxfp4(lin.out_features, lin.in_features, seed + i))
        elif scheme.startswith("nvfp4"):
            layer = QuantLinear(fake_nvfp4(lin.out_features, lin.in_features, scheme, seed + i))
        else:
            layer = QuantLinear.from_linear(lin, scheme)
        set_module(model, name, layer)
    return model


def logits(model, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def nll(model) -> float:
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return float(model(ids, labels=ids).loss)


@pytest.mark.parametrize("scheme", ["w4g32", "w8", "w3g32", "w2g16", "w4g32:full=0", "w8g32"])
def test_uniform_int_bit_for_bit_through_transformers(tmp_path, scheme):
    model = quantized(dict.fromkeys(block_linears(tiny()), scheme))
    ct.export(model, None, tmp_path / "ct")
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "pack-quantized"
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    # transformers' own CPU decompression path (dequantize=True), one config group
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32,
                                                  quantization_config=CompressedTensorsConfig(run_compressed=False))
    for name, layer in quant_layers(model).items():
        assert torch.equal(loaded.get_submodule(name).weight, layer.weight), name
    assert torch.equal(logits(loaded), logits(model))
    assert nll(loaded) == nll(model)


def test_full_range_negative_scales_are_kept(tmp_path):
    w = torch.randn(32, 64)
    q = quantize(w, "w4g32")
    assert (q.scales < 0).any() and (q.codes == 0).any()  # max -> -8 with a negative scale
    d = ct.int_tensors(q)
    assert (d["weight_scale"] < 0).any()


def test_mixed_plan_int_and_nvfp4(tmp_path):
    names = block_linears(tiny())
    options = ["w4g32", "nvfp4-46", "w8", "w3g32", "nvfp4", "mxfp4"]
    model = quantized({n: options[i % len(options)] for i, n in enumerate(names)})
    ct.export(model, None, tmp_path / "ct")
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "mixed-precision"
    formats = sorted(g["format"] for g in cfg["config_groups"].values())
    assert formats.count("nvfp4-pack-quantized") == 1 and formats.count("pack-quantized") == 3
    assert formats.count("mxfp4-pack-quantized") == 1
    loaded = ct.load_decompressed(tmp_path / "ct")
    for name, layer in quant_layers(model).items():
        got = loaded.get_submodule(name).weight
        if layer.scheme.scale == "e4m3":  # compressed-tensors decompresses NVFP4 to bf16: equal after that cast
            assert torch.equal(got, layer.weight.to(torch.bfloat16).float()), name
        else:
            assert torch.equal(got, layer.weight), name
    assert abs(nll(loaded) - nll(model)) < 1e-3


def test_nvfp4_uniform_matches_in_bf16(tmp_path):
    model = quantized(dict.fromkeys(block_linears(tiny()), "nvfp4-46"))
    ct.export(model, None, tmp_path / "ct")
    loaded = ct.load_decompressed(tmp_path / "ct")
    for name, layer in quant_layers(model).items():
        assert torch.equal(loaded.get_submodule(name).weight, layer.weight.to(torch.bfloat16).float())
    assert abs(nll(loaded) - nll(model)) < 1e-3


@pytest.mark.parametrize("scheme", ["w4g32a", "w2g16a", "w8g32a", "w4a"])
def test_asym_zero_points_decompress_exactly(scheme):
    """Asymmetric groups through compressed-tensors' own pack-quantized compressor."""
    from compressed_tensors.quantization import QuantizationArgs

    q = quantize(torch.randn(40, 64), scheme)
    t = ct.target_for(q.scheme, 64)
    d = ct.int_tensors(q)
    assert d["weight_zero_point"].dtype == torch.int32
    scheme_ct = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**t.args), format=t.format)
    out = PackedQuantizationCompressor.decompress(dict(d), scheme_ct)
    assert torch.equal(out["weight"], q.dequantize())


def test_compress_roundtrip_matches_compressed_tensors_quantizer():
    """compressed-tensors re-quantizing lowbit's dequantized weight gives the same packed words."""
    from compressed_tensors.quantization import QuantizationArgs

    q = quantize(torch.randn(24, 96), "w4g32")
    t = ct.target_for(q.scheme, 96)
    ours = ct.int_tensors(q)
    scheme_ct = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**t.args), format=t.format)
    theirs = PackedQuantizationCompressor.compress(
        {"weight": q.dequantize(), "weight_scale": q.scales.clone()}, scheme_ct)
    assert torch.equal(theirs["weight_packed"], ours["weight_packed"])


@pytest.mark.parametrize("scheme,cols", [("nvfp4-ue5m3", 64), ("nvfp4:block=32", 64),
                                         ("w4g48", 64), ("mxfp8:block=16", 64)])
def test_refuses_schemes_without_a_format(scheme, cols):
    with pytest.raises(SchemeError, match="compressed-tensors"):
        ct.target_for(Scheme.parse(scheme), cols, "layer x")


def test_refuses_existing_output_and_model_without_quant_layers(tmp_path):
    model = quantized(dict.fromkeys(block_linears(tiny()), "w4g32"))
    (tmp_path / "ct").mkdir()
    with pytest.raises(LowbitError, match="--force"):
        ct.export(model, None, tmp_path / "ct")
    ct.export(model, None, tmp_path / "ct", force=True)
    assert (tmp_path / "ct" / "model.safetensors").is_file()
    with pytest.raises(SchemeError, match="no quantized layers"):
        ct.export(tiny(), None, tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_failed_export_leaves_nothing(tmp_path):
    model = quantized({block_linears(tiny())[0]: "w4g32"})
    # a layer whose scheme compressed-tensors cannot hold is found before anything is written
    set_module(model, "model.layers.1.mlp.up_proj", QuantLinear.from_linear(torch.nn.Linear(64, 128), "w4g48"))
    with pytest.raises(SchemeError):
        ct.export(model, None, tmp_path / "ct")
    assert list(tmp_path.iterdir()) == []


def _native(tmp_path, scheme: str = "w4g32"):
    from lowbit.files.native import save

    model = quantized(dict.fromkeys(block_linears(tiny()), scheme))
    save(model, None, tmp_path / "native")
    return model, tmp_path / "native"


def test_cli_export_and_inspect(tmp_path, capsys):
    from lowbit.cli import main

    model, native_dir = _native(tmp_path)
    assert main(["export", str(native_dir), "--to", "compressed-tensors", "--out", str(tmp_path / "ct"),
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["out"] == str(tmp_path / "ct") and r["bits_per_weight"] == 5.0  # 4 + fp32 scale / 32
    loaded = ct.load_decompressed(tmp_path / "ct")
    assert torch.equal(logits(loaded), logits(model))
    assert main(["inspect", str(native_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["format"] == "lowbit" and info["quantized_layers"] == 14
    assert info["bits_per_weight"] == 4.5 and info["schemes"] == {"w4g32": 14}
    assert info["fp16_bytes"] == 2 * sum(p.numel() for p in tiny().parameters())  # tied head counted once
    assert main(["inspect", str(tmp_path / "ct")]) == 0
    out, err = capsys.readouterr()
    assert "compressed-tensors" in out and "pack-quantized: int4 g32" in out  # the per-scheme table


def test_cli_refuses_existing_out_and_foreign_folders(tmp_path, capsys):
    from lowbit.cli import main

    _, native_dir = _native(tmp_path)
    (tmp_path / "ct").mkdir()
    assert main(["export", str(native_dir), "--to", "compressed-tensors", "--out", str(tmp_path / "ct")]) != 0
    assert "--force" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "ct"), "--to", "gguf", "--out", str(tmp_path / "x.gguf")]) != 0
    assert "not a lowbit checkpoint" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "ct")]) != 0
    assert "neither" in capsys.readouterr().err


@pytest.mark.slow
def test_bundled_model_ct_same_perplexity_in_transformers(tmp_path, bundled_w4g32):
    """SmolLM2-135M, RTN w4g32 -> pack-quantized: transformers decompresses to lowbit's weights."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from lowbit.eval import perplexity

    lm, tokens, ours = bundled_w4g32
    ct.export(lm.model, lm.tokenizer, tmp_path / "ct")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32,
                                              quantization_config=CompressedTensorsConfig(run_compressed=False))
    for name, layer in quant_layers(lm.model).items():
        assert torch.equal(hf.get_submodule(name).weight, layer.weight), name
    assert perplexity(hf, tokens, seqlen=256, windows=2, progress=False).ppl == ours


def test_cli_hand_edited_checkpoint_is_one_clear_error(tmp_path, capsys):
    from lowbit.cli import main

    _, native_dir = _native(tmp_path)
    m = json.loads((native_dir / "lowbit.json").read_text())
    m["layers"]["model.layers.0.mlp.up_proj"]["shape"] = [128, 32]
    (native_dir / "lowbit.json").write_text(json.dumps(m))
    for to, out in (("compressed-tensors", "ct"), ("gguf", "m.gguf")):
        assert main(["export", str(native_dir), "--to", to, "--out", str(tmp_path / out)]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "up_proj" in err[0]
        assert not (tmp_path / out).exists()


def test_16_bit_dense_tensors_stored_as_fp16_losslessly(tmp_path):
    from safetensors import safe_open

    model = quantized(dict.fromkeys(block_linears(tiny()), "w8"))
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight.half().float())
    ct.export(model, None, tmp_path / "ct")
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F16"
        assert f.get_slice("model.norm.weight").get_dtype() == "F32"
    assert torch.equal(logits(ct.load_decompressed(tmp_path / "ct")), logits(model))
