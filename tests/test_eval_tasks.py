"""`lowbit eval --tasks`: task YAML files, task folders and registered names, and their errors.

The end-to-end tests run a tiny multiple-choice task whose data is a local .jsonl, so
they need no network; they skip when lm-eval is not installed (it is the ``eval`` extra).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowbit.cli import main
from lowbit.errors import ConfigError, DataError, LowbitError
from lowbit.eval.tasks import explain_failure, parse_tasks

TASK = "lowbit_tiny_mc"


def write_task(folder: Path, name: str = TASK) -> Path:
    """A 6-question multiple-choice task reading ``data.jsonl`` beside it; returns the YAML path."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "data.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"What is {i} plus one?", "choices": [str(i + 1), str(i + 2)],
                                          "answer": 0}) for i in range(6)) + "\n")
    yaml = folder / f"{name}.yaml"
    yaml.write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
                    "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    return yaml


def need_lm_eval() -> None:
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lowbit[eval]'); "
                                          "the --tasks end-to-end tests need it")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from conftest import make_llama, make_tokenizer

    d = tmp_path_factory.mktemp("evalmodel")
    tok = make_tokenizer()
    make_llama(len(tok), layers=1).save_pretrained(d)
    tok.save_pretrained(d)
    return d


# --------------------------------------------------------------- no lm-eval needed
def test_yaml_syntax_error_names_file_and_line(tmp_path):
    f = write_task(tmp_path)
    f.write_text(f.read_text().replace("test_split: test", "test_split: [test"))
    with pytest.raises(ConfigError, match=r"YAML syntax error at line \d+") as e:
        parse_tasks([str(f)])
    assert "offline" not in str(e.value)


def test_yaml_syntax_error_inside_a_task_folder(tmp_path):
    write_task(tmp_path / "tasks")
    (tmp_path / "tasks" / "broken.yaml").write_text("task: x\n  bad: indent: here\n")
    with pytest.raises(ConfigError, match="broken.yaml has a YAML syntax error"):
        parse_tasks([str(tmp_path / "tasks")])


@pytest.mark.parametrize("entry, needle", [
    ("missing/task.yaml", "does not exist"),
    ("nothing.yaml", "does not exist"),
    (" , ", "--tasks is empty"),
])
def test_bad_task_entries(entry, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_tasks(entry.split(","))


def test_a_yaml_that_is_not_a_task_config(tmp_path):
    (tmp_path / "x.yaml").write_text("just: data\n")
    with pytest.raises(ConfigError, match="not an lm-eval task config"):
        parse_tasks([str(tmp_path / "x.yaml")])


def test_function_tags_are_not_run_while_checking(tmp_path):
    f = write_task(tmp_path)
    f.write_text(f.read_text() + "process_docs: !function utils.process_docs\n")
    (tmp_path / "utils.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    with pytest.raises(ConfigError, match=r"runs Python \(!function utils.process_docs at line \d+\).*--trust-task-code"):
        parse_tasks([str(f)])
    assert parse_tasks([str(f)], trust_code=True).specs == [str(f.resolve())]
    assert not (tmp_path / "ran").exists()


def test_only_download_failures_blame_offline_data():
    from huggingface_hub.errors import OfflineModeIsEnabled

    try:
        try:
            raise OfflineModeIsEnabled("offline mode is enabled")
        except OfflineModeIsEnabled as inner:
            raise ConnectionError("Couldn't reach 'allenai/ai2_arc' on the Hub") from inner
    except ConnectionError as e:
        offline = explain_failure(e, ["arc_easy"])
    assert isinstance(offline, DataError) and "datasets cache" in str(offline)
    other = explain_failure(ValueError("doc_to_target returned a list"), ["t"])
    assert type(other) is LowbitError and "offline" not in str(other) and "cache" not in str(other)
    missing = explain_failure(FileNotFoundError("data.jsonl"), ["t"])
    assert isinstance(missing, DataError) and "data_files" in str(missing) and "offline" not in str(missing)


# --------------------------------------------------------------- with lm-eval
def test_eval_cli_runs_a_local_task_yaml(model_dir, tmp_path, capsys):
    need_lm_eval()
    yaml = write_task(tmp_path / "t")
    assert main(["eval", str(model_dir), "--windows", "1", "--seqlen", "32", "--tasks", str(yaml), "--limit", "4",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0.0 <= r["tasks"][TASK]["acc,none"] <= 1.0


def test_task_folder_and_its_names(model_dir, tmp_path):
    need_lm_eval()
    from lowbit.eval.tasks import resolve, task_manager
    from lowbit.models import load_model

    write_task(tmp_path / "suite", TASK)
    write_task(tmp_path / "suite" / "more", "lowbit_tiny_mc2")
    parsed = parse_tasks([str(tmp_path / "suite"), TASK, "arc_easy"])
    assert resolve(parsed, task_manager(parsed)) == [TASK, "lowbit_tiny_mc2", "arc_easy"]  # registered names too
    from lowbit.eval import zero_shot

    lm = load_model(model_dir)
    out = zero_shot(lm.model, lm.tokenizer, [str(tmp_path / "suite"), TASK], limit=2)
    assert sorted(out) == [TASK, "lowbit_tiny_mc2"]  # the folder's tasks, each once
    with pytest.raises(ConfigError, match=r"unknown lm-eval task 'arc_easyy'; did you mean arc_easy"):
        zero_shot(lm.model, lm.tokenizer, ["arc_easyy"])
