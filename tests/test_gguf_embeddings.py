"""token_embd and output in llama.cpp's types for each file type (issue 39), exact through gguf-py."""

import numpy as np
import pytest
import torch
import transformers

gguf = pytest.importorskip("gguf")

from lowbit.api import build_plan  # noqa: E402
from lowbit.errors import ConfigError  # noqa: E402
from lowbit.files import gguf_export as ge  # noqa: E402
from lowbit.files.gguf_types import embedding_types, gguf_scheme  # noqa: E402
from lowbit.formats import quantize  # noqa: E402
from lowbit.ptq.rtn import rtn_quantize  # noqa: E402

# llama.cpp's rule, read from src/llama-quant.cpp (llama_tensor_get_type_impl: the OUTPUT category, and
# TOKEN_EMBD when has_tied_embeddings, take Q8_0 if ne[0] % blck_size(default_type) else Q6_K unless the
# default is Q8_0; an untied TOKEN_EMBD keeps default_type; then tensor_type_fallback: Q2_K/Q3_K -> Q4_0,
# Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 on rows not a multiple of 256), written out by hand per file type:
# file type: (tied 576, tied 1024, untied 4096 (token_embd, output), untied 576 (token_embd, output))
RULE = {
    "gguf:q2_k": ("Q8_0", "Q6_K", ("Q2_K", "Q6_K"), ("Q4_0", "Q8_0")),
    "q2_k_s": ("Q8_0", "Q6_K", ("Q2_K", "Q6_K"), ("Q4_0", "Q8_0")),
    "q3_k_s": ("Q8_0", "Q6_K", ("Q3_K", "Q6_K"), ("Q4_0", "Q8_0")),
    "q3_k_m": ("Q8_0", "Q6_K", ("Q3_K", "Q6_K"), ("Q4_0", "Q8_0")),
    "q3_k_l": ("Q8_0", "Q6_K", ("Q3_K", "Q6_K"), ("Q4_0", "Q8_0")),
    "q4_k_s": ("Q8_0", "Q6_K", ("Q4_K", "Q6_K"), ("Q5_0", "Q8_0")),
    "q4_k_m": ("Q8_0", "Q6_K", ("Q4_K", "Q6_K"), ("Q5_0", "Q8_0")),
    "q5_k_s": ("Q8_0", "Q6_K", ("Q5_K", "Q6_K"), ("Q5_1", "Q8_0")),
    "q5_k_m": ("Q8_0", "Q6_K", ("Q5_K", "Q6_K"), ("Q5_1", "Q8_0")),
    "gguf:q6_k": ("Q8_0", "Q6_K", ("Q6_K", "Q6_K"), ("Q8_0", "Q8_0")),
    # legacy types: block 32 divides 576, so the output rule says Q6_K, which falls back to Q8_0 at 576
    "q4_0": ("Q8_0", "Q6_K", ("Q4_0", "Q6_K"), ("Q4_0", "Q8_0")),
    "q4_1": ("Q8_0", "Q6_K", ("Q4_1", "Q6_K"), ("Q4_1", "Q8_0")),
    "q5_0": ("Q8_0", "Q6_K", ("Q5_0", "Q6_K"), ("Q5_0", "Q8_0")),
    "q5_1": ("Q8_0", "Q6_K", ("Q5_1", "Q6_K"), ("Q5_1", "Q8_0")),
    "q8_0": ("Q8_0", "Q8_0", ("Q8_0", "Q8_0"), ("Q8_0", "Q8_0")),
}


@pytest.mark.parametrize("ftype", sorted(RULE))
def test_embedding_types_are_llama_cpps(ftype):
    tied576, tied1024, (emb4096, out4096), (emb576, out576) = RULE[ftype]
    assert embedding_types(ftype, 576, tied=True) == {"token_embd": tied576}
    assert embedding_types(ftype, 1024, tied=True) == {"token_embd": tied1024}
    assert embedding_types(ftype, 4096, tied=False) == {"token_embd": emb4096, "output": out4096}
    assert embedding_types(ftype, 576, tied=False) == {"token_embd": emb576, "output": out576}
    assert embedding_types(ftype, 100, tied=True) == {"token_embd": "F16"}  # no block fits: llama.cpp keeps F16


def tiny(vocab: int, hidden: int, tie: bool, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=256, tie_word_embeddings=tie)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def tensors(path):
    r = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type)) for t in r.tensors}


def lowbit_values(w: torch.Tensor, qtype: str) -> np.ndarray:
    return quantize(w.detach().float(), gguf_scheme(qtype)).dequantize().numpy()


def test_tied_embedding_is_the_output_type_bit_exact_and_loads(tmp_path, tiny_tokenizer):
    vocab = len(tiny_tokenizer)
    model = tiny(vocab, 256, tie=True)
    rtn_quantize(model, build_plan(model, "q4_k_m"), progress=False)
    path = tmp_path / "m.gguf"
    r = ge.export(model, tiny_tokenizer, path, file_type=ge.FILE_TYPES["q4_k_m"])
    got = tensors(path)
    assert "output.weight" not in got and got["token_embd.weight"][0] == "Q6_K"
    emb = model.get_input_embeddings().weight
    want = lowbit_values(emb, "Q6_K")
    assert np.array_equal(got["token_embd.weight"][1].reshape(want.shape), want)  # gguf-py reads lowbit's codes
    assert "Q6_K" in r["embeddings"] and "tied" in r["embeddings"]
    f16 = ge.export(model, tiny_tokenizer, tmp_path / "f.gguf", file_type=ge.FILE_TYPES["q4_k_m"],
                    embeddings="f16")
    assert tensors(tmp_path / "f.gguf")["token_embd.weight"][0] in ("F16", "F32") and "kept" in f16["embeddings"]
    assert path.stat().st_size < (tmp_path / "f.gguf").stat().st_size
    # transformers' GGUF loader dequantizes the Q6_K table: the model with that table is what it runs
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()
    with torch.no_grad():
        emb.copy_(torch.from_numpy(want))
        ids = torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(back(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_untied_output_and_width_fallbacks(tmp_path, tiny_tokenizer):
    model = tiny(len(tiny_tokenizer), 288, tie=False)  # 288 % 256: Q4_K -> Q5_0 for token_embd, output Q8_0
    rtn_quantize(model, build_plan(model, "q4_k_m"), progress=False)
    path = tmp_path / "u.gguf"
    ge.export(model, tiny_tokenizer, path, file_type=ge.FILE_TYPES["q4_k_m"])
    got = tensors(path)
    assert got["token_embd.weight"][0] == "Q5_0" and got["output.weight"][0] == "Q8_0"
    for key, name in (("token_embd.weight", "model.embed_tokens"), ("output.weight", "lm_head")):
        w = model.get_submodule(name).weight
        want = lowbit_values(w, got[key][0])
        assert np.array_equal(got[key][1].reshape(want.shape), want)


def test_a_quantized_lm_head_unties_the_embedding(tmp_path, tiny_tokenizer):
    model = tiny(len(tiny_tokenizer), 256, tie=True)
    rtn_quantize(model, build_plan(model, "q4_k_m", lm_head=True), progress=False)
    path = tmp_path / "h.gguf"
    ge.export(model, tiny_tokenizer, path, file_type=ge.FILE_TYPES["q4_k_m"])
    got = tensors(path)  # output.weight exists (Q6_K, from the plan), so token_embd keeps the base type
    assert got["output.weight"][0] == "Q6_K" and got["token_embd.weight"][0] == "Q4_K"


def test_a_uniform_legacy_plan_is_llama_cpps_legacy_file_type(tmp_path, tiny_tokenizer):
    model = tiny(len(tiny_tokenizer), 256, tie=True)
    rtn_quantize(model, build_plan(model, "w8g32"), progress=False)
    path = tmp_path / "q8.gguf"
    r = ge.export(model, tiny_tokenizer, path)
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.file_type"].contents() == 7  # LlamaFileType.MOSTLY_Q8_0
    assert tensors(path)["token_embd.weight"][0] == "Q8_0" and "q8_0" in r["embeddings"]


def test_embeddings_flag_is_refused_where_it_means_nothing(tmp_path):
    from lowbit.api import ExportJob

    with pytest.raises(ConfigError, match="--embeddings applies to --to gguf"):
        ExportJob(tmp_path / "q", "compressed-tensors", tmp_path / "o", embeddings="f16")
    with pytest.raises(ConfigError, match="choose one of"):
        ExportJob(tmp_path / "q", "gguf", tmp_path / "o.gguf", embeddings="q8_0")


def test_qwen3_head_dim_is_said_at_export_and_read_by_lowbits_loader(tmp_path, tiny_tokenizer, monkeypatch):
    """head_dim 32 != hidden / heads (64) and != Qwen3's default (128): transformers' own GGUF loader rebuilds
    128-wide heads (it ignores qwen3.attention.key_length); llama.cpp and lowbit read key_length."""
    from lowbit.models import load_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the converted copy stays in this test
    vocab = len(tiny_tokenizer)
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=vocab,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=256, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    rtn_quantize(model, build_plan(model, "q4_k_m"), progress=False)
    path = tmp_path / "q3.gguf"
    with pytest.warns(UserWarning, match="transformers' own GGUF loader cannot read this file back"):
        r = ge.export(model, tiny_tokenizer, path, file_type=ge.FILE_TYPES["q4_k_m"])
    assert "heads of 128, not 32" in r["transformers_readback"]
    lm = load_model(path)  # what `lowbit eval` loads
    assert lm.model.config.head_dim == 32
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.copy_(torch.from_numpy(tensors(path)["token_embd.weight"][1]).reshape(emb.shape))
        ids = torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(lm.model(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_file_transformers_reads_back_gets_no_readback_note(tmp_path, tiny_tokenizer):
    model = tiny(len(tiny_tokenizer), 256, tie=True)
    rtn_quantize(model, build_plan(model, "q4_k_m"), progress=False)
    assert "transformers_readback" not in ge.export(model, tiny_tokenizer, tmp_path / "l.gguf")


def test_inspect_prices_the_file_against_llama_cpps_own_mix(tmp_path, tiny_tokenizer):
    from lowbit.api import inspect

    model = tiny(len(tiny_tokenizer), 256, tie=True)
    rtn_quantize(model, build_plan(model, "q4_k_m"), progress=False)
    ge.export(model, tiny_tokenizer, tmp_path / "d.gguf", file_type=ge.FILE_TYPES["q4_k_m"])
    ge.export(model, tiny_tokenizer, tmp_path / "f.gguf", file_type=ge.FILE_TYPES["q4_k_m"], embeddings="f16")
    same, wide = inspect(tmp_path / "d.gguf"), inspect(tmp_path / "f.gguf")
    assert {t["name"]: t["type"] for t in same["tensors"]}["token_embd.weight"] == "Q6_K"
    assert same["llama_cpp"]["file_type"] == "q4_k_m" and same["llama_cpp"]["types_differ"] == {}
    assert same["llama_cpp"]["expected_bytes"] == same["file_bytes"]
    assert wide["llama_cpp"]["types_differ"] == {"token_embd.weight": "F32 (llama.cpp: Q6_K)"}
    assert wide["llama_cpp"]["expected_bytes"] == same["file_bytes"] < wide["file_bytes"]


def test_llama_cpp_types_of_a_files_tensors():
    """8 blocks, 4096 wide, untied: llama.cpp's Q4_K_M (use_more_bits: attn_v / ffn_down of blocks 0, 3, 6, 7)."""
    from lowbit.plans.kmix import llama_cpp_types

    shapes = {"token_embd.weight": (32000, 4096), "output.weight": (32000, 4096), "output_norm.weight": (4096,)}
    for i in range(8):
        shapes |= {f"blk.{i}.attn_v.weight": (1024, 4096), f"blk.{i}.ffn_down.weight": (4096, 11008 // 256 * 256),
                   f"blk.{i}.attn_q.weight": (4096, 4096), f"blk.{i}.attn_norm.weight": (4096,)}
    got = llama_cpp_types("q4_k_m", shapes, n_gqa=4)
    assert got["token_embd.weight"] == "Q4_K" and got["output.weight"] == "Q6_K" and "output_norm.weight" not in got
    assert [got[f"blk.{i}.attn_v.weight"] for i in range(8)] == ["Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K",
                                                                 "Q6_K", "Q6_K"]
    assert got["blk.0.ffn_down.weight"] == "Q6_K" and got["blk.1.attn_q.weight"] == "Q4_K"
    assert llama_cpp_types("q8_0", shapes, 4)["blk.3.attn_v.weight"] == "Q8_0"


def test_quantize_records_the_output_importance_and_export_searches_with_it(tmp_path, tiny_tokenizer):
    """quantize (q4_k_m, searched RTN) records the final hidden states' mean squares; export weights the tied
    table by them (64 columns: every Linear falls back to a 32-block type and the table is Q8_0, which keeps
    the searched RTN quick)."""
    from lowbit.api import Calibration, ExportJob, QuantizeJob, export
    from lowbit.api import quantize as quantize_job
    from lowbit.files.native import load, read_manifest

    hf = tmp_path / "hf"
    tiny(len(tiny_tokenizer), 64, tie=True).save_pretrained(hf)
    tiny_tokenizer.save_pretrained(hf)
    r = quantize_job(QuantizeJob(out=tmp_path / "q", model=str(hf), scheme="q4_k_m", evaluation=None, progress=False,
                                 calib=Calibration(nsamples=4, seqlen=64)))
    assert r["gguf_embeddings"].startswith("model.embed_tokens: Q8_0")
    imp = read_manifest(tmp_path / "q")["meta"]["gguf_output_importance"]
    assert len(imp) == 64 and min(imp) >= 0 and max(imp) > 0
    e = export(ExportJob(tmp_path / "q", "gguf", tmp_path / "m.gguf"))
    assert "weighted by the calibration" in e["embeddings"]
    model, _ = load(tmp_path / "q")
    w = model.get_input_embeddings().weight.detach().float()
    want = quantize(w, gguf_scheme("Q8_0"), torch.tensor(imp)).dequantize().numpy()
    got = tensors(tmp_path / "m.gguf")["token_embd.weight"][1].reshape(want.shape)
    assert np.array_equal(got, want)  # gguf-py reads the importance-searched codes
    assert not np.array_equal(got, lowbit_values(w, "Q8_0"))  # and they are not the unweighted search's
