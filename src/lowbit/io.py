"""Atomic file and folder writes: results appear complete or not at all.

Everything lowbit writes goes to a temporary path in the same folder, is fsynced, then
renamed into place — a crash or a bad input never leaves a half-written checkpoint
that a later ``load`` could mistake for a good one. Temporary names have one shape,
``.NAME.lowbit-XXXX.partial``, so a later run writing ``NAME`` (holding its lock) can
recognise and remove what a killed run left behind.

Every folder lowbit writes carries a small ``.lowbit`` file naming what wrote it and
the files it holds: ``--force`` replaces such a folder only while it holds nothing else,
so a user's own files (or the input model) are never deleted by a replace.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lowbit.errors import CheckpointError, LowbitError

MARKER = ".lowbit"
_STAGE = "lowbit-"


class OutputError(LowbitError):
    """An output path that cannot be written, is busy, or must not be replaced."""


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stage_prefix(path: Path) -> str:
    return f".{path.name}.{_STAGE}"


def stale_partials(path: Path) -> list[Path]:
    """Temporaries of ``path`` left by killed runs (``.NAME.lowbit-XXXX.partial`` beside it)."""
    path = Path(path)
    pattern = re.compile(re.escape(_stage_prefix(path)) + r"[A-Za-z0-9_-]+\.partial$")
    try:
        return sorted(p for p in path.parent.iterdir() if pattern.match(p.name))
    except FileNotFoundError:
        return []


def remove_stale_partials(path: Path) -> list[Path]:
    """Delete `stale_partials` of ``path``; only safe while holding `output_lock` on it."""
    gone = stale_partials(path)
    for p in gone:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
    return gone


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it into place.

    For writers that want a file name rather than bytes (GGUF, safetensors). On any
    error the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_stage_prefix(path), suffix=".partial", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        fsync_path(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


@contextlib.contextmanager
def atomic_dir(final: Path, force: bool = False, kind: str = "folder") -> Iterator[Path]:
    """Build a folder under a temporary name; rename it to ``final`` only on success.

    An existing ``final`` is replaced only with ``force`` (it is removed after the new
    folder is complete, so a failure keeps the old one). The finished folder gets a
    ``.lowbit`` marker listing its files (``kind`` says what it is).
    """
    final = Path(final)
    if final.exists() and not force:
        raise OutputError(f"{final} already exists; choose another --out or pass --force to replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_stage_prefix(final), suffix=".partial", dir=final.parent))
    try:
        yield tmp
        files = sorted(p.name for p in tmp.iterdir())
        (tmp / MARKER).write_text(json.dumps({"written_by": "lowbit", "kind": kind, "files": files}))
        for p in tmp.iterdir():
            if p.is_file():
                fsync_path(p)
        _swap_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_into_place(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``, moving an existing ``final`` aside first and deleting it after."""
    old = None
    if final.exists() or final.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=_stage_prefix(final), suffix=".partial", dir=final.parent))
        try:
            os.replace(final, old / "old")
        except FileNotFoundError:  # removed meanwhile by someone else: nothing to keep aside
            pass
    try:
        os.replace(tmp, final)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR, errno.ENOTDIR):
            raise
        raise OutputError(f"{final} was created by another process while this one was writing it; "
                          "nothing was replaced — run again, or choose another --out") from None
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    fsync_path(final.parent)


def lowbit_folder_files(folder: Path) -> list[str] | None:
    """The files a lowbit-written folder's marker lists, or None if it has no valid marker."""
    marker = Path(folder) / MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("written_by") != "lowbit" or not isinstance(info.get("files"), list):
        return None
    return [str(f) for f in info["files"]]


def foreign_files(folder: Path) -> list[str] | None:
    """Names in ``folder`` that lowbit did not write there (None: no lowbit marker at all)."""
    listed = lowbit_folder_files(folder)
    if listed is None:
        return None
    allowed = set(listed) | {MARKER}
    return sorted(p.name for p in Path(folder).iterdir() if p.name not in allowed)


@contextlib.contextmanager
def output_lock(final: Path) -> Iterator[None]:
    """Hold an exclusive lock on writing ``final`` for the body (``.NAME.lock`` beside it).

    Two runs writing the same output at once would race on the final rename and both
    report success while one result survives; the second run is refused instead.
    """
    final = Path(final)
    lock = final.with_name(f".{final.name}.lock")
    fd = _acquire(lock, final)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
        os.close(fd)


def _acquire(lock: Path, final: Path) -> int:
    import fcntl

    for _ in range(3):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(f"another lowbit run is writing {final} right now; wait for it to finish or "
                              "choose another --out") from None
        try:  # the holder before us may have unlinked the file we opened: lock the one on disk
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                os.write(fd, f"{os.getpid()}\n".encode())
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise OutputError(f"could not lock {lock}; another run keeps replacing it — try again")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_inside(folder: Path, name: object, what: str) -> Path:
    """The file ``name`` of a manifest, refused unless it is a plain file name inside ``folder``.

    Manifests are data anyone can edit; a name such as ``../../etc/passwd``, an absolute
    path or a symlink pointing out of the folder would make lowbit read (and hash, and
    parse) a file the folder's owner never meant to hand over.
    """
    folder = Path(folder)
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or os.path.isabs(name) or "\0" in name:
        raise CheckpointError(f"{what} names the file {name!r}, which is not a plain file name inside {folder}; "
                              "the manifest was edited — re-create the folder")
    path = folder / name
    if not path.resolve().is_relative_to(folder.resolve()):
        raise CheckpointError(f"{path} points outside {folder} (a symlink); {what} may only name files inside "
                              "its own folder — replace the link with the file itself or re-create the folder")
    return path
