"""RTN with importance, AWQ and rotations block by block on a lazily loaded model: the whole-model path's results."""

import pytest
import torch
from ptq_helpers import calib, tiny_model, uniform
from test_ptq_pipeline import same_weights

from lowbit.errors import ConfigError
from lowbit.models.lazy import is_lazy, load_lazy
from lowbit.ptq import quantize_model
from lowbit.ptq.awq import AWQSettings
from lowbit.ptq.rotation import RotationSettings


def saved(tmp_path, tie: bool = False, layers: int = 3):
    m = tiny_model(layers=layers, hidden=64, inter=128)
    if tie:
        m.config.tie_word_embeddings = True
        m.lm_head.weight = m.model.embed_tokens.weight
    with torch.no_grad():  # norms that are not all ones: folding them into the readers must matter
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(len(n))) + 0.5)
    folder = tmp_path / "hf"
    m.save_pretrained(folder)
    return m, folder


def _pair(tmp_path, method, settings, tie=False, **kw):
    ref, folder = saved(tmp_path, tie=tie)
    plan, c = uniform(ref, "w4g32"), calib()
    quantize_model(ref, plan, method, settings, calib=c, progress=False, **kw)
    lazy = load_lazy(folder)
    assert is_lazy(lazy)
    read = []
    for b in lazy.model.layers:  # how many blocks hold float weights while one runs
        b.register_forward_pre_hook(lambda mod, *_: read.append(sum(
            1 for other in lazy.model.layers if other is not mod
            for p in other.parameters() if p.device.type != "meta" and p.dim() == 2 and p.dtype == torch.float32)))
    quantize_model(lazy, plan, method, settings, calib=c, progress=False, **kw)
    assert read and max(read) == 0
    return ref, lazy


def _same_model(ref, lazy):
    assert same_weights(ref, lazy)
    a, b = ref.state_dict(), lazy.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].float(), b[k].float()), k
    ids = calib(2, 16, seed=3)
    assert torch.equal(ref(ids).logits, lazy(ids).logits)


def test_rtn_with_importance_block_by_block_gives_the_whole_model_codes(tmp_path):
    """The searched scales come from the float model's statistics, which the walk collects block by block in the
    whole-model pass's batches of samples: the same codes and scales bit for bit."""
    ref, lazy = _pair(tmp_path, "rtn", {"search": True})
    _same_model(ref, lazy)


def test_rtn_importance_is_used_block_by_block(tmp_path):
    """Not a vacuous equality: with other calibration tokens the searched scales move."""
    ref, folder = saved(tmp_path)
    plan = uniform(ref, "w4g32")
    a, b = load_lazy(folder), load_lazy(folder)
    quantize_model(a, plan, "rtn", {"search": True}, calib=calib(), progress=False)
    quantize_model(b, plan, "rtn", {"search": True}, calib=calib(seed=7), progress=False)
    assert not same_weights(a, b)


@pytest.mark.parametrize("method,settings", [("rtn", {"search": True}), ("gptq", {"search": False})])
def test_awq_block_by_block_gives_the_whole_model_weights(tmp_path, method, settings):
    """AWQ's search and folds run on each block as the walk reads it, before the method's pass on that block:
    the folded weights, the codes and the logits are the whole-model path's."""
    ref, lazy = _pair(tmp_path, method, settings, awq=AWQSettings(grid=4, samples=4))
    _same_model(ref, lazy)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("method,settings", [("rtn", {"search": True}), ("gptq", {"search": False})])
def test_rotation_block_by_block_gives_the_whole_model_weights(tmp_path, method, settings, tie):
    """The tables are turned once before block 0 is captured, every block as it is read: the same rotated
    (untied) weights, codes and logits as rotating the whole float model first."""
    ref, lazy = _pair(tmp_path, method, settings, tie=tie, rotate=RotationSettings(online=("down_proj",)))
    _same_model(ref, lazy)
    assert lazy.lm_head.weight is not lazy.model.embed_tokens.weight


def test_rotation_and_awq_together_block_by_block(tmp_path):
    ref, lazy = _pair(tmp_path, "gptq", {"search": False}, rotate=RotationSettings(keep=4),
                      awq=AWQSettings(grid=4, samples=4))
    _same_model(ref, lazy)


def test_a_range_fallback_after_the_pre_steps_is_an_error_block_by_block(tmp_path, monkeypatch):
    """The whole-model path falls back for a layer its scales cannot hold; block by block the recorded plan cannot
    change half-way, so it stops with the layer's name instead of quantizing it with scales that do not hold."""
    from lowbit.formats.ranges import Fit
    from lowbit.ptq import block_prep

    _, folder = saved(tmp_path)
    lazy = load_lazy(folder)
    plan = uniform(lazy, "w4g32")
    target = "model.layers.1.mlp.down_proj"

    def fake_fit(w, scheme):
        return Fit(None, "too wide") if w.shape == (64, 128) and fake_fit.block == 1 else Fit(scheme)

    fake_fit.block = 0
    real_step = block_prep.PrepPass.step

    def step(self, i, block, saved):
        fake_fit.block = i
        return real_step(self, i, block, saved)

    monkeypatch.setattr(block_prep, "fit", fake_fit)
    monkeypatch.setattr(block_prep.PrepPass, "step", step)
    with pytest.raises(ConfigError, match=f"layer {target}: too wide"):
        quantize_model(lazy, plan, "rtn", {"search": True}, calib=calib(), progress=False,
                       rotate=RotationSettings())


def test_a_rotation_that_changes_the_function_is_refused_on_block_0(tmp_path, monkeypatch):
    """The whole-model path compares logits before and after rotating; block by block, block 0's output before and
    after its rotation is compared instead (recorded as probe_rel_diff), and a wrong rotation is an error."""
    from lowbit.errors import ModelError
    from lowbit.ptq import block_prep, rotation

    _, folder = saved(tmp_path)
    pre = {}

    def run(lazy):
        from lowbit.ptq.conductor import PtqSpec, conduct
        from lowbit.ptq.methods import RunContext

        out = conduct(lazy, uniform(lazy, "w4g32"), PtqSpec("rtn", {"search": True}, rotate=RotationSettings()),
                      RunContext(calib=calib(), progress=False))
        pre.update(out.prepared)

    run(load_lazy(folder))
    assert pre["rotation"]["probe_rel_diff"] < 1e-5 and pre["rotation"]["rotated_width"] == 64

    def no_fold(block, lay, rot):  # rotates without folding the norms first: not the same function
        for name in lay.readers:
            lin = block.get_submodule(name)
            lin.weight.copy_(rot.rows(lin.weight))

    monkeypatch.setattr(block_prep, "rotate_block", torch.no_grad()(no_fold))
    with pytest.raises(ModelError, match="no longer computes the same function .* on block 0"):
        run(load_lazy(folder))
    assert rotation.rotate_block is not no_fold


def test_a_bf16_checkpoint_rotated_block_by_block_keeps_its_head_narrow_until_the_end(tmp_path):
    """From a bf16 checkpoint (tied): the embedding is widened and turned before the capture and held in fp16 after it
    (its final values), the untied head stays a bf16 copy through the walk and is turned (then held in fp16) after
    it; the result is the whole-model path's on the same values."""
    from test_lazy import fresh_rotary

    m = tiny_model(layers=3)
    m.config.tie_word_embeddings = True
    m.lm_head.weight = m.model.embed_tokens.weight
    m.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    ref = m.float()
    fresh_rotary(ref)
    plan, c = uniform(ref, "w4g32"), calib()
    quantize_model(ref, plan, "rtn", {"search": True}, calib=c, progress=False, rotate=RotationSettings())
    lazy = load_lazy(tmp_path / "hf")
    heads = []
    for b in lazy.model.layers:
        b.register_forward_pre_hook(lambda *_: heads.append((lazy.model.embed_tokens.weight.dtype,
                                                             lazy.lm_head.weight.dtype)))
    quantize_model(lazy, plan, "rtn", {"search": True}, calib=c, progress=False, rotate=RotationSettings())
    captured = heads.index((torch.float16, torch.bfloat16))
    assert captured and set(heads[:captured]) == {(torch.float32, torch.bfloat16)}  # the capture's batches
    assert set(heads[captured:]) == {(torch.float16, torch.bfloat16)}  # the walk's forwards
    assert lazy.model.embed_tokens.weight.dtype == lazy.lm_head.weight.dtype == torch.float16
    _same_model(ref, lazy)
