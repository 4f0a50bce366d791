"""K-quant GGUF export for every supported architecture, read back by gguf-py, transformers and llama.cpp."""

import importlib.util

import numpy as np
import pytest
import torch
import transformers

gguf = pytest.importorskip("gguf")

from lowbit.api import build_plan  # noqa: E402
from lowbit.errors import LowbitError, ModelError, SchemeError  # noqa: E402
from lowbit.files import gguf_export as ge  # noqa: E402
from lowbit.nn import quant_layers  # noqa: E402
from lowbit.plans import kmix  # noqa: E402
from lowbit.ptq.rtn import rtn_quantize  # noqa: E402

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


def tiny_arch(kind: str, vocab: int, hidden: int = 256, seed: int = 0):
    """A tiny random decoder of ``kind`` whose config transformers' GGUF loader restores as it was."""
    torch.manual_seed(seed)
    common = dict(hidden_size=hidden, intermediate_size=512, num_hidden_layers=2, vocab_size=vocab,
                  max_position_embeddings=512, tie_word_embeddings=True)
    if kind == "llama":
        cfg = transformers.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **common)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
                                         head_dim=hidden // 4, **common)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **common)
    elif kind == "qwen3":  # the GGUF loader leaves head_dim at Qwen3's default, 128
        cfg = transformers.Qwen3Config(num_attention_heads=2, num_key_value_heads=1, head_dim=128, **common)
    else:  # gemma3: llama.cpp scales attention by 1/sqrt(head_dim), HF by query_pre_attn_scalar (256)
        cfg = transformers.Gemma3TextConfig(num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                            sliding_window=64, **common)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a wrong norm shift or dropped bias shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, 20), generator=torch.Generator().manual_seed(3))


def read_weights(path) -> dict[str, tuple[str, np.ndarray]]:
    r = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type)) for t in r.tensors}


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_kquant_mix_round_trips_through_gguf_py_and_transformers(tmp_path, tiny_tokenizer, kind):
    vocab = len(tiny_tokenizer)
    model = tiny_arch(kind, vocab)
    plan = build_plan(model, "q4_k_m")
    assert {s.name for s in plan.schemes()} == {"q4_k", "q6_k"}  # attn_v / ffn_down of "more bits" layers
    rtn_quantize(model, plan, progress=False)
    path = tmp_path / f"{kind}.gguf"
    r = ge.export(model, tiny_tokenizer, path, file_type=ge.FILE_TYPES["q4_k_m"])
    assert r["verified"] == len(quant_layers(model)) + 1 and not r["requantized"]  # + the tied token_embd
    got = read_weights(path)
    kind_e, e = got["token_embd.weight"]
    emb = model.get_input_embeddings().weight
    assert kind_e == "Q6_K"  # llama.cpp's output type (tied embeddings, 256 columns)
    with torch.no_grad():  # what the file holds: the model with that table, compared below
        emb.copy_(torch.from_numpy(e.reshape(emb.shape)))
    arch = ge.ARCH_MAP[model.config.model_type]
    assert gguf.GGUFReader(str(path)).fields["general.architecture"].contents() == arch.gguf
    # v_proj is never permuted: its blocks dequantize to lowbit's weight exactly
    v = model.get_submodule("model.layers.1.self_attn.v_proj").weight.detach().numpy()
    kind_v, w = got["blk.1.attn_v.weight"]
    assert kind_v in ("Q4_K", "Q6_K") and np.array_equal(w.reshape(v.shape), v)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()
    with torch.no_grad():
        want, have = model(ids(vocab)).logits, back(ids(vocab)).logits
    torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed in this environment "
                                               "(the benchmark venv has it); llama.cpp cannot run the file here")
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_llama_cpp_runs_the_file_with_lowbits_logits(tmp_path, tiny_tokenizer, kind):
    from benchmarks.llamacpp import open_llama  # plain CPU buffers: the AMX repack segfaults (see there)

    vocab = len(tiny_tokenizer)
    model = tiny_arch(kind, vocab)
    rtn_quantize(model, build_plan(model, "q4_k_m"), progress=False)
    path = tmp_path / f"{kind}.gguf"
    ge.export(model, tiny_tokenizer, path)
    llm = open_llama(path, 64, 1)
    toks = ids(vocab)[0].tolist()
    llm.eval(toks)
    have = torch.tensor(np.array(llm.scores[: len(toks)]))
    with torch.no_grad():
        want = model(ids(vocab)).logits[0]
    # llama.cpp multiplies K-quant weights with 8-bit-quantized activations: close, not equal
    assert torch.corrcoef(torch.stack([have.reshape(-1), want.reshape(-1)]))[0, 1] > 0.99
    assert (have.argmax(-1) == want.argmax(-1)).float().mean() > 0.8


def test_width_fallback_is_llama_cpps_and_reported(tmp_path, tiny_tokenizer):
    model = tiny_arch("llama", len(tiny_tokenizer), hidden=288)  # 288 % 256 != 0: q/k/v/o/gate/up fall back
    plan = build_plan(model, "q3_k_m")
    assert plan["model.layers.0.self_attn.q_proj"].name == "w4g32"  # Q3_K -> Q4_0
    assert plan["model.layers.1.self_attn.v_proj"].name == "w5g32a"  # Q5_K (first two attn_v) -> Q5_1
    assert plan["model.layers.1.self_attn.o_proj"].name == "w5g32"  # Q4_K -> Q5_0
    assert plan["model.layers.0.mlp.down_proj"].name == "q4_k"  # 512 columns: a real K-quant
    plan = build_plan(model, "q4_k")  # a uniform K scheme takes the fallback on narrow layers too
    assert plan["model.layers.0.self_attn.q_proj"].name == "w5g32"
    rtn_quantize(model, build_plan(model, "q4_k_m"), progress=False)
    r = ge.export(model, tiny_tokenizer, tmp_path / "f.gguf")
    assert "fallback" in r and r["types"]["Q5_0"] > 0 and r["types"]["Q4_K"] > 0


def test_mix_recipes_follow_llama_cpp():
    n = 32
    sizes = {}
    for i in range(n):
        for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            sizes[f"model.layers.{i}.{p}"] = (4096, 4096)
    sizes["lm_head"] = (32000, 4096)
    m = kmix.mix_plan(sizes, "q4_k_m", n_gqa=4).weights()
    six = [i for i in range(n) if m[f"model.layers.{i}.mlp.down_proj"].bits == 6]
    assert six == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]  # use_more_bits
    assert m["lm_head"].name == "q6_k" and m["model.layers.5.self_attn.q_proj"].name == "q4_k"
    q3 = kmix.mix_plan(sizes, "q3_k_m", n_gqa=4).weights()
    assert [q3[f"model.layers.{i}.self_attn.v_proj"].bits for i in range(3)] == [5, 5, 4]
    assert q3["model.layers.0.mlp.down_proj"].bits == 5 and q3["model.layers.2.mlp.down_proj"].bits == 4
    assert q3["model.layers.7.self_attn.o_proj"].bits == 4 and q3["model.layers.7.mlp.up_proj"].bits == 3
    q2 = kmix.mix_plan(sizes, "gguf:q2_k", n_gqa=4).weights()
    assert q2["model.layers.3.self_attn.v_proj"].bits == 4 and q2["model.layers.3.mlp.down_proj"].bits == 3
    assert kmix.mix_plan(sizes, "gguf:q2_k", n_gqa=1).weight("model.layers.3.self_attn.v_proj").bits == 3
    narrow = kmix.mix_plan({"lm_head": (100, 576)}, "q4_k_m", 1)
    assert narrow["lm_head"].name == "w8g32"  # llama.cpp: Q8_0 for an output whose rows do not fit
    with pytest.raises(SchemeError, match="unknown K-quant mix"):
        kmix.mix_plan(sizes, "q4_k_x", 1)


def test_refusals(tmp_path, tiny_tokenizer):
    from lowbit.files.compressed_tensors import target_for
    from lowbit.formats import Scheme

    with pytest.raises(SchemeError, match="K-quant.*--to gguf"):
        target_for(Scheme.parse("q4_k"), 512)
    model = tiny_arch("llama", len(tiny_tokenizer))
    rtn_quantize(model, build_plan(model, "w3g128"), progress=False)
    with pytest.raises(SchemeError, match="no exact GGUF type.*Q2_K..Q6_K"):
        ge.export(model, None, tmp_path / "x.gguf")
    assert not list(tmp_path.iterdir())
    model.config.model_type = "phi3"
    with pytest.raises(ModelError, match="llama, mistral, qwen2, qwen3, gemma3_text"):
        ge.export(model, None, tmp_path / "x.gguf", allow_requant=True)
    (tmp_path / "y.gguf").write_bytes(b"not mine")
    model.config.model_type = "llama"
    with pytest.raises(LowbitError, match="already exists"):
        ge.export(model, None, tmp_path / "y.gguf", allow_requant=True)
    assert (tmp_path / "y.gguf").read_bytes() == b"not mine"


def test_a_kquant_file_lowbit_wrote_is_an_input_to_every_command(tmp_path, tiny_tokenizer):
    """quantize (--scheme q4_k_m) -> export (--to gguf) -> load_model(the .gguf): the api path the CLI runs."""
    from lowbit.api import ExportJob, QuantizeJob, export, quantize
    from lowbit.models import load_model

    hf = tmp_path / "hf"
    tiny_arch("qwen2", len(tiny_tokenizer)).save_pretrained(hf)
    tiny_tokenizer.save_pretrained(hf)
    r = quantize(QuantizeJob(out=tmp_path / "q", model=str(hf), scheme="q4_k_m", evaluation=None, progress=False,
                             settings={"search": False}))
    assert r["scheme"] == "q4_k_m" and r["layer_schemes"] == {"q4_k": 12, "q6_k": 2}
    assert r["gguf_embeddings"].startswith("model.embed_tokens: Q6_K in `lowbit export --to gguf`")
    e = export(ExportJob(tmp_path / "q", "gguf", tmp_path / "m.gguf"))
    # + the tied token_embd in llama.cpp's output type
    assert e["types"]["Q4_K"] == 12 and e["types"]["Q6_K"] == 3 and e["verified"] == 15
    assert e["file_bytes"] < 0.5 * e["fp16_bytes"] or e["size_vs_fp16"] < 1
    lm = load_model(tmp_path / "m.gguf")  # transformers' GGUF loader, K-quant blocks dequantized by gguf-py
    from lowbit.files.native import load

    model, _ = load(tmp_path / "q")
    x = ids(len(tiny_tokenizer))
    with torch.no_grad():  # the checkpoint with the file's Q6_K table is what the file holds
        emb = model.get_input_embeddings().weight
        emb.copy_(torch.from_numpy(read_weights(tmp_path / "m.gguf")["token_embd.weight"][1]).reshape(emb.shape))
        torch.testing.assert_close(lm.model(x).logits, model(x).logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(LowbitError, match="already exists"):
        export(ExportJob(tmp_path / "q", "gguf", tmp_path / "m.gguf"))


@pytest.mark.parametrize("mix", ["gguf:q2_k", "q4_k_m"])
def test_gptq_on_a_kquant_mix_exports_exact_blocks(tmp_path, tiny_tokenizer, mix):
    """GPTQ quantizes the K types and their legacy fallbacks alike; every tensor is written exactly."""
    from lowbit.ptq.gptq import GPTQSettings, gptq_quantize

    vocab = len(tiny_tokenizer)
    model = tiny_arch("llama", vocab, hidden=288)  # 288 columns: q/k/v/o/gate/up take the fallback types
    plan = build_plan(model, mix)
    calib = torch.randint(0, vocab, (8, 32), generator=torch.Generator().manual_seed(4))
    gptq_quantize(model, plan, GPTQSettings(), calib, progress=False)
    layers = quant_layers(model)
    assert any(q.scheme.super_block for q in layers.values()) and not all(q.scheme.super_block for q in layers.values())
    path = tmp_path / "g.gguf"
    r = ge.export(model, tiny_tokenizer, path, allow_requant=mix == "q4_k_m")  # Q5_1's fp16 min (see gguf.md)
    assert r["verified"] + len(r["requantized"]) == len(layers)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()
    with torch.no_grad():
        want, have = model(ids(vocab)).logits, back(ids(vocab)).logits
    torch.testing.assert_close(have, want, rtol=1e-3, atol=1e-3)
