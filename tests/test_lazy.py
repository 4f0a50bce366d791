"""Lazy loading: blocks stay in the checkpoint until the pipeline reaches them, same result."""

import json

import pytest
import torch
from ptq_helpers import calib, tiny_model, uniform
from test_ptq_pipeline import pinned_file_maps, same_weights

from lowbit.errors import ModelError
from lowbit.models.lazy import is_lazy, load_lazy, materialize
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


@pytest.mark.parametrize("method", ["signround", "signround2"])
def test_lazy_blockwise_ptq_equals_the_in_memory_run(tmp_path, method):
    ref, folder = saved(tmp_path, dtype=torch.bfloat16)  # bf16 on disk, fp32 in memory, as from the hub
    # the round trip through bf16 also rounded the rotary frequencies, which a loaded model computes in fp32:
    # the two runs only stayed identical while 3 iterations at lr 1/3 never improved on the start (issue 38)
    rotary = tiny_model(layers=3).model.rotary_emb
    for name, buf in rotary.named_buffers():
        setattr(ref.model.rotary_emb, name, buf.clone())
    plan, c = uniform(ref, "w4g32"), calib()
    quantize_model(ref, plan, method, {"iters": 3, "batch_size": 4}, calib=c, progress=False)
    lazy = load_lazy(folder)
    seen = []
    for b in lazy.model.layers:
        b.register_forward_pre_hook(lambda mod, *_: seen.append(sum(
            1 for other in lazy.model.layers for p in other.parameters() if p.device.type != "meta"
            and other is not mod and p.dim() == 2 and p.dtype == torch.float32)))
    quantize_model(lazy, plan, method, {"iters": 3, "batch_size": 4}, calib=c, progress=False)
    assert not is_lazy(lazy)
    assert same_weights(ref, lazy)
    # while a block ran, no other block held float matrices (finished ones hold codes only)
    assert seen and max(seen) == 0
    assert not pinned_file_maps(lazy, folder)


def test_methods_that_need_the_whole_model_load_it_first(tmp_path):
    ref, folder = saved(tmp_path)
    plan = uniform(ref, "w4g32")
    quantize_model(ref, plan, "rtn", {"search": False}, progress=False)
    lazy = load_lazy(folder)
    quantize_model(lazy, plan, "rtn", {"search": False}, progress=False)
    assert not is_lazy(lazy) and same_weights(ref, lazy)


def test_unreadable_checkpoints_are_clear_errors(tmp_path):
    _, folder = saved(tmp_path)
    (folder / "model.safetensors").rename(folder / "weights.bin")
    with pytest.raises(ModelError, match="no model.safetensors.*drop --offload-dir"):
        load_lazy(folder)
    _, folder = saved(tmp_path / "b", shard="40KB")
    index = folder / "model.safetensors.index.json"
    d = json.loads(index.read_text())
    d["weight_map"] = {k.replace("layers.1.", "layer.1."): v for k, v in d["weight_map"].items()}
    index.write_text(json.dumps(d))
    lazy = load_lazy(folder)  # block 1 is only read when reached
    with pytest.raises(ModelError, match="no tensor 'model.layers.1.*drop --offload-dir"):
        materialize(lazy)
