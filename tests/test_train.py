"""The shared training loop: schedule, data order, accumulation, resume, logs, errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lowbit.errors import ConfigError, DataError
from lowbit.train import Callback, TrainConfig, kd_loss, smooth, speedup, steps_to_reach, train
from lowbit.train.loop import batch_indices, lr_at


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
    return LlamaForCausalLM(cfg)


def tokens(n: int = 16, t: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


def cfg(**kw) -> TrainConfig:
    base = dict(steps=6, batch_size=4, lr=3e-3, warmup=2, progress=False)
    base.update(kw)
    return TrainConfig(**base)


def test_lr_schedule_warmup_then_cosine():
    c = TrainConfig(steps=11, lr=1.0, min_lr=0.1, warmup=3)
    lrs = [lr_at(s, c) for s in range(11)]
    assert lrs[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert lrs[3] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert lr_at(5, c) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 2 / 7)))  # cosine over 7 steps
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:], strict=False))


def test_batch_indices_cover_each_epoch_once_and_are_deterministic():
    n, b = 10, 4
    stream = torch.cat([batch_indices(n, b, s, seed=3) for s in range(5)])  # 20 = two epochs
    assert sorted(stream[:10].tolist()) == list(range(10))
    assert sorted(stream[10:].tolist()) == list(range(10))
    assert torch.equal(batch_indices(n, b, 2, 3), batch_indices(n, b, 2, 3))
    assert not torch.equal(batch_indices(n, b, 0, 3), batch_indices(n, b, 0, 4))


def test_training_reduces_loss_and_writes_logs(tmp_path):
    m = tiny_model()
    r = train(m, tokens(), cfg(steps=12, out_dir=str(tmp_path), eval_every=4),
              eval_fn=lambda model: {"val": 1.0})
    assert r.steps == 12 and len(r.losses) == 12
    assert sum(r.losses[-3:]) / 3 < sum(r.losses[:3]) / 3
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [d["step"] for d in lines if "loss" in d] == list(range(1, 13))
    assert [d["step"] for d in lines if "eval" in d] == [4, 8, 12]
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_gradient_accumulation_matches_one_big_batch():
    a = train(tiny_model(), tokens(), cfg(batch_size=4, grad_accum=1)).losses
    b = train(tiny_model(), tokens(), cfg(batch_size=4, grad_accum=4)).losses
    assert a == pytest.approx(b, abs=1e-5)


class Crash(Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_after_optimizer_step(self, state):
        if state.step == self.at:
            raise KeyboardInterrupt


def test_resume_is_bit_identical_to_uninterrupted(tmp_path):
    full = train(tiny_model(), tokens(), cfg(steps=8)).losses
    c = cfg(steps=8, out_dir=str(tmp_path), checkpoint_every=3)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_model(), tokens(), c, callbacks=[Crash(5)])  # checkpoint at 3, logged up to 5
    resumed = train(tiny_model(), tokens(), c)
    assert resumed.resumed_from == 3
    assert resumed.losses == full  # exact, not approx
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))  # no duplicated or lost step records


def test_resume_with_different_settings_is_refused(tmp_path):
    c = cfg(steps=8, out_dir=str(tmp_path), checkpoint_every=2)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_model(), tokens(), c, callbacks=[Crash(3)])
    with pytest.raises(ConfigError, match="lr"):
        train(tiny_model(), tokens(), cfg(steps=8, out_dir=str(tmp_path), checkpoint_every=2, lr=1e-3))
    with pytest.raises(ConfigError, match="extra.method"):
        train(tiny_model(), tokens(), c, extra={"method": "winq"})
    assert train(tiny_model(), tokens(), c, resume=False).resumed_from == 0


def test_bad_settings_are_clear_errors():
    with pytest.raises(ConfigError, match="warm-up"):
        TrainConfig(steps=10, warmup=10)
    with pytest.raises(ConfigError, match="grad_accum"):
        TrainConfig(steps=10, batch_size=6, grad_accum=4)
    with pytest.raises(ConfigError, match="out_dir"):
        TrainConfig(steps=10, checkpoint_every=2)
    with pytest.raises(DataError, match="batch_size"):
        train(tiny_model(), tokens(n=2), cfg(batch_size=4))
    with pytest.raises(ConfigError, match="nothing to train"):
        train(tiny_model(), tokens(), cfg(), trainable=lambda n, p: False)
    assert TrainConfig.from_dict(cfg().to_dict()) == cfg()


def test_trainable_filter_freezes_everything_else():
    m = tiny_model()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    train(m, tokens(), cfg(steps=2, warmup=0), trainable=lambda n, p: "mlp" in n)
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]) != ("mlp" in n), n


def test_bf16_autocast_trains():
    r = train(tiny_model(), tokens(), cfg(steps=3, dtype="bf16"))
    assert all(math.isfinite(x) for x in r.losses)


def test_kd_loss_is_zero_against_itself_and_positive_otherwise():
    student, batch = tiny_model(0), tokens(n=2)
    assert float(kd_loss(tiny_model(0))(student, batch).detach()) == pytest.approx(0.0, abs=1e-6)
    assert float(kd_loss(tiny_model(1))(student, batch).detach()) > 1e-4
    r = train(student, tokens(), cfg(steps=4), loss_fn=kd_loss(tiny_model(1)))
    assert r.losses[-1] < r.losses[0]


def test_smoothing_and_speedup_against_hand_computation():
    assert smooth([4.0, 2.0, 0.0, 2.0], window=2) == [4.0, 3.0, 1.0, 1.0]
    assert steps_to_reach([5, 4, 3, 2, 1], 2.5, window=1) == 4
    assert steps_to_reach([5, 4], 1.0, window=1) is None
    base = [10 - i for i in range(10)]  # reaches its final loss 1 at step 10
    fast = [10 - 2 * i for i in range(10)]  # reaches <= 1 at step 6 (value 0)
    s = speedup(base, fast, window=1)
    assert (s["baseline_steps"], s["other_steps"]) == (10, 6) and s["speedup"] == pytest.approx(10 / 6)
