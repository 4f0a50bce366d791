"""GPTQ's choice between searched and abs-max scales by the quantized model's calibration loss (`lowbit.ptq.gptq_choice`)."""

import copy

import pytest
import torch
from ptq_helpers import calib, tiny_model, uniform

import lowbit.ptq.gptq_choice as choice_mod
from lowbit.errors import ConfigError
from lowbit.ptq import quantize_model
from lowbit.ptq.gptq import GPTQSettings, gptq_quantize
from lowbit.ptq.gptq_choice import calibration_loss


def _quantized(model, settings: GPTQSettings, c: torch.Tensor, scheme: str):
    q = copy.deepcopy(model)
    plan, infos = gptq_quantize(q, uniform(model, scheme), settings, c, progress=False)
    return q, plan, infos


@pytest.mark.parametrize("seed, scheme", ((0, "w3g32"), (1, "w2g32"), (2, "w4g32")))
def test_the_rule_kept_never_has_a_larger_held_out_loss_than_the_other(seed, scheme):
    """Two folds: trial runs from one half of the windows, their loss on the other half; the model is then GPTQ'd from
    all windows with the rule of the lower total held-out loss; the plan and every block's info say which."""
    model, c = tiny_model(layers=2, seed=seed), calib(8, 32, seed=seed + 1)
    losses = {}
    for rule, settings in (("search", GPTQSettings()), ("absmax", GPTQSettings(search=False))):
        losses[rule] = sum(calibration_loss(_quantized(model, settings, fit, scheme)[0], test)
                           for fit, test in ((c[:4], c[4:]), (c[4:], c[:4]))) / 2
    best = min(losses, key=losses.__getitem__)
    full = _quantized(model, GPTQSettings(search=best == "search"), c, scheme)[0]
    chosen, plan, infos = _quantized(model, GPTQSettings(choose_rule=True), c, scheme)
    ids = calib(2, 32, seed=99)
    with torch.no_grad():
        assert torch.equal(chosen(ids).logits, full(ids).logits)
    assert {s.rule for s in plan.weights().values()} == {best}
    assert all(i["rule_absmax"] == (best == "absmax") for i in infos)
    assert all(i["rule_loss_search"] == pytest.approx(losses["search"], rel=1e-9)
               and i["rule_loss_absmax"] == pytest.approx(losses["absmax"], rel=1e-9) for i in infos)


@pytest.mark.parametrize("search_loss", (1.0, 3.0))
def test_either_model_can_be_kept_and_the_kept_one_is_what_the_model_computes(monkeypatch, search_loss):
    """Forced outcomes (the held-out losses of the searched trials 1 or 3, the abs-max trials' 2): the model in place is
    GPTQ'd from all windows with the kept rule, and its tied embeddings stay tied."""
    model, c = tiny_model(layers=1, seed=3), calib(4, 16)
    ids = calib(2, 16, seed=7)
    want = {"search": _quantized(model, GPTQSettings(), c, "w3g32")[0],
            "absmax": _quantized(model, GPTQSettings(search=False), c, "w3g32")[0]}
    losses = iter((search_loss, search_loss, 2.0, 2.0))
    monkeypatch.setattr(choice_mod, "calibration_loss", lambda *_a, **_k: next(losses))
    q, plan, _ = _quantized(model, GPTQSettings(choose_rule=True), c, "w3g32")
    kept = "search" if search_loss < 2.0 else "absmax"
    assert {s.rule for s in plan.weights().values()} == {kept}
    with torch.no_grad():
        assert torch.equal(q(ids).logits, want[kept](ids).logits)
    if model.config.tie_word_embeddings:
        assert q.lm_head.weight is q.model.embed_tokens.weight


def test_choose_rule_with_a_work_folder_is_refused_before_any_work(tmp_path):
    model = tiny_model(layers=1)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError, match="--choose-rule"):
        quantize_model(model, uniform(model, "w4g32"), "gptq", {"choose_rule": True}, calib=calib(2, 16),
                       workdir=str(tmp_path / "w"), progress=False)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not (tmp_path / "w").exists()


def test_choose_rule_needs_windows_to_hold_out():
    model = tiny_model(layers=1)
    with pytest.raises(ConfigError, match="at least 2"):
        gptq_quantize(model, uniform(model, "w4g32"), GPTQSettings(choose_rule=True), calib(1, 16), progress=False)


def test_choose_rule_without_the_search_is_refused():
    with pytest.raises(ConfigError, match="--no-search"):
        GPTQSettings(choose_rule=True, search=False)
