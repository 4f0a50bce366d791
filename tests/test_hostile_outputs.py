"""What careless or hostile use of outputs and flags does: refused in one line, nothing lost.

End-to-end through the CLI on a tiny random Llama (issue #19: data loss, validation before
work, concurrent runs, leftovers, flags a path cannot honour, partial-plan bits, QAT work
folders, the float base of a fine-tune).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from lowbit.cli import main

FAST = ["--nsamples", "4", "--seqlen", "32", "--eval-seqlen", "64", "--windows", "2"]


def one_error(capsys, needle: str) -> str:
    """The run printed exactly one error line (progress bars aside), and it names ``needle``."""
    err = capsys.readouterr().err
    lines = [x for x in err.replace("\r", "\n").splitlines() if "error" in x.lower()]
    assert len(lines) == 1 and needle in lines[0], err
    return lines[0]


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def tree(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size) for p in path.rglob("*"))


# ------------------------------------------------------------------ --force
def test_force_never_replaces_the_input_model(tiny_hf_dir, capsys):
    before = tree(tiny_hf_dir)
    code = main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--no-eval", "--out", str(tiny_hf_dir), "--force"])
    assert code != 0
    one_error(capsys, "would overwrite the input")
    assert tree(tiny_hf_dir) == before


def test_force_never_replaces_a_folder_lowbit_did_not_write(tiny_hf_dir, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--no-eval", "--out", str(mine), "--force"]) != 0
    one_error(capsys, "not a lowbit output")
    assert (mine / "notes.txt").read_text() == "keep me"


def test_force_keeps_files_added_to_a_lowbit_output(tiny_hf_dir, tmp_path, capsys):
    out = tmp_path / "q"
    args = ["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--no-eval", "--out", str(out)]
    assert main(args) == 0
    assert main([*args, "--force"]) == 0  # lowbit's own output: replaced
    (out / "my-notes.md").write_text("mine")
    assert main([*args, "--force"]) != 0
    one_error(capsys, "files lowbit did not write")
    assert (out / "my-notes.md").read_text() == "mine"


def test_force_never_replaces_a_data_file(tiny_hf_dir, tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text("precious\n\ntext")
    assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--no-eval", "--out", str(data), "--force"]) != 0
    one_error(capsys, "not a lowbit output folder")
    assert data.read_text() == "precious\n\ntext"


def test_out_dot_is_refused(tiny_hf_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--no-eval", "--out", "."]) != 0
    one_error(capsys, "already exists")
    assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--no-eval", "--out", ".", "--force"]) != 0
    one_error(capsys, "not a lowbit output")


def test_gguf_export_onto_a_folder_is_one_line(tiny_hf_dir, tmp_path, capsys):
    q = tmp_path / "q"
    assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--no-eval", "--out", str(q)]) == 0
    (tmp_path / "folder").mkdir()
    assert main(["export", str(q), "--to", "gguf", "--out", str(tmp_path / "folder"), "--force"]) != 0
    one_error(capsys, "is a folder")
    assert main(["export", str(q), "--to", "gguf", "--out", str(q / "model.gguf")]) != 0
    one_error(capsys, "would overwrite the input")


# ------------------------------------------------- validation before any work
@pytest.mark.parametrize("args,needle", [
    (["--windows", "-1"], "--windows must be >= 0"),
    (["--method", "signround2", "--iters", "1", "--windows", "-1", "--offload-dir", "OFF"], "--windows must be >= 0"),
    (["--out", "FILE/sub/q"], "is a file, not a folder"),
    (["--method", "rtn", "--iters", "3"], "--iters does not apply to --method rtn"),
    (["--method", "rtn", "--preset", "best"], "--preset does not apply to --method rtn"),
    (["--method", "rtn", "--batch-size", "4"], "--batch-size does not apply"),
    (["--method", "rtn", "--fp-inputs"], "--fp-inputs does not apply"),
    (["--method", "rtn", "--tune-dtype", "bf16"], "--tune-dtype does not apply"),
    (["--method", "rtn", "--workdir", "W"], "--workdir applies to the block-wise methods"),
    (["--method", "rtn", "--no-search", "--offload-dir", "W"], "--offload-dir applies to the block-wise methods"),
    (["--method", "signround", "--no-search"], "--search does not apply to --method signround"),
    (["--method", "rtn", "--damp", "0.1"], "--damp does not apply to --method rtn; it applies to --method gptq"),
    (["--method", "signround2", "--lazy-batch", "64"], "--lazy-batch does not apply to --method signround2"),
    (["--method", "gptq", "--iters", "3"], "--iters does not apply to --method gptq"),
    (["--method", "gptq", "--damp", "2"], "damp must be in [0, 1]"),
    (["--method", "gptq", "--no-static-groups"], "needs a per-column group index"),
    (["--no-search", "--nsamples", "8"], "does not use"),
    (["--tie-qkv"], "needs both --avg-bits and --options"),
    (["--delta-mode", "signed"], "needs both --avg-bits and --options"),
    (["--ignore-scale-bits"], "needs both --avg-bits and --options"),
    (["--avg-bits", "3"], "needs both --avg-bits and --options"),
    (["--plan", "PLAN", "--scheme", "w4g32"], "give only one"),
    (["--avg-bits", "3", "--options", "w2g32,w4g32", "--scheme", "w4g32"], "give only one"),
    (["--no-eval", "--windows", "3"], "which --no-eval skips"),
    (["--avg-bits", "1.0", "--options", "w2g32,w4g32", "--method", "rtn"], "cannot be met"),
])
def test_quantize_refuses_before_work(tiny_hf_dir, tmp_path, capsys, args, needle):
    (tmp_path / "FILE").write_text("x")
    (tmp_path / "PLAN").write_text('{"layers": {}}')
    args = [a if a not in ("FILE/sub/q", "W", "OFF", "PLAN") else str(tmp_path / a) for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "q")]
    base = [a for a in FAST if "--windows" not in args or a not in ("--windows", "2")]
    if "--no-eval" in args:
        base = FAST[:4]
    scheme = [] if "--scheme" in args or "--options" in args else ["--scheme", "w4g32"]
    assert main(["quantize", str(tiny_hf_dir), *scheme, *base, *args, *out]) != 0
    one_error(capsys, needle)
    assert not (tmp_path / "q").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries, no locks


def test_unwritable_out_fails_before_loading(tiny_hf_dir, tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root can write anywhere")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--no-eval", "--out", str(ro / "q")]) != 0
    one_error(capsys, "permission denied")


def test_eval_limit_needs_tasks(tiny_hf_dir, capsys):
    assert main(["eval", str(tiny_hf_dir), "--limit", "5"]) != 0
    one_error(capsys, "--limit applies to zero-shot tasks")


# ----------------------------------------------------------- concurrent runs
def test_a_second_run_on_a_busy_output_is_told_so(tiny_hf_dir, tmp_path, capsys):
    from lowbit.io import output_lock

    out = tmp_path / "q"
    with output_lock(out):  # as if another lowbit run were writing it right now
        assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--no-eval", "--out", str(out), "--force"]) != 0
    one_error(capsys, "another lowbit run is writing")
    assert not out.exists()
    assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--no-eval", "--out", str(out)]) == 0


def test_two_processes_on_one_output_one_wins_the_other_is_told(tiny_hf_dir, tmp_path):
    out = tmp_path / "q"
    cmd = [sys.executable, "-m", "lowbit", "quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--no-eval", "--force",
           "--out", str(out)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for code, err in results:  # each run either wrote the output or was told another run held it
        assert code == 0 or "another lowbit run is writing" in err, err
    assert any(code == 0 for code, _ in results)
    from lowbit.files.native import load

    load(out)
    assert [p.name for p in tmp_path.iterdir()] == ["q"]


# ------------------------------------------------------------------ leftovers
def test_leftovers_of_killed_runs_are_cleared(tiny_hf_dir, tmp_path):
    out = tmp_path / "q"
    (tmp_path / ".q.lowbit-dead1.partial").mkdir()
    (tmp_path / ".q.lowbit-dead1.partial" / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / ".q.lowbit-dead2.partial").write_bytes(b"half a gguf")
    (tmp_path / ".qq.lowbit-other.partial").mkdir()  # another output's: not ours to touch
    assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--no-eval", "--out", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".qq.lowbit-other.partial", "q"]


def test_mixed_precision_leaves_nothing_in_the_temp_dir(tiny_hf_dir, tmp_path, monkeypatch, capsys):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    args = ["quantize", str(tiny_hf_dir), *FAST[:4], "--no-eval", "--avg-bits", "3.5", "--options", "w2g32,w4g32"]
    assert main([*args, "--out", str(tmp_path / "q")]) == 0
    assert main([*args, "--method", "signround2", "--iters", "1", "--avg-bits", "1.0",
                 "--out", str(tmp_path / "bad")]) != 0
    assert list(tmp.iterdir()) == []
    assert {"plan.json", "plan.png"} <= {p.name for p in (tmp_path / "q").iterdir()}


# --------------------------------------------------------------- reporting
def test_partial_plan_reports_bits_over_every_linear(tiny_hf_dir, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": {"model.layers.0.self_attn.q_proj": "w4g32"}}))
    assert main(["quantize", str(tiny_hf_dir), "--plan", str(plan), "--no-search", "--no-eval",
                 "--out", str(tmp_path / "q"), "--json"]) == 0
    r = last_json(capsys)
    assert r["layers_quantized"] == 1 and r["layers_16bit"] == 13
    assert r["bits_per_weight_nominal"] == r["bits_per_weight"]  # 64-wide rows: no padded group
    q_params = 64 * 64
    total = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128)  # 2 blocks: q,o 64x64; k,v 32x64; mlp 3 x 64x128
    assert r["bits_per_weight"] == round((4.5 * q_params + 16 * (total - q_params)) / total, 4)


# ------------------------------------------------------------------- qat
def test_qat_workdir_is_the_one_used_and_copied(tiny_hf_dir, tmp_path, capsys):
    out, work = tmp_path / "o", tmp_path / "w"
    args = ["qat", str(tiny_hf_dir), "--scheme", "w2", "--method", "winq", "--steps", "8", "--batch-size", "2",
            "--seqlen", "32", "--no-eval", "--checkpoint-every", "4", "--workdir", str(work), "--out", str(out), "--json"]
    assert main(args) == 0
    first = last_json(capsys)
    assert first["workdir"] == str(work) and first["reinits"] == [2, 4, 6]
    assert (out / "metrics.jsonl").is_file() and (out / "loss.png").is_file()
    assert not (tmp_path / "o.train").exists()
    assert main([*args, "--force"]) == 0  # resumes at step 4: the report still lists every re-init
    again = last_json(capsys)
    assert again["resumed_from"] == 4 and again["reinits"] == [2, 4, 6]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines if "loss" in json.loads(x)] == list(range(1, 9))


@pytest.mark.parametrize("args,needle", [
    (["--method", "ste", "--reinit-a", "0.5"], "--reinit-a switch WinQ parts"),
    (["--method", "ste", "--no-noise"], "--no-noise switch WinQ parts"),
    (["--reinit-every", "50"], "switch WinQ parts; --method ste has none"),  # ste is the default
    (["--method", "winq", "--reinit-every", "50"], "not shorter than the 8-step run"),
    (["--method", "winq", "--reinit-a", "1.0"], "must be in [0, 1)"),
    (["--method", "winq", "--sigma-w", "-1"], "sigmas must be >= 0"),
    (["--kd-temperature", "2"], "add --kd"),
])
def test_qat_refuses_flags_its_method_cannot_honour(tiny_hf_dir, tmp_path, capsys, args, needle):
    assert main(["qat", str(tiny_hf_dir), "--scheme", "w2", "--steps", "8", "--no-eval", *args,
                 "--out", str(tmp_path / "o")]) != 0
    one_error(capsys, needle)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------- finetune
@pytest.fixture
def quantized(tiny_hf_dir, tmp_path, monkeypatch):
    """A w4g32 checkpoint of a copy of the tiny model, made from a relative path."""
    import shutil

    src = tmp_path / "src" / "model"
    shutil.copytree(tiny_hf_dir, src)
    monkeypatch.chdir(tmp_path / "src")
    assert main(["quantize", "model", "--scheme", "w4g32", "--no-search", "--no-eval", "--out", str(tmp_path / "q")]) == 0
    return tmp_path / "q", src


def test_finetune_finds_the_recorded_base_from_another_folder(quantized, tmp_path, monkeypatch, capsys):
    q, src = quantized
    other = tmp_path / "elsewhere"
    (other / "model").mkdir(parents=True)  # a different model under the same relative name
    monkeypatch.chdir(other)
    meta = json.loads((q / "lowbit.json").read_text())["meta"]
    assert meta["source"] == str(src.resolve()) and meta["source_digest"]
    assert main(["finetune", str(q), "--adapter", "qwha", "--rank", "2", "--steps", "1", "--batch-size", "2",
                 "--nsamples", "2", "--seqlen", "32", "--no-eval", "--out", str(tmp_path / "a"), "--json"]) == 0
    r = last_json(capsys)
    assert r["base_model"] == str(src.resolve()) and r["base_verified"] is True


def test_finetune_refuses_a_base_with_other_weights(quantized, tmp_path, capsys):
    q, src = quantized
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        m.model.layers[0].mlp.down_proj.weight.mul_(1.01)
    m.save_pretrained(tmp_path / "impostor")
    (tmp_path / "impostor" / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    assert main(["finetune", str(q), "--adapter", "loftq", "--rank", "2", "--steps", "1", "--no-eval",
                 "--base-model", str(tmp_path / "impostor"), "--out", str(tmp_path / "a")]) != 0
    one_error(capsys, "is not the one the checkpoint was quantized from")
    assert not (tmp_path / "a").exists()


def test_finetune_refuses_a_vanished_base(quantized, tmp_path, capsys):
    import shutil

    q, src = quantized
    shutil.rmtree(src)
    assert main(["finetune", str(q), "--adapter", "qwha", "--steps", "1", "--no-eval",
                 "--out", str(tmp_path / "a")]) != 0
    one_error(capsys, "not there any more")


@pytest.mark.parametrize("args,needle", [
    (["--adapter", "lora", "--k-min", "2"], "--k-min does not apply to --adapter lora"),
    (["--adapter", "lora", "--scale", "3"], "--scale does not apply to --adapter lora"),
    (["--adapter", "loftq", "--no-refine"], "--refine does not apply to --adapter loftq"),
    (["--adapter", "lora", "--base-model", "X"], "--base-model applies to --adapter qwha | loftq"),
    (["--no-eval", "--windows", "3"], "which --no-eval skips"),
])
def test_finetune_refuses_flags_its_adapter_cannot_honour(quantized, tmp_path, capsys, args, needle):
    q, _ = quantized
    assert main(["finetune", str(q), "--steps", "1", *args, "--out", str(tmp_path / "a")]) != 0
    one_error(capsys, needle)
    assert not (tmp_path / "a").exists()


# ------------------------------------------------- nothing non-finite is written (issue 31)
def _all_finite(folder) -> list[str]:
    """Names of the non-finite tensors in every safetensors file under ``folder``."""
    from safetensors.torch import load_file

    from lowbit.formats.finite import nonfinite

    return [n for f in sorted(folder.glob("*.safetensors")) for n, _ in nonfinite(load_file(f).items())]


@pytest.fixture
def outlier_dir(tiny_hf_dir, tmp_path):
    """The tiny model with one row of up_proj scaled by 3e7 (|w| ~ 1.5e6, finite): fp16 group scales overflow."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "outlier"
    shutil.copytree(tiny_hf_dir, d)
    w = load_file(d / "model.safetensors")
    w["model.layers.0.mlp.up_proj.weight"][3] *= 3e7
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    return d


def _layer_error(out, source, name: str) -> torch.Tensor:
    """Relative error per row of layer ``name`` of checkpoint ``out`` against the float ``source``."""
    from safetensors.torch import load_file

    from lowbit.files.native import load

    model, _ = load(out)
    q = model.get_submodule(name).weight.detach()
    w = load_file(source / "model.safetensors")[f"{name}.weight"]
    return ((q - w).norm(dim=1) / w.norm(dim=1)).float()


def _quantize_warned(model, out, capsys, scheme: str, warning: str) -> dict:
    """Quantize ``model`` with ``scheme`` (RTN, no eval), expecting the warning; returns the JSON summary."""
    with pytest.warns(UserWarning, match=warning):
        assert main(["quantize", str(model), "--scheme", scheme, "--no-search", "--no-eval", "--out", str(out),
                     "--json"]) == 0
    return last_json(capsys)


@pytest.mark.parametrize("scheme", ["w4g32", "w2g64", "w4g32a"])
def test_an_outlier_row_gets_fp32_scales_not_nan(outlier_dir, tmp_path, capsys, scheme):
    out = tmp_path / "q"
    r = _quantize_warned(outlier_dir, out, capsys, scheme, "need group scales up to .* beyond the 65504 that fp16 holds")
    assert r["range_fallbacks"] == {"model.layers.0.mlp.up_proj": "fp32 scales"}
    assert f"{scheme}:scale=fp32" in r["scheme"] and r["layers_16bit"] == 0
    assert _all_finite(out) == []
    err = _layer_error(out, outlier_dir, "model.layers.0.mlp.up_proj")
    bound = {"w2g64": 0.7, "w4g32": 0.2, "w4g32a": 0.2}[scheme]
    assert bool(torch.isfinite(err).all()) and float(err.max()) < bound  # the outlier row too: fp32 holds it


@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4-46"])
def test_nvfp4_keeps_a_layer_it_cannot_hold_in_16_bits(outlier_dir, tmp_path, capsys, scheme):
    """Next to a 1.5e6 outlier, E4M3 block scales under the tensor scale round every other row to zero."""
    out = tmp_path / "q"
    r = _quantize_warned(outlier_dir, out, capsys, scheme, "rows would get only zero e4m3 block scales")
    assert r["range_fallbacks"] == {"model.layers.0.mlp.up_proj": "16 bits"} and r["layers_16bit"] == 1
    assert r["layers_quantized"] == 13 and _all_finite(out) == []
    assert float(_layer_error(out, outlier_dir, "model.layers.0.mlp.up_proj").max()) == 0.0  # float, untouched
    manifest = json.loads((out / "lowbit.json").read_text())
    assert "model.layers.0.mlp.up_proj" not in manifest["layers"] and "model.layers.1.mlp.up_proj" in manifest["layers"]


def test_range_fit_decides_from_the_weights():
    from lowbit.formats import Scheme, quantize
    from lowbit.formats.ranges import fit

    torch.manual_seed(0)
    w = torch.randn(64, 256) * 0.02
    for name in ("w4g32", "nvfp4", "nvfp4-46", "nvfp4-ue5m3", "mxfp4", "q4_k", "fp8"):
        assert fit(w, Scheme.parse(name)).reason is None  # ordinary weights: as planned
    big = w.clone()
    big[0, 0] = 5.3e5  # 5.3e5 / 8 > 65504
    assert fit(big, Scheme.parse("w4g32")).scheme == Scheme.parse("w4g32:scale=fp32")
    assert fit(big, Scheme.parse("w8")).reason is None  # 8 bits: 5.3e5 / 128 fits fp16
    assert fit(big, Scheme.parse("nvfp4")).scheme is None  # every other row's blocks underflow
    assert fit(big * 100, Scheme.parse("nvfp4-ue5m3")).scheme is None  # 5.3e7 / 6 > UE5M3's 114688
    assert fit(big * 1000, Scheme.parse("q4_k")).scheme is None  # beyond the fp16 super-block scales
    tiny_row = w.clone()
    tiny_row[5] *= 1e-9  # a row that is itself negligible dies, and that is no reason to keep 16 bits
    tiny_row[0, 0] = 1.0
    assert fit(tiny_row, Scheme.parse("nvfp4")).reason is None
    for s in ("w4g32", "w4g32a", "w2g64", "q4_k", "nvfp4-ue5m3"):  # the scale casts saturate: never inf
        q = quantize(big * 100, Scheme.parse(s))
        assert all(bool(torch.isfinite(t).all()) for t in (q.scales, q.dequantize()) if t is not None), s


def test_gguf_refuses_a_layer_whose_scales_need_fp32(outlier_dir, tmp_path, capsys):
    pytest.importorskip("gguf")
    q = tmp_path / "q"
    with pytest.warns(UserWarning):
        assert main(["quantize", str(outlier_dir), "--scheme", "w4g32", "--no-search", "--no-eval", "--out", str(q)]) == 0
    capsys.readouterr()
    assert main(["export", str(q), "--to", "gguf", "--out", str(tmp_path / "m.gguf")]) == 2
    one_error(capsys, "model.layers.0.mlp.up_proj (w4g32:scale=fp32")
    assert main(["export", str(q), "--to", "gguf", "--allow-requant", "--out", str(tmp_path / "m.gguf")]) == 2
    one_error(capsys, "Q4_0 stores fp16 block scales, which cannot hold this layer's weights")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outlier", "q"]  # nothing written, no temporaries
    assert main(["export", str(q), "--to", "compressed-tensors", "--out", str(tmp_path / "ct")]) == 0
    assert _all_finite(tmp_path / "ct") == []


def _quantized_with_nan(where: str):
    """A tiny quantized Llama with one NaN, in a norm weight or in a quantized layer's scales."""
    from conftest import make_llama

    from lowbit.nn import replace_linears
    from lowbit.plans.plan import Plan

    model = make_llama(128, layers=1)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    replace_linears(model, Plan.uniform(names, "w4g32"))
    with torch.no_grad():
        if where == "norm":
            model.model.norm.weight[0] = float("nan")
        else:
            model.model.layers[0].mlp.up_proj.scales[0, 0] = float("inf")
    return model


@pytest.mark.parametrize("where", ["norm", "scales"])
@pytest.mark.parametrize("writer", ["native", "compressed-tensors", "gguf"])
def test_writers_refuse_non_finite_tensors_and_write_nothing(tmp_path, writer, where):
    from lowbit.errors import NonFiniteError

    model = _quantized_with_nan(where)
    out = tmp_path / ("m.gguf" if writer == "gguf" else "m")
    if writer == "native":
        from lowbit.files.native import save as write
    elif writer == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
        from lowbit.files.compressed_tensors import export as write
    else:
        pytest.importorskip("gguf")
        from lowbit.files.gguf_export import export as write
    with pytest.raises(NonFiniteError, match="model.norm.weight" if where == "norm" else "up_proj"):
        write(model, None, out)
    assert list(tmp_path.iterdir()) == []


def test_adapters_and_training_checkpoints_refuse_non_finite_tensors(tmp_path):
    from conftest import make_llama

    from lowbit.errors import NonFiniteError
    from lowbit.peft import PeftConfig, apply_adapters, save_adapters
    from lowbit.train.checkpoint import save_checkpoint

    model = _quantized_with_nan("none")
    cfg = PeftConfig("lora", rank=2)
    apply_adapters(model, cfg)
    with torch.no_grad():
        next(p for p in model.parameters() if p.requires_grad).fill_(float("nan"))
    with pytest.raises(NonFiniteError, match="the training diverged"):
        save_adapters(model, tmp_path / "ad", cfg)
    assert list(tmp_path.iterdir()) == []
    fp = make_llama(64, layers=1)
    opt = torch.optim.AdamW(fp.parameters())
    folder = tmp_path / "ck"
    folder.mkdir()
    save_checkpoint(folder, model=fp, optimizer=opt, step=1, losses=[1.0], evals=[], fingerprint="f", settings={})
    before = sorted(p.name for p in folder.iterdir())
    with torch.no_grad():
        fp.model.norm.weight[0] = float("nan")
    with pytest.raises(NonFiniteError, match="training checkpoint of step 2.*previous checkpoint is kept"):
        save_checkpoint(folder, model=fp, optimizer=opt, step=2, losses=[1.0, 2.0], evals=[], fingerprint="f",
                        settings={})
    assert sorted(p.name for p in folder.iterdir()) == before


def test_a_diverging_qat_run_writes_no_nan_checkpoint(tiny_hf_dir, tmp_path, capsys):
    """--lr 1e30 is finite, so it is accepted; the NaN it makes is refused where it would be written."""
    work = tmp_path / "w"
    assert main(["qat", str(tiny_hf_dir), "--scheme", "w2", "--steps", "3", "--batch-size", "2", "--seqlen", "32",
                 "--no-eval", "--lr", "1e30", "--checkpoint-every", "1", "--workdir", str(work),
                 "--out", str(tmp_path / "o")]) == 2
    one_error(capsys, "the training diverged: lower --lr")
    assert not (tmp_path / "o").exists() and _all_finite(work / "checkpoint") == []
