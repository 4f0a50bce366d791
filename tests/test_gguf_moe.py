"""GGUF export of mixture-of-experts models: llama.cpp's 3-D expert tensors, read back by gguf-py and llama.cpp.

References: the quantized experts module's own dequantized weights in the float module's layout
(`QuantExperts.float_weights`), split the way transformers defines gate / up (rows 0..I-1 / I..2I-1,
gpt-oss: even / odd columns of its transposed tensor) -- independent of the exporter's row cut; gguf-py's
dequantization of the file; llama.cpp (llama-cpp-python) running the file on the same token ids.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from gguf_moe_helpers import tiny_moe

gguf = pytest.importorskip("gguf")

from lowbit.errors import LowbitError, ModelError  # noqa: E402
from lowbit.files import gguf_export as ge  # noqa: E402
from lowbit.files import targets  # noqa: E402
from lowbit.files.specs import from_model  # noqa: E402
from lowbit.nn.quant_experts import QuantExperts  # noqa: E402
from lowbit.plans.source import build_plan  # noqa: E402
from lowbit.ptq import quantize_model  # noqa: E402

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss")
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe",
             "gpt_oss": "gpt-oss"}


def quantized(arch: str, scheme: str, vocab: int = 128, **kw) -> torch.nn.Module:
    model = tiny_moe(arch, vocab, **kw)
    quantize_model(model, build_plan(model, scheme), "rtn", {"search": False}, progress=False)
    return model


def reference_experts(mod: QuantExperts, gpt_oss: bool) -> dict[str, torch.Tensor]:
    """GGUF name suffix -> the [E, out, in] matrices transformers' forward multiplies by (from the module's layout)."""
    w = mod.float_weights()
    if gpt_oss:  # [E, H, 2I] interleaved, [E, I, H]
        gu, down = w["gate_up_proj"], w["down_proj"]
        return {"ffn_gate_exps": gu[..., ::2].transpose(1, 2), "ffn_up_exps": gu[..., 1::2].transpose(1, 2),
                "ffn_down_exps": down.transpose(1, 2)}
    gate, up = w["gate_up_proj"].chunk(2, dim=1)
    return {"ffn_gate_exps": gate, "ffn_up_exps": up, "ffn_down_exps": w["down_proj"]}


def read(path) -> tuple[dict[str, tuple[str, np.ndarray]], dict]:
    r = gguf.GGUFReader(str(path))
    tensors = {t.name: (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type)) for t in r.tensors}
    return tensors, {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}


def llama_cpp_and_lowbit_logits(path, model: torch.nn.Module, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's and lowbit's logits of the same 24 token ids (llama.cpp on plain CPU buffers: see open_llama)."""
    from benchmarks.llamacpp import open_llama

    ids = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(3))
    llm = open_llama(path, 64, 1)
    llm.eval(ids[0].tolist())
    have = torch.tensor(np.array(llm.scores[:24]))
    with torch.no_grad():
        return have, model(ids).logits[0].float()


@pytest.mark.parametrize("arch", ARCHS)
def test_expert_tensors_read_back_bit_exactly_through_gguf_py(tmp_path, arch):
    model = quantized(arch, "w4g32")
    path = tmp_path / "m.gguf"
    r = ge.export(model, None, path, embeddings="f16")
    assert r["arch"] == GGUF_ARCH[arch] and not r["requantized"]
    tensors, meta = read(path)
    cfg = model.config
    a = GGUF_ARCH[arch]
    assert meta[f"{a}.expert_count"] == 8 and meta[f"{a}.expert_used_count"] == 2
    if arch in ("qwen3_moe", "qwen2_moe", "gpt_oss"):
        assert meta[f"{a}.expert_feed_forward_length"] == 32
    if arch == "qwen2_moe":
        assert meta[f"{a}.expert_shared_feed_forward_length"] == cfg.shared_expert_intermediate_size
    for layer in range(cfg.num_hidden_layers):
        mlp = model.model.layers[layer].mlp
        want = reference_experts(mlp.experts, arch == "gpt_oss")
        for suffix, w in want.items():
            kind, got = tensors[f"blk.{layer}.{suffix}.weight"]
            assert kind == "Q4_0" and got.shape == tuple(w.shape)  # [E, out, in]: ne {in, out, E}
            assert np.array_equal(got, w.numpy()), suffix
        router = mlp.router if arch == "gpt_oss" else mlp.gate
        kind, got = tensors[f"blk.{layer}.ffn_gate_inp.weight"]
        assert kind == "F32" and np.array_equal(got, router.weight.detach().numpy())
        if arch == "gpt_oss":  # biases de-interleaved like the weights, router bias, attention sinks
            gu, down = mlp.experts.gate_up_proj_bias.detach(), mlp.experts.down_proj_bias.detach()
            for suffix, b in (("ffn_gate_exps", gu[:, ::2]), ("ffn_up_exps", gu[:, 1::2]), ("ffn_down_exps", down)):
                assert np.array_equal(tensors[f"blk.{layer}.{suffix}.bias"][1], b.numpy())
            assert np.array_equal(tensors[f"blk.{layer}.ffn_gate_inp.bias"][1], router.bias.detach().numpy())
            sinks = model.model.layers[layer].self_attn.sinks.detach().numpy()
            assert np.array_equal(tensors[f"blk.{layer}.attn_sinks.weight"][1], sinks)
    assert not any(n.endswith(("gate_up_proj", "down_proj")) for n in tensors)  # nothing under HF names


@pytest.mark.parametrize(("arch", "scheme", "qtype"), [("qwen3_moe", "q4_k", "Q4_K"), ("gpt_oss", "mxfp4", "MXFP4"),
                                                       ("mixtral", "q6_k", "Q6_K"), ("olmoe", "w5g32", "Q5_0")])
def test_kquant_mxfp4_and_asymmetric_experts_are_written_exactly(tmp_path, arch, scheme, qtype):
    """K-quant super-block scales are per row: the gate/up cut moves them with their rows; gpt-oss's MXFP4 experts
    are GGML MXFP4 (E8M0 + E2M1 nibbles), not re-quantized."""
    width = 256 if qtype.endswith("_K") else 64
    model = quantized(arch, scheme, hidden=width, inter=width, experts=2)
    path = tmp_path / "m.gguf"
    ge.export(model, None, path, embeddings="f16")
    tensors, _ = read(path)
    want = reference_experts(model.model.layers[1].mlp.experts, arch == "gpt_oss")
    for suffix, w in want.items():
        kind, got = tensors[f"blk.1.{suffix}.weight"]
        assert kind == qtype and np.array_equal(got, w.numpy()), suffix


def test_float_experts_kept_by_the_plan_are_written_as_float_3d_tensors(tmp_path):
    model = tiny_moe("qwen3_moe")
    plan = build_plan(model, "w4g32")
    keep = [n for n in plan if n.endswith("down_proj") and ".experts." in n]
    from lowbit.plans.plan import Plan

    quantize_model(model, Plan({n: s for n, s in plan.layers.items() if n not in keep}), "rtn", {"search": False},
                   progress=False, keep16=True)
    path = tmp_path / "m.gguf"
    ge.export(model, None, path, embeddings="f16")
    tensors, _ = read(path)
    kind, got = tensors["blk.0.ffn_down_exps.weight"]
    w = model.model.layers[0].mlp.experts.float_weights()
    assert kind == "F32" and "down_proj" not in w
    down = model.model.layers[0].mlp.experts.down_proj.detach().numpy()
    assert np.array_equal(got, down) and tensors["blk.0.ffn_gate_exps.weight"][0] == "Q4_0"


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed in this environment "
                                               "(`make bench-setup` installs it); llama.cpp cannot run the file here")
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_runs_the_moe_file_with_lowbits_logits(tmp_path, tiny_tokenizer, arch):
    vocab = len(tiny_tokenizer)
    model = quantized(arch, "w8g32", vocab)
    path = tmp_path / "m.gguf"
    ge.export(model, tiny_tokenizer, path, embeddings="f16")
    have, want = llama_cpp_and_lowbit_logits(path, model, vocab)
    # llama.cpp multiplies Q8_0 weights with 8-bit activations: close, not equal. A wrong expert split, router,
    # bias or routing normalisation moves the logits by several times this bound (measured: 0.03 vs 0.005)
    assert (have - want).abs().max() < 0.02
    assert (have.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_moe_architecture_without_a_llama_cpp_mapping_is_refused_by_name_before_any_work(tmp_path):
    model = quantized("qwen3_moe", "w4g32")
    model.config.model_type = "glm4_moe"  # experts lowbit quantizes, in an architecture its GGUF export does not map
    specs = from_model(model)
    with pytest.raises(ModelError, match=r"mixture-of-experts models supports qwen3_moe, qwen2_moe, mixtral, olmoe, "
                                         r"gpt_oss, deepseek_v3 .*not 'glm4_moe'"):
        targets.check("gguf", specs, "glm4_moe")  # what `lowbit export` asks before reading a weight
    path = tmp_path / "m.gguf"
    with pytest.raises(ModelError, match="not 'glm4_moe'"):
        ge.export(model, None, path)
    assert list(tmp_path.iterdir()) == []


def test_routing_llama_cpp_computes_otherwise_is_refused(tmp_path):
    model = quantized("qwen3_moe", "w4g32")
    model.config.norm_topk_prob = False
    with pytest.raises(ModelError, match="norm_topk_prob=False: llama.cpp's qwen3moe graph always renormalises"):
        ge.export(model, None, tmp_path / "m.gguf")
    model = quantized("qwen3_moe", "w4g32")
    model.config.mlp_only_layers = [1]
    with pytest.raises(ModelError, match="dense MLP layers"):
        ge.export(model, None, tmp_path / "m.gguf")
    model = quantized("mixtral", "w4g32")
    model.config.sliding_window = 64
    with pytest.raises(ModelError, match="64-token sliding window"):
        ge.export(model, None, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


def test_scheme_without_exact_type_on_experts_is_refused_unless_requant(tmp_path):
    model = quantized("qwen3_moe", "w4g16")
    with pytest.raises(LowbitError, match="no exact GGUF type"):
        ge.export(model, None, tmp_path / "m.gguf")
    r = ge.export(model, None, tmp_path / "m.gguf", allow_requant=True, embeddings="f16")
    assert "model.layers.0.mlp.experts.gate_up_proj" in r["requantized"]
    tensors, _ = read(tmp_path / "m.gguf")
    want = reference_experts(model.model.layers[0].mlp.experts, False)["ffn_up_exps"]
    kind, got = tensors["blk.0.ffn_up_exps.weight"]
    assert kind == "Q4_0" and np.abs(got - want.numpy()).max() < 0.1 * np.abs(want.numpy()).max()


def _mix(arch: str, mix: str, experts: int, layers: int = 8) -> dict[str, str]:
    from lowbit.plans.source import build_plan as plan_of

    model = tiny_moe(arch, hidden=256, inter=256, experts=experts, layers=layers)
    return {n.removeprefix("model."): s.name for n, s in plan_of(model, mix).weights().items()}


def test_mixes_follow_llama_cpps_expert_rules_on_8_experts():
    """llama_tensor_get_type (llama-quant.cpp) for n_expert == 8: attn_v and attn_k Q8_0 in every mix, attn_output
    Q5_K in q2_k/q3_k_s/q3_k_m/q4_k_s/q4_k_m and the base type in the rest; ffn_down(_exps) by its block
    (use_more_bits of 8 blocks: 0, 3, 6, 7), gate/up at the base type."""
    p = _mix("mixtral", "q4_k_m", 8)
    assert {p[f"layers.{i}.self_attn.{x}"] for i in range(8) for x in ("k_proj", "v_proj")} == {"w8g32"}
    assert {p[f"layers.{i}.self_attn.o_proj"] for i in range(8)} == {"q5_k"}
    assert {p[f"layers.{i}.self_attn.q_proj"] for i in range(8)} == {"q4_k"}
    assert [p[f"layers.{i}.mlp.experts.down_proj"] for i in range(8)] == \
        ["q6_k", "q4_k", "q4_k", "q6_k", "q4_k", "q4_k", "q6_k", "q6_k"]
    assert {p[f"layers.{i}.mlp.experts.gate_up_proj"] for i in range(8)} == {"q4_k"}
    q3l = _mix("mixtral", "q3_k_l", 8)
    assert q3l["layers.0.self_attn.o_proj"] == "q3_k"  # dense q3_k_l would give Q5_K: not with 8 experts
    assert q3l["layers.5.mlp.experts.down_proj"] == "q5_k" and q3l["layers.5.self_attn.v_proj"] == "w8g32"


def test_mixes_on_other_expert_counts_use_the_dense_attention_rules_and_block_indexed_down():
    """16 experts: no 8-expert bumps; Qwen2-MoE's shared-expert down shares its block's rule (llama.cpp parses the
    block from both names), its one-row shared-expert gate stays 16-bit (F32 in llama.cpp's files)."""
    p = _mix("qwen2_moe", "q4_k_m", 16)
    assert [p[f"layers.{i}.self_attn.v_proj"] for i in range(8)] == \
        ["q6_k", "q4_k", "q4_k", "q6_k", "q4_k", "q4_k", "q6_k", "q6_k"]
    assert {p[f"layers.{i}.self_attn.k_proj"] for i in range(8)} == {"q4_k"}
    for i in range(8):
        assert p[f"layers.{i}.mlp.shared_expert.down_proj"] == p[f"layers.{i}.mlp.experts.down_proj"]
    assert [p[f"layers.{i}.mlp.experts.down_proj"] for i in range(8)] == \
        ["q6_k", "q4_k", "q4_k", "q6_k", "q4_k", "q4_k", "q6_k", "q6_k"]
    assert not any("shared_expert_gate" in n for n in p)
    q2 = _mix("qwen2_moe", "gguf:q2_k", 16, layers=2)
    assert q2["layers.0.self_attn.o_proj"] == "q3_k" and q2["layers.1.mlp.experts.down_proj"] == "q3_k"


def test_a_mix_exports_with_llama_cpps_types_for_every_tensor(tmp_path):
    """The plan's file holds, tensor by tensor, the type `llama_cpp_types` (the same rules read on GGUF names and
    3-D shapes) gives: the exported types are llama-quantize's. (Most of its time is K-quant RTN of 256-column rows,
    the narrowest where K types hold: ~26 s at load 19 on 2 cores, a few seconds on an idle machine.)"""
    from lowbit.plans import kmix

    model = tiny_moe("qwen3_moe", hidden=256, inter=256, experts=2, layers=2)  # the 8-expert rules: the next test
    quantize_model(model, build_plan(model, "q3_k_m"), "rtn", {"search": False}, progress=False)
    path = tmp_path / "m.gguf"
    ge.export(model, None, path, file_type=ge.FILE_TYPES["q3_k_m"])
    r = gguf.GGUFReader(str(path))
    have = {t.name: t.tensor_type.name for t in r.tensors}
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in r.tensors}
    want = kmix.llama_cpp_types("q3_k_m", shapes, n_gqa=2, n_expert=2)
    assert want and {n: have[n] for n in want} == want
    assert have["blk.0.attn_v.weight"] == "Q5_K" and have["blk.1.ffn_gate_inp.weight"] == "F32"  # first two attn_v
    # q3_k_m: ffn_down Q5_K below n_layer/16 (none of 2 blocks), else Q4_K; gate/up the base Q3_K
    assert have["blk.0.ffn_down_exps.weight"] == "Q4_K" and have["blk.0.ffn_up_exps.weight"] == "Q3_K"


@pytest.mark.parametrize("arch", (*ARCHS, "deepseek_v3"))
def test_lowbit_reads_its_moe_gguf_back_into_fused_experts_with_the_same_logits(tmp_path, monkeypatch, tiny_tokenizer,
                                                                                 arch):
    """transformers' GGUF loader rebuilds these wrongly (Mixtral as a dense Llama): lowbit's reader inverts its own
    mapping, so the float model it builds computes the quantized model's logits (to float rounding)."""
    from lowbit.models.accounting import is_fused_experts
    from lowbit.models.loading import load_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = quantized(arch, "w4g32", len(tiny_tokenizer))
    path = tmp_path / "m.gguf"
    with pytest.warns(UserWarning, match="does not rebuild mixture-of-experts files faithfully"):
        ge.export(model, tiny_tokenizer, path, embeddings="f16")
    back = load_model(str(path))
    assert type(back.model) is type(model)
    assert sum(is_fused_experts(m) for m in back.model.modules()) == 1 + (arch != "deepseek_v3")  # dense block 0
    ids = torch.randint(0, len(tiny_tokenizer), (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = back.model(ids).logits, model(ids).logits
    # the same weights and modules: equal bit for bit on most CPUs; DeepSeek-V3's MLA path rounded one ULP apart
    # (6e-8) on an AMD EPYC, where the GEMMs' summation order differs. A mapping error moves logits by ~0.1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert back.tokenizer("def f(x): return x")["input_ids"] == tiny_tokenizer("def f(x): return x")["input_ids"]


def test_a_moe_gguf_lowbit_did_not_write_is_refused_in_one_line(tmp_path, monkeypatch):
    from lowbit.models.loading import load_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "mixtral.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_expert_count(8)
    w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="mixture-of-experts GGUF lowbit did not write"):
        load_model(str(path))


@pytest.mark.parametrize("arch", ("qwen3_moe", "deepseek_v3"))
def test_cli_quantize_export_and_eval_the_gguf(tmp_path, monkeypatch, capsys, tiny_tokenizer, arch):
    """`lowbit quantize` -> `lowbit export --to gguf` -> `lowbit eval file.gguf` on a MoE folder; a DeepSeek-V3
    export names its float attn_k_b tensors and why."""
    import json

    from lowbit.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = tmp_path / "src"
    tiny_moe(arch, len(tiny_tokenizer)).save_pretrained(src)
    tiny_tokenizer.save_pretrained(src)
    fast = ["--method", "rtn", "--no-search", "--no-eval", "--json"]
    assert main(["quantize", str(src), "--scheme", "w4g32", *fast, "--out", str(tmp_path / "q")]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "q"), "--to", "gguf", "--out", str(tmp_path / "m.gguf"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tensors, meta = read(tmp_path / "m.gguf")
    a = {**GGUF_ARCH, "deepseek_v3": "deepseek2"}[arch]
    assert tensors["blk.1.ffn_down_exps.weight"][0] == "Q4_0" and meta[f"{a}.expert_count"] == 8
    if arch == "deepseek_v3":
        assert sorted(result["float_tensors"]) == ["blk.0.attn_k_b.weight", "blk.1.attn_k_b.weight"]
        assert tensors["blk.1.attn_v_b.weight"][0] == "Q4_0" and meta["deepseek2.expert_gating_func"] == 2
    else:
        assert "float_tensors" not in result
    args = ["--windows", "1", "--seqlen", "32", "--json"]
    assert main(["eval", str(tmp_path / "q"), *args]) == 0
    native = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["eval", str(tmp_path / "m.gguf"), *args]) == 0
    from_gguf = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the same quantized weights (embeddings quantized by llama.cpp's Q4_0 rule in the file: close, not equal)
    assert abs(from_gguf["ppl"] / native["ppl"] - 1) < 0.05


def test_inspect_prices_a_moe_mix_at_llama_cpps_types(tmp_path):
    """`lowbit inspect` reads the expert count from the file: an 8-expert q4_k_m file has llama.cpp's types (attn_v
    Q8_0 by the 8-expert rule), so nothing differs and the sizes agree. One block of 8 experts x 256 columns: the
    smallest model where both the 8-expert rules and real K types apply (~15 s of K-quant RTN on 2 cores)."""
    from lowbit.api.inspect import llama_cpp_size
    from lowbit.files.inspect import gguf_layout

    model = tiny_moe("mixtral", hidden=256, inter=256, experts=8, layers=1)
    quantize_model(model, build_plan(model, "q4_k_m"), "rtn", {"search": False}, progress=False)
    path = tmp_path / "m.gguf"
    ge.export(model, None, path, file_type=ge.FILE_TYPES["q4_k_m"])
    layout = gguf_layout(path)
    assert layout["n_expert"] == 8
    got = llama_cpp_size(layout, path.stat().st_size)
    assert got["types_differ"] == {} and got["size_vs_llama_cpp"] == 1.0
    assert {t["type"] for t in layout["tensors"] if t["name"].endswith("attn_v.weight")} == {"Q8_0"}


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed in this environment "
                                               "(`make bench-setup` installs it); llama.cpp cannot run the file here")
def test_gpt_oss_yarn_rope_is_written_as_llama_cpp_reads_it(tmp_path, tiny_tokenizer):
    """gpt-oss ships YaRN (factor 32 over 4096 positions): the file says so, and llama.cpp's logits follow it
    (measured max |diff| 0.0006 with the keys, 0.0015 without them: plain rope)."""
    vocab = len(tiny_tokenizer)
    model = tiny_moe("gpt_oss", vocab, yarn=True)
    quantize_model(model, build_plan(model, "w8g32"), "rtn", {"search": False}, progress=False)
    path = tmp_path / "m.gguf"
    ge.export(model, tiny_tokenizer, path, embeddings="f16")
    _, meta = read(path)
    assert meta["gpt-oss.rope.scaling.type"] == "yarn" and meta["gpt-oss.rope.scaling.factor"] == 32.0
    assert meta["gpt-oss.rope.scaling.original_context_length"] == 4096
    have, want = llama_cpp_and_lowbit_logits(path, model, vocab)
    assert (have - want).abs().max() < 0.001


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed in this environment "
                                               "(`make bench-setup` installs it); llama.cpp's quantizer cannot run here")
@pytest.mark.parametrize(("arch", "experts"), [("mixtral", 8), ("qwen2_moe", 4)])
def test_llama_cpps_own_quantizer_types_every_tensor_as_lowbits_rules_do(tmp_path, arch, experts):
    """llama_model_quantize on lowbit's float GGUF (F32 3-D experts) picks, for every tensor of every mix, the type
    `llama_cpp_types` (the rules the mix plans follow) gives: the 8-expert bumps, block-indexed ffn_down_exps and
    ffn_down_shexp, gate/up exps at the base type, routers and the shared-expert gate untouched."""
    from benchmarks.gguf import llamacpp_quantize
    from lowbit.plans import kmix

    model = tiny_moe(arch, 256, hidden=256, inter=256, experts=experts, layers=4)  # more bits in blocks 2, 3
    ge.export(model, None, tmp_path / "f.gguf")
    for mix in ("q4_k_m", "gguf:q2_k"):
        llamacpp_quantize(tmp_path / "f.gguf", tmp_path / "q.gguf", mix, 1, embeddings="llama.cpp")
        r = gguf.GGUFReader(str(tmp_path / "q.gguf"))
        have = {t.name: t.tensor_type.name for t in r.tensors}
        shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in r.tensors}
        want = kmix.llama_cpp_types(mix, shapes, n_gqa=2, n_expert=experts)
        assert len(want) == 2 + 4 * (4 + (6 if arch == "qwen2_moe" else 3))  # every matmul weight but the routers
        assert {n: have[n] for n in want} == want, mix
        assert have["blk.0.ffn_gate_inp.weight"] == "F32"


# ------------------------------------------------------------------ DeepSeek-V3 (llama.cpp's deepseek2, MLA)


def _kv_b_halves(model: torch.nn.Module, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(attn_k_b [heads, rank, nope], attn_v_b [heads, v, rank]) from kv_b_proj's dequantized weight, cut the way
    transformers' MLA reads it (``view(..., heads, nope + v)`` then split at nope) -- not by the exporter's rows."""
    cfg = model.config
    attn = model.model.layers[layer].self_attn
    w = attn.kv_b_proj.qweight.dequantize().reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
    k, v = torch.split(w, [cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
    return k.transpose(1, 2).numpy(), v.numpy()


def test_deepseek_v3_reads_back_bit_exactly_with_mla_and_routing_metadata(tmp_path):
    model = quantized("deepseek_v3", "w4g32")
    path = tmp_path / "m.gguf"
    r = ge.export(model, None, path, embeddings="f16")
    assert r["arch"] == "deepseek2" and not r["requantized"]
    # kv_b_proj's key half is the one quantized weight a float type holds, named with its reason
    assert set(r["float_tensors"]) == {"blk.0.attn_k_b.weight", "blk.1.attn_k_b.weight"}
    assert all("qk_nope_head_dim" in why for why in r["float_tensors"].values())
    tensors, meta = read(path)
    cfg = model.config
    a = "deepseek2"
    want_meta = {"attention.head_count_kv": 1, "attention.key_length": 64 + 16, "attention.value_length": 64,
                 "attention.key_length_mla": 32 + 16, "attention.value_length_mla": 16,
                 "attention.kv_lora_rank": 64, "attention.q_lora_rank": 32, "rope.dimension_count": 16,
                 "leading_dense_block_count": 1, "expert_count": 8, "expert_used_count": 2,
                 "expert_feed_forward_length": 32, "expert_shared_count": 1, "expert_weights_scale": 2.5,
                 "expert_weights_norm": True, "expert_gating_func": 2, "expert_group_count": 2,
                 "expert_group_used_count": 1, "feed_forward_length": 64}
    assert {k: meta[f"{a}.{k}"] for k in want_meta} == want_meta
    for layer in range(cfg.num_hidden_layers):
        attn = model.model.layers[layer].self_attn
        k_b, v_b = _kv_b_halves(model, layer)
        kind, got = tensors[f"blk.{layer}.attn_v_b.weight"]
        assert kind == "Q4_0" and got.shape == v_b.shape and np.array_equal(got, v_b)
        kind, got = tensors[f"blk.{layer}.attn_k_b.weight"]
        assert kind in ("F16", "BF16", "F32") and got.shape == k_b.shape and np.array_equal(got, k_b)
        for hf, gg in (("q_a_proj", "attn_q_a"), ("q_b_proj", "attn_q_b"), ("kv_a_proj_with_mqa", "attn_kv_a_mqa"),
                       ("o_proj", "attn_output")):
            kind, got = tensors[f"blk.{layer}.{gg}.weight"]
            assert kind == "Q4_0" and np.array_equal(got, getattr(attn, hf).qweight.dequantize().numpy()), hf
    dense = model.model.layers[0].mlp
    for part in ("gate", "up", "down"):
        kind, got = tensors[f"blk.0.ffn_{part}.weight"]
        assert kind == "Q4_0" and np.array_equal(got, getattr(dense, f"{part}_proj").qweight.dequantize().numpy())
    moe = model.model.layers[1].mlp
    for suffix, w in reference_experts(moe.experts, False).items():
        kind, got = tensors[f"blk.1.{suffix}.weight"]
        assert kind == "Q4_0" and np.array_equal(got, w.numpy()), suffix
    for part in ("gate", "up", "down"):
        kind, got = tensors[f"blk.1.ffn_{part}_shexp.weight"]
        want = getattr(moe.shared_experts, f"{part}_proj").qweight.dequantize().numpy()
        assert kind == "Q4_0" and np.array_equal(got, want), part
    assert tensors["blk.1.ffn_gate_inp.weight"][0] == "F32"
    assert np.array_equal(tensors["blk.1.ffn_gate_inp.weight"][1], moe.gate.weight.detach().numpy())
    kind, got = tensors["blk.1.exp_probs_b.bias"]
    assert kind == "F32" and np.array_equal(got, moe.gate.e_score_correction_bias.numpy()) and got.std() > 0
    assert "blk.0.ffn_gate_inp.weight" not in tensors and not any("attn_kv_b" in n for n in tensors)
    # `inspect`'s accounting of the file: the per-head 3-D MLA tensors are attention, not experts
    from lowbit.models.accounting import kind_by_name

    kinds = {n: kind_by_name(n, got.shape) for n, (_, got) in tensors.items() if got.ndim == 3}
    assert {n for n, k in kinds.items() if k == "attention"} == {f"blk.{b}.attn_{p}_b.weight" for b in (0, 1)
                                                                  for p in "kv"}
    assert {k for n, k in kinds.items() if "_exps" in n} == {"experts"}


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed in this environment "
                                               "(`make bench-setup` installs it); llama.cpp cannot run the file here")
def test_llama_cpp_runs_deepseek_v3_with_lowbits_logits(tmp_path, tiny_tokenizer):
    vocab = len(tiny_tokenizer)
    model = quantized("deepseek_v3", "w8g32", vocab)
    path = tmp_path / "m.gguf"
    ge.export(model, tiny_tokenizer, path, embeddings="f16")
    have, want = llama_cpp_and_lowbit_logits(path, model, vocab)
    assert (have - want).abs().max() < 0.02  # the bound of the other MoE architectures (Q8_0 activations)
    assert (have.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    # the bound tells: lowbit's model routing without groups, without renormalising, without the routed scaling
    # factor or without the correction bias is 0.08-0.18 away from llama.cpp (measured; its own gap 0.008)
    ids = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(3))
    gate = model.model.layers[1].mlp.gate
    for attr, value in (("num_group", 1), ("norm_topk_prob", False), ("routed_scaling_factor", 1.0)):
        kept = getattr(gate, attr)
        setattr(gate, attr, value)
        with torch.no_grad():
            other = model(ids).logits[0].float()
        setattr(gate, attr, kept)
        assert (have - other).abs().max() > 0.05, attr
    bias = gate.e_score_correction_bias.clone()
    gate.e_score_correction_bias.zero_()
    with torch.no_grad():
        assert (have - model(ids).logits[0].float()).abs().max() > 0.05
    gate.e_score_correction_bias.copy_(bias)


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed in this environment "
                                               "(`make bench-setup` installs it); llama.cpp cannot run the file here")
def test_deepseek_v3_yarn_rope_and_mla_softmax_scale_follow_llama_cpp(tmp_path, tiny_tokenizer):
    """DeepSeek-V3 ships YaRN (factor 40 over 4096 positions, mscale = mscale_all_dim = 1), which also scales MLA's
    softmax by mscale^2: llama.cpp reads that from yarn_log_multiplier. Measured max |diff| 0.0105 with the keys,
    0.33 without the multiplier, 0.30 without any YaRN key (plain rope)."""
    vocab = len(tiny_tokenizer)
    model = quantized("deepseek_v3", "w8g32", vocab, yarn=True)
    path = tmp_path / "m.gguf"
    ge.export(model, tiny_tokenizer, path, embeddings="f16")
    _, meta = read(path)
    assert meta["deepseek2.rope.scaling.type"] == "yarn" and meta["deepseek2.rope.scaling.factor"] == 40.0
    assert meta["deepseek2.rope.scaling.original_context_length"] == 4096
    assert meta["deepseek2.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1)
    have, want = llama_cpp_and_lowbit_logits(path, model, vocab)
    assert (have - want).abs().max() < 0.02


def test_deepseek_v3_that_llama_cpp_would_compute_otherwise_is_refused(tmp_path):
    for attr, value, why in (("rope_interleave", False, "rope_interleave=False"),
                             ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0,
                                                  "mscale": 0.707, "mscale_all_dim": 1.0,
                                                  "original_max_position_embeddings": 4096}, "mscale differs")):
        model = quantized("deepseek_v3", "w4g32")
        setattr(model.config, attr, value)
        with pytest.raises(ModelError, match=why):
            ge.export(model, None, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed in this environment "
                                               "(`make bench-setup` installs it); llama.cpp's quantizer cannot run here")
def test_a_deepseek_v3_mix_has_llama_cpps_own_types_but_the_float_attn_k_b(tmp_path):
    """llama_model_quantize (Q4_K_M) on lowbit's float DeepSeek-V3 GGUF vs lowbit's q4_k_m plan exported: the same
    type for every tensor (MLA projections at the base type or its width fallback, 8-expert attn_output Q5_K,
    block-indexed ffn_down / _shexp / _exps) except attn_k_b, which lowbit writes as float (llama.cpp re-quantizes
    it along qk_nope)."""
    import copy

    from benchmarks.gguf import llamacpp_quantize

    model = tiny_moe("deepseek_v3", 256, hidden=256, inter=256, layers=3)  # ffn_down more bits in block 2
    ge.export(model, None, tmp_path / "f.gguf")
    llamacpp_quantize(tmp_path / "f.gguf", tmp_path / "q.gguf", "q4_k_m", 1, embeddings="llama.cpp")
    theirs = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors}
    ours_model = copy.deepcopy(model)
    quantize_model(ours_model, build_plan(ours_model, "q4_k_m"), "rtn", {"search": False}, progress=False)
    r = ge.export(ours_model, None, tmp_path / "l.gguf", file_type=ge.FILE_TYPES["q4_k_m"])
    ours = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "l.gguf")).tensors}
    assert set(ours) == set(theirs)
    differ = {n for n in ours if ours[n] != theirs[n]}
    assert differ == set(r["float_tensors"]) == {f"blk.{b}.attn_k_b.weight" for b in range(3)}
    assert ours["blk.2.ffn_down_exps.weight"] == "Q6_K" and ours["blk.1.ffn_down_exps.weight"] == "Q4_K"
    assert ours["blk.1.attn_output.weight"] == "Q5_K" and ours["blk.1.attn_kv_a_mqa.weight"] == "Q4_K"
