"""`lowbit qat` end to end on a tiny Llama: JSON keys, native save, baseline speed-up, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_llama
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from lowbit.cli import main

WORDS = [f"w{i}" for i in range(120)]
FAST = ["--steps", "6", "--batch-size", "2", "--seqlen", "32", "--eval-seqlen", "64", "--windows", "2",
        "--lr", "1e-3", "--json"]


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer: built in microseconds, unlike a trained BPE."""
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(["<unk>", "<pad>", *WORDS])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<pad>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama folder plus a small .txt corpus (--data) of random-word documents."""
    d = tmp_path_factory.mktemp("tiny")
    tok = word_tokenizer()
    make_llama(len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(WORDS[j] for j in torch.randint(0, 120, (200,), generator=g).tolist()) for _ in range(8)]
    (d / "corpus.txt").write_text("\n\n".join(docs))
    FAST.extend(["--data", str(d / "corpus.txt")]) if "--data" not in FAST else None
    return d


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_qat_saves_a_checkpoint_that_evaluates_like_ptq(model_dir, tmp_path, capsys):
    from lowbit.files.native import load
    from lowbit.nn import QuantLinear

    out = tmp_path / "winq"
    assert main(["qat", str(model_dir), "--scheme", "w2", "--method", "winq", *FAST, "--out", str(out)]) == 0
    r = last_json(capsys)
    for key in ("steps", "final_loss", "ppl", "seconds", "steps_to_baseline_loss", "ppl_fp", "reinits"):
        assert key in r
    assert r["steps"] == 6 and r["quantizer"] == "seq2" and r["reinits"] == [1, 2, 3, 4, 5]
    # issue 38: the quantized model's perplexity before training, beside the FP and the trained one
    keys = list(r)
    assert keys[keys.index("ppl_fp"):keys.index("ppl_fp") + 3] == ["ppl_fp", "ppl_before_training", "ppl"]
    assert 1 < r["ppl_before_training"] < float("inf")
    assert (out / "metrics.jsonl").is_file() and (out / "loss.png").is_file()
    assert r["matmul_weights"]["quantized_share"] > 0.5 and set(r["matmul_weights"]["float"]) == {"embeddings"}
    model, tok = load(out)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 14 and all(m.scheme.bits == 2 for m in layers)
    assert main(["eval", str(out), "--seqlen", "64", "--windows", "2", "--json", "--data", str(model_dir / "corpus.txt")]) == 0
    assert last_json(capsys)["ppl"] == pytest.approx(r["ppl"], rel=1e-5)

    base = tmp_path / "ste"
    assert main(["qat", str(model_dir), "--scheme", "w2", "--method", "ste", *FAST, "--out", str(base),
                 "--baseline", str(out), "--kd"]) == 0  # distilled from the FP model
    s = last_json(capsys)
    assert s["initial_loss"] < 1.0  # a KL to the FP teacher, not the CE of ~ln(vocab) = 4.8
    assert s["reinits"] == [] and s["baseline_loss"] == pytest.approx(
        sum(json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()) / 6)


@pytest.mark.parametrize("extra, needle", [
    (["--steps", "4", "--warmup", "4"], "warm-up"),
    (["--scheme", "w4g128", "--quantizer", "seq"], "cannot express"),
    (["--method", "adam"], "method"),
    (["--scheme", "w7x"], "valid names"),
])
def test_bad_qat_input_is_one_line(model_dir, tmp_path, capsys, extra, needle):
    assert main(["qat", str(model_dir), *extra, "--out", str(tmp_path / "o")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_resume_with_other_settings_is_refused(model_dir, tmp_path, capsys):
    out, work = tmp_path / "o", tmp_path / "work"
    train = [a for i, a in enumerate(FAST) if a not in ("--eval-seqlen", "--windows")
             and FAST[i - 1] not in ("--eval-seqlen", "--windows")]
    args = ["qat", str(model_dir), "--scheme", "ternary", "--method", "winq", *train, "--no-eval", "--checkpoint-every", "2",
            "--workdir", str(work), "--out", str(out)]
    assert main(args) == 0
    first = last_json(capsys)
    assert (work / "checkpoint" / "checkpoint.json").is_file()
    assert main([*args, "--force"]) == 0  # same settings: resumes from step 4, same curve
    again = last_json(capsys)
    assert again["resumed_from"] == 4 and again["final_loss"] == first["final_loss"]
    assert main([*args, "--force", "--sigma-w", "0.01"]) != 0
    assert "different settings" in capsys.readouterr().err
