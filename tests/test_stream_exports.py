"""`lowbit quantize --stream --export-to compressed-tensors|gguf`: the exporters' files without the model in memory.

Reference: the in-model RTN checkpoint (`test_stream._in_model`) loaded and exported by
`lowbit.files.compressed_tensors.export` / `lowbit.files.gguf_export.export`. The streamed
compressed-tensors folder must hold the same tensors (names, dtypes, bytes) and the same
``quantization_config``; the streamed GGUF file must be the same file, byte for byte.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_stream import _in_model, _saved

from lowbit.api.stream import StreamJob, stream_quantize
from lowbit.cli import main
from lowbit.errors import ConfigError
from lowbit.files import compressed_tensors as ct
from lowbit.files import gguf_export as ge
from lowbit.files import native
from lowbit.ptq import stream_exports


def _stream(src, out, scheme, export, **kw):
    return stream_quantize(StreamJob(model=src, out=out, scheme=scheme, progress=False, shard_mb=0.004,
                                     export_to=export, **kw))


def _folder_tensors(folder) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("scheme", ["w4g8", "nvfp4-46", "fp8", "mxfp4"])
def test_streamed_compressed_tensors_is_the_export_of_the_in_model_checkpoint(tmp_path, scheme):
    src = _saved("llama", tmp_path / "src")
    s = _stream(src, tmp_path / "ct", scheme, "compressed-tensors")
    assert s["export"] == "compressed-tensors" and s["shards"] > 1
    model, _ = native.load(_in_model(src, scheme, tmp_path / "ref"))
    ct.export(model, None, tmp_path / "ref_ct")
    got, want = _folder_tensors(tmp_path / "ct"), _folder_tensors(tmp_path / "ref_ct")
    assert set(got) == set(want)
    bad = [k for k in got if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not bad, bad[:5]
    cfg = [json.loads((f / "config.json").read_text())["quantization_config"] for f in (tmp_path / "ct",
                                                                                         tmp_path / "ref_ct")]
    assert cfg[0] == cfg[1]
    index = json.loads((tmp_path / "ct" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(got)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no work folder left


def _kquant_llama(path):
    """A llama whose rows are multiples of 256 (K-quant super-blocks), untied, saved in bf16 shards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320, tie_word_embeddings=False, max_position_embeddings=256)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, max_shard_size="300KB")
    return path


@pytest.mark.parametrize(("scheme", "pieces"), [("q4_k_m", True), ("w4g32", False)])
def test_streamed_gguf_is_the_export_of_the_in_model_checkpoint(tmp_path, monkeypatch, scheme, pieces):
    """The same file byte for byte: metadata, tensor order, K-quant and legacy blocks (q/k rows permuted for
    llama.cpp), llama.cpp's embedding types for the mix (quantized in row pieces when the table is big)."""
    if pieces:
        monkeypatch.setattr(stream_exports, "_EMBED_ROWS", 256 * 7)
    src = _kquant_llama(tmp_path / "src")
    s = _stream(src, tmp_path / "s.gguf", scheme, "gguf", search=False)  # the K-quant search: minutes on 2 cores
    model, _ = native.load(_in_model(src, scheme, tmp_path / "ref", search=False))
    mix = scheme if scheme in ge.FILE_TYPES else None
    ge.export(model, None, tmp_path / "ref.gguf", name=str(src), file_type=ge.FILE_TYPES.get(mix or "", 1))
    assert (tmp_path / "s.gguf").read_bytes() == (tmp_path / "ref.gguf").read_bytes()
    assert s["gguf"]["types"] and s["output_bytes"] == (tmp_path / "s.gguf").stat().st_size
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_stream_export_refusals_come_before_any_tensor_is_read(tmp_path, capsys):
    src = _saved("llama", tmp_path / "src")
    with pytest.raises(ConfigError, match="fused experts"):
        _stream(_saved("qwen3_moe", tmp_path / "moe"), tmp_path / "o", "w4g8", "gguf")
    # w4g8 has no exact GGUF type; groups of 24 do not divide rows of 32 (vLLM refuses partial groups)
    assert main(["quantize", str(src), "--stream", "--scheme", "w4g8", "--export-to", "gguf", "--out",
                 str(tmp_path / "x.gguf")]) == 2
    assert "no exact GGUF type" in capsys.readouterr().err
    assert main(["quantize", str(src), "--stream", "--scheme", "w4g24", "--export-to", "compressed-tensors", "--out",
                 str(tmp_path / "y")]) == 2
    assert "does not divide" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "y").exists()
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_a_killed_compressed_tensors_run_resumes_and_a_native_work_folder_is_not_reused(tmp_path, monkeypatch):
    """CT shards are sealed like the native ones: a killed run resumes them; the run record names the export, so
    a native run's shards in the same work folder are cleared, not taken for compressed-tensors ones."""
    from lowbit.ptq import stream

    src = _saved("llama", tmp_path / "src")
    out = tmp_path / "out"
    real, calls = stream.write_shard, {"n": 0}

    def dies_on_the_third(work, shard, tensors, record):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        real(work, shard, tensors, record)

    monkeypatch.setattr(stream, "write_shard", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        _stream(src, out, "w4g8", None, search=False)  # native
    calls["n"] = 0
    with pytest.warns(UserWarning, match="other settings"), pytest.raises(KeyboardInterrupt):
        _stream(src, out, "w4g8", "compressed-tensors", search=False)
    monkeypatch.setattr(stream, "write_shard", real)
    lines: list[str] = []
    monkeypatch.setattr("lowbit.api.stream._reporter", lambda progress: lines.append)
    _stream(src, out, "w4g8", "compressed-tensors", search=False)
    assert any("resuming: 2 of" in ln for ln in lines)
    model, _ = native.load(_in_model(src, "w4g8", tmp_path / "ref", search=False))
    ct.export(model, None, tmp_path / "ref_ct")
    got, want = _folder_tensors(out), _folder_tensors(tmp_path / "ref_ct")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in got)
