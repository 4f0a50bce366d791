"""Issue 38, the first hour of a new user: one bits-per-weight figure, flags, output, messages."""

from __future__ import annotations

import json

import pytest

from lowbit.cli import main


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# --------------------------------------------------------------- bits per weight
def test_quantize_inspect_and_export_report_one_bits_per_weight(tiny_hf_dir, tmp_path, capsys):
    """quantize and inspect give the same stored figure for a checkpoint, padding and 16-bit Linears included."""
    plan = tmp_path / "plan.json"
    # 64-wide rows at group 48 store 2 groups: 96 4-bit codes + 2 fp16 scales per 64 weights = 6.5 bits
    plan.write_text(json.dumps({"layers": {"model.layers.0.self_attn.q_proj": "w4g48"}}))
    assert main(["quantize", str(tiny_hf_dir), "--plan", str(plan), "--no-search", "--no-eval",
                 "--out", str(tmp_path / "q"), "--json"]) == 0
    r = last_json(capsys)
    total = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128)  # every decoder Linear of the 2 blocks
    q = 64 * 64
    assert r["bits_per_weight"] == round((6.5 * q + 16 * (total - q)) / total, 4)
    assert r["bits_per_weight_nominal"] == round(((4 + 16 / 48) * q + 16 * (total - q)) / total, 4)
    assert "16-bit Linears count 16" in r["bits_counted"]
    assert main(["inspect", str(tmp_path / "q"), "--json"]) == 0
    i = last_json(capsys)
    assert (i["bits_per_weight"], i["bits_per_weight_nominal"]) == (r["bits_per_weight"], r["bits_per_weight_nominal"])
    assert i["bits_counted"] == r["bits_counted"]


def test_export_labels_the_exported_files_bits_beside_the_checkpoints(tiny_hf_dir, tmp_path, capsys):
    assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--no-eval",
                 "--out", str(tmp_path / "q"), "--json"]) == 0
    r = last_json(capsys)
    assert main(["export", str(tmp_path / "q"), "--to", "compressed-tensors", "--out", str(tmp_path / "ct"),
                 "--json"]) == 0
    e = last_json(capsys)
    assert e["bits_per_weight_checkpoint"] == r["bits_per_weight"] == 4.5
    assert e["bits_per_weight"] == 5.0 and e["bits_counted"].endswith("in the exported file")  # fp32 scales
    assert main(["inspect", str(tmp_path / "ct"), "--json"]) == 0
    assert last_json(capsys)["bits_per_weight"] == e["bits_per_weight"]


# ------------------------------------------------------------------------ flags
def test_no_arguments_lists_the_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    for command in ("quantize", "eval", "inspect", "formats", "qat", "finetune", "export"):
        assert f"\n    {command}" in err
    assert "--help" in err


def test_an_unknown_flag_names_the_subcommand_and_the_closest_flag(capsys):
    assert main(["quantize", "--itres", "5", "--out", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lowbit quantize: error: unrecognized argument") and "(did you mean --iters?)" in err
    assert len(err.splitlines()) == 1
    assert main(["eval", "--windos", "3"]) == 2
    assert "lowbit eval: error:" in (err := capsys.readouterr().err) and "--windows?" in err


def test_schemes_are_case_insensitive_and_a_typo_gets_a_suggestion(capsys, tiny_hf_dir, tmp_path):
    from lowbit.errors import SchemeError
    from lowbit.formats import Recipe

    assert Recipe.parse("W4G128") == Recipe.parse("w4g128")
    assert str(Recipe.parse("W4A4-MXFP4")) == "w4a4-mxfp4"
    with pytest.raises(SchemeError, match=r"did you mean w4a4-mxfp4\?"):
        Recipe.parse("w4a4-mxfp")
    with pytest.raises(SchemeError, match=r"did you mean nvfp4-46\?"):
        Recipe.parse("nvfp4_46")
    assert main(["quantize", str(tiny_hf_dir), "--scheme", "W4G32", "--no-search", "--no-eval",
                 "--out", str(tmp_path / "q"), "--json"]) == 0
    assert last_json(capsys)["scheme"] == "w4g32"
    assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g123x", "--out", str(tmp_path / "r")]) == 2
    assert "unknown scheme" in capsys.readouterr().err


def test_eval_takes_eval_seqlen_like_every_command_and_keeps_the_old_name(tiny_hf_dir, tmp_path, capsys):
    assert main(["eval", str(tiny_hf_dir), "--eval-seqlen", "64", "--windows", "2", "--json"]) == 0
    new = last_json(capsys)
    assert main(["eval", str(tiny_hf_dir), "--seqlen", "64", "--windows", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["ppl"] == new["ppl"] and new["tokens"] == 2 * 63
    assert "--seqlen is now --eval-seqlen" in err


# ------------------------------------------------------------------ model paths
@pytest.fixture
def no_network(monkeypatch):
    """The hub unreachable at once; a download attempt (from_pretrained without local_files_only) fails the test."""
    import urllib.error
    import urllib.request

    from transformers import AutoModelForCausalLM

    def urlopen(*a, **k):
        raise urllib.error.URLError("Name or service not known")

    real = AutoModelForCausalLM.from_pretrained

    def from_pretrained(*a, **k):
        assert k.get("local_files_only"), "tried the network"
        return real(*a, **k)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)


def test_a_mistyped_local_path_with_a_slash_is_checked_locally_first(tmp_path, monkeypatch, no_network, capsys):
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "out/q4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "out/q4 does not exist (the folder out/ does" in err


def test_an_offline_hub_id_fails_fast_with_the_local_options(no_network, capsys):
    assert main(["eval", "nobody-here/no-such-model-xyz"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "hub cannot be reached (https://huggingface.co unreachable" in err
    for option in ("local Hugging Face model folder", ".gguf file", "omit MODEL"):
        assert option in err


# ----------------------------------------------------------------------- output
def test_loading_a_checkpoint_prints_no_transformers_deprecation(tiny_hf_dir, tmp_path, capsys, caplog):
    """Every export, fine-tune and checkpoint eval printed transformers' `torch_dtype` deprecation warning."""
    from lowbit.files.native import load

    assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--no-eval",
                 "--out", str(tmp_path / "q"), "--json"]) == 0
    capsys.readouterr()
    with caplog.at_level("WARNING"):
        load(tmp_path / "q")
    assert "torch_dtype" not in caplog.text + capsys.readouterr().err


def _deep_llama(layers: int = 6):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def deep_model(monkeypatch):
    from types import SimpleNamespace

    model = _deep_llama()
    monkeypatch.setattr("lowbit.models.load_model",
                        lambda src=None, **k: SimpleNamespace(model=model, tokenizer=None, source="deep"))
    return model


def test_formats_samples_blocks_by_default_and_studies_all_with_full(deep_model, capsys):
    """Issue 38, point 8: the default study is a sample of blocks over the depth; --full is every block."""
    from lowbit.models import linear_layers
    from lowbit.studies import block_size_study

    assert main(["formats", "--schemes", "nvfp4", "--block-sizes", "16", "--json"]) == 0
    quick = last_json(capsys)
    assert quick["layers"].startswith("a sample: blocks 0, 2, 3, 5 of 6 (28 of 42 Linears)")
    sampled = {n: m.weight.detach() for n, m in linear_layers(deep_model).items()
               if n.split(".")[2] in ("0", "2", "3", "5")}
    ref = block_size_study(sampled, ["nvfp4"], [16], progress=False)[0]
    assert quick["rows"][0]["rel_error"] == pytest.approx(ref.rel_error, rel=1e-9)
    assert main(["formats", "--schemes", "nvfp4", "--block-sizes", "16", "--full", "--json"]) == 0
    full = last_json(capsys)
    assert full["layers"] == "every decoder block (42 Linears)"
    everything = {n: m.weight.detach() for n, m in linear_layers(deep_model).items()}
    assert full["rows"][0]["rel_error"] == pytest.approx(
        block_size_study(everything, ["nvfp4"], [16], progress=False)[0].rel_error, rel=1e-9)
    assert main(["formats", "--full", "--sample", "2"]) == 2


def test_formats_prints_its_table_and_verdicts_on_stdout_without_python_reprs(deep_model, capsys):
    """Issue 38, point 7: the table went to stderr and the summary printed Python dicts."""
    assert main(["formats", "--schemes", "nvfp4,nvfp4-46", "--block-sizes", "8,32"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["scheme", "block", "8"] and lines[1].startswith("nvfp4 ")
    assert any(ln.startswith("nvfp4-46: rel error") and "finer is" in ln for ln in lines)
    assert "{" not in out and "[" not in out and "None" not in out and "scheme" not in err


def test_inspect_summarises_by_default_and_lists_with_layers(tiny_hf_dir, tmp_path, capsys):
    """Issue 38, point 7: inspect printed every layer (210 lines on the bundled model)."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": {"model.layers.0.self_attn.q_proj": "w4g32",
                                           "model.layers.1.mlp.down_proj": "w4g32",
                                           "model.layers.1.mlp.up_proj": "w8"}}))
    assert main(["quantize", str(tiny_hf_dir), "--plan", str(plan), "--no-search", "--no-eval",
                 "--out", str(tmp_path / "q"), "--json"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    table = out.split("\nformat")[0].splitlines()
    assert table[0].split() == ["scheme", "layers", "weights", "bits/w", "stored"]
    assert sorted(row.split()[:2] for row in table[1:]) == [["w4g32", "2"], ["w8", "1"]]
    assert "model.layers.0.self_attn.q_proj" not in out and "{" not in out
    assert main(["inspect", str(tmp_path / "q"), "--layers"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.self_attn.q_proj" in out and "model.layers.1.mlp.up_proj" in out


# --------------------------------------------------------------------- progress
class Bars:
    """A stand-in for tqdm that records every bar a module draws: total, description, updates."""

    made: list[Bars] = []

    def __init__(self, iterable=None, total=None, desc=None, disable=False, **kw):
        self.iterable, self.total, self.desc, self.disable = iterable, total, desc, disable
        self.updates: list[int] = []
        self.postfix: list[str] = []
        Bars.made.append(self)

    def __iter__(self):
        for x in self.iterable:
            yield x
            self.updates.append(1)

    def update(self, k=1):
        self.updates.append(k)

    def set_postfix_str(self, s):
        self.postfix.append(s)

    def set_postfix(self, *a, **k):
        pass

    def refresh(self):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def bars(monkeypatch):
    import importlib

    Bars.made = []
    for name in ("lowbit.eval.perplexity", "lowbit.models.activations", "lowbit.ptq.sensitivity",
                 "lowbit.models.loading"):
        monkeypatch.setattr(importlib.import_module(name), "tqdm", Bars)
    return Bars.made


def test_perplexity_ticks_every_window_on_the_cpu(bars):
    """A 4-window W4A4 evaluation was one 163 s tick."""
    import torch

    from lowbit.eval import perplexity

    perplexity(_deep_llama(2), torch.randint(0, 256, (1, 5 * 32)), seqlen=32, windows=5)
    (bar,) = bars
    assert bar.total == 5 and bar.updates == [1] * 5 and not bar.disable


def test_deltaloss_ticks_every_batch_of_every_scheme(bars):
    """The mixed-precision pass had two ticks of ~130 s (one per candidate scheme)."""
    import torch

    from lowbit.ptq.sensitivity import delta_loss

    model = _deep_llama(2)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    delta_loss(model, names, ["w2g32", "w4g32"], torch.randint(0, 256, (6, 16)), batch_size=2)
    (bar,) = bars
    assert bar.total == 2 * 3 and bar.updates == [1] * 6 and bar.postfix == ["w2g32", "w4g32"]


def test_rtn_search_shows_its_calibration_pass(bars):
    """67-118 s of silence before the quantize bar: the importance pass over the calibration data."""
    import torch

    from lowbit.plans.plan import Plan
    from lowbit.ptq.rtn import rtn_quantize

    model = _deep_llama(2)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    rtn_quantize(model, Plan.uniform(names, "w4g32"), torch.randint(0, 256, (12, 16)), search=True)
    calib = [b for b in bars if b.desc == "calibration pass"]
    assert len(calib) == 1 and calib[0].updates == [1, 1] and not calib[0].disable  # 12 samples, batches of 8


def test_gguf_conversion_reports_its_stages(bars, tmp_path, monkeypatch):
    """The first-run conversion of the bundled GGUF (~2 min) printed nothing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowbit.models import loading

    model = _deep_llama(1)
    monkeypatch.setattr(loading, "open_gguf", lambda *a, **k: None)
    monkeypatch.setattr(loading, "restored_config", lambda *a, **k: None)  # the head size read from the file
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: "tok")
    assert loading._convert_gguf(tmp_path / "m.gguf", None) == (model, "tok")
    (bar,) = bars
    assert "first use only" in bar.desc and bar.total == sum(loading.CONVERT_STAGES.values())
    assert bar.updates == list(loading.CONVERT_STAGES.values()) and bar.postfix == list(loading.CONVERT_STAGES)


# ------------------------------------------------------------------ time spent
def test_quantize_says_where_the_time_went(tiny_hf_dir, tmp_path, capsys):
    """Issue 38, point 4: the demo's two perplexity passes were most of its time, and nothing said so."""
    assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--nsamples", "4", "--seqlen", "32",
                 "--eval-seqlen", "64", "--windows", "2", "--out", str(tmp_path / "q"), "--json"]) == 0
    r = last_json(capsys)
    assert list(r["time_s"]) == ["load", "data", "ppl_fp", "quantize", "ppl_q", "save"]
    assert sum(r["time_s"].values()) <= r["seconds"] + 0.5
    assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--no-eval",
                 "--out", str(tmp_path / "q"), "--force"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("time_s"))
    assert "load: " in line and "quantize: " in line and "{" not in line


def test_a_busy_machine_gets_a_note_naming_threads_and_threads_sets_torch(tiny_hf_dir, tmp_path, capsys,
                                                                         monkeypatch):
    """At load ~7 on 2 cores torch's 2 threads made a scale search 13x slower than 1 thread."""
    import os

    import torch

    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (7.2, 7.0, 6.5))
    args = ["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--no-eval", "--out"]
    assert main([*args, str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "busy (load average 7.2 on 2 CPUs)" in err and "--threads 1" in err and set_to == []
    assert main([*args, str(tmp_path / "b"), "--threads", "1"]) == 0
    assert "busy" not in capsys.readouterr().err and set_to == [1]
    assert main(["eval", "no/such/dir/x"]) == 2  # an error stays one line
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 0.2, 0.1))
    assert main([*args, str(tmp_path / "c")]) == 0
    assert "busy" not in capsys.readouterr().err
