"""QuantLinear, replace_linears and the native checkpoint round trip on tiny random models."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lowbit.errors import CheckpointError, LowbitError, SchemeError
from lowbit.files.native import load, save
from lowbit.formats import Scheme, qdq
from lowbit.nn import QuantLinear, fake_quant, quant_layers, replace_linears
from lowbit.plans.plan import Plan


def tiny(tie: bool = True, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).eval()


def block_linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]


def test_quant_linear_matches_qdq_weight():
    lin = torch.nn.Linear(96, 16)
    q = QuantLinear.from_linear(lin, "w4g32")
    x = torch.randn(3, 96)
    ref = torch.nn.functional.linear(x, qdq(lin.weight.detach(), Scheme.parse("w4g32")), lin.bias)
    assert torch.equal(q(x), ref)


def test_adapters_add_to_output():
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 8)
    q = QuantLinear.from_linear(lin, "w8g32")
    x = torch.randn(2, 32)
    with torch.no_grad():
        base = q(x)
        adapter = torch.nn.Linear(32, 8, bias=False)
        delta = adapter(x)
        assert delta.abs().min() > 0  # a real correction, so a dropped adapter would show
        q.adapters["a"] = adapter
        assert torch.equal(q(x), base + delta)  # the adapter's output, added once, nothing else
        q.adapters["b"] = torch.nn.Linear(32, 8, bias=False)
        assert torch.equal(q(x), base + delta + q.adapters["b"](x))


def test_fake_quant_is_straight_through():
    w = torch.randn(4, 32, requires_grad=True)
    y = fake_quant(w, "w2g16")
    assert torch.equal(y.detach(), qdq(w.detach(), Scheme.parse("w2g16")))
    y.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("scheme", ["w4g32", "w3g32a", "w2g16", "w8"])
def test_save_load_logits_equal_bit_for_bit(tmp_path, tie, scheme):
    model = tiny(tie)
    replace_linears(model, Plan.uniform(block_linears(model), scheme))
    ids = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        before = model(ids).logits
    save(model, None, tmp_path / "ck", meta={"note": "t"})
    loaded, _ = load(tmp_path / "ck")
    with torch.no_grad():
        after = loaded(ids).logits
    assert torch.equal(before, after)
    assert len(quant_layers(loaded)) == 14
    assert not list(tmp_path.glob(".ck*")), "temporary folders left behind"


def test_mixed_plan_round_trip(tmp_path):
    model = tiny()
    names = block_linears(model)
    plan = Plan({n: Scheme.parse("w2g16" if i % 2 else "w4g32a") for i, n in enumerate(names)})
    replace_linears(model, plan)
    save(model, None, tmp_path / "ck")
    loaded, _ = load(tmp_path / "ck")
    assert {n: m.scheme for n, m in quant_layers(loaded).items()} == plan.weights()


def test_out_exists_refused_and_force_replaces(tmp_path):
    model = tiny()
    replace_linears(model, Plan.uniform(block_linears(model), "w4g32"))
    save(model, None, tmp_path / "ck")
    with pytest.raises(LowbitError, match="--force"):
        save(model, None, tmp_path / "ck")
    save(model, None, tmp_path / "ck", force=True)
    load(tmp_path / "ck")


@pytest.fixture
def saved(tmp_path):
    model = tiny()
    replace_linears(model, Plan.uniform(block_linears(model), "w4g32"))
    return save(model, None, tmp_path / "ck")


def test_truncated_checkpoint_is_refused(saved):
    f = saved / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="checksum"):
        load(saved)


def test_missing_manifest_and_path(saved, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load(tmp_path / "nope")
    (saved / "lowbit.json").unlink()
    with pytest.raises(CheckpointError, match="not a lowbit checkpoint"):
        load(saved)


def test_hand_edited_shape_is_refused(saved):
    m = json.loads((saved / "lowbit.json").read_text())
    name = next(iter(m["layers"]))
    m["layers"][name]["shape"][1] = 128
    (saved / "lowbit.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="disagree"):
        load(saved)


def test_plan_naming_missing_layer_is_error():
    model = tiny()
    with pytest.raises(SchemeError, match="does not have"):
        replace_linears(model, Plan.uniform(["model.layers.9.mlp.up_proj"], "w4g32"))
    with pytest.raises(SchemeError, match="larger than"):
        replace_linears(model, Plan.uniform(["model.layers.0.mlp.up_proj"], "w4g128"))


def test_plan_json_round_trip(tmp_path):
    plan = Plan({"a": Scheme.parse("w2g64"), "b": Scheme.parse("nvfp4-46:block=8")})
    plan.save(tmp_path / "p.json")
    assert dict(Plan.load(tmp_path / "p.json").items()) == dict(plan.items())
    assert plan.average_bits({"a": (10, 64), "b": (10, 64)}) == pytest.approx(((2 + 16 / 64) + (4 + 1)) / 2)


def test_embeddings_stay_16bit_and_round_trip_exactly(tmp_path):
    from safetensors import safe_open

    from lowbit.ptq import quantize_model

    model = tiny(tie=False)
    quantize_model(model, Plan.uniform(block_linears(model), "w4g32"), "rtn", {"search": False}, progress=False)
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        before = model(ids).logits
    save(model, None, tmp_path / "ck")
    with safe_open(str(tmp_path / "ck" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float16
        assert f.get_tensor("lm_head.weight").dtype == torch.float16
    loaded, _ = load(tmp_path / "ck")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, before)
