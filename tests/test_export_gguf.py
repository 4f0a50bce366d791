"""GGUF export: the gguf reader and transformers' GGUF loader see lowbit's exact weights."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

gguf = pytest.importorskip("gguf")

from lowbit.errors import LowbitError, ModelError, SchemeError  # noqa: E402
from lowbit.files import gguf_export as ge  # noqa: E402
from lowbit.formats import QTensor, Scheme, quantize  # noqa: E402
from lowbit.nn import QuantLinear, quant_layers, set_module  # noqa: E402


def tiny(tie: bool = True, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).eval()


def block_linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]


def fake_mxfp4(out: int, cols: int, seed: int = 0) -> QTensor:
    """Every E2M1 code with E8M0 (power-of-two) scales over a wide exponent range."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, cols // 32, 32), dtype=torch.uint8, generator=g)
    scales = 2.0 ** torch.randint(-20, 4, (out, cols // 32), generator=g).float()
    return QTensor(codes, scales, None, None, (out, cols), Scheme.parse("mxfp4"))


def quantized(schemes: list[str], tie: bool = True) -> LlamaForCausalLM:
    model = tiny(tie)
    for i, name in enumerate(block_linears(model)):
        lin, s = model.get_submodule(name), schemes[i % len(schemes)]
        layer = QuantLinear(fake_mxfp4(lin.out_features, lin.in_features, i)) if s == "mxfp4" else \
            QuantLinear.from_linear(lin, s)
        set_module(model, name, layer)
    return model


def read_weights(path) -> dict[str, tuple[str, torch.Tensor]]:
    r = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()))
            for t in r.tensors}


def logits(model) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("tie", [True, False])
def test_reader_dequantizes_to_lowbit_weights_and_transformers_round_trips(tmp_path, tie):
    model = quantized(["w4g32", "w8g32", "mxfp4", "w4g32:full=0"], tie)
    r = ge.export(model, None, tmp_path / "m.gguf")
    assert r["requantized"] == [] and {"Q4_0", "Q8_0", "MXFP4"} <= set(r["types"])
    got = read_weights(tmp_path / "m.gguf")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    for name, layer in quant_layers(model).items():
        qtype, w = got[names.get_name(f"{name}.weight", try_suffixes=(".weight",))]
        assert qtype == ge.exact_type(layer.scheme, layer.in_features)
        heads = {"q_proj": 4, "k_proj": 2}.get(name.rsplit(".", 1)[1])
        ref = layer.weight if heads is None else layer.weight[ge.rope_rows(layer.out_features, heads)]
        assert torch.equal(w, ref), name
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    assert loaded.config.tie_word_embeddings == tie
    for name, layer in quant_layers(model).items():  # transformers undoes the q/k permutation
        assert torch.equal(loaded.get_submodule(name).weight, layer.weight), name
    assert torch.equal(logits(loaded), logits(model))


def test_dense_tensors_use_the_narrowest_exact_float(tmp_path):
    model = quantized(["w4g32"])
    emb = model.model.embed_tokens.weight
    with torch.no_grad():
        emb.copy_(emb.to(torch.bfloat16).float())  # a bf16 checkpoint: exact in BF16, not all in F16
        emb[0, 0] = 2.0**-30  # below fp16 range, exact in bf16
    r = ge.export(model, None, tmp_path / "m.gguf", embeddings="f16")  # a uniform w4g32 is Q4_0: Q8_0 embeddings
    assert r["types"]["BF16"] == 1 and r["types"]["F32"] == 5  # norms stay F32
    qtype, w = read_weights(tmp_path / "m.gguf")["token_embd.weight"]
    assert qtype == "BF16" and torch.equal(w, emb)
    half = torch.randn(8, 32).half().float()
    assert ge.dense_blocks(half)[1] == "F16" and ge.dense_blocks(torch.randn(8, 32))[1] == "F32"


def test_rope_rows_match_the_reference_reshape():
    w = torch.arange(24 * 3).reshape(24, 3)
    ref = w.reshape(4, 2, 3, 3).swapaxes(1, 2).reshape(24, 3)  # the converters' numpy recipe
    assert torch.equal(w[ge.rope_rows(24, 4)], ref)


def test_q4_0_bytes_match_gguf_own_quantizer():
    """gguf's Q4_0 quantizer (d = max/-8, the full-range rule) gives the same bytes as lowbit's codes."""
    w = torch.randn(16, 128)
    q = quantize(w, "w4g32")
    theirs = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0)
    ours = ge.pack_blocks(q, "Q4_0")
    same = (theirs == ours).mean()
    assert same > 0.99  # ties may round differently (trunc(x+8.5) vs round-half-even)


def test_q4_1_exact_when_minimum_fits_fp16_else_refused(tmp_path):
    model = quantized(["w4g32a"])
    with pytest.raises(SchemeError, match="Q4_1.*--allow-requant"):
        ge.export(model, None, tmp_path / "a.gguf")
    assert not list(tmp_path.iterdir())
    r = ge.export(model, None, tmp_path / "a.gguf", allow_requant=True)
    assert r["types"]["Q4_1"] == 14 and len(r["requantized"]) == 14
    # a group whose minimum is an fp16 number is exact
    q = quantize(torch.randn(8, 64), "w4g32a")
    q = QTensor(q.codes, torch.full_like(q.scales, 0.125), q.zeros, None, q.shape, q.scheme)
    assert ge.q4_1_exact(q)
    blocks = ge.pack_blocks(q, "Q4_1")
    w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1)
    assert torch.equal(torch.from_numpy(w.copy()), q.dequantize())


def fake_nvfp4(out: int, cols: int) -> QTensor:
    codes = torch.randint(0, 16, (out, cols // 16, 16), dtype=torch.uint8)
    return QTensor(codes, torch.ones(out, cols // 16), None, torch.tensor(2.0), (out, cols), Scheme.parse("nvfp4"))


@pytest.mark.parametrize("scheme", ["w4g64", "w3g32", "w2g16", "w8", "nvfp4", "w8g32a"])
def test_refuses_schemes_without_exact_type_and_lists_types(tmp_path, scheme):
    model = tiny()
    for name in block_linears(model):
        lin = model.get_submodule(name)
        q = fake_nvfp4(lin.out_features, lin.in_features) if scheme == "nvfp4" else quantize(lin.weight, scheme)
        set_module(model, name, QuantLinear(q))
    with pytest.raises(SchemeError, match="Q4_0.*Q8_0.*MXFP4"):
        ge.export(model, None, tmp_path / "x.gguf")
    assert not list(tmp_path.iterdir())


def test_allow_requant_uses_gguf_quantizer(tmp_path):
    model = quantized(["w4g64", "w8"])
    r = ge.export(model, None, tmp_path / "r.gguf", allow_requant=True)
    # norms stay F32 (1-D); the float32 embedding F16 cannot hold is rounded to F16 and listed
    assert set(r["types"]) == {"F32", "F16", "Q4_0", "Q8_0"} and len(r["requantized"]) == 14
    assert r["rounded_to_f16"] == ["model.embed_tokens.weight"]
    got = read_weights(tmp_path / "r.gguf")
    _, w = got["blk.0.attn_v.weight"]
    ref = model.get_submodule("model.layers.0.self_attn.v_proj").weight
    assert 0 < float(((w - ref) ** 2).sum() / (ref**2).sum()) < 0.05


def test_existing_output_refused_unless_force(tmp_path):
    model = quantized(["w4g32"])
    (tmp_path / "m.gguf").write_bytes(b"old")
    with pytest.raises(LowbitError, match="--force"):
        ge.export(model, None, tmp_path / "m.gguf")
    with pytest.raises(LowbitError, match="not a GGUF lowbit wrote"):  # --force replaces only lowbit's own files
        ge.export(model, None, tmp_path / "m.gguf", force=True)
    assert (tmp_path / "m.gguf").read_bytes() == b"old"
    (tmp_path / "m.gguf").unlink()
    ge.export(model, None, tmp_path / "m.gguf")
    assert ge.written_by_lowbit(tmp_path / "m.gguf")
    ge.export(model, None, tmp_path / "m.gguf", force=True)
    assert gguf.GGUFReader(str(tmp_path / "m.gguf")).fields["general.architecture"].contents() == "llama"
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_non_llama_model_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ModelError, match="llama"):
        ge.export(model, None, tmp_path / "g.gguf")


def test_hf_bpe_tokenizer_round_trips_through_gguf(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bpe = tokenizers.ByteLevelBPETokenizer()
    text = ["def quantize(w, scheme): return codes", "low bit models run on small machines"] * 20
    bpe.train_from_iterator(text, vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>", "<pad>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<|endoftext|>",
                                  eos_token="<|endoftext|>", pad_token="<pad>")
    model = tiny()
    model.config.vocab_size = 256
    for n in block_linears(model):
        set_module(model, n, QuantLinear.from_linear(model.get_submodule(n), "w4g32"))
    ge.export(model, tok, tmp_path / "t.gguf")
    fields = gguf.GGUFReader(str(tmp_path / "t.gguf")).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    sample = "def small(w): return low bit"
    assert back(sample)["input_ids"][-len(tok(sample)["input_ids"]):] == tok(sample)["input_ids"]


def test_cli_export_gguf_and_inspect(tmp_path, capsys):
    from lowbit.cli import main
    from lowbit.files.native import save

    model = quantized(["w4g32", "w8g32"])
    save(model, None, tmp_path / "native")
    out = tmp_path / "m.gguf"
    assert main(["export", str(tmp_path / "native"), "--to", "gguf", "--out", str(out), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["types"]["Q4_0"] == 7 and r["types"]["Q8_0"] == 7 and r["requantized"] == []
    assert r["bits_per_weight"] == pytest.approx((4.5 * 7 + 8.5 * 7) / 14, abs=0.3)
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["format"] == "gguf" and info["schemes"] == {"Q4_0": 7, "Q8_0": 7}
    assert {r["bits_per_weight"] for r in info["layers"]} == {4.5, 8.5}
    # a scheme with no exact type: refused by the CLI with the list, accepted with --allow-requant
    save(quantized(["w4g64"]), None, tmp_path / "n2")
    assert main(["export", str(tmp_path / "n2"), "--to", "gguf", "--out", str(tmp_path / "b.gguf")]) != 0
    assert "Q4_0" in capsys.readouterr().err and not (tmp_path / "b.gguf").exists()
    assert main(["export", str(tmp_path / "n2"), "--to", "gguf", "--out", str(tmp_path / "b.gguf"),
                 "--allow-requant"]) == 0


@pytest.mark.slow
def test_bundled_model_gguf_same_perplexity_in_transformers(tmp_path, bundled_w4g32):
    """SmolLM2-135M, RTN w4g32 -> Q4_0: transformers' GGUF loader gives lowbit's perplexity."""
    from transformers import AutoModelForCausalLM

    from lowbit.eval import perplexity
    from lowbit.models.loading import bundled_gguf

    lm, tokens, ours = bundled_w4g32
    # the embeddings as lowbit evaluated them (16-bit); by default llama.cpp's Q4_0 file type holds them in Q8_0
    r = ge.export(lm.model, lm.tokenizer, tmp_path / "m.gguf", source_gguf=bundled_gguf(), embeddings="f16")
    assert r["types"]["Q4_0"] == 210 and r["requantized"] == []
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    for name, layer in list(quant_layers(lm.model).items())[:14]:
        assert torch.equal(hf.get_submodule(name).weight, layer.weight), name
    theirs = perplexity(hf, tokens, seqlen=256, windows=2, progress=False).ppl
    assert theirs == pytest.approx(ours, rel=1e-5)
