"""Where a job writes its result: checked before any work, locked while the job runs.

Rules, the same for every command:
- ``--out`` may not be (or contain, or lie inside) any input of the job: a model folder
  or file, a plan, a data file.
- an existing ``--out`` is replaced only with ``--force``, and only when lowbit wrote it:
  a folder whose ``.lowbit`` marker lists every file in it, or a GGUF file carrying
  lowbit's metadata. A folder holding anything else, or a file lowbit did not write,
  is refused with the reason.
- the place must be writable: no file where a parent folder should be, no read-only folder.
- while a job runs it holds a lock on its output: a second run writing the same output
  is refused at once, and temporaries that killed runs left beside it are removed.
- the name must leave room for lowbit's temporary name on its file system, checked
  before any work (a 240-character name otherwise failed after the whole run).
- side folders (``--workdir``, ``--offload-dir``) follow the same rules where they apply:
  never an input, a writable place, locked while a job uses them (`hold_folder`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from lowbit.io import OutputError, check_name_length, foreign_files, output_lock, remove_stale_partials


def resolve(path: str | Path) -> Path:
    """Absolute form of a user path (``~`` expanded, symlinks resolved where they exist)."""
    return Path(path).expanduser().resolve()


def check_output(out: str | Path, force: bool, inputs: Iterable[str | Path | None] = (),
                 file_output: bool = False) -> Path:
    """Validate ``out`` (see module docstring) without touching anything; returns it resolved."""
    target = resolve(out)
    _check_not_an_input(target, inputs)
    _check_writable_place(target)
    check_name_length(target)
    if target.exists() or target.is_symlink():
        if not force:
            raise OutputError(f"{out} already exists; choose another --out or pass --force to replace it")
        _check_replaceable(target, file_output)
    elif file_output and str(out).endswith(os.sep):
        raise OutputError(f"{out} names a folder, but this output is one file (e.g. model.gguf)")
    return target


def check_folder(folder: str | Path, out: str | Path, what: str = "--workdir",
                 inputs: Iterable[str | Path | None] = ()) -> Path:
    """A side folder of a job (work or offload folder): creatable here, not inside ``--out``, not an input."""
    path, target = resolve(folder), resolve(out)
    if path == target or path.is_relative_to(target) or target.is_relative_to(path):
        raise OutputError(f"{what} {path} overlaps --out {target}; --out is replaced when the job ends, "
                          "so keep the two apart")
    _check_not_an_input(path, inputs, what)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path} is a file; give a folder")
    _check_writable_place(path / "x", what)
    check_name_length(path, what)
    return path


@contextlib.contextmanager
def hold_folder(folder: str | Path | None, what: str = "--workdir") -> Iterator[None]:
    """Lock a side folder for the body: two runs sharing one work folder would interleave its files."""
    if folder is None:
        yield
        return
    path = resolve(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(path, what):
        yield


def _check_not_an_input(target: Path, inputs: Iterable[str | Path | None], what: str = "--out") -> None:
    for item in inputs:
        if item is None or not Path(item).expanduser().exists():
            continue
        src = resolve(item)
        if target == src or src.is_relative_to(target) or target.is_relative_to(src):
            where = "would overwrite the input" if what == "--out" else "overlaps the input"
            raise OutputError(f"{what} {target} {where} {src}; "
                              f"{'write the result' if what == '--out' else 'give a folder'} somewhere else")


def _check_writable_place(target: Path, what: str = "--out") -> None:
    parent = target.parent
    while not parent.exists():
        if parent.is_symlink():
            raise OutputError(f"cannot create {target}: {parent} is a broken link")
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"cannot create {target}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write to {parent} (permission denied); choose another {what}")


def _check_replaceable(target: Path, file_output: bool) -> None:
    if target.is_dir() and not target.is_symlink():
        if file_output:
            raise OutputError(f"{target} is a folder; this output is one file: give a file path (e.g. model.gguf)")
        foreign = foreign_files(target)
        if foreign is None:
            raise OutputError(f"--force replaces only what lowbit wrote, and {target} is not a lowbit output; "
                              "choose another --out (or delete it yourself)")
        if foreign:
            raise OutputError(f"--force would delete files lowbit did not write in {target} ({', '.join(foreign[:3])}"
                              f"{'...' if len(foreign) > 3 else ''}); move them away or choose another --out")
        return
    if not file_output:
        raise OutputError(f"{target} is a file, not a lowbit output folder; choose another --out")
    from lowbit.files import targets  # each one-file export knows its own marker

    if targets.written_by_lowbit(target) is None:
        raise OutputError(f"--force replaces only files lowbit wrote, and {target} is not a file lowbit exported "
                          f"({' | '.join(targets.FILE_TARGETS)}); choose another --out (or delete it yourself)")


@contextlib.contextmanager
def claim(out: str | Path, force: bool, inputs: Iterable[str | Path | None] = (),
          file_output: bool = False) -> Iterator[Path]:
    """Check ``out``, lock it for the body and clear what killed runs left; yields it resolved."""
    inputs = list(inputs)
    target = check_output(out, force, inputs, file_output)
    target.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(target):
        remove_stale_partials(target)
        check_output(target, force, inputs, file_output)  # another run may have finished meanwhile
        yield target
