"""Unbounded or unsafe reads (issue 31, causes 8, 9, 10): what lowbit reads is bounded data.

- every JSON reader goes through `lowbit.io.read_json`: a deeply nested file is one line
  naming the file (it was a RecursionError traceback in ten readers);
- ``--data`` reads regular files only (a FIFO or ``/dev/zero`` is refused by name, not
  waited on or read forever), within stated size limits;
- ``--tasks`` files that would run Python (lm-eval's ``!function``, in the file or in a
  file it includes) are refused unless ``--trust-task-code``, and templates render in
  jinja2's sandbox.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
from test_hostile_inputs import one_error_line as one_error

from lowbit.cli import main
from lowbit.errors import CheckpointError, ConfigError, DataError, LowbitError

DEEP = "[" * 200_000  # Python's parser recursed once per level: RecursionError
DEEP_BUT_PARSEABLE = json.dumps({"layers": {"a": [[[[0]]]] * 1}}).replace("[0]", "[" * 150 + "0" + "]" * 150)


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (instead of hanging the suite) when the body blocks or reads forever."""
    def fire(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------ bounded JSON
@pytest.mark.parametrize("text", [DEEP, DEEP_BUT_PARSEABLE], ids=["recursion", "over-the-limit"])
def test_read_json_refuses_deep_nesting_in_one_line(tmp_path, text):
    from lowbit.io import read_json

    f = tmp_path / "x.json"
    f.write_text(text)
    with pytest.raises(CheckpointError, match=r"x.json is nested deeper than 100 levels.*; re-create it"):
        read_json(f, CheckpointError, "re-create it")


def test_read_json_refuses_big_files_and_non_files(tmp_path):
    from lowbit.io import read_json

    big = tmp_path / "big.json"
    big.write_text("[" + "0," * 1000 + "0]")
    with pytest.raises(CheckpointError, match="big.json is larger than 1.0 KiB"):
        read_json(big, CheckpointError, "fix", max_bytes=1024)
    fifo = tmp_path / "f.json"
    os.mkfifo(fifo)
    with deadline(10), pytest.raises(CheckpointError, match=r"f.json is a named pipe \(FIFO\), not a regular file"):
        read_json(fifo, CheckpointError, "fix")


def _native(tmp_path: Path) -> Path:
    from test_hostile_inputs import quantized_llama

    from lowbit.files.native import save

    return save(quantized_llama(), None, tmp_path / "ckpt")


def _adapter(tmp_path: Path) -> tuple:
    from test_hostile_inputs import quantized_llama

    from lowbit.peft import PeftConfig, apply_adapters, save_adapters

    model = quantized_llama()
    cfg = PeftConfig("lora", rank=2)
    apply_adapters(model, cfg)
    return quantized_llama(), save_adapters(model, tmp_path / "ad", cfg)


def _reader_cases():
    """(name, make the nested file and return a call that reads it, needle): the readers of issue 31."""
    from lowbit.files.inspect import inspect
    from lowbit.files.native import read_manifest
    from lowbit.io import lowbit_folder_files
    from lowbit.models.lazy import ShardSource
    from lowbit.peft import load_adapters
    from lowbit.plans.plan import Plan
    from lowbit.ptq.blockwise import WorkDir
    from lowbit.train.checkpoint import load_checkpoint
    from lowbit.train.metrics import read_losses

    def native_manifest(tmp):
        d = _native(tmp)
        (d / "lowbit.json").write_text(DEEP)
        return lambda: read_manifest(d)

    def plan(tmp):
        (tmp / "plan.json").write_text(DEEP)
        return lambda: Plan.load(tmp / "plan.json")

    def run_json(tmp):
        (tmp / "wd").mkdir()
        (tmp / "wd" / "run.json").write_text(DEEP)
        return lambda: WorkDir(tmp / "wd", {"method": "x"})

    def train_manifest(tmp):
        (tmp / "checkpoint.json").write_text(DEEP)
        return lambda: load_checkpoint(tmp / "checkpoint.json", "f", {})

    def baseline(tmp):
        (tmp / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n' + DEEP + "\n")
        return lambda: read_losses(tmp / "metrics.jsonl")

    def jsonl(tmp):
        from lowbit.data.sources import jsonl_records

        (tmp / "d.jsonl").write_text('{"text": "a"}\n' + DEEP + "\n")
        return lambda: jsonl_records(tmp / "d.jsonl")

    def ct_config(tmp):
        (tmp / "ct").mkdir()
        (tmp / "ct" / "config.json").write_text(DEEP)
        return lambda: inspect(tmp / "ct")

    def adapter(tmp):
        base, folder = _adapter(tmp)
        (folder / "adapter.json").write_text(DEEP)
        return lambda: load_adapters(base, folder)

    def shard_index(tmp):
        (tmp / "m").mkdir()
        (tmp / "m" / "model.safetensors.index.json").write_text(DEEP)
        return lambda: ShardSource.of(tmp / "m")

    def marker(tmp):
        (tmp / "o").mkdir()
        (tmp / "o" / ".lowbit").write_text(DEEP)
        return lambda: None if lowbit_folder_files(tmp / "o") is None else pytest.fail("a nested marker was read")

    return [("lowbit.json", native_manifest, "lowbit.json is nested deeper"),
            ("plan", plan, "plan.json is nested deeper"),
            ("run.json", run_json, "run.json is nested deeper"),
            ("checkpoint.json", train_manifest, "checkpoint.json is nested deeper"),
            ("--baseline", baseline, "metrics.jsonl:2 is not a metrics record"),
            (".jsonl line", jsonl, "d.jsonl:2 is nested deeper"),
            ("compressed-tensors config", ct_config, "config.json is nested deeper"),
            ("adapter.json", adapter, "adapter.json is nested deeper"),
            ("shard index", shard_index, "index.json is nested deeper"),
            (".lowbit marker", marker, None)]


@pytest.mark.parametrize("case", range(10), ids=[c[0] for c in _reader_cases()])
def test_every_json_reader_turns_deep_nesting_into_one_error(tmp_path, case):
    _, make, needle = _reader_cases()[case]
    call = make(tmp_path)
    if needle is None:
        call()  # the marker reader reports "no valid marker" (so --force refuses), never a traceback
        return
    with pytest.raises(LowbitError, match=needle):
        call()


def test_block_sidecar_nested_deeply_means_retune(tmp_path):
    from lowbit.ptq.blockwise import WorkDir

    wd = WorkDir(tmp_path / "wd", {"method": "x"})
    wd.block_file(0).write_bytes(b"x")
    wd.sidecar(0).write_text(DEEP)
    with pytest.warns(UserWarning, match="block_0000.json is damaged"):
        assert wd.done(2) == 0


def test_cli_nested_plan_and_manifest_are_one_line(tmp_path, tiny_hf_dir, capsys):
    (tmp_path / "plan.json").write_text(DEEP)
    assert main(["quantize", str(tiny_hf_dir), "--plan", str(tmp_path / "plan.json"), "--no-eval",
                 "--out", str(tmp_path / "o")]) == 2
    one_error(capsys, "plan.json is nested deeper than 100 levels")
    d = _native(tmp_path)
    (d / "lowbit.json").write_text(DEEP)
    assert main(["inspect", str(d)]) == 2
    one_error(capsys, "lowbit.json is nested deeper than 100 levels", "re-create the checkpoint")


# ------------------------------------------------------------------ --data
@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_data_fifo_is_refused_by_name_not_waited_on(tmp_path, suffix):
    from lowbit.data import load_documents

    fifo = tmp_path / f"pipe{suffix}"
    os.mkfifo(fifo)
    with deadline(10), pytest.raises(DataError, match=r"pipe\.\w+ is a named pipe \(FIFO\), not a regular file"):
        load_documents(fifo)


def limited(code: str, memory: int = 2 << 30) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with an address-space cap: a read without bounds fails there
    (MemoryError) instead of exhausting the machine; prints ``refused: MESSAGE`` for a `DataError`."""
    head = (f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))\n"
            "from lowbit.data import load_documents\nfrom lowbit.errors import DataError\n")
    body = "try:\n" + "".join(f"    {ln}\n" for ln in code.splitlines()) + "except DataError as e:\n    print('refused:', e)\n"
    return subprocess.run([sys.executable, "-c", head + body], capture_output=True, text=True, timeout=120)


def test_data_device_is_refused_by_name_not_read_forever():
    r = limited("load_documents('/dev/zero')")
    assert "refused: /dev/zero is a character device, not a regular file" in r.stdout, r.stderr[-800:]


def test_data_size_limits_are_stated_and_enforced(tmp_path, monkeypatch):
    from lowbit.data import load_documents, sources

    monkeypatch.setattr(sources, "MAX_SOURCE_BYTES", 10_000)
    monkeypatch.setattr(sources, "MAX_RECORD_CHARS", 1_000)
    big = tmp_path / "big.txt"
    big.write_text("word " * 2_001)
    with pytest.raises(DataError, match=r"big.txt is larger than 0 MiB, the most lowbit reads from a --data file"):
        load_documents(big)
    para = tmp_path / "para.txt"
    para.write_text("short\n\n" + "x" * 1_001 + "\n\nshort")
    with pytest.raises(DataError, match=r"para.txt, paragraph 2 is a record .* over the limit .* per record"):
        load_documents(para)
    rec = tmp_path / "rec.jsonl"
    rec.write_text('{"text": "a"}\n' + json.dumps({"text": "y" * 1_001}) + "\n")
    with pytest.raises(DataError, match=r"rec.jsonl:2 is a record .* per record"):
        load_documents(rec)


def test_binary_data_is_refused_from_its_first_bytes(tmp_path):
    """The 8 KiB binary check comes before the rest is read (a 1 GB sparse file took 27 s and 1.4 GB)."""
    f = tmp_path / "sparse.jsonl"
    with open(f, "wb") as h:
        h.truncate(3 << 30)  # 3 GiB of zeros, no disk used: more than the 2 GiB the reader may take
    r = limited(f"load_documents({str(f)!r})")
    assert "refused: " in r.stdout and "looks binary" in r.stdout, r.stderr[-800:]


def test_cli_data_fifo_is_one_line(tmp_path, tiny_hf_dir, capsys):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    with deadline(60):
        assert main(["eval", str(tiny_hf_dir), "--data", str(fifo), "--windows", "1"]) == 2
    one_error(capsys, "pipe.txt is a named pipe (FIFO)")


# ------------------------------------------------------------------ --tasks code
def _task(folder: Path, name: str = "t", extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    f = folder / f"{name}.yaml"
    f.write_text(f"task: {name}\ndataset_path: json\noutput_type: multiple_choice\ndoc_to_text: '{{{{q}}}}'\n{extra}")
    return f


def _evil_module(folder: Path, marker: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef process_docs(d):\n    return d\n")


@pytest.mark.parametrize("where", ["file", "folder", "included"])
def test_task_files_that_run_python_are_refused(tmp_path, where):
    from lowbit.eval.tasks import parse_tasks

    marker = tmp_path / "ran"
    _evil_module(tmp_path / "tasks", marker)
    if where == "included":
        _task(tmp_path / "tasks", "base", "process_docs: !function evil.process_docs\n")
        entry = _task(tmp_path / "tasks", "child", "include: base.yaml\n")
        (tmp_path / "tasks" / "base.yaml").rename(tmp_path / "tasks" / "base.yml.inc")
        entry.write_text(entry.read_text().replace("base.yaml", "base.yml.inc"))
        needle = r"base.yml.inc runs Python \(!function evil.process_docs at line 5\)"
    else:
        entry = _task(tmp_path / "tasks", "t", "process_docs: !function evil.process_docs\n")
        needle = r"t.yaml runs Python \(!function evil.process_docs at line 5\)"
    target = entry if where != "folder" else tmp_path / "tasks"
    with pytest.raises(ConfigError, match=needle + ".*--trust-task-code"):
        parse_tasks([str(target)])
    assert parse_tasks([str(target)], trust_code=True)
    assert not marker.exists()


def test_task_code_is_refused_before_the_model_loads(tmp_path, capsys):
    f = _task(tmp_path, "t", "process_docs: !function evil.process_docs\n")
    # the model does not exist: had it been loaded first, that would be the error
    assert main(["eval", str(tmp_path / "no-model"), "--tasks", str(f)]) == 2
    one_error(capsys, "runs Python (!function evil.process_docs", "--trust-task-code")
    assert main(["eval", "--trust-task-code"]) == 2
    one_error(capsys, "--trust-task-code applies to zero-shot task files; pass --tasks")


def test_eval_help_states_the_task_code_rule(capsys):
    assert main(["eval", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    assert "runs Python (!function) is refused, and templates render sandboxed, unless --trust-task-code" in out


def test_task_templates_render_sandboxed(monkeypatch):
    """lm-eval renders templates in a plain Jinja environment, where templates reach os; not under lowbit."""
    from jinja2 import BaseLoader, Environment, StrictUndefined
    from jinja2.exceptions import SecurityError

    from lowbit.eval.tasks import sandboxed_templates

    env = Environment(loader=BaseLoader(), undefined=StrictUndefined)
    utils = types.ModuleType("lm_eval.utils")
    utils.env = env
    utils.apply_template = lambda template, doc: env.from_string(template).render(**doc)
    task_mod = types.ModuleType("lm_eval.api.task")
    task_mod.apply_template = utils.apply_template  # bound by name, as a module importing it would be
    pkg = types.ModuleType("lm_eval")
    pkg.utils = utils
    for name, mod in (("lm_eval", pkg), ("lm_eval.utils", utils), ("lm_eval.api.task", task_mod)):
        monkeypatch.setitem(sys.modules, name, mod)
    payload = "{{ cycler.__init__.__globals__.os.getcwd() }}"
    assert utils.apply_template(payload, {}) == os.getcwd()  # what lm-eval itself does
    with sandboxed_templates():
        assert utils.apply_template("{{ q | upper }} {{ c[1] }}", {"q": "hi", "c": [1, 2]}) == "HI 2"
        for fn in (utils.apply_template, task_mod.apply_template):
            with pytest.raises(SecurityError):
                fn(payload, {})
    assert utils.apply_template(payload, {}) == os.getcwd()  # restored afterwards


def test_a_sandbox_refusal_names_the_flag():
    from jinja2.exceptions import SecurityError

    from lowbit.eval.tasks import explain_failure

    outer = RuntimeError("task failed")  # lm-eval wraps what the template raised
    outer.__cause__ = SecurityError("access to attribute '__init__' of 'Cycler' object is unsafe.")
    err = explain_failure(outer, ["t"])
    assert isinstance(err, ConfigError) and "--trust-task-code" in str(err)
