"""Lazy loading: blocks stay in the checkpoint until the pipeline reaches them, same result."""

import json

import pytest
import torch
from ptq_helpers import block_names, calib, tiny_model, uniform
from test_ptq_pipeline import pinned_file_maps, same_weights

from lowbit.errors import ModelError
from lowbit.models.finite import refuse_nonfinite
from lowbit.models.lazy import ShardSource, is_lazy, load_lazy, materialize
from lowbit.nn import quant_layers
from lowbit.plans.plan import Plan
from lowbit.ptq import quantize_model


def saved(tmp_path, tie: bool = True, shard: str | None = None, dtype=torch.float32, layers: int = 3):
    m = tiny_model(layers=layers)  # untied by default
    if tie:
        m.config.tie_word_embeddings = True
        m.lm_head.weight = m.model.embed_tokens.weight
    folder = tmp_path / "hf"
    m.to(dtype).save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return m.float(), folder


def meta_names(model) -> set[str]:
    return {n for n, t in model.state_dict().items() if t.device.type == "meta"}


@pytest.mark.parametrize("tie", [True, False])
def test_only_the_blocks_stay_on_disk_and_materialize_gives_the_saved_model(tmp_path, tie):
    ref, folder = saved(tmp_path, tie=tie, shard="40KB")
    assert (folder / "model.safetensors.index.json").is_file()  # several shards
    lazy = load_lazy(folder)
    assert is_lazy(lazy)
    off = meta_names(lazy)
    assert off and all(n.startswith("model.layers.") for n in off)
    assert {n for n in ref.state_dict() if n.startswith("model.layers.")} == off
    assert (lazy.lm_head.weight is lazy.model.embed_tokens.weight) == tie
    materialize(lazy)
    assert not is_lazy(lazy) and not meta_names(lazy)
    for n, t in ref.state_dict().items():
        assert torch.equal(lazy.state_dict()[n], t), n
    ids = calib(2, 16, seed=3)
    assert torch.equal(lazy(ids).logits, ref(ids).logits)


def fresh_rotary(ref) -> None:
    """The round trip through bf16 also rounded the rotary frequencies, which a loaded model computes in fp32."""
    rotary = tiny_model(layers=3).model.rotary_emb
    for name, buf in rotary.named_buffers():
        setattr(ref.model.rotary_emb, name, buf.clone())


SETTINGS = {"signround": {"iters": 3, "batch_size": 4}, "signround2": {"iters": 3, "batch_size": 4},
            "gptq": {"search": False}}


@pytest.mark.parametrize("method", ["signround", "signround2", "gptq"])
def test_lazy_blockwise_ptq_equals_the_in_memory_run(tmp_path, method):
    ref, folder = saved(tmp_path, tie=False, dtype=torch.bfloat16)  # bf16 on disk, fp32 in memory, as from the hub
    # the two runs only stayed identical while 3 iterations at lr 1/3 never improved on the start (issue 38)
    fresh_rotary(ref)
    plan, c = uniform(ref, "w4g32"), calib()
    quantize_model(ref, plan, method, SETTINGS[method], calib=c, progress=False)
    lazy = load_lazy(folder)
    seen, tables = [], []
    for b in lazy.model.layers:
        b.register_forward_pre_hook(lambda mod, *_: seen.append(sum(
            1 for other in lazy.model.layers for p in other.parameters() if p.device.type != "meta"
            and other is not mod and p.dim() == 2 and p.dtype == torch.float32)))
        b.register_forward_pre_hook(lambda *_: tables.append((lazy.model.embed_tokens.weight.dtype,
                                                              lazy.lm_head.weight.dtype)))
    quantize_model(lazy, plan, method, SETTINGS[method], calib=c, progress=False)
    assert not is_lazy(lazy)
    assert same_weights(ref, lazy)
    # while a block ran, no other block held float matrices (finished ones hold codes only)
    assert seen and max(seen) == 0
    assert not pinned_file_maps(lazy, folder)
    # the float tables stayed in the checkpoint's bf16 throughout, with the values the fp32 run keeps (fp16 ones)
    assert set(tables) == {(torch.bfloat16, torch.bfloat16)}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        got, want = lazy.state_dict()[name], ref.state_dict()[name]
        assert got.dtype == torch.bfloat16 and torch.equal(got.float(), want), name
    ids = calib(2, 16, seed=3)
    assert torch.equal(lazy(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("tie", [True, False])
def test_float_tables_stay_in_the_checkpoint_dtype_and_compute_in_float32(tmp_path, tie):
    ref, folder = saved(tmp_path, tie=tie, dtype=torch.bfloat16)
    fresh_rotary(ref)
    lazy = load_lazy(folder)
    emb, head = lazy.model.embed_tokens.weight, lazy.lm_head.weight
    assert emb.dtype == head.dtype == torch.bfloat16 and (head is emb) == tie
    assert lazy.model.norm.weight.dtype == torch.float32  # small tensors as before
    materialize(lazy, widen_tables=False)  # the blocks in (fp32), the tables as stored
    assert lazy.model.embed_tokens.weight.dtype == torch.bfloat16
    assert lazy.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    ids = calib(2, 16, seed=3)
    out = lazy(ids).logits
    assert out.dtype == torch.float32 and torch.equal(out, ref(ids).logits)
    whole = load_lazy(folder)
    materialize(whole)  # whole-model methods get float32 tables, still tied where they were
    emb, head = whole.model.embed_tokens.weight, whole.lm_head.weight
    assert emb.dtype == head.dtype == torch.float32 and (head is emb) == tie
    assert torch.equal(whole(ids).logits, ref(ids).logits)


def test_a_planned_lm_head_is_rounded_from_its_float32_values(tmp_path):
    ref, folder = saved(tmp_path, tie=False, dtype=torch.bfloat16)
    fresh_rotary(ref)
    plan, c = Plan.uniform([*block_names(ref), "lm_head"], "w4g32"), calib()
    quantize_model(ref, plan, "gptq", {"search": False}, calib=c, progress=False)
    lazy = load_lazy(folder)
    quantize_model(lazy, plan, "gptq", {"search": False}, calib=c, progress=False)
    assert "lm_head" in quant_layers(lazy) and same_weights(ref, lazy)
    assert lazy.model.embed_tokens.weight.dtype == torch.bfloat16


def _poison(folder, name: str) -> None:
    from safetensors.torch import load_file, save_file

    index = folder / "model.safetensors.index.json"
    file = folder / json.loads(index.read_text())["weight_map"][name]
    w = load_file(file)
    w[name].view(-1)[5] = float("nan")
    save_file(w, file, metadata={"format": "pt"})


@pytest.mark.parametrize("name, stored", [
    ("model.layers.1.post_attention_layernorm.weight", 1),  # read with its block: the walk stops at block 1
    ("model.layers.1.mlp.down_proj.weight", 0),  # a planned weight: read by the range fit before block 0
])
def test_finite_weights_are_checked_as_they_are_read_not_in_a_pass_of_their_own(tmp_path, monkeypatch, name, stored):
    """Loading reads no block (each tensor is checked for NaN / inf when it is read), and a non-finite tensor of
    block 1 stops the run naming it, before block 1's result is stored."""
    ref, folder = saved(tmp_path, tie=False, shard="40KB")
    read = []
    real = ShardSource.read
    monkeypatch.setattr(ShardSource, "read", lambda self, names, *a, **k: read.extend(names) or real(self, names, *a,
                                                                                                     **k))
    refuse_nonfinite(load_lazy(folder), "m")  # what load_model runs after loading
    assert read and not [n for n in read if n.startswith("model.layers.")]
    _poison(folder, name)
    lazy = load_lazy(folder)
    refuse_nonfinite(lazy, "m")  # block 1 is not read yet
    work = tmp_path / "work"
    with pytest.raises(ModelError, match=rf"{name} holds 1 NaN/inf.*finite weights"):
        quantize_model(lazy, uniform(ref, "w4g32"), "gptq", {"search": False}, calib=calib(), workdir=str(work),
                       progress=False)
    assert sorted(p.name for p in work.rglob("block_*.safetensors")) == [f"block_{i:04d}.safetensors"
                                                                         for i in range(stored)]
