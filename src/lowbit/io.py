"""Atomic file and folder writes: results appear complete or not at all.

Everything lowbit writes goes to a temporary path in the same folder, is fsynced, then
renamed into place — a crash or a bad input never leaves a half-written checkpoint
that a later ``load`` could mistake for a good one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lowbit.errors import CheckpointError, LowbitError


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it into place.

    For writers that want a file name rather than bytes (GGUF, safetensors). On any
    error the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
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
def atomic_dir(final: Path, force: bool = False) -> Iterator[Path]:
    """Build a folder under a temporary name; rename it to ``final`` only on success.

    An existing ``final`` is replaced only with ``force`` (it is removed after the new
    folder is complete, so a failure keeps the old one).
    """
    final = Path(final)
    if final.exists() and not force:
        raise LowbitError(f"{final} already exists; choose another --out or pass --force to replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    try:
        yield tmp
        for p in tmp.iterdir():
            if p.is_file():
                fsync_path(p)
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_path(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
