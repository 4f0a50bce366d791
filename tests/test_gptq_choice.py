"""GPTQ's per-matrix choice between searched and abs-max scales, by the block's output error (`lowbit.ptq.gptq_choice`)."""

import pytest
import torch
from torch import nn

from lowbit.formats import Scheme
from lowbit.ptq.blockwise import BlockJob
from lowbit.ptq.gptq import GPTQSettings, GPTQTuner
from lowbit.ptq.gptq_choice import BlockProbe, plain

SEARCH = Scheme.parse("w3g32").replace(rule="search")


class ExpBlock(nn.Module):
    """A Linear under ``exp``: the block's output weighs the error at large pre-activations more than the Linear's
    output error does, so the rule with the lower matrix error is not always the one with the lower block error."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        self.lin.weight.data = w.clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.lin(x))


def _case(seed: int) -> tuple[ExpBlock, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 64, generator=g) * 0.15
    w[:, ::32] *= 4  # one large weight per group of 32: clipped by the search, kept by abs-max
    return ExpBlock(w), torch.randn(8, 32, 64, generator=g)


def _gptq(block: ExpBlock, x: torch.Tensor, scheme: Scheme, settings: GPTQSettings):
    qts, info = GPTQTuner(settings)(BlockJob(0, block, {"b.lin": ("lin", scheme)}, x, None, {}, None))
    q = qts["b.lin"]
    with torch.no_grad():
        got = torch.exp(x @ q.dequantize().T)
        err = float((got - block(x)).pow(2).sum())
    return q, err, info


def test_the_chosen_rule_never_has_a_larger_block_error_than_either_rule():
    """On each constructed block GPTQ keeps the rule with the lower block output error: its codes are that run's, its
    error the smaller of the two; over the cases both rules get chosen (the criterion is not a fixed rule)."""
    picked = set()
    for seed in range(6):
        block, x = _case(seed)
        qs, err_search, _ = _gptq(block, x, SEARCH, GPTQSettings(choose_scales=False))
        qa, err_absmax, _ = _gptq(block, x, SEARCH.replace(rule="absmax"), GPTQSettings(search=False))
        q, err, info = _gptq(block, x, SEARCH, GPTQSettings())
        assert err == min(err_search, err_absmax), (seed, err, err_search, err_absmax)
        winner = qa if err_absmax < err_search else qs
        assert torch.equal(q.codes, winner.codes) and torch.equal(q.scales, winner.scales)
        assert q.scheme == SEARCH  # the plan's rule is what the layer records
        assert info["scale_choices"] == 1 and info["scale_absmax"] == (err_absmax < err_search)
        picked.add(err_absmax < err_search)
    assert picked == {True, False}


def test_no_choice_without_the_search_or_with_it_turned_off():
    block, x = _case(2)
    for settings in (GPTQSettings(search=False), GPTQSettings(choose_scales=False)):
        scheme = SEARCH if settings.search else SEARCH.replace(rule="absmax")
        _, _, info = _gptq(block, x, scheme, settings)
        assert "scale_choices" not in info


def test_probe_installs_the_best_candidate_and_counts_it():
    lin = nn.Linear(4, 4, bias=False)
    target = lin.weight.detach().clone()
    probe = BlockProbe(lin, torch.randn(6, 4), {}, 2)  # float targets: the current weights' outputs
    cands = [target + 0.5, target + 0.1, target - 0.3]

    def install(i: int) -> None:
        lin.weight.data = cands[i].clone()

    assert probe.choose(install, 3) == 1
    assert torch.equal(lin.weight, cands[1])
    assert probe.info() == {"scale_choices": 1.0, "scale_absmax": 1.0}


@pytest.mark.parametrize("rule, alt", (("search", "absmax"), ("absmax", None), ("4over6", None)))
def test_plain_alternative_only_for_searched_schemes(rule, alt):
    s = Scheme.parse("nvfp4").replace(rule=rule)
    assert (plain(s) is None) if alt is None else plain(s) == s.replace(rule=alt)
