"""Adapters on a tiny quantized Llama: budgets, init, training, merge, save/load, data."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lowbit.errors import CheckpointError, ConfigError
from lowbit.files.native import load, save
from lowbit.models.activations import second_moments
from lowbit.nn import QuantLinear, quant_layers, replace_linears
from lowbit.peft import (
    KINDS,
    PeftConfig,
    adapters_of,
    apply_adapters,
    count_trainable,
    load_adapters,
    lora_budget,
    merge,
    merge_and_requantize,
    save_adapters,
    unmerge,
)
from lowbit.peft.finetune import IGNORE, lm_rows, masked_lm_loss, train_adapters
from lowbit.plans.plan import Plan
from lowbit.train import TrainConfig

VOCAB = 128


def fp_model(seed=0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB)
    return LlamaForCausalLM(cfg).eval()


def linears(model):
    return {n: m.weight.detach().clone() for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and ".layers." in n}


def quantized(scheme="w2g32", seed=0):
    fp = fp_model(seed)
    w = linears(fp)
    q = copy.deepcopy(fp)
    replace_linears(q, Plan.uniform(list(w), scheme))
    return fp, q, w


def batches(n=8, t=32, seed=1):
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def base():
    fp, q, w = quantized()
    xtx = second_moments(q, batches(), list(w))
    return fp, q, w, xtx


@pytest.mark.parametrize("kind", KINDS)
def test_every_adapter_gets_the_lora_budget(base, kind):
    _, q, w, xtx = base
    q = copy.deepcopy(q)
    apply_adapters(q, PeftConfig(kind, rank=4), fp_weights=w, xtx=xtx)
    expected = sum(lora_budget(4, *t.shape) for t in w.values())
    assert count_trainable(q) == expected
    trainable = {n for n, p in q.named_parameters() if p.requires_grad}
    assert trainable and all(".adapters.peft." in n for n in trainable)


def test_xtx_equals_brute_force(base):
    _, q, w, xtx = base
    name = "model.layers.1.mlp.down_proj"
    seen = []
    h = q.get_submodule(name).register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, 128)))
    logits(q, batches())
    h.remove()
    x = torch.cat(seen).double()
    assert torch.allclose(xtx[name], x.T @ x, rtol=1e-6, atol=1e-6)


def test_initialisations_repair_the_quantized_output(base):
    fp, q, w, xtx = base
    ids = batches(4, 32, seed=7)  # not the calibration batches
    ref = logits(fp, ids)
    gap = {"base": float((logits(q, ids) - ref).square().mean())}
    for kind in ("qwha", "loftq", "lora"):
        m = copy.deepcopy(q)
        apply_adapters(m, PeftConfig(kind, rank=4), fp_weights=w, xtx=xtx)
        gap[kind] = float((logits(m, ids) - ref).square().mean())
    assert gap["lora"] == pytest.approx(gap["base"], rel=1e-6)  # zero init = unrepaired
    assert gap["qwha"] < 0.8 * gap["base"] and gap["loftq"] < gap["base"]
    assert gap["qwha"] < gap["loftq"]


def test_qwha_needs_full_precision_weights_and_a_fitting_rank(base):
    _, q, w, _ = base
    with pytest.raises(ConfigError, match="full-precision"):
        apply_adapters(copy.deepcopy(q), PeftConfig("qwha", rank=4))
    with pytest.raises(ConfigError, match="exceeds"):
        apply_adapters(copy.deepcopy(q), PeftConfig("qwha", rank=64), fp_weights=w)
    with pytest.raises(ConfigError, match="unknown adapter"):
        PeftConfig("dora")


def test_merge_unmerge_restore_the_base_exactly(base):
    _, q, w, xtx = base
    m = copy.deepcopy(q)
    apply_adapters(m, PeftConfig("qwha", rank=4), fp_weights=w, xtx=xtx)
    ids = batches(2, 16, seed=3)
    codes = {n: lay.codes.clone() for n, lay in quant_layers(m).items()}
    with_adapter = logits(m, ids)
    errs = merge(m, "w8")  # re-quantize finely so merged ~ unmerged
    assert all(e < 1e-3 for e in errs.values())
    assert torch.allclose(logits(m, ids), with_adapter, atol=5e-2)
    unmerge(m)
    assert torch.equal(logits(m, ids), with_adapter)
    assert all(torch.equal(codes[n], lay.codes) for n, lay in quant_layers(m).items())


def test_merged_requantized_model_exports_like_any_other(base, tmp_path):
    _, q, w, xtx = base
    m = copy.deepcopy(q)
    apply_adapters(m, PeftConfig("loftq", rank=4), fp_weights=w, xtx=xtx)
    merge_and_requantize(m)
    schemes = {n: lay.scheme for n, lay in quant_layers(q).items()}
    assert not adapters_of(m) and all(lay.scheme == schemes[n] for n, lay in quant_layers(m).items())
    ids = batches(2, 16, seed=3)
    save(m, None, tmp_path / "ck")
    back, _ = load(tmp_path / "ck")
    assert torch.equal(logits(back, ids), logits(m, ids))


def test_adapter_save_load_and_fingerprint(base, tmp_path):
    fp, q, w, xtx = base
    m = copy.deepcopy(q)
    cfg = PeftConfig("qwha", rank=4)
    apply_adapters(m, cfg, fp_weights=w, xtx=xtx)
    with torch.no_grad():
        for a in adapters_of(m).values():
            a.values.mul_(1.5)
    ids = batches(2, 16, seed=3)
    save_adapters(m, tmp_path / "ad", cfg)
    fresh = copy.deepcopy(q)
    assert load_adapters(fresh, tmp_path / "ad") == cfg
    assert torch.equal(logits(fresh, ids), logits(m, ids))
    _, other, _ = quantized("w3g32")
    with pytest.raises(CheckpointError, match="different base"):
        load_adapters(other, tmp_path / "ad")
    (tmp_path / "ad" / "adapter.safetensors").write_bytes(b"broken")
    with pytest.raises(CheckpointError, match="checksum"):
        load_adapters(copy.deepcopy(q), tmp_path / "ad")


@pytest.mark.parametrize("kind", KINDS)
def test_training_moves_only_the_adapters(base, kind):
    _, q, w, xtx = base
    m = copy.deepcopy(q)
    apply_adapters(m, PeftConfig(kind, rank=4), fp_weights=w, xtx=xtx)
    frozen = {k: v.clone() for k, v in m.state_dict().items() if ".adapters." not in k}
    lr = 1e-3 if kind == "fourierft" else 1e-2
    result, timer = train_adapters(m, lm_rows(batches(16, 32)), TrainConfig(steps=6, batch_size=4, lr=lr,
                                                                             progress=False))
    assert result.losses[-1] < result.losses[0] and len(timer.times) == 6
    after = m.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in frozen.items())


def test_masked_loss_counts_only_answer_tokens():
    m = fp_model()
    ids = batches(2, 12)
    labels = ids.clone()
    labels[:, :7] = IGNORE
    got = masked_lm_loss(m, torch.stack((ids, labels), 1))
    lg = logits(m, ids)[:, 6:-1]
    ref = torch.nn.functional.cross_entropy(lg.reshape(-1, VOCAB), ids[:, 7:].reshape(-1))
    assert torch.allclose(got.detach(), ref, atol=1e-5)


def test_qwha_on_a_float_linear_base():
    fp = fp_model()
    w = linears(fp)
    m = copy.deepcopy(fp)
    name = "model.layers.0.mlp.down_proj"
    target = {name: w[name] + 0.01 * torch.randn_like(w[name])}
    apply_adapters(m, PeftConfig("qwha", rank=4, refine=False), fp_weights=target, names=[name])
    assert isinstance(m.get_submodule(name), torch.nn.Linear) and not isinstance(m.get_submodule(name), QuantLinear)
    ids = batches(2, 8)
    before = logits(m, ids)
    merge(m)
    assert torch.allclose(logits(m, ids), before, atol=1e-4)
