"""Block-size study, its plot, and the `lowbit formats` command on a tiny random Llama."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lowbit.cli.formats import parse_blocks, parse_schemes
from lowbit.errors import ConfigError
from lowbit.formats import Scheme, qdq
from lowbit.studies import block_size_study, model_block_study, plot_study, verdicts, weight_error


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
    return LlamaForCausalLM(cfg).eval()


def test_weight_error_is_pooled_not_averaged():
    a, b = torch.randn(8, 64), torch.randn(8, 64) * 10
    s = Scheme.parse("nvfp4")
    num = float(((qdq(a, s) - a) ** 2).sum() + ((qdq(b, s) - b) ** 2).sum())
    den = float((a**2).sum() + (b**2).sum())
    assert weight_error({"a": a, "b": b}, s) == pytest.approx(num / den, rel=1e-6)


def test_study_rows_and_verdicts():
    g = torch.Generator().manual_seed(0)
    w = {"x": torch.randn(64, 256, generator=g) * torch.exp(torch.randn(64, 256, generator=g))}
    rows = block_size_study(w, ["nvfp4-46", "nvfp4-46:rule=brute"], [8, 16, 64], progress=False)
    assert [(r.label, r.block) for r in rows] == [(lab, b) for lab in ("nvfp4-46", "nvfp4-46:rule=brute")
                                                  for b in (8, 16, 64)]
    assert rows[0].scheme == "nvfp4-46:block=8" and rows[0].rule == "4over6"
    by = {(r.label, r.block): r.rel_error for r in rows}
    for b in (8, 16, 64):
        assert by[("nvfp4-46:rule=brute", b)] <= by[("nvfp4-46", b)]
    v = verdicts(rows)
    assert v["nvfp4-46:rule=brute"]["finer_is_better"]  # heavy-tailed data: finer blocks win


def test_model_study_restores_weights_and_measures_ppl(tiny, tmp_path):
    before = {n: p.detach().clone() for n, p in tiny.named_parameters()}
    tokens = torch.randint(0, 256, (1, 4 * 32 + 1), generator=torch.Generator().manual_seed(1))
    rows, fp = model_block_study(tiny, ["nvfp4", "nvfp4-46"], [8, 32], tokens, seqlen=32, windows=4,
                                 progress=False)
    assert fp is not None and all(r.ppl is not None and r.ppl > 1 for r in rows)
    for n, p in tiny.named_parameters():
        assert torch.equal(p, before[n]), n
    out = plot_study(rows, tmp_path / "study.png", "ppl", fp_ppl=fp)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parse_cli_lists():
    assert parse_schemes("nvfp4,nvfp4:guard=1,block=8;mxfp4") == ["nvfp4", "nvfp4:guard=1,block=8", "mxfp4"]
    from lowbit.api import FormatsJob

    assert FormatsJob(("nvfp4",), parse_blocks("32,8,16,8")).blocks == (8, 16, 32)
    with pytest.raises(ConfigError):
        FormatsJob(("nvfp4",), parse_blocks("2,8"))
    with pytest.raises(ConfigError):
        parse_blocks("eight")


def test_cli_formats_json(tiny, tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from lowbit.cli import main

    monkeypatch.setattr("lowbit.models.load_model",
                        lambda src=None, **k: SimpleNamespace(model=tiny, tokenizer=None, source="tiny"))
    plot = tmp_path / "f.png"
    rc = main(["formats", "--schemes", "nvfp4,nvfp4-46:rule=span", "--block-sizes", "8,16",
               "--plot", str(plot), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["rows"]) == 4 and out["plot"] == str(plot) and plot.exists()
    assert set(out["verdict_error"]) == {"nvfp4", "nvfp4-46:rule=span"}
    rc = main(["formats", "--schemes", "nvfp5"])
    assert rc != 0 and "unknown scheme" in capsys.readouterr().err


@pytest.mark.slow
def test_bundled_model_one_point():
    from lowbit.models import linear_layers, load_model

    model = load_model().model
    w = {n: m.weight.detach() for n, m in list(linear_layers(model).items())[:7]}  # first block
    rows = block_size_study(w, ["nvfp4", "nvfp4-46"], [16], progress=False)
    assert rows[1].rel_error < rows[0].rel_error < 0.02
