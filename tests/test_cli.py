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
])
def test_bad_input_is_one_clear_line(tmp_path, capsys, args, needle):
    args = [a.replace("OUT", str(tmp_path / "out")) for a in args]
    code = main(args)
    err = capsys.readouterr().err
    assert code != 0
    assert needle in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


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
