"""The pipeline's activation caches, the tuned block's attention, and a loop that never waits on the host."""

from __future__ import annotations

import copy

import pytest
import torch
from ptq_helpers import calib, tiny_model, uniform

from lowbit.errors import ConfigError
from lowbit.nn import quant_layers
from lowbit.ptq.blockwise import PipelineOptions, quantize_blockwise
from lowbit.ptq.methods import RunContext
from lowbit.ptq.signround import SignRoundTuner, make_config


class Recording(SignRoundTuner):
    """SignRound that records what each block's job looked like."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.seen: list[tuple[torch.dtype, torch.dtype, torch.device]] = []

    def __call__(self, job):
        self.seen.append((job.x.dtype, job.y.dtype, job.x.device))
        return super().__call__(job)


def run(model, cache_dtype: str, fp_inputs: bool = False, iters: int = 4):
    cfg = make_config(iters=iters, batch_size=4, v2=True, tune_dtype="fp32", fp_inputs=fp_inputs)
    tuner = Recording(cfg)
    infos = quantize_blockwise(model, uniform(model, "w4g32"), tuner, {"config": cfg.to_dict()},
                               RunContext(calib=calib(), progress=False),
                               PipelineOptions(chunk=4, cache_dtype=cache_dtype, fp_inputs=fp_inputs))
    return infos, tuner.seen


@pytest.mark.parametrize("fp_inputs", [False, True])
def test_bf16_caches_store_bf16_and_tune_like_fp32(fp_inputs):
    m32, m16 = tiny_model(layers=2), tiny_model(layers=2)
    i32, seen32 = run(m32, "fp32", fp_inputs)
    i16, seen16 = run(m16, "bf16", fp_inputs)
    assert {s[:2] for s in seen32} == {(torch.float32, torch.float32)}
    assert {s[:2] for s in seen16} == {(torch.bfloat16, torch.bfloat16)}
    for a, b in zip(i16, i32, strict=True):
        assert a["loss"] <= a["rtn_loss"]
        # full-set block losses of two tuning runs whose inputs differ by bf16 rounding
        assert a["loss"] == pytest.approx(b["loss"], rel=0.1)
    q32, q16 = quant_layers(m32), quant_layers(m16)
    same = sum((q32[n].codes == q16[n].codes).sum().item() for n in q32)
    assert same / sum(q.codes.numel() for q in q32.values()) > 0.9


def test_in_place_caches_hold_exactly_the_block_outputs():
    """Targets and quantized inputs, written in place, equal the block outputs computed afresh."""
    from lowbit.models.layers import decoder_blocks
    from lowbit.ptq.blockwise import capture_inputs, run_block

    class Keep(SignRoundTuner):
        def __init__(self, cfg) -> None:
            super().__init__(cfg)
            self.jobs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def __call__(self, job):
            self.jobs.append((job.x.clone(), job.y.clone()))
            return super().__call__(job)

    m = tiny_model(layers=2)
    fp = copy.deepcopy(m)
    cfg = make_config(iters=2, batch_size=4, v2=True, tune_dtype="fp32")
    keep = Keep(cfg)
    quantize_blockwise(m, uniform(m, "w4g32"), keep, {}, RunContext(calib=calib(), progress=False),
                       PipelineOptions(chunk=4))
    x0, kw = capture_inputs(fp, decoder_blocks(fp)[0], calib(), torch.device("cpu"))
    with torch.no_grad():
        y0 = run_block(decoder_blocks(fp)[0], x0, kw, 4)
        y1 = run_block(decoder_blocks(fp)[1], y0, kw, 4)
        xq1 = run_block(decoder_blocks(m)[0], x0, kw, 4)  # block 0 is quantized now
    assert torch.equal(keep.jobs[0][0], x0) and torch.equal(keep.jobs[0][1], y0)
    assert torch.equal(keep.jobs[1][0], xq1) and torch.equal(keep.jobs[1][1], y1)


def test_unknown_cache_settings_are_errors():
    with pytest.raises(ConfigError, match="cache dtype"):
        PipelineOptions(cache_dtype="fp16")
    m = tiny_model(layers=1)
    with pytest.raises(ConfigError, match="--cache-device"):
        quantize_blockwise(m, uniform(m, "w4g32"), SignRoundTuner(make_config(iters=0)), {},
                           RunContext(calib=calib(), cache_device="gpu", progress=False))
    with pytest.raises(ConfigError, match="cache_dtype"):
        make_config(cache_dtype="int8")


HOST_READS = ("__bool__", "__float__", "__int__", "__index__", "item", "tolist", "numpy", "cpu")


def count_host_reads(monkeypatch, iters: int) -> int:
    """Tensor -> Python reads while SignRound tunes one block (each is a host sync on a GPU)."""
    from lowbit.ptq import signround

    calls = {"n": 0}
    real_tune = signround.SignRoundTuner._tune

    def counting_tune(self, job, rounders):
        with monkeypatch.context() as mp:
            for name in HOST_READS:
                orig = getattr(torch.Tensor, name)

                def wrapped(t, *a, _orig=orig, **k):
                    calls["n"] += 1
                    return _orig(t, *a, **k)

                mp.setattr(torch.Tensor, name, wrapped)
            return real_tune(self, job, rounders)

    monkeypatch.setattr(signround.SignRoundTuner, "_tune", counting_tune)
    run(tiny_model(layers=1), "bf16", iters=iters)
    monkeypatch.undo()
    return calls["n"]


def test_the_iteration_loop_never_reads_back_to_the_host(monkeypatch):
    """The host reads the same few values whether the loop runs 2 or 7 steps: none per step."""
    few, many = count_host_reads(monkeypatch, 2), count_host_reads(monkeypatch, 7)
    assert few == many
    assert 2 <= few <= 4  # the two losses reported at the end (the patch does see them)


def test_expanded_kv_attention_equals_grouped_sdpa(monkeypatch):
    """The fp32-on-GPU path (KV heads repeated, plain SDPA) gives transformers' sdpa output."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lowbit.models import attention

    m = tiny_model(layers=1)
    mod = m.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 2, 16, 16, generator=g), torch.randn(
        2, 2, 16, 16, generator=g)
    ref, _ = sdpa_attention_forward(mod, q, k, v, None, scaling=0.25)
    monkeypatch.setattr(attention, "needs_expanded_kv", lambda *_: True)
    got, _ = attention.block_attention(mod, q, k, v, None, scaling=0.25)
    assert torch.allclose(got, ref, atol=1e-6)


def test_tuning_attention_swaps_sdpa_and_restores_it():
    from lowbit.models.attention import NAME, tuning_attention

    m = tiny_model(layers=1)
    assert m.config._attn_implementation == "sdpa"
    with tuning_attention(m):
        assert m.config._attn_implementation == NAME
        ids = calib(2, 8)
        with torch.no_grad():
            out = m(ids).logits
    assert m.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert torch.equal(out, m(ids).logits)
    m.config._attn_implementation = "eager"
    with tuning_attention(m):
        assert m.config._attn_implementation == "eager"  # only sdpa is swapped


@pytest.mark.parametrize("method", ["gptq", "signround", "signround2"])
def test_cache_device_cpu_reaches_the_engine_for_every_blockwise_method(monkeypatch, method):
    """``--cache-device cpu`` puts the caches in host memory for every block-wise method (GPTQ dropped it once).

    The compute device is made to read as one that is not the host, and the capture is
    stopped as soon as the engine asks where the cache goes.
    """
    from lowbit.ptq import quantize_model
    from lowbit.ptq.blockwise import loop

    class Stop(Exception):
        pass

    seen = []

    def capture(model, block0, calib, device, dtype=None, where=None, shard=None):
        seen.append((device, where))
        raise Stop

    monkeypatch.setattr(loop, "check_device", lambda _d: torch.device("meta"))
    monkeypatch.setattr(loop, "capture_inputs", capture)
    m = tiny_model(layers=1)
    settings = {"iters": 0} if method.startswith("signround") else None
    with pytest.raises(Stop):
        quantize_model(m, uniform(m, "w4g32"), method, settings, calib=calib(), cache_device="cpu", progress=False)
    assert seen == [(torch.device("meta"), torch.device("cpu"))]
