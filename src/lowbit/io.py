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
        from lowbit.errors import LowbitError

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
