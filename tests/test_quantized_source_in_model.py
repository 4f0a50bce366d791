"""Quantized sources (gpt-oss MXFP4 experts, FP8 weights) loaded in-model, without --stream (issue 34 point 4).

References: requantizing a float copy of the source's dequantized weights (`test_stream._dequantized_copy`) must
give the very codes requantizing the source gives; MXFP4 -> MXFP4 must reproduce the source's values exactly;
transformers' own MXFP4 dequantization (its Mxfp4 quantizer, which dequantizes on CPU) must agree with lowbit's.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_stream import _dequantized_copy, _fp8_source, _mxfp4_source, _saved

from lowbit.cli import main
from lowbit.errors import ModelError
from lowbit.files import native
from lowbit.models.loading import load_model
from lowbit.models.quantized_source import load_dequantized

RTN = ["--method", "rtn", "--no-search", "--no-eval", "--json"]
GPT_OSS_QC = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                  "model.embed_tokens", "lm_head"]}


def _with_config(folder, qc: dict) -> None:
    c = json.loads((folder / "config.json").read_text())
    c["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(c))


def _quantize(src, out, scheme: str, tokenizer) -> dict:
    tokenizer.save_pretrained(src)
    assert main(["quantize", str(src), "--scheme", scheme, *RTN, "--out", str(out)]) == 0
    return {n: m for n, m in native.load(out)[0].named_modules() if hasattr(m, "codes") or hasattr(m, "qweight")}


def _same_codes(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for n, m in a.items():
        x, y = (getattr(m, "qweight", m), getattr(b[n], "qweight", b[n]))
        assert torch.equal(x.codes, y.codes) and torch.equal(x.scales, y.scales), n


@pytest.fixture
def mxfp4_src(tmp_path, tiny_tokenizer):
    src = _mxfp4_source(tmp_path)
    _with_config(src, GPT_OSS_QC)  # as openai/gpt-oss-* ship it
    tiny_tokenizer.save_pretrained(src)
    _dequantized_copy(src, tmp_path / "deq")
    return src, tmp_path / "deq"


@pytest.mark.parametrize("scheme", ("mxfp4", "w4g8"))
def test_mxfp4_source_requantizes_in_model_as_its_float_dequantization(mxfp4_src, tmp_path, tiny_tokenizer, scheme):
    src, deq = mxfp4_src
    a = _quantize(src, tmp_path / "a", scheme, tiny_tokenizer)
    b = _quantize(deq, tmp_path / "b", scheme, tiny_tokenizer)
    _same_codes(a, b)
    if scheme == "mxfp4":  # MXFP4 -> MXFP4: the source's own values, exactly
        from lowbit.models.stream_source import StreamSource

        source = StreamSource.open(src)
        for name, stack in a.items():
            if ".experts." in name:
                assert torch.equal(stack.dequantize(), source.tensor(name))


def test_mxfp4_dequantization_agrees_with_transformers_and_records_the_source_precision(mxfp4_src):
    from transformers import AutoModelForCausalLM

    src, _ = mxfp4_src
    ours, counts = load_dequantized(src)
    assert counts["mxfp4"] == 4  # gate_up and down of two layers; the rest bf16
    theirs = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)  # its quantizer dequantizes on CPU
    for (n, p), (m, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert n == m and torch.equal(p, q), n
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_model(src).model(ids).logits, ours(ids).logits)


@pytest.mark.parametrize("arch, config", (("llama", False), ("llama", True), ("deepseek_v3", True)))
def test_fp8_block_source_requantizes_in_model_as_its_float_dequantization(tmp_path, tiny_tokenizer, arch, config):
    """Without a quantization_config transformers used to load the FP8 bytes unscaled (the scales dropped as
    unexpected keys): other codes than the dequantization's, silently. DeepSeek-V3 as it ships: FP8 block-scaled
    Linears, experts one by one on disk, the router's correction bias a buffer."""
    src = _saved(arch, tmp_path / "src", dtype=torch.float32)
    _fp8_source(src, tmp_path / "fp8", "block")
    if arch == "deepseek_v3":  # its checkpoints carry a multi-token-prediction layer the model class skips
        f = sorted((tmp_path / "fp8").glob("model*.safetensors"))[0]
        save_file({**load_file(f), "model.layers.61.eh_proj.weight": torch.ones(4, 4)}, f, metadata={"format": "pt"})
        index = tmp_path / "fp8" / "model.safetensors.index.json"
        m = json.loads(index.read_text())
        m["weight_map"]["model.layers.61.eh_proj.weight"] = f.name
        index.write_text(json.dumps(m))
    if config:  # DeepSeek-V3's form
        _with_config(tmp_path / "fp8", {"quant_method": "fp8", "weight_block_size": [16, 16],
                                        "activation_scheme": "dynamic", "fmt": "e4m3"})
    _dequantized_copy(tmp_path / "fp8", tmp_path / "deq")
    _same_codes(_quantize(tmp_path / "fp8", tmp_path / "a", "w4g8", tiny_tokenizer),
                _quantize(tmp_path / "deq", tmp_path / "b", "w4g8", tiny_tokenizer))


def test_a_source_tensor_the_model_has_no_place_for_is_refused(mxfp4_src, tmp_path, tiny_tokenizer, capsys):
    src, _ = mxfp4_src
    t = load_file(src / "model.safetensors")
    t["model.layers.0.mlp.experts.extra_proj_blocks"] = t["model.layers.0.mlp.experts.down_proj_blocks"].clone()
    t["model.layers.0.mlp.experts.extra_proj_scales"] = t["model.layers.0.mlp.experts.down_proj_scales"].clone()
    save_file(t, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match="extra_proj.*has no place for|has no place for.*extra_proj"):
        load_dequantized(src)
    tiny_tokenizer.save_pretrained(src)
    assert main(["quantize", str(src), "--scheme", "mxfp4", *RTN, "--out", str(tmp_path / "q")]) == 2
    assert "lowbit drops nothing silently" in capsys.readouterr().err and not (tmp_path / "q").exists()


def test_offload_dir_on_a_quantized_source_is_refused_naming_the_ways_that_work(mxfp4_src, tmp_path, capsys):
    src, _ = mxfp4_src
    assert main(["quantize", str(src), "--scheme", "w4g8", "--method", "gptq", "--offload-dir", str(tmp_path / "off"),
                 "--no-eval", "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "MXFP4 / FP8 weights, which --offload-dir cannot read" in err and "--stream" in err
    assert not (tmp_path / "q").exists()
