"""A quantized model evaluates with its weights packed: no float copy kept between forwards."""

from __future__ import annotations

import torch
from ptq_helpers import calib, tiny_model, uniform

from lowbit.nn import QuantLinear, quant_layers, replace_linears


def cached(model) -> list[str]:
    return [n for n, q in quant_layers(model).items() if q._cached is not None]


def test_eval_keeps_weights_packed_and_training_reuses_them():
    m = tiny_model(layers=1)
    replace_linears(m, uniform(m, "w4g32"))
    ids = calib(2, 16)
    m.eval()
    with torch.no_grad():
        a = m(ids).logits
    assert cached(m) == []  # dequantized per forward, dropped after it
    m.train()
    b = m(ids).logits
    assert len(cached(m)) == 7  # training keeps the frozen base's float weight between steps
    m.eval()
    assert cached(m) == []
    assert torch.equal(a, b.detach())


def test_forced_cache_setting_wins():
    q = QuantLinear.from_linear(torch.nn.Linear(64, 8), "w4g32")
    q.cache = True
    q.eval()(torch.randn(2, 64))
    assert q._cached is not None
    q.cache = False
    q.train()
    q._cached = None
    q(torch.randn(2, 64))
    assert q._cached is None


def test_loading_a_checkpoint_never_builds_float_linears(tmp_path, monkeypatch):
    """The architecture is built with parameters on meta; the quantized layers and the rest fill it."""
    from lowbit.files import native

    m = tiny_model(layers=2)
    replace_linears(m, uniform(m, "w2g32"))
    native.save(m, None, tmp_path / "ck")
    seen = {}
    real = native._empty_model

    def spy(path):
        model = real(path)
        seen["linear_devices"] = {mod.weight.device.type for mod in model.modules()
                                  if isinstance(mod, torch.nn.Linear)}
        return model

    monkeypatch.setattr(native, "_empty_model", spy)
    loaded, _ = native.load(tmp_path / "ck")
    assert seen["linear_devices"] == {"meta"}
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    ids = calib(2, 16)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, m.eval()(ids).logits)
