"""Every matmul weight accounted for (lowbit.models.accounting), on tiny random models of each architecture.

The accounting must see fused 3-D experts, bare-Parameter routers and shared experts, count
every matmul weight exactly once, agree between a model in memory and its stored tensors,
and a quantize (or QAT) that would leave experts in float unasked is refused before any work.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from lowbit.cli import main
from lowbit.errors import ConfigError, ModelError
from lowbit.models.accounting import (
    account_model,
    account_tensors,
    check_architecture,
    check_float_left,
    kept,
)

SMALL = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8)


def make(arch: str, vocab: int = 128):
    """A tiny random model of ``arch`` built from its transformers config (8 experts, top-2 for the MoE ones)."""
    import transformers as tf

    torch.manual_seed(0)
    small = {**SMALL, "vocab_size": vocab}
    moe = dict(num_experts_per_tok=2)
    cfgs = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**small, intermediate_size=64, tie_word_embeddings=True)),
        "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **small, **moe, intermediate_size=64, moe_intermediate_size=16, num_experts=8)),
        "qwen2_moe": lambda: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **small, **moe, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32,
            num_experts=8)),
        "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(**small, **moe, intermediate_size=16,
                                                                  num_local_experts=8)),
        "olmoe": lambda: tf.OlmoeForCausalLM(tf.OlmoeConfig(**small, **moe, intermediate_size=16, num_experts=8,
                                                            pad_token_id=0, eos_token_id=1)),
        "gpt_oss": lambda: tf.GptOssForCausalLM(tf.GptOssConfig(**small, **moe, intermediate_size=16,
                                                                num_local_experts=8)),
        "deepseek_v3": lambda: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **{**small, "num_key_value_heads": 4}, **moe, intermediate_size=64, moe_intermediate_size=16,
            n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=4, v_head_dim=8, n_group=2, topk_group=1)),
        "granitemoe": lambda: tf.GraniteMoeForCausalLM(tf.GraniteMoeConfig(**small, **moe, intermediate_size=16,
                                                                           num_local_experts=8)),
    }
    return cfgs[arch]().eval()


MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3")


def _matmul_params(model) -> int:
    """What the accounting must total: distinct parameters with 2+ dims, biases (gpt-oss's [E, out]) excluded."""
    return sum(p.numel() for n, p in model.named_parameters() if p.ndim >= 2 and not n.endswith("bias"))


@pytest.mark.parametrize("arch", ("llama", *MOE))
def test_totals_equal_every_matmul_weight_and_experts_are_found(arch):
    model = make(arch)
    acc = account_model(model)
    assert acc.total == _matmul_params(model)
    kinds = acc.by_kind()
    stacked = sum(p.numel() for p in model.parameters() if p.ndim == 3)
    assert kinds.get("experts", (0, 0)) == (0, stacked)
    assert all(q == 0 for q, _ in kinds.values())  # nothing quantized yet
    check_architecture(model)
    if arch == "llama":
        assert set(kinds) == {"attention", "mlp", "embeddings"}  # tied lm_head: counted once, as embeddings
        return
    assert stacked > 0 and kinds["router"][1] >= 8 * 32  # an [8, 32] router per MoE layer
    routers = [w for w in acc.weights if w.kind == "router"]
    assert all(w.shape[0] in (8, 1) for w in routers)  # top-k routers, and Qwen2-MoE's [1, H] shared-expert gate
    assert ("shared_experts" in kinds) == (arch in ("qwen2_moe", "deepseek_v3"))
    assert not any("bias" in w.name for w in acc.weights)


@pytest.mark.parametrize("arch", ("llama", *MOE))
def test_stored_tensors_give_the_same_accounting_as_the_model(arch):
    """`inspect` classifies by name and shape: on the model's own tensors it must agree with the structural walk."""
    model = make(arch)
    seen, entries = set(), []
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:  # a tied lm_head is stored once
            seen.add(t.data_ptr())
            entries.append((name, tuple(t.shape), False))
    assert account_tensors(entries).to_dict() == account_model(model).to_dict()


@pytest.mark.parametrize("arch", ("mixtral", "qwen2_moe"))
def test_hf_folders_per_expert_names_count_as_experts(arch, tmp_path):
    """transformers saves experts per expert (mixtral: block_sparse_moe.experts.E.w1): same totals per kind."""
    model = make(arch)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as st:
        entries = [(k, tuple(st.get_slice(k).get_shape()), False) for k in st.keys()]
    assert any(".experts.0." in n for n, _, _ in entries)
    assert account_tensors(entries).by_kind() == account_model(model).by_kind()


def test_gguf_names_are_classified():
    acc = account_tensors([("token_embd.weight", (128, 32), False), ("output.weight", (128, 32), False),
                           ("blk.0.attn_q.weight", (32, 32), True), ("blk.0.attn_norm.weight", (32,), False),
                           ("blk.0.ffn_gate_exps.weight", (8, 16, 32), True), ("blk.0.ffn_gate_inp.weight", (8, 32), False),
                           ("blk.0.ffn_up_shexp.weight", (32, 32), True), ("blk.0.ffn_down.weight", (32, 64), True)])
    assert acc.by_kind() == {"attention": (1024, 0), "mlp": (2048, 0), "experts": (4096, 0),
                             "shared_experts": (1024, 0), "router": (0, 256), "embeddings": (0, 4096),
                             "lm_head": (0, 4096)}


def test_refusal_names_the_kinds_left_and_their_share():
    model = make("qwen3_moe")
    planned = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n]
    acc = account_model(model, planned)
    with pytest.raises(ConfigError) as e:
        check_float_left(acc)
    msg = str(e.value)
    share = 100 * acc.by_kind()["experts"][1] / acc.total
    assert f"experts {acc.by_kind()['experts'][1]:,} ({share:.1f}%" in msg and "--keep experts" in msg
    assert "model.layers.*.mlp.experts.gate_up_proj" in msg and "\n" not in msg
    assert "router" not in msg.split(";")[0]  # the router stays 16-bit by rule, it is not a refusal
    check_float_left(acc, {w.name for w in acc.weights if w.kind == "experts"})  # asked: passes


def test_an_architecture_whose_experts_lowbit_cannot_map_is_refused_by_name():
    with pytest.raises(ModelError, match=r"granitemoe.*qwen3_moe, qwen2_moe, mixtral, olmoe, gpt_oss, deepseek_v3"):
        check_architecture(make("granitemoe"))


# ------------------------------------------------------------------ the command line


def _save(arch: str, path, tokenizer):
    make(arch, len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tiny_tokenizer):
    return _save("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3moe", tiny_tokenizer)


FAST = ["--method", "rtn", "--no-search", "--no-eval", "--json"]


def _last(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_avg_bits_plans_the_experts_too(moe_dir, tmp_path, capsys):
    """Every plan source covers the fused experts (a uniform --scheme: tests/test_experts.py; llama.cpp mixes:
    tests/test_expert_mixed.py, whose K types need wider experts than this model's 16 columns)."""
    out = tmp_path / "q"
    how = ["--avg-bits", "3", "--options", "w2g16,w4g16", "--method", "rtn", "--no-eval", "--json"]
    assert main(["quantize", str(moe_dir), *how, "--out", str(out)]) == 0
    r = _last(capsys)["matmul_weights"]
    assert "experts" in r["quantized"] and set(r["float"]) == {"router", "embeddings", "lm_head"}


def test_a_plan_file_leaving_experts_in_float_is_refused_before_any_work(moe_dir, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": {"model.layers.0.self_attn.q_proj": "w4g16"}}))
    out = tmp_path / "q"
    assert main(["quantize", str(moe_dir), "--plan", str(plan), *FAST, "--out", str(out)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("lowbit")]  # not transformers' bars
    assert len(err) == 1 and "experts" in err[0] and "% of the matmul weights in float" in err[0]
    assert "--avg-bits plan covers fused mixture-of-experts experts" in err[0] and "--keep experts" in err[0]
    assert list(out.parent.glob("q*")) == []  # nothing written, no temporaries


def test_keep_experts_quantizes_the_rest_and_reports_experts_in_float(moe_dir, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(moe_dir), "--scheme", "w4g32", *FAST, "--keep", "experts", "--out", str(out)]) == 0
    summary = _last(capsys)
    r = summary["matmul_weights"]
    model = make("qwen3_moe", 512)
    experts = sum(p.numel() for p in model.parameters() if p.ndim == 3)
    attention = sum(p.numel() for n, p in model.named_parameters() if "self_attn" in n and p.ndim == 2)
    assert r["params"] == _matmul_params(model)
    assert r["quantized"] == {"attention": attention} and r["float"]["experts"] == experts
    assert set(r["float"]) == {"experts", "router", "embeddings", "lm_head"}
    assert r["quantized_share"] == round(attention / r["params"], 4)
    assert json.loads((out / "lowbit.json").read_text())["meta"]["matmul_weights"] == r
    # the float experts and routers count 16 bits in bits_per_weight, not only in the accounting
    f16 = r["float"]["experts"] + r["float"]["router"]
    assert summary["bits_per_weight"] == round((4.5 * attention + 16 * f16) / (attention + f16), 4)
    assert main(["inspect", str(out), "--json"]) == 0
    info = _last(capsys)
    assert info["matmul_weights"] == r  # from the stored tensors alone: the same accounting
    assert info["bits_per_weight"] == summary["bits_per_weight"]


@pytest.mark.parametrize("arch", MOE)
def test_every_architecture_quantizes_with_kept_experts_and_inspect_agrees(arch, tmp_path, capsys, tiny_tokenizer):
    """Through lowbit's loader (per-expert names on disk, fused in memory) to a checkpoint and back by inspect."""
    src = _save(arch, tmp_path / arch, tiny_tokenizer)
    assert main(["quantize", str(src), "--scheme", "w4g8", *FAST, "--keep", "experts", "--out", str(tmp_path / "q")]) == 0
    r = _last(capsys)
    model = make(arch, len(tiny_tokenizer))
    assert r["matmul_weights"]["params"] == _matmul_params(model)
    assert "experts" not in r["matmul_weights"]["quantized"] and "router" not in r["matmul_weights"]["quantized"]
    assert r["matmul_weights"]["float"]["experts"] == sum(p.numel() for p in model.parameters() if p.ndim == 3)
    assert main(["inspect", str(tmp_path / "q"), "--json"]) == 0
    i = _last(capsys)
    assert i["matmul_weights"] == r["matmul_weights"] and i["bits_per_weight"] == r["bits_per_weight"]


@pytest.mark.parametrize("keep, needle", (("expert", "--keep expert matches no matmul weight"),
                                          (",", "--keep takes kinds")))
def test_keep_that_matches_nothing_is_refused(moe_dir, tmp_path, capsys, keep, needle):
    assert main(["quantize", str(moe_dir), "--scheme", "w4g32", *FAST, "--keep", keep,
                 "--out", str(tmp_path / "q")]) == 2
    assert needle in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_qat_refuses_experts_left_in_float(moe_dir, tmp_path, capsys):
    assert main(["qat", str(moe_dir), "--scheme", "w2", "--steps", "1", "--no-eval",
                 "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "experts" in err and "--keep experts" in err and list(tmp_path.iterdir()) == []


def test_unmappable_experts_are_refused_listing_the_supported(tmp_path, capsys, tiny_tokenizer):
    src = _save("granitemoe", tmp_path / "granite", tiny_tokenizer)
    assert main(["quantize", str(src), "--scheme", "w4g32", *FAST, "--keep", "experts",
                 "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "(model_type 'granitemoe') has experts lowbit cannot map" in err and "qwen3_moe, qwen2_moe, mixtral" in err
    assert not (tmp_path / "q").exists()


def test_dense_model_accounting_and_keep_by_kind(tmp_path, capsys, tiny_hf_dir):
    assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", *FAST, "--out", str(tmp_path / "a")]) == 0
    r = _last(capsys)
    acc = r["matmul_weights"]
    assert set(acc["quantized"]) == {"attention", "mlp"} and set(acc["float"]) == {"embeddings"}
    assert r["layers_quantized"] == 14 and r["layers_16bit"] == 0 and r["bits_per_weight"] == 4.5
    assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", *FAST, "--keep", "attention",
                 "--out", str(tmp_path / "b")]) == 0
    r = _last(capsys)
    assert set(r["matmul_weights"]["quantized"]) == {"mlp"} and r["matmul_weights"]["float"]["attention"] > 0
    assert r["layers_quantized"] == 6  # the kept Linears left the plan: 16-bit by request


def test_plan_file_leaving_linears_out_is_the_users_choice(tmp_path, capsys, tiny_hf_dir):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": {"model.layers.0.mlp.down_proj": "w4g32"}}))
    assert main(["quantize", str(tiny_hf_dir), "--plan", str(plan), *FAST, "--out", str(tmp_path / "q")]) == 0
    assert _last(capsys)["matmul_weights"]["quantized"] == {"mlp": 64 * 128}


def test_float_left_beside_quantized_weights_of_its_kind_is_kept_by_a_glob():
    """Attention outside the decoder (a vision tower, say) beside a quantized decoder: --keep attention would be wrong."""
    model = torch.nn.Module()
    model.lm = make("llama")
    model.vision = torch.nn.Module()
    model.vision.self_attn = torch.nn.Linear(16, 16)
    planned = [f"lm.{n}" for n, m in model.lm.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n]
    acc = account_model(model, planned)
    with pytest.raises(ConfigError, match=r"attention 256 \(.*vision.self_attn.weight\).*--keep vision.self_attn.\* "):
        check_float_left(acc)
    check_float_left(acc, kept(acc, ["vision.self_attn.*"]))  # the suggested glob keeps exactly that
