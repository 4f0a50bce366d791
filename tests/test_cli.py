"""The CLI contract: --json last line, one clear error line and a non-zero exit on bad input."""

import json
import subprocess
import sys

import pytest

from lowbit.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lowbit", *args], capture_output=True, text=True, timeout=300)


def test_help_lists_core_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("quantize", "eval"):
        assert cmd in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["quantize", "--scheme", "w5g999x", "--out", "OUT"], "unknown scheme"),
    (["quantize", "--scheme", "w4g128", "--method", "magic", "--out", "OUT"], "unknown method"),
    (["quantize", "/no/such/model", "--out", "OUT"], "does not exist"),
    (["eval", "/no/such/model"], "does not exist"),
    (["quantize", "--device", "banana", "--out", "OUT"], "unknown device"),
    (["eval", "--device", "meta"], "not supported"),
])
def test_bad_input_is_one_clear_line(tmp_path, capsys, args, needle):
    args = [a.replace("OUT", str(tmp_path / "out")) for a in args]
    code = main(args)
    err = capsys.readouterr().err
    assert code != 0
    assert needle in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_a_gpu_is_one_clear_line_before_loading(tmp_path, capsys):
    code = main(["quantize", "/no/such/model", "--method", "signround2", "--device", "cuda",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code != 0 and "sees no CUDA device" in err and "--device cpu" in err  # before the missing model
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_folder_that_is_no_model(tmp_path, capsys):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hi")
    code = main(["eval", str(tmp_path / "junk")])
    err = capsys.readouterr().err.lower()
    assert code != 0
    assert "neither" in err or "not a" in err


def test_json_flag_prints_one_object_last(capsys):
    from lowbit.cli import emit

    emit({"a": 1, "b": 2.5}, True)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == {"a": 1, "b": 2.5}


def _save_tiny_qwen(path, tokenizer):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)


def test_quantize_local_hf_folder_then_eval_checkpoint(tmp_path, capsys, tiny_tokenizer):
    _save_tiny_qwen(tmp_path / "qwen", tiny_tokenizer)
    out = tmp_path / "q"
    code = main(["quantize", str(tmp_path / "qwen"), "--scheme", "w4g32", "--search", "--nsamples", "4",
                 "--seqlen", "32", "--eval-seqlen", "64", "--windows", "3", "--out", str(out), "--json"])
    assert code == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["scheme"] == "w4g32:rule=search" and r["bits_per_weight"] == 4.5
    assert (out / "lowbit.json").is_file()
    assert main(["eval", str(out), "--seqlen", "64", "--windows", "3", "--json"]) == 0
    e = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert e["ppl"] == r["ppl_q"] and e["windows"] == 3


def test_offload_dir_reads_blocks_from_the_checkpoint_with_the_same_result(tmp_path, capsys, tiny_tokenizer):
    """--offload-dir on a safetensors folder loads lazily (Qwen2: q/k/v biases too)."""
    _save_tiny_qwen(tmp_path / "qwen", tiny_tokenizer)
    common = ["--scheme", "w4g32", "--method", "signround2", "--iters", "2", "--nsamples", "4", "--seqlen", "32",
              "--batch-size", "2", "--eval-seqlen", "64", "--windows", "3", "--json"]
    results = []
    for name, extra in (("mem", []), ("lazy", ["--offload-dir", str(tmp_path / "off")])):
        assert main(["quantize", str(tmp_path / "qwen"), *common, *extra, "--out", str(tmp_path / name)]) == 0
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    mem, lazy = results
    assert "ppl_fp" in mem and "ppl_fp" not in lazy and "lowbit eval" in lazy["ppl_fp_skipped"]
    assert lazy["ppl_q"] == mem["ppl_q"]
    assert not (tmp_path / "off").exists() or not list((tmp_path / "off").iterdir())  # nothing copied


def test_group_larger_than_row_leaves_nothing(tmp_path, capsys, tiny_tokenizer):
    _save_tiny_qwen(tmp_path / "qwen", tiny_tokenizer)
    code = main(["quantize", str(tmp_path / "qwen"), "--scheme", "w4g256", "--out", str(tmp_path / "q"),
                 "--no-eval"])
    assert code != 0
    assert "larger than the 64 input columns" in capsys.readouterr().err
    assert not (tmp_path / "q").exists() and not list(tmp_path.glob(".q*"))


def test_eval_seqlen_longer_than_text(tmp_path, capsys, tiny_tokenizer):
    _save_tiny_qwen(tmp_path / "qwen", tiny_tokenizer)
    (tmp_path / "t.txt").write_text("short one\n\nshort two\n\nshort three")
    code = main(["eval", str(tmp_path / "qwen"), "--data", str(tmp_path / "t.txt"), "--seqlen", "512"])
    assert code != 0
    assert "fewer than one window" in capsys.readouterr().err


def test_mixed_precision_signround2_saves_plan_in_checkpoint(tmp_path, capsys, tiny_tokenizer):
    _save_tiny_qwen(tmp_path / "qwen", tiny_tokenizer)
    out = tmp_path / "q"
    code = main(["quantize", str(tmp_path / "qwen"), "--method", "signround2", "--iters", "2",
                 "--avg-bits", "3.5", "--options", "w2g32,w4g32", "--nsamples", "4", "--seqlen", "32",
                 "--no-eval", "--out", str(out), "--json"])
    assert code == 0, capsys.readouterr().err
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["scheme"].startswith("mixed(") and r["bits_per_weight"] <= 3.5
    assert (out / "plan.json").is_file() and (out / "plan.png").is_file()
    from lowbit.files.native import load

    load(out)


def test_tune_dtype_reaches_the_tuning_options():
    from lowbit.cli import build_parser
    from lowbit.cli.quantize import build_job

    args = build_parser().parse_args(["quantize", "--method", "signround2", "--tune-dtype", "bf16", "--out", "o"])
    assert build_job(args).settings.tune_dtype == "bf16"
    args = build_parser().parse_args(["quantize", "--method", "signround2", "--out", "o"])
    assert build_job(args).settings.tune_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["quantize", "--tune-dtype", "fp16", "--out", "o"])


def test_gptq_with_rotation_and_awq_round_trips_and_offloads(tmp_path, capsys, tiny_tokenizer):
    """The pre-steps and GPTQ from the command line: saved, evaluated again, and the same with --offload-dir
    (loaded lazily: the pre-steps run on each block as it is read, the same quantized model)."""
    _save_tiny_qwen(tmp_path / "qwen", tiny_tokenizer)
    common = ["--scheme", "w4g32", "--method", "gptq", "--rotate", "--awq", "--nsamples", "4", "--seqlen", "32",
              "--eval-seqlen", "64", "--windows", "3", "--json"]
    results = []
    for name, extra in (("mem", []), ("off", ["--offload-dir", str(tmp_path / "off")])):
        code = main(["quantize", str(tmp_path / "qwen"), *common, *extra, "--out", str(tmp_path / f"q_{name}")])
        assert code == 0, capsys.readouterr().err
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    mem, off = results
    assert mem["rotation"]["untied_head"] is False and mem["rotation"]["probe_rel_diff"] < 1e-5
    assert mem["awq"]["groups"] == 6 and mem["scheme"] == "w4g32:rule=search"
    assert off["ppl_q"] == mem["ppl_q"] and "ppl_fp_skipped" in off  # lazily loaded: no float perplexity
    assert off["awq"]["groups"] == mem["awq"]["groups"] and off["rotation"]["untied_head"] is False
    assert main(["eval", str(tmp_path / "q_mem"), "--seqlen", "64", "--windows", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ppl"] == mem["ppl_q"]
    meta = json.loads((tmp_path / "q_mem" / "lowbit.json").read_text())["meta"]
    assert meta["rotation"] == {"kind": "random", "seed": 0, "keep": 0, "residual": True, "online": []}
    assert meta["awq"]["grid"] == 20


def test_gptq_with_awq_resumes_from_the_workdir_with_host_caches(tmp_path, capsys, tiny_tokenizer):
    """--method gptq --awq --cache-device cpu --workdir: accepted and honoured; the rerun replays AWQ's blocks
    (WORKDIR/awq) and GPTQ's, and writes the same checkpoint."""
    import torch
    from safetensors.torch import load_file

    _save_tiny_qwen(tmp_path / "qwen", tiny_tokenizer)
    common = ["--scheme", "w4g32", "--method", "gptq", "--awq", "--nsamples", "4", "--seqlen", "32", "--no-eval",
              "--cache-device", "cpu", "--workdir", str(tmp_path / "wd"), "--json"]
    for name in ("a", "b"):
        code = main(["quantize", str(tmp_path / "qwen"), *common, "--out", str(tmp_path / name)])
        assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "wd" / "awq").glob("block_*.safetensors")) == [
        "block_0000.safetensors", "block_0001.safetensors"]
    a, b = (load_file(str(next((tmp_path / n).glob("*.safetensors")))) for n in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _awq_job(tmp_path, method="gptq", grid=4, evaluation=None, **kw):
    from lowbit.api.common import Calibration
    from lowbit.api.quantize import QuantizeJob
    from lowbit.ptq import AWQSettings

    return QuantizeJob(out=tmp_path / f"out-{method}-{grid}", model=str(tmp_path / "qwen"), scheme="w4g32",
                       method=method, awq=AWQSettings(grid=grid), calib=Calibration(nsamples=4, seqlen=32),
                       evaluation=evaluation, workdir=str(tmp_path / "wd"), progress=False, force=True, **kw)


def test_a_changed_awq_setting_in_the_workdir_is_refused_before_the_float_perplexity(tmp_path, monkeypatch,
                                                                                      tiny_tokenizer):
    """AWQ's record (WORKDIR/awq/run.json) is part of the early resume check: a rerun with another AWQ setting
    stops before the float perplexity and before AWQ walks a block."""
    from lowbit.api.common import Evaluation
    from lowbit.api.quantize import quantize
    from lowbit.errors import ConfigError
    from lowbit.ptq import awq

    _save_tiny_qwen(tmp_path / "qwen", tiny_tokenizer)
    quantize(_awq_job(tmp_path, grid=4))
    heavy = []
    monkeypatch.setattr(Evaluation, "perplexity", lambda *a, **k: heavy.append("ppl_fp"))
    monkeypatch.setattr(awq, "walk_blocks", lambda *a, **k: heavy.append("awq"))
    with pytest.raises(ConfigError, match=r"work folder .*wd.awq holds a run with different settings \(config\)"):
        quantize(_awq_job(tmp_path, grid=5, evaluation=Evaluation(seqlen=64, windows=2)))
    assert heavy == []


def test_rtn_with_awq_resumes_awq_from_the_workdir(tmp_path, monkeypatch, tiny_tokenizer):
    """--method rtn --awq takes --workdir (AWQ walks the blocks on the engine): the rerun replays AWQ's blocks
    without searching again and writes the same checkpoint; without --awq, rtn refuses it and says why."""
    import torch
    from safetensors.torch import load_file

    from lowbit.api.quantize import QuantizeJob, quantize
    from lowbit.errors import ConfigError
    from lowbit.ptq import awq

    _save_tiny_qwen(tmp_path / "qwen", tiny_tokenizer)
    quantize(_awq_job(tmp_path, method="rtn"))
    a = load_file(str(next((tmp_path / "out-rtn-4").glob("*.safetensors"))))
    assert sorted(p.name for p in (tmp_path / "wd" / "awq").glob("block_*.safetensors")) == [
        "block_0000.safetensors", "block_0001.safetensors"]
    searched = []
    real = awq.search_scales
    monkeypatch.setattr(awq, "search_scales", lambda *a, **k: searched.append(1) or real(*a, **k))
    quantize(_awq_job(tmp_path, method="rtn"))
    assert searched == []  # every block's scales replayed from WORKDIR/awq
    b = load_file(str(next((tmp_path / "out-rtn-4").glob("*.safetensors"))))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConfigError, match="--workdir applies to the block-wise methods .* and to the --awq "
                                          "pre-step; --method rtn here quantizes the whole model at once"):
        QuantizeJob(out=tmp_path / "o", method="rtn", workdir="w")
    QuantizeJob(out=tmp_path / "o", method="rtn", workdir="w", offload_dir="off")  # block by block: honoured


def test_cli_warnings_are_one_line_naming_the_command():
    """The CLI changes only the text of warnings, so callers that record them still get them."""
    import warnings

    from lowbit.cli import _one_line_warnings

    with _one_line_warnings("quantize"):
        text = warnings.formatwarning("kept notes.txt", UserWarning, "src/lowbit/io.py", 12)
        with pytest.warns(UserWarning, match="kept"):
            warnings.warn("kept notes.txt", stacklevel=1)
    assert text == "lowbit quantize: warning: kept notes.txt\n"
