"""The benchmarks' off-grid model: a Haar rotation of the residual stream takes weights off their 4-bit grid
and leaves the function as it was (on a tiny Llama whose weights sit on a Q4_1-like grid, as the bundled
model's do; benchmarks/results/offgrid.json records the same check on the bundled model)."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import common
from benchmarks.offgrid import grid_stats
from lowbit.errors import ModelError


def _on_grid(model) -> None:
    """Every weight of ``model`` on an asymmetric 4-bit group-32 grid, like a dequantized Q4_1 GGUF."""
    from lowbit.formats import quantize

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(quantize(p, "w4g32a").dequantize())
            elif "norm" in name:  # trained norms are not all ones: the folding step must matter
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(1)) + 0.5)


@pytest.fixture(scope="module")
def on_grid_dir(tmp_path_factory, tiny_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("ongrid") / "llama"
    torch.manual_seed(0)  # 128 wide, so groups of 128 fit; tied, like SmolLM2
    model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tiny_tokenizer),
                                         tie_word_embeddings=True)).eval()
    _on_grid(model)
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def _ppl(path, windows=3):
    from lowbit.data import eval_tokens
    from lowbit.eval import perplexity
    from lowbit.models import load_model

    lm = load_model(str(path))
    return lm, perplexity(lm.model, eval_tokens(lm.tokenizer), seqlen=64, windows=windows, progress=False).ppl


def test_offgrid_copy_keeps_the_function_and_leaves_every_grid(on_grid_dir, tmp_path):
    folder = common.offgrid_folder(on_grid_dir, seed=0, cache=tmp_path)
    src, ppl_src = _ppl(on_grid_dir)
    off, ppl_off = _ppl(folder)
    assert abs(ppl_off / ppl_src - 1) < 1e-3
    before, after = grid_stats(src.model), grid_stats(off.model)
    # the source: every 32-column group holds <= 16 values and asymmetric g32 RTN reproduces it
    assert before["share_on_a_4bit_grid"] == 1.0 and before["min_rtn_rel_error"]["w4g32a"] < 1e-6
    # the copy: no group could come from any 4-bit quantizer with groups of 32 / 64 / 128
    assert after["groups_at_most_16_values"] == 0
    assert min(after["min_rtn_rel_error"].values()) > 0.02
    # the tied head was untied (its weight is E diag(final norm) R), the norms folded to ones
    assert off.model.config.tie_word_embeddings is False
    assert off.model.lm_head.weight.data_ptr() != off.model.model.embed_tokens.weight.data_ptr()
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in off.model.named_parameters() if "norm" in n)
    info = common.offgrid_info(folder)
    assert info["untied_head"] is True and info["rotation"]["kind"] == "haar" and info["seed"] == 0
    assert info["reload_rel_logit_diff"] < 1e-5 and len(info["sha256"]) == 64


def test_offgrid_copy_is_made_once_and_remade_when_damaged(on_grid_dir, tmp_path):
    folder = common.offgrid_folder(on_grid_dir, seed=1, cache=tmp_path)
    weights = folder / "model.safetensors"
    stamp, digest = os.stat(weights).st_mtime_ns, common.offgrid_info(folder)["sha256"]
    assert common.offgrid_folder(on_grid_dir, seed=1, cache=tmp_path) == folder
    assert os.stat(weights).st_mtime_ns == stamp  # reused, not rewritten
    other = common.offgrid_folder(on_grid_dir, seed=2, cache=tmp_path)  # another seed: another copy
    assert other != folder and common.offgrid_info(other)["sha256"] != digest
    with open(weights, "r+b") as f:  # a damaged copy no longer matches its recorded digest
        f.seek(os.path.getsize(weights) - 8)
        f.write(b"\x00" * 8)
    assert common.offgrid_folder(on_grid_dir, seed=1, cache=tmp_path) == folder
    assert common.offgrid_info(folder)["sha256"] == digest  # made again, the same bytes (seeded)


def test_offgrid_copy_of_an_architecture_lowbit_cannot_rotate_is_refused_by_name(tmp_path, capsys, monkeypatch):
    from transformers import GemmaConfig, GemmaForCausalLM

    from benchmarks import offgrid

    src = tmp_path / "gemma"
    GemmaForCausalLM(GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, vocab_size=256)).save_pretrained(src)
    with pytest.raises(ModelError, match=r"an off-grid copy .*GemmaDecoderLayer .*GemmaRMSNorm"):
        common.offgrid_folder(src, cache=tmp_path / "cache")
    assert not any(p.name.startswith("gemma-haar") for p in (tmp_path / "cache").iterdir())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the script's default cache, kept out of $HOME
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # the script: one line, exit code 2, nothing written
        offgrid.main(["--source", str(src), "--windows", "1", "--out", str(tmp_path / "r.json")])
    assert e.value.code == 2 and not (tmp_path / "r.json").exists()
    last = capsys.readouterr().err.strip().splitlines()[-1]  # (above it: transformers' loading bar)
    assert last.startswith("error: an off-grid copy") and "GemmaDecoderLayer" in last


def test_rows_on_the_offgrid_model_do_not_replace_the_bundled_ones(tmp_path):
    """Every script keys its rows by model too; rows written before the option count as the bundled model's."""
    from benchmarks import acts, gguf, ptq, ptq_methods

    for mod, row in ((ptq, {"config": "w4g128", "tool": "lowbit"}), (ptq_methods, {"row": "w4g64/gptq"}),
                     (acts, {"row": "fp"}), (gguf, {"mix": "q4_k_m", "method": "rtn", "seed": None})):
        out = tmp_path / f"{mod.__name__}.json"
        key = getattr(mod, "key", None) or mod._key
        common.merge_row(out, dict(row, ppl=1.0), key)  # an older row: no model field
        common.merge_row(out, dict(row, ppl=2.0, model="offgrid"), key)
        common.merge_row(out, dict(row, ppl=3.0, model="bundled"), key)  # replaces the older bundled row
        assert sorted(r["ppl"] for r in common.load_results(out)["rows"]) == [2.0, 3.0], mod.__name__
    assert "offgrid" in ptq.parser().parse_args(["--model", "offgrid"]).model


def test_headline_gguf_rows_keep_files_of_one_embedding_type_apart():
    """gguf rows at llama.cpp's embedding types (issue 39) are other files: the F16-table headline row takes
    neither their perplexity into its mean nor them as a second run; rows before the field are F16."""
    from benchmarks.offgrid import headline

    row = {"mix": "q4_k_m", "method": "gptq", "seed": None, "nsamples": 16}
    results = {"gguf": [dict(row, ppl_llamacpp=15.0), dict(row, ppl_llamacpp=14.0, embeddings="llama.cpp")]}
    line = next(x for x in headline(results).splitlines() if x.startswith("| GGUF Q4_K_M, GPTQ"))
    assert "| 15.00 |" in line and "runs" not in line and "14.50" not in line


def test_headline_rows_record_means_runs_and_seed_kind():
    """The recorded headline (offgrid.json) holds each cell's mean and run count; a row averaging seeds names their
    kind, a row of single runs does not."""
    from benchmarks.offgrid import SEED_KIND, headline_rows

    ptq = [{"config": "w3g128-bf16", "tool": "lowbit", "ppl": 19.0, "model": "offgrid"},
           {"config": "w3g128-bf16-seed1", "tool": "lowbit", "ppl": 20.0, "model": "offgrid"},
           {"config": "w3g128-bf16", "tool": "autoround", "ppl": 21.0, "model": "offgrid"},
           {"config": "rtn-w4g128", "tool": "lowbit", "ppl": 31.0, "model": "offgrid"}]
    rows = {r["what"]: r for r in headline_rows({"ptq": ptq})}
    w3 = rows["SignRoundV2 W3 g128, bf16"]
    assert w3["offgrid_lowbit"] == {"ppl": 19.5, "runs": 2} and w3["offgrid_peer"] == {"ppl": 21.0, "runs": 1}
    assert w3["bundled_lowbit"] is None and w3["seed_kind"] == SEED_KIND
    assert "seed_kind" not in rows["RTN W4 g128 (plain)"]
