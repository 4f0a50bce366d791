"""Outputs, work folders and resumes under careless use (issue 31, causes 3, 13, 14, 15, 16, 17).

- ``--force`` never deletes a file the user saved into the old ``--out`` while the run worked;
- a write that fails after the work (disk full, a name too long) is one line, checked before
  the work where it can be, and the per-block work is kept for a resume;
- work folders are locked like ``--out``, may not be an input, and their errors name their flag;
- ``lowbit finetune`` resumes byte-identically from its work folder;
- a resume with other settings is refused before the float perplexity pass.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
from test_hostile_inputs import one_error_line as one_error

from lowbit import io
from lowbit.cli import main
from lowbit.errors import LowbitError

FAST = ["--scheme", "w4g32", "--no-search", "--no-eval"]


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> str:
    """A small --data file: tokenizing the bundled corpus again in every run would dominate these tests."""
    from lowbit.data import load_documents

    f = tmp_path_factory.mktemp("data") / "text.txt"
    f.write_text("\n\n".join(load_documents(None)[:120]))
    return str(f)


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def partials(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".partial", ".lock")))


# ------------------------------------------------------------------ --force at the moment of replacing
def drop_file_at_replace(monkeypatch, name: str, text: str = "mine") -> None:
    """Save a file into the old --out right before lowbit replaces it (the user did so mid-run)."""
    real = io._swap_into_place

    def swap(tmp: Path, final: Path) -> None:
        (final / name).write_text(text)
        real(tmp, final)

    monkeypatch.setattr(io, "_swap_into_place", swap)


def test_force_keeps_a_file_saved_into_the_old_out_while_running(tiny_hf_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "q"
    args = ["quantize", str(tiny_hf_dir), *FAST, "--out", str(out)]
    assert main(args) == 0
    drop_file_at_replace(monkeypatch, "notes.txt", "keep me")
    with pytest.warns(UserWarning, match="kept notes.txt"):
        assert main([*args, "--force"]) == 0  # the probe: notes.txt deleted, rc 0
    assert (out / "notes.txt").read_text() == "keep me"
    assert "notes.txt" not in json.loads((out / ".lowbit").read_text())["files"]  # not claimed as lowbit's
    monkeypatch.undo()
    assert main([*args, "--force"]) == 2  # so the next --force refuses to touch it
    one_error(capsys, "files lowbit did not write", "notes.txt")
    assert partials(tmp_path) == []


def test_a_file_the_new_result_would_overwrite_keeps_the_old_out_whole(tmp_path, monkeypatch):
    from lowbit.io import OutputError, atomic_dir

    final = tmp_path / "o"
    with atomic_dir(final) as tmp:
        (tmp / "a.bin").write_text("old")
    drop_file_at_replace(monkeypatch, "b.bin", "the user's")
    with pytest.raises(OutputError, match=r"holds files lowbit did not write .*\(b.bin; .*the new result is in .*o.new"):
        with atomic_dir(final, force=True) as tmp:
            (tmp / "a.bin").write_text("new")
            (tmp / "b.bin").write_text("new")
    assert (final / "a.bin").read_text() == "old" and (final / "b.bin").read_text() == "the user's"
    assert (tmp_path / "o.new" / "b.bin").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o", "o.new"]


def test_a_file_output_swapped_for_a_foreign_one_while_writing_is_kept(tmp_path):
    from lowbit.io import OutputError, atomic_file

    f = tmp_path / "m.gguf"
    f.write_text("the user's own file, put there mid-run")
    with pytest.raises(OutputError, match="replaced by a file lowbit did not write"):
        with atomic_file(f, may_replace=lambda p: False) as tmp:
            tmp.write_text("new")
    assert f.read_text() == "the user's own file, put there mid-run" and partials(tmp_path) == []


# ------------------------------------------------------------------ write failures
def test_a_name_too_long_for_the_temporary_is_refused_before_work(tiny_hf_dir, tmp_path, capsys, monkeypatch):
    from lowbit.models import loading

    monkeypatch.setattr(loading, "_load_dir", lambda *a: pytest.fail("loaded before refusing"))
    out = tmp_path / ("o" * 240)  # valid (240 < 255) but its temporary name is 265
    assert main(["quantize", str(tiny_hf_dir), *FAST, "--out", str(out)]) == 2
    one_error(capsys, "its name is 240 bytes", "choose a name of at most 230 bytes")
    assert main(["quantize", str(tiny_hf_dir), *FAST, "--method", "gptq", "--workdir", str(out),
                 "--out", str(tmp_path / "q")]) == 2
    one_error(capsys, "--workdir", "its name is 240 bytes")


def test_an_output_bigger_than_the_free_space_is_refused_before_work(tiny_hf_dir, tmp_path, capsys, monkeypatch):
    from lowbit.api.common import Evaluation

    monkeypatch.setattr(io, "_free_bytes", lambda folder: 1 << 20)
    monkeypatch.setattr(Evaluation, "perplexity", lambda *a, **k: pytest.fail("evaluated before refusing"))
    assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--no-search", "--out",
                 str(tmp_path / "q")]) == 2
    one_error(capsys, "the quantized checkpoint needs about", "1.0 MiB free", "choose another --out")
    assert list(tmp_path.iterdir()) == []


def disk_full(*_a, **_k):
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_a_full_disk_at_the_final_write_is_one_line_and_keeps_the_blocks(tiny_hf_dir, text, tmp_path, capsys,
                                                                           monkeypatch):
    from lowbit.files import native

    work, out = tmp_path / "w", tmp_path / "q"
    args = ["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--method", "gptq", "--nsamples", "4", "--seqlen",
            "32", "--no-eval", "--workdir", str(work), "--out", str(out), "--data", text]
    monkeypatch.setattr(native, "save_file", disk_full)
    assert main(args) == 2  # was a SafetensorError traceback after the work
    one_error(capsys, f"cannot write {out}: no space left on its device", f"--workdir {work}", "resume")
    assert not out.exists() and partials(tmp_path) == []
    blocks = {p.name: p.stat().st_mtime_ns for p in work.glob("block_*")}
    assert len(blocks) == 4  # two blocks, each a file and its sidecar
    monkeypatch.undo()
    assert main(args) == 0
    assert {p.name: p.stat().st_mtime_ns for p in work.glob("block_*")} == blocks  # resumed, not re-tuned


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   OSError("18432 requested and 7936 written")])  # numpy's short write (GGUF)
def test_write_failures_of_the_place_are_one_line(tmp_path, error):
    from lowbit.io import WriteError, atomic_file

    with pytest.raises(WriteError, match=r"cannot write .*m.gguf: no space left on its device"):
        with atomic_file(tmp_path / "m.gguf"):
            raise error
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OSError):  # still an OSError for callers that treat a write as optional
        with atomic_file(tmp_path / "m.gguf"):
            raise error


# ------------------------------------------------------------------ work folders
@pytest.fixture
def quantized(tiny_hf_dir, tmp_path):
    q = tmp_path / "q"
    assert main(["quantize", str(tiny_hf_dir), *FAST, "--out", str(q)]) == 0
    return q


def command(kind: str, tiny_hf_dir: Path, tmp_path: Path, work: Path, data: str | None = None) -> list[str]:
    return {"quantize": ["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--method", "gptq", "--nsamples", "4",
                         "--seqlen", "32", "--no-eval"],
            "qat": ["qat", str(tiny_hf_dir), "--scheme", "w2", "--steps", "2", "--batch-size", "2", "--seqlen", "32",
                    "--no-eval"],
            "finetune": ["finetune", str(tmp_path / "q"), "--adapter", "lora", "--rank", "2", "--steps", "2",
                         "--batch-size", "2", "--nsamples", "2", "--seqlen", "32", "--no-eval"],
            }[kind] + ["--workdir", str(work), "--out", str(tmp_path / f"out-{kind}")] + (["--data", data] if data else [])


@pytest.mark.parametrize("kind", ["quantize", "qat", "finetune"])
def test_a_work_folder_in_use_is_refused(kind, quantized, tiny_hf_dir, tmp_path, capsys):
    work = tmp_path / "shared-work"
    with io.output_lock(work, "--workdir"):  # another run holds it
        assert main(command(kind, tiny_hf_dir, tmp_path, work)) == 2
    one_error(capsys, f"another lowbit run is writing {work} right now", "choose another --workdir")
    assert not work.exists() and not (tmp_path / f"out-{kind}").exists()


def test_an_offload_folder_in_use_is_refused(tiny_hf_dir, tmp_path, capsys):
    off = tmp_path / "off"
    with io.output_lock(off, "--offload-dir"):
        assert main(["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--method", "gptq", "--nsamples", "4",
                     "--seqlen", "32", "--no-eval", "--offload-dir", str(off), "--out", str(tmp_path / "o")]) == 2
    one_error(capsys, "choose another --offload-dir")


@pytest.mark.parametrize("kind", ["quantize", "qat"])
def test_a_work_folder_may_not_be_an_input(kind, tiny_hf_dir, tmp_path, capsys):
    before = sorted(p.name for p in tiny_hf_dir.iterdir())
    for work in (tiny_hf_dir, tiny_hf_dir / "sub"):
        assert main(command(kind, tiny_hf_dir, tmp_path, work)) == 2
        one_error(capsys, f"--workdir {work} overlaps the input {tiny_hf_dir}")
    assert sorted(p.name for p in tiny_hf_dir.iterdir()) == before  # the probe: 13 files written into it


def test_an_unwritable_work_folder_names_its_flag(tiny_hf_dir, tmp_path, capsys, monkeypatch):
    import os

    from lowbit.api import outputs

    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(outputs.os, "access", lambda p, mode: Path(p) != ro and os.access(p, mode))
    assert main(command("quantize", tiny_hf_dir, tmp_path, ro / "w")) == 2
    one_error(capsys, f"cannot write to {ro} (permission denied); choose another --workdir")


# ------------------------------------------------------------------ finetune resume
class Killed(BaseException):
    """Stands for SIGKILL: nothing of lowbit's handles it."""


def kill_after_checkpoint(monkeypatch, step: int) -> None:
    from lowbit.train import checkpoint

    real = checkpoint.save_checkpoint

    def save(folder, **kw):
        path = real(folder, **kw)
        if kw["step"] == step:
            raise Killed
        return path

    monkeypatch.setattr(checkpoint, "save_checkpoint", save)


@pytest.mark.parametrize("adapter", ["qwha"])  # the default, whose init (AdaAlloc, refinement) is the most involved
def test_finetune_resumes_byte_identically_after_a_kill(adapter, quantized, text, tmp_path, capsys, monkeypatch):
    base = ["finetune", str(quantized), "--adapter", adapter, "--rank", "2", "--steps", "6", "--batch-size", "2",
            "--nsamples", "4", "--seqlen", "32", "--no-eval", "--checkpoint-every", "2", "--json", "--data", text]
    assert main([*base, "--out", str(tmp_path / "full")]) == 0
    full = last_json(capsys)
    assert full["resumed_from"] == 0 and (tmp_path / "full.train" / "metrics.jsonl").is_file()
    kill_after_checkpoint(monkeypatch, 4)
    with pytest.raises(Killed):
        main([*base, "--out", str(tmp_path / "part")])
    monkeypatch.undo()
    assert not (tmp_path / "part").exists()
    assert main([*base, "--out", str(tmp_path / "part")]) == 0
    again = last_json(capsys)
    assert again["resumed_from"] == 4 and again["loss_last"] == full["loss_last"]
    for name in ("adapter.safetensors",):
        assert (tmp_path / "part" / name).read_bytes() == (tmp_path / "full" / name).read_bytes()
    steps = [json.loads(x)["step"] for x in (tmp_path / "part.train" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))


@pytest.mark.parametrize("change,needle", [(["--lr", "1e-3"], "lr: checkpoint"), (["--rank", "3"], "extra.peft")])
def test_finetune_resume_with_other_settings_is_refused_before_work(change, needle, quantized, text, tmp_path,
                                                                     capsys, monkeypatch):
    from lowbit.api.common import Evaluation

    base = ["finetune", str(quantized), "--adapter", "lora", "--rank", "2", "--steps", "4", "--batch-size", "2",
            "--nsamples", "4", "--seqlen", "32", "--checkpoint-every", "2", "--windows", "1", "--eval-seqlen", "32",
            "--out", str(tmp_path / "a"), "--data", text, "--eval-data", text]
    kill_after_checkpoint(monkeypatch, 2)
    with pytest.raises(Killed):
        main(base)
    monkeypatch.undo()
    monkeypatch.setattr(Evaluation, "perplexity", lambda *a, **k: pytest.fail("evaluated before refusing"))
    args = list(base)
    for flag, value in zip(change[::2], change[1::2], strict=True):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    assert main(args) == 2
    one_error(capsys, "was written by a run with different settings", needle)


# ------------------------------------------------------------------ checks before heavy work
def test_a_ptq_resume_with_other_settings_is_refused_before_the_float_pass(tiny_hf_dir, text, tmp_path, capsys,
                                                                            monkeypatch):
    from lowbit.api.common import Evaluation

    work = tmp_path / "w"
    args = ["quantize", str(tiny_hf_dir), "--scheme", "w4g32", "--method", "signround2", "--iters", "1",
            "--nsamples", "4", "--seqlen", "32", "--batch-size", "4", "--no-eval", "--workdir", str(work),
            "--data", text]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    monkeypatch.setattr(Evaluation, "perplexity", lambda *a, **k: pytest.fail("evaluated before refusing"))
    for change, needle in ((["--iters", "2"], "(config)"), (["--scheme", "w4g64"], "(plan)"),
                           (["--seed", "3"], "calib")):
        other = [a for a in args if a != "--no-eval"] + ["--windows", "1", "--eval-seqlen", "32"]
        for flag, value in zip(change[::2], change[1::2], strict=True):
            if flag in other:
                other[other.index(flag) + 1] = value
            else:
                other += [flag, value]
        assert main([*other, "--out", str(tmp_path / "b")]) == 2
        one_error(capsys, "holds a run with different settings", needle)


def test_a_qat_resume_with_other_settings_is_refused_before_the_float_pass(tiny_hf_dir, text, tmp_path, capsys,
                                                                           monkeypatch):
    from lowbit.api.common import Evaluation

    args = ["qat", str(tiny_hf_dir), "--scheme", "w2", "--steps", "4", "--batch-size", "2", "--seqlen", "32",
            "--checkpoint-every", "2", "--workdir", str(tmp_path / "w"), "--data", text]
    assert main([*args, "--no-eval", "--out", str(tmp_path / "a")]) == 0
    monkeypatch.setattr(Evaluation, "perplexity", lambda *a, **k: pytest.fail("evaluated before refusing"))
    assert main([*args, "--lr", "1e-3", "--windows", "1", "--eval-seqlen", "32", "--out", str(tmp_path / "b")]) == 2
    one_error(capsys, "different settings (lr: checkpoint")
    shutil.rmtree(tmp_path / "a")


def test_free_space_messages_name_the_size(tmp_path, monkeypatch):
    from lowbit.io import OutputError, check_free_space

    monkeypatch.setattr(io, "_free_bytes", lambda folder: 3 << 30)
    check_free_space(tmp_path / "x", 2 << 30, "it")
    with pytest.raises(OutputError, match=r"it needs about 4.0 GiB at .*x, and its device has 3.0 GiB free"):
        check_free_space(tmp_path / "x", 4 << 30, "it")
    assert issubclass(OutputError, LowbitError)
