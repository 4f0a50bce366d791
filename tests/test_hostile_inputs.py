"""Hostile and damaged inputs: every one is refused with one clear `LowbitError`, nothing runs.

Files that lowbit reads back (training checkpoints, native checkpoints, adapter folders,
PTQ work folders, data files, plan files) are treated as untrusted data: a pickle is
never unpickled, a manifest cannot point outside its folder, checksums are mandatory,
and a damaged file is reported as damaged.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from conftest import make_llama
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lowbit.cli import main
from lowbit.errors import CheckpointError, ModelError
from lowbit.train import TrainConfig, train
from lowbit.train import checkpoint as ckpt

WORDS = [f"w{i}" for i in range(120)]


class Payload:
    """Unpickling this creates ``marker``: proof that a pickle was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def evil_pickle(marker: Path) -> bytes:
    return pickle.dumps({"step": 1, "payload": Payload(marker)})


def word_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(["<unk>", "<pad>", *WORDS])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<pad>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama folder with a word tokenizer and a small random-word corpus.txt."""
    d = tmp_path_factory.mktemp("tiny")
    tok = word_tokenizer()
    make_llama(len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(WORDS[j] for j in torch.randint(0, 120, (200,), generator=g).tolist()) for _ in range(8)]
    (d / "corpus.txt").write_text("\n\n".join(docs))
    return d


def one_error_line(capsys, *needles: str) -> str:
    """The CLI's stderr is exactly one ``lowbit CMD: error: ...`` line holding every needle."""
    text = capsys.readouterr().err
    # progress bars may precede it; warnings and an earlier successful run's busy-machine note are lines
    # of their own ("lowbit CMD: warning: ...", "lowbit CMD: note: ...")
    err = [ln for ln in text.splitlines()
           if ln.startswith("lowbit ") and ": warning: " not in ln and ": note: " not in ln]
    assert len(err) == 1 and "error:" in err[0] and "Traceback" not in text, text
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


# ------------------------------------------------------------------ training checkpoints
def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64))


def tokens() -> torch.Tensor:
    return torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))


def train_cfg(out: Path) -> TrainConfig:
    return TrainConfig(steps=4, batch_size=2, lr=1e-3, warmup=1, progress=False, out_dir=str(out),
                       checkpoint_every=2, plot=False)


class Stop(Exception):
    pass


def interrupted_run(out: Path) -> Path:
    """Train until step 3 (one checkpoint at step 2), then crash; returns the checkpoint folder."""
    from lowbit.train import Callback

    class Crash(Callback):
        def on_after_optimizer_step(self, state):
            if state.step == 3:
                raise Stop

    with pytest.raises(Stop):
        train(tiny_model(), tokens(), train_cfg(out), callbacks=[Crash()])
    return out / "checkpoint"


def test_training_checkpoint_is_tensors_and_json_only(tmp_path):
    folder = interrupted_run(tmp_path)
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["checkpoint.json", "tensors-00000002.safetensors"]
    manifest = json.loads((folder / "checkpoint.json").read_text())
    assert manifest["step"] == 2 and manifest["tensors"] == names[1]
    from safetensors.torch import load_file

    python_rng = ckpt.decode(manifest["rng"], load_file(str(folder / names[1])), "t")["python"]
    assert isinstance(python_rng, tuple) and all(isinstance(v, int) for v in python_rng[1])


def test_old_pickle_checkpoint_is_refused_and_never_unpickled(tmp_path):
    folder = interrupted_run(tmp_path)
    for p in folder.iterdir():
        p.unlink()
    marker = tmp_path / "pwned"
    (folder / "checkpoint.pt").write_bytes(evil_pickle(marker))
    with pytest.raises(CheckpointError, match="pickle.*arbitrary code.*--no-resume"):
        train(tiny_model(), tokens(), train_cfg(tmp_path))
    assert not marker.exists()
    assert train(tiny_model(), tokens(), train_cfg(tmp_path), resume=False).resumed_from == 0
    assert not marker.exists() and not (folder / "checkpoint.pt").exists()  # superseded by the new checkpoint


@pytest.mark.parametrize("victim", ["checkpoint.json", "tensors", "metrics.jsonl"])
def test_pickle_in_place_of_any_work_file_is_refused(tmp_path, victim):
    folder = interrupted_run(tmp_path)
    marker = tmp_path / "pwned"
    target = {"checkpoint.json": folder / "checkpoint.json", "metrics.jsonl": tmp_path / "metrics.jsonl",
              "tensors": next(folder.glob("tensors-*.safetensors"))}[victim]
    target.write_bytes(evil_pickle(marker))
    with pytest.raises(CheckpointError, match="damaged|checksum|metrics"):
        train(tiny_model(), tokens(), train_cfg(tmp_path))
    assert not marker.exists()


def test_training_checkpoint_damage_and_escapes_are_refused(tmp_path):
    folder = interrupted_run(tmp_path)
    m = folder / "checkpoint.json"
    good = json.loads(m.read_text())
    tensors = next(folder.glob("tensors-*.safetensors"))
    intact = tensors.read_bytes()
    tensors.write_bytes(intact[:-3] + bytes([intact[-3] ^ 0xFF]) + intact[-2:])
    with pytest.raises(CheckpointError, match="checksum"):
        train(tiny_model(), tokens(), train_cfg(tmp_path))
    tensors.write_bytes(intact)
    for name in ("../../etc/passwd", "/etc/passwd", ".."):
        m.write_text(json.dumps({**good, "tensors": name}))
        with pytest.raises(CheckpointError, match="plain file name"):
            train(tiny_model(), tokens(), train_cfg(tmp_path))
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(intact)
    os.symlink(outside, folder / "link.safetensors")
    m.write_text(json.dumps({**good, "tensors": "link.safetensors"}))
    with pytest.raises(CheckpointError, match="outside"):
        train(tiny_model(), tokens(), train_cfg(tmp_path))
    m.write_text(json.dumps({**good, "optimizer": {"__reduce__": ["os.system", "true"]}}))
    with pytest.raises(CheckpointError, match="did not write"):
        train(tiny_model(), tokens(), train_cfg(tmp_path))
    m.write_text(json.dumps(good))
    assert train(tiny_model(), tokens(), train_cfg(tmp_path)).resumed_from == 2  # intact again: resumes


def test_qat_cli_refuses_a_pickle_checkpoint(model_dir, tmp_path, capsys):
    marker = tmp_path / "pwned"
    work = tmp_path / "work"
    (work / "checkpoint").mkdir(parents=True)
    (work / "checkpoint" / "checkpoint.pt").write_bytes(evil_pickle(marker))
    code = main(["qat", str(model_dir), "--scheme", "ternary", "--steps", "6", "--batch-size", "2", "--seqlen", "32",
                 "--no-eval", "--data", str(model_dir / "corpus.txt"), "--workdir", str(work),
                 "--out", str(tmp_path / "o")])
    assert code == 2
    one_error_line(capsys, "checkpoint.pt", "pickle")
    assert not marker.exists() and not (tmp_path / "o").exists()


# ------------------------------------------------------------------ native checkpoints
def quantized_llama(vocab: int = 128):
    from lowbit.nn import replace_linears
    from lowbit.plans.plan import Plan

    model = make_llama(vocab, layers=1)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    replace_linears(model, Plan.uniform(names, "w4g32"))
    return model


@pytest.fixture
def native_dir(tmp_path) -> Path:
    from lowbit.files.native import save

    return save(quantized_llama(), None, tmp_path / "ckpt")


def edit_manifest(folder: Path, **changes) -> None:
    m = json.loads((folder / "lowbit.json").read_text())
    for k, v in changes.items():
        if v is None:
            m.pop(k, None)
        else:
            m[k] = v
    (folder / "lowbit.json").write_text(json.dumps(m))


def flip_byte(path: Path, at: int = -10) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("files", [None, {}, {"config.json": "0" * 64}])
def test_native_checksums_cannot_be_switched_off(native_dir, files):
    from lowbit.files.native import load

    edit_manifest(native_dir, files=files)
    flip_byte(native_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match="no checksum for model.safetensors"):
        load(native_dir)


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "..", "sub/../../x"])
def test_native_manifest_cannot_name_files_outside_the_folder(native_dir, name):
    from lowbit.files.native import load

    m = json.loads((native_dir / "lowbit.json").read_text())
    edit_manifest(native_dir, files={**m["files"], name: "0" * 64})
    with pytest.raises(CheckpointError, match="not a plain file name"):
        load(native_dir)


def test_native_weights_symlinked_outside_are_refused(native_dir, tmp_path):
    from lowbit.files.native import load

    outside = tmp_path / "outside.safetensors"
    (native_dir / "model.safetensors").rename(outside)
    os.symlink(outside, native_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match="points outside"):
        load(native_dir)


def test_eval_of_a_checkpoint_without_checksums_is_one_line(native_dir, capsys):
    edit_manifest(native_dir, files=None)
    assert main(["eval", str(native_dir), "--windows", "1"]) == 2
    one_error_line(capsys, "no checksum")


# ------------------------------------------------------------------ adapter folders
@pytest.fixture
def adapter_dir(tmp_path):
    from lowbit.peft import PeftConfig, apply_adapters, save_adapters

    model = quantized_llama()
    cfg = PeftConfig("lora", rank=2)
    apply_adapters(model, cfg)
    return quantized_llama(), save_adapters(model, tmp_path / "ad", cfg)


def test_adapter_checksum_is_required(adapter_dir):
    from lowbit.peft import load_adapters

    base, folder = adapter_dir
    m = json.loads((folder / "adapter.json").read_text())
    del m["sha256"]
    (folder / "adapter.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="no sha256"):
        load_adapters(base, folder)


def test_adapter_file_missing_or_linked_outside_is_refused(adapter_dir, tmp_path):
    from lowbit.peft import load_adapters

    base, folder = adapter_dir
    outside = tmp_path / "outside.safetensors"
    (folder / "adapter.safetensors").rename(outside)
    with pytest.raises(CheckpointError, match="missing"):
        load_adapters(base, folder)
    os.symlink(outside, folder / "adapter.safetensors")
    with pytest.raises(CheckpointError, match="points outside"):
        load_adapters(base, folder)


def test_adapter_manifest_that_is_not_json_is_refused(adapter_dir, tmp_path):
    from lowbit.peft import load_adapters

    base, folder = adapter_dir
    marker = tmp_path / "pwned"
    (folder / "adapter.json").write_bytes(evil_pickle(marker))
    with pytest.raises(CheckpointError, match="corrupted"):
        load_adapters(base, folder)
    assert not marker.exists()


# ------------------------------------------------------------------ inspect and damaged files
def test_inspect_verifies_native_checksums(native_dir, capsys):
    assert main(["inspect", str(native_dir), "--json"]) == 0
    capsys.readouterr()
    flip_byte(native_dir / "model.safetensors")
    assert main(["inspect", str(native_dir)]) == 2
    one_error_line(capsys, "checksum")
    data = (native_dir / "model.safetensors").read_bytes()
    (native_dir / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert main(["inspect", str(native_dir)]) == 2
    one_error_line(capsys, "truncated or corrupted")


def test_inspect_of_a_truncated_compressed_tensors_folder_is_one_line(tmp_path, capsys):
    from safetensors.torch import save_file

    folder = tmp_path / "ct"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "compressed-tensors"}}))
    save_file({"w.weight_packed": torch.zeros(4, 4, dtype=torch.int32)}, str(folder / "model.safetensors"))
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-7])
    assert main(["inspect", str(folder)]) == 2
    one_error_line(capsys, "truncated or damaged")


@pytest.fixture
def truncated_gguf(tmp_path) -> Path:
    pytest.importorskip("gguf")
    from lowbit.files import gguf_export

    path = tmp_path / "m.gguf"
    gguf_export.export(quantized_llama(), None, path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    return path


def test_inspect_of_a_truncated_gguf_is_one_line(truncated_gguf, capsys):
    assert main(["inspect", str(truncated_gguf)]) == 2
    one_error_line(capsys, "truncated, damaged")


def test_loading_a_truncated_gguf_says_so(truncated_gguf, tmp_path, monkeypatch):
    from lowbit.models import load_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(ModelError, match="truncated, damaged") as e:
        load_model(truncated_gguf)
    assert "architecture" not in str(e.value)


def test_checkpoint_without_tokenizer(native_dir, tiny_tokenizer, tmp_path):
    from lowbit.files.native import load, require_tokenizer, save

    model, tok = load(native_dir)
    assert tok is None  # the library still loads the weights
    with pytest.raises(CheckpointError, match="has no tokenizer files; copy them"):
        require_tokenizer(tok, native_dir)
    with_tok = save(model, tiny_tokenizer, tmp_path / "with_tok")
    assert require_tokenizer(load(with_tok)[1], with_tok) is not None
    (with_tok / "tokenizer.json").write_text("{not json")  # its checksum is in lowbit.json now
    with pytest.raises(CheckpointError, match="tokenizer.json does not match its checksum"):
        load(with_tok)
    (native_dir / "tokenizer.json").write_text("{not json")  # copied into a checkpoint saved without one
    with pytest.raises(CheckpointError, match="tokenizer files .* cannot be read"):
        load(native_dir)


def test_eval_of_a_checkpoint_without_tokenizer_is_one_line(native_dir, capsys):
    assert main(["eval", str(native_dir), "--windows", "1"]) == 2
    one_error_line(capsys, "no tokenizer", "copy the tokenizer files")


# ------------------------------------------------------------------ stored quantized tensors
def packed_w4g32():
    from lowbit.formats import Scheme, quantize

    q = quantize(torch.randn(8, 64), Scheme.parse("w4g32"))
    return q, q.pack()


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.pop("scales"), "lacks"),
    (lambda d: d.update(codes=d["codes"][:, :-1]), "packed codes"),
    (lambda d: d.update(codes=d["codes"].float()), "packed codes"),
    (lambda d: d.update(scales=d["scales"][:4]), "scales have shape"),
    (lambda d: d.update(zeros=torch.zeros(8, 2)), "zero points are present"),
    (lambda d: d.update(tensor_scale=torch.ones(3)), "tensor scale"),
])
def test_from_packed_mismatch_is_a_checkpoint_error(edit, needle):
    from lowbit.formats import QTensor

    q, d = packed_w4g32()
    edit(d)
    with pytest.raises(CheckpointError, match=needle):
        QTensor.from_packed(d, q.shape, q.scheme)


def test_set_qweight_of_another_shape_is_a_scheme_error():
    from lowbit.errors import SchemeError
    from lowbit.nn import QuantLinear

    q, _ = packed_w4g32()
    layer = QuantLinear.from_linear(torch.nn.Linear(32, 8), "w4g32")
    with pytest.raises(SchemeError, match="cannot replace") as e:
        layer.set_qweight(q)
    assert isinstance(e.value, ValueError)  # callers that caught ValueError still do


def test_native_layer_shape_edited_is_a_checkpoint_error(native_dir):
    from lowbit.files.native import load

    m = json.loads((native_dir / "lowbit.json").read_text())
    name = next(iter(m["layers"]))
    m["layers"][name]["shape"][0] += 8
    (native_dir / "lowbit.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=f"layer {name}.*packed codes"):
        load(native_dir)


# ------------------------------------------------------------------ data files
def chat(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def test_instruction_rows_come_from_the_training_split_only(tmp_path, tiny_tokenizer):
    from lowbit.data import split_texts
    from lowbit.peft.finetune import instruction_rows

    path = tmp_path / "both.jsonl"
    recs = [chat(f"question number {i}", f"answer number {i}") if i % 2 == 0 else
            {"instruction": f"question number {i}", "output": f"answer number {i}"} for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in recs[:3]) + "\n\n" + "\n".join(json.dumps(r) for r in recs[3:]))
    rows = instruction_rows(tiny_tokenizer, path, seqlen=64)
    trained = [tiny_tokenizer.decode(r[0][r[0] != tiny_tokenizer.pad_token_id]) for r in rows]
    evaluated = split_texts(path, "eval", tiny_tokenizer)
    assert len(trained) == 3 and len(evaluated) == 3  # the blank line does not shift the split
    for i in range(6):
        where = trained if i % 2 == 0 else evaluated
        other = evaluated if i % 2 == 0 else trained
        assert sum(f"number {i}" in t for t in where) == 1 and not any(f"number {i}" in t for t in other)


BAD_RECORDS = [
    ({"messages": "hello"}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, "lacks a string 'content'"),
    ({"messages": [{"content": "hi"}]}, "lacks a string 'role'"),
    ({"messages": ["hi"]}, "message 0 is a str"),
    (["not", "an", "object"], "not an object"),
]


@pytest.mark.parametrize("record, needle", BAD_RECORDS)
def test_bad_chat_records_are_data_errors(tmp_path, tiny_tokenizer, record, needle):
    from lowbit.data import split_texts
    from lowbit.errors import DataError
    from lowbit.peft.finetune import instruction_rows

    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(record) for _ in range(4)) + "\n")
    for read in (lambda: split_texts(path, "calib", tiny_tokenizer), lambda: split_texts(path, "eval", tiny_tokenizer),
                 lambda: instruction_rows(tiny_tokenizer, path, seqlen=32)):
        with pytest.raises(DataError, match=f"bad.jsonl:1 *.*{needle}|bad.jsonl:2 *.*{needle}"):
            read()


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    """A tiny quantized Llama whose tokenizer has a chat template, saved natively."""
    from conftest import make_tokenizer

    from lowbit.files.native import save

    tok = make_tokenizer()
    return save(quantized_llama(len(tok)), tok, tmp_path_factory.mktemp("chat") / "q")


@pytest.mark.parametrize("record, needle", BAD_RECORDS[:2])
def test_bad_chat_records_are_one_line_in_finetune_and_quantize(chat_checkpoint, model_dir, tmp_path, capsys,
                                                                record, needle):
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(json.dumps(record) for _ in range(4)) + "\n")
    assert main(["finetune", str(chat_checkpoint), "--adapter", "lora", "--rank", "2", "--steps", "1",
                 "--batch-size", "2", "--seqlen", "24", "--data", str(data), "--no-eval",
                 "--out", str(tmp_path / "ft")]) == 2
    one_error_line(capsys, needle)
    assert main(["quantize", str(model_dir), "--scheme", "w4g32", "--data", str(data),
                 "--out", str(tmp_path / "q")]) == 2
    one_error_line(capsys, needle)
    assert not (tmp_path / "ft").exists() and not (tmp_path / "q").exists()


# ------------------------------------------------------------------ plan files
def test_plan_file_accepts_scheme_names_and_fields(tmp_path):
    from lowbit.formats import Scheme
    from lowbit.plans.plan import Plan

    f = tmp_path / "plan.json"
    f.write_text(json.dumps({"layers": {"a": "w4g128", "b": Scheme.parse("w2g64").to_dict()}}))
    plan = Plan.load(f)
    assert plan.weight("a") == Scheme.parse("w4g128") and plan.weight("b") == Scheme.parse("w2g64")


@pytest.mark.parametrize("content, needle", [
    ('{"a": "w4g128"}', "no 'layers' object"),
    ("{not json", "not valid JSON"),
    ('{"layers": {"a": "w7x"}}', "layer a: .*valid names"),
    ('{"layers": {"a": 4}}', "layer a: 4 is neither a scheme name"),
])
def test_bad_plan_files_show_the_accepted_format(tmp_path, content, needle):
    from lowbit.errors import ConfigError
    from lowbit.plans.plan import Plan

    f = tmp_path / "plan.json"
    f.write_text(content)
    with pytest.raises(ConfigError, match=needle) as e:
        Plan.load(f)
    assert '{"layers": {"model.layers.0.self_attn.q_proj": "w4g128"' in str(e.value)


def test_quantize_with_a_plan_of_scheme_names(model_dir, tmp_path, capsys):
    layers = {f"model.layers.0.{m}": "w4g32" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")}
    layers["model.layers.0.mlp.down_proj"] = "w8"
    (tmp_path / "plan.json").write_text(json.dumps({"layers": layers}))
    assert main(["quantize", str(model_dir), "--plan", str(tmp_path / "plan.json"), "--no-eval",
                 "--out", str(tmp_path / "q"), "--json"]) == 0
    manifest = json.loads((tmp_path / "q" / "lowbit.json").read_text())
    assert manifest["layers"]["model.layers.0.mlp.down_proj"]["scheme"]["bits"] == 8


@pytest.mark.parametrize("words, needle", [
    (5, "too few for even one sample of 64 tokens; use more text, or samples of at most"),
    (100, "at most 1 samples of 64 tokens"),
])
def test_short_calibration_text_message(tmp_path, words, needle):
    from lowbit.data import calibration_batches
    from lowbit.errors import DataError

    f = tmp_path / "short.txt"
    f.write_text(" ".join(WORDS[:words]) + "\n\nw1 w2")
    with pytest.raises(DataError, match=needle) as e:
        calibration_batches(word_tokenizer(), f, nsamples=4, seqlen=64)
    assert "at most 0" not in str(e.value)


# ------------------------------------------------------------------ PTQ work folders
def test_pickles_in_a_ptq_work_folder_never_run(tmp_path):
    from ptq_helpers import calib, tiny_model, uniform

    from lowbit.ptq.blockwise import PipelineOptions, quantize_blockwise
    from lowbit.ptq.methods import RunContext
    from lowbit.ptq.signround import SignRoundTuner, make_config

    def run(workdir):
        m = tiny_model(layers=2)
        cfg = make_config(iters=2, batch_size=4)
        return quantize_blockwise(m, uniform(m, "w4g32"), SignRoundTuner(cfg), {"config": cfg.to_dict()},
                                  RunContext(calib=calib(), workdir=workdir, progress=False), PipelineOptions(chunk=4))

    run(tmp_path / "w")
    marker = tmp_path / "pwned"
    (tmp_path / "w" / "block_0001.safetensors").write_bytes(evil_pickle(marker))
    with pytest.warns(UserWarning, match="block 1's saved result is"):
        assert [i.get("resumed", 0.0) for i in run(tmp_path / "w")] == [1.0, 0.0]
    (tmp_path / "w" / "run.json").write_bytes(evil_pickle(marker))
    with pytest.raises(CheckpointError, match="run.json"):
        run(tmp_path / "w")
    assert not marker.exists()


# ------------------------------------------------------------------ numbers out of range (issue 31)
def hf_copy(src: Path, tmp_path: Path, name: str = "m") -> Path:
    import shutil

    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def edit_config(folder: Path, **changes) -> None:
    c = json.loads((folder / "config.json").read_text())
    c.update(changes)
    (folder / "config.json").write_text(json.dumps(c))


QUICK = ["--method", "rtn", "--no-search", "--no-eval"]


def refused(capsys, tmp_path: Path, argv: list[str], *needles: str) -> str:
    """``main(argv)`` exits 2 with one error line holding the needles, and ``tmp_path/out`` was not written."""
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    line = one_error_line(capsys, *needles)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temporaries, no lock
    return line


@pytest.mark.parametrize("scheme", ["nvfp4:smax=inf", "nvfp4:smax=1e38", "nvfp4:smax=1e-42", "nvfp4:smax=nan",
                                    "nvfp4-46:smax=449", "nvfp4:smax=0@nvfp4", "nvfp4@nvfp4:smax=inf"])
def test_tensor_scale_smax_outside_e4m3_is_refused_naming_the_range(tiny_hf_dir, tmp_path, capsys, scheme):
    line = refused(capsys, tmp_path, ["quantize", str(tiny_hf_dir), "--scheme", scheme, *QUICK])
    assert "[0.015625, 448]" in line and "e4m3" in line


def test_smax_range_follows_the_block_scale_format():
    from lowbit.errors import SchemeError
    from lowbit.formats import InputScheme, Scheme

    assert Scheme.parse("nvfp4-ue5m3:tensor=1,smax=1e5").tensor_max == 1e5  # UE5M3 reaches 114688
    with pytest.raises(SchemeError, match=r"\[6.10352e-05, 114688\] for ue5m3"):
        Scheme.parse("nvfp4-ue5m3:tensor=1,smax=2e5")
    with pytest.raises(SchemeError, match="has none; drop smax"):  # nothing to apply it to: an error, not ignored
        Scheme.parse("w4g128:smax=3")
    with pytest.raises(SchemeError, match="has none; drop smax"):
        InputScheme.parse("mxfp4:smax=3")
    assert Scheme.parse("nvfp4:smax=0.015625").tensor_max == 2.0**-6  # the ends are included


@pytest.mark.parametrize("entry, needle", [
    ({"tensor_max": float("inf")}, "[0.015625, 448]"),
    ({"tensor_max": 1e-42}, "[0.015625, 448]"),
    ({"group_size": 32.5}, "group_size (block) must be a whole number, got 32.5"),
    ({"bits": 4.5}, "bits must be a whole number, got 4.5"),
    ({"sym": "no"}, "sym must be true or false, got 'no'"),
    ({"guard": 1}, "guard must be true or false"),
    ({"rule": None}, "rule is required"),
])
def test_plan_fields_of_the_wrong_kind_or_range_are_one_line(tiny_hf_dir, tmp_path, capsys, entry, needle):
    from lowbit.formats import Scheme

    base = Scheme.parse("nvfp4" if "tensor_max" in entry else "w4g32").to_dict()
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": {"model.layers.0.mlp.up_proj": {**base, **entry}}}))  # inf -> Infinity
    refused(capsys, tmp_path, ["quantize", str(tiny_hf_dir), "--plan", str(plan), *QUICK],
            "model.layers.0.mlp.up_proj", needle)


def test_whole_number_floats_in_plans_become_ints(tmp_path):
    from lowbit.formats import Scheme
    from lowbit.plans.plan import Plan

    f = tmp_path / "plan.json"
    f.write_text(json.dumps({"layers": {"a": {**Scheme.parse("w4g32").to_dict(), "group_size": 32.0, "bits": 4.0}}}))
    s = Plan.load(f).weight("a")
    assert s == Scheme.parse("w4g32") and isinstance(s.group_size, int) and s.name == "w4g32"


@pytest.mark.parametrize("argv, needle", [
    (["qat", "MODEL", "--scheme", "w2", "--steps", "4", "--no-eval", "--lr", "inf"], "lr must be a finite number"),
    (["qat", "MODEL", "--scheme", "w2", "--steps", "4", "--no-eval", "--lr", "nan"], "lr must be"),
    (["qat", "MODEL", "--scheme", "w2", "--steps", "4", "--no-eval", "--min-lr", "inf"], "min_lr must be a finite"),
    (["qat", "MODEL", "--scheme", "w2", "--steps", "4", "--no-eval", "--grad-clip", "inf"], "grad_clip must be a"),
    (["qat", "MODEL", "--scheme", "w2", "--steps", "4", "--no-eval", "--baseline", "nan"], "--baseline nan is not a"),
    (["qat", "MODEL", "--scheme", "w2", "--steps", "4", "--no-eval", "--baseline=-inf"], "finite positive"),
    (["qat", "MODEL", "--scheme", "w2", "--steps", "4", "--no-eval", "--kd", "--kd-temperature", "inf"],
     "kd_temperature must be a finite number"),
    (["quantize", "MODEL", "--avg-bits", "inf", "--options", "w2g64,w4g32", "--no-eval"], "--avg-bits must be a finite"),
    (["quantize", "MODEL", "--scheme", "w4g32", "--method", "gptq", "--damp", "nan", "--no-eval"], "damp must be a"),
    (["quantize", "MODEL", "--avg-bits", "nan", "--options", "w2g64,w4g32", "--no-eval"], "--avg-bits must be a finite"),
])
def test_non_finite_flags_are_refused_before_loading(tiny_hf_dir, tmp_path, capsys, argv, needle):
    refused(capsys, tmp_path, [a if a != "MODEL" else str(tiny_hf_dir) for a in argv], needle)


@pytest.mark.parametrize("flags, needle", [
    (["--adapter", "qwha", "--scale", "nan"], "scale must be a finite number"),
    (["--adapter", "lora", "--lr", "inf"], "lr must be a finite number"),
    (["--adapter", "fourierft", "--lr", "nan"], "lr must be a finite number"),
])
def test_non_finite_finetune_flags_are_refused(native_dir, tmp_path, capsys, flags, needle):
    refused(capsys, tmp_path, ["finetune", str(native_dir), *flags, "--steps", "1", "--no-eval"], needle)


def test_every_job_refuses_a_non_finite_float_field():
    """The one field check (`lowbit.configs.check_fields`) runs in every config and job the API builds."""
    import dataclasses

    from lowbit.api import Calibration, Evaluation, QatJob, QuantizeJob
    from lowbit.configs import check_fields
    from lowbit.errors import ConfigError, SchemeError
    from lowbit.peft import PeftConfig
    from lowbit.ptq import AWQSettings, GPTQSettings, MixedSettings, SignRoundSettings

    nan = float("nan")
    builds = [lambda: TrainConfig(steps=4, lr=nan), lambda: TrainConfig(steps=4, betas=(0.9, float("inf"))),
              lambda: PeftConfig(damp=nan), lambda: GPTQSettings(damp=float("inf")),
              lambda: SignRoundSettings(filter_frac=nan), lambda: MixedSettings(avg_bits=float("inf"), options="w4g32"),
              lambda: AWQSettings(grid=2.5), lambda: Calibration(nsamples=4.5), lambda: Evaluation(windows="2"),
              lambda: QatJob(out="o", scheme="w2", train=TrainConfig(steps=4), kd_temperature=nan),
              lambda: QuantizeJob(out="o", force="yes")]
    for build in builds:
        with pytest.raises((ConfigError, SchemeError)):
            build()
    from lowbit.formats import InputScheme, Scheme

    for cls in (Scheme, InputScheme):  # every float field of the schemes is covered by a check
        floats = [f.name for f in dataclasses.fields(cls) if f.type == "float"]
        for name in floats:
            with pytest.raises(SchemeError):
                cls(**{name: nan})
    assert check_fields.__doc__  # one helper, documented


# ------------------------------------------------------------------ model folders (issue 31)
def test_a_million_blocks_in_config_json_are_refused_not_built(tiny_hf_dir, tmp_path):
    """In its own process with a time limit: before the check, memory grew without end (no message at all)."""
    import subprocess
    import sys

    model = hf_copy(tiny_hf_dir, tmp_path)
    edit_config(model, num_hidden_layers=10**6)
    r = subprocess.run([sys.executable, "-m", "lowbit", "quantize", str(model), "--scheme", "w4g32", *QUICK,
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "num_hidden_layers = 1000000, but the weights hold blocks 0..1" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("changes, needle", [
    ({"num_hidden_layers": 3}, "num_hidden_layers = 3, but the weights hold blocks 0..1"),
    ({"hidden_size": 0}, "hidden_size must be a positive whole number, got 0"),
    ({"vocab_size": 1e10}, "vocab_size must be a positive whole number"),
    ({"vocab_size": 10**10}, "model.embed_tokens.weight [10000000000, 64], but model.safetensors stores [512, 64]"),
    ({"intermediate_size": 96}, "does not match the weights"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive whole number"),
    ({"num_attention_heads": 3}, "cannot read"),
])
def test_config_that_disagrees_with_the_weights_is_one_line(tiny_hf_dir, tmp_path, capsys, changes, needle):
    model = hf_copy(tiny_hf_dir, tmp_path)
    edit_config(model, **changes)
    refused(capsys, tmp_path, ["quantize", str(model), "--scheme", "w4g32", *QUICK], needle)


def test_missing_weights_that_transformers_would_initialize_are_refused(tiny_hf_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    model = hf_copy(tiny_hf_dir, tmp_path)
    w = load_file(model / "model.safetensors")
    del w["model.layers.1.post_attention_layernorm.weight"]
    save_file(w, model / "model.safetensors", metadata={"format": "pt"})
    refused(capsys, tmp_path, ["quantize", str(model), "--scheme", "w4g32", *QUICK],
            "lack model.layers.1.post_attention_layernorm.weight", "would be random")


def _header(path: Path) -> tuple[dict, bytes]:
    import struct

    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def _with_header(path: Path, header: dict, body: bytes) -> None:
    import struct

    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + body)


def _lying_header(path: Path) -> None:
    header, body = _header(path)
    header["model.norm.weight"]["shape"] = [65536, 65536]
    _with_header(path, header, body)


@pytest.mark.parametrize("damage, needle", [
    (lambda f, m: f.write_bytes(evil_pickle(m)), "is not a readable safetensors file (Error while deserializing"),
    (lambda f, m: f.write_bytes(f.read_bytes()[:-1000]), "truncated, damaged or another format"),
    (lambda f, m: _lying_header(f), "is not a readable safetensors file"),
    (lambda f, m: f.write_bytes(b""), "is not a readable safetensors file"),
])
def test_damaged_weight_files_are_one_line(tiny_hf_dir, tmp_path, capsys, damage, needle):
    model = hf_copy(tiny_hf_dir, tmp_path)
    marker = tmp_path / "pwned"
    damage(model / "model.safetensors", marker)
    refused(capsys, tmp_path, ["quantize", str(model), "--scheme", "w4g32", *QUICK], needle)
    assert not marker.exists()


def test_pickle_only_weights_are_refused_and_never_unpickled(tiny_hf_dir, tmp_path, capsys):
    model = hf_copy(tiny_hf_dir, tmp_path)
    marker = tmp_path / "pwned"
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(evil_pickle(marker))
    refused(capsys, tmp_path, ["quantize", str(model), "--scheme", "w4g32", *QUICK],
            "pytorch_model.bin", "lowbit reads no pickle", "safetensors")
    assert not marker.exists()


def test_integer_weights_are_refused_by_name(tiny_hf_dir, tmp_path, capsys):
    """transformers would cast int32 weights to float without a word (an x1000 copy became 1000x weights)."""
    from safetensors.torch import load_file, save_file

    model = hf_copy(tiny_hf_dir, tmp_path)
    w = load_file(model / "model.safetensors")
    w["model.layers.0.mlp.up_proj.weight"] = (w["model.layers.0.mlp.up_proj.weight"] * 1000).to(torch.int32)
    save_file(w, model / "model.safetensors", metadata={"format": "pt"})
    refused(capsys, tmp_path, ["quantize", str(model), "--scheme", "w4g32", *QUICK],
            "model.layers.0.mlp.up_proj.weight is stored as I32", "F32, F16 or BF16")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_source_weights_are_refused_by_name(tiny_hf_dir, tmp_path, capsys, value):
    from safetensors.torch import load_file, save_file

    model = hf_copy(tiny_hf_dir, tmp_path)
    w = load_file(model / "model.safetensors")
    w["model.layers.1.mlp.down_proj.weight"][3, 5] = value
    save_file(w, model / "model.safetensors", metadata={"format": "pt"})
    refused(capsys, tmp_path, ["quantize", str(model), "--scheme", "w4g32", *QUICK],
            "model.layers.1.mlp.down_proj.weight holds 1 NaN/inf value")
    refused(capsys, tmp_path, ["quantize", str(model), "--scheme", "w4g32", "--method", "signround2", "--iters", "1",
                               "--no-eval", "--offload-dir", str(tmp_path / "off")],
            "model.layers.1.mlp.down_proj.weight holds 1 NaN/inf value")  # lazily loaded: read tensor by tensor
