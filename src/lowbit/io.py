"""Atomic file and folder writes: results appear complete or not at all.

Everything lowbit writes goes to a temporary path in the same folder, is fsynced, then
renamed into place — a crash or a bad input never leaves a half-written checkpoint
that a later ``load`` could mistake for a good one. Temporary names have one shape,
``.NAME.lowbit-XXXX.partial``, so a later run writing ``NAME`` (holding its lock) can
recognise and remove what a killed run left behind.

Every folder lowbit writes carries a small ``.lowbit`` file naming what wrote it and
the files it holds: ``--force`` replaces such a folder only while it holds nothing else,
so a user's own files (or the input model) are never deleted by a replace — checked when
the run starts and again at the moment of the replace.

Reading is bounded too: `read_json` is the one reader of every JSON file lowbit parses
(size and nesting limits, regular files only), and `open_regular` refuses FIFOs and
devices by name instead of blocking on them or reading forever.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from lowbit.errors import CheckpointError, LowbitError

MARKER = ".lowbit"
_STAGE = "lowbit-"


class OutputError(LowbitError):
    """An output path that cannot be written, is busy, or must not be replaced."""


class WriteError(OutputError, OSError):
    """Writing failed for a reason of the place (full, read-only, name too long): one line, no traceback.

    Also an ``OSError``, so callers that treat a failed write as optional (a cache) still catch it.
    """


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
def atomic_file(path: Path, may_replace: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it into place.

    For writers that want a file name rather than bytes (GGUF, safetensors). On any
    error the temporary file is removed and ``path`` is untouched. may_replace: asked
    again right before the rename when ``path`` exists (it may have been replaced by a
    file lowbit did not write while this one was being written); False refuses the replace.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_stage_prefix(path), suffix=".partial", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        fsync_path(Path(tmp))
        if may_replace is not None and (path.exists() or path.is_symlink()) and not may_replace(path):
            raise OutputError(f"{path} was replaced by a file lowbit did not write while this run was writing it; "
                              "it was left as it is — move it away (or choose another --out) and rerun")
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        failure = write_error(e, path)
        if failure is not None:
            raise failure from None
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
    folder is complete, so a failure keeps the old one), and files in it that its own
    marker does not list are kept (see `_swap_into_place`). The finished folder gets a
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
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        failure = write_error(e, final)
        if failure is not None:
            raise failure from None
        raise


def _swap_into_place(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``, moving an existing ``final`` aside first and deleting it after.

    The old folder was checked to hold only lowbit's files when the run started, but the
    user may have saved something into it since. Once it is moved aside (so nothing new
    can arrive through its path), whatever its marker does not list is carried into the
    new folder, where it stays under the name it had; only lowbit's own files are deleted
    (a folder without a readable marker has none). When that is impossible (a name the
    new folder also has), the old folder is put back untouched and the new result is
    kept beside it.
    """
    old = None
    if final.exists() or final.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=_stage_prefix(final), suffix=".partial", dir=final.parent))
        try:
            os.replace(final, old / "old")
        except FileNotFoundError:  # removed meanwhile by someone else: nothing to keep aside
            pass
    try:
        if old is not None and (old / "old").exists():
            _keep_foreign(old / "old", tmp, final)
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


def _keep_foreign(old: Path, new: Path, final: Path) -> None:
    """Move the entries of ``old`` that lowbit did not write into ``new`` (see `_swap_into_place`)."""
    if not old.is_dir() or old.is_symlink():
        return
    foreign = foreign_files(old)
    if foreign is None:  # no readable marker (any more): nothing in it is known to be lowbit's
        foreign = sorted(p.name for p in old.iterdir())
    clash = [n for n in foreign if (new / n).exists() or (new / n).is_symlink()]
    if clash:
        os.replace(old, final)  # back where it was, untouched
        kept = _keep_result(new, final)
        raise OutputError(f"{final} holds files lowbit did not write that the new result would overwrite "
                          f"({', '.join(clash[:3])}; added while this run was writing it?), so it was left as it is; "
                          + (f"the new result is in {kept}" if kept else "the new result was discarded")
                          + " — move your files away and rerun (or choose another --out)")
    for name in foreign:
        os.replace(old / name, new / name)
    if foreign:
        import warnings

        warnings.warn(f"kept {', '.join(foreign[:3])}{'...' if len(foreign) > 3 else ''} in {final}: added while "
                      "this run was writing it, so not lowbit's to delete", stacklevel=4)


def _keep_result(tmp: Path, final: Path) -> Path | None:
    """A finished result that cannot take its place: renamed to a free visible name beside it."""
    for k in range(1, 100):
        cand = final.with_name(f"{final.name}.new{k if k > 1 else ''}")
        if not cand.exists() and not cand.is_symlink():
            try:
                os.rename(tmp, cand)
                return cand
            except OSError:
                return None
    return None


def lowbit_folder_files(folder: Path) -> list[str] | None:
    """The files a lowbit-written folder's marker lists, or None if it has no valid marker."""
    marker = Path(folder) / MARKER
    try:
        info = read_json(marker, OutputError, "", max_bytes=1 << 20)
    except (OSError, LowbitError):
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
def output_lock(final: Path, flag: str = "--out") -> Iterator[None]:
    """Hold an exclusive lock on writing ``final`` for the body (``.NAME.lock`` beside it).

    Two runs writing the same output (or work folder: ``flag`` names it) at once would
    race on the final rename, or interleave their files, and both report success while
    one result survives; the second run is refused instead.
    """
    final = Path(final)
    lock = final.with_name(f".{final.name}.lock")
    fd = _acquire(lock, final, flag)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
        os.close(fd)


def _acquire(lock: Path, final: Path, flag: str) -> int:
    import fcntl

    for _ in range(3):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(f"another lowbit run is writing {final} right now; wait for it to finish or "
                              f"choose another {flag}") from None
        try:  # the holder before us may have unlinked the file we opened: lock the one on disk
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                os.write(fd, f"{os.getpid()}\n".encode())
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise OutputError(f"could not lock {lock}; another run keeps replacing it — try again")


# ------------------------------------------------------------------ write failures
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_DENIED = (errno.EROFS, errno.EACCES, errno.EPERM)


def _os_errno(e: BaseException) -> int | None:
    """The errno behind a failed write: an OSError's, or the ``(os error N)`` a Rust writer (safetensors) reports.

    numpy's ``tofile`` reports a short write ("N requested and M written") without an errno:
    that is a full device too.
    """
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno
    m = re.search(r"\(os error (\d+)\)", str(e))
    if m:
        return int(m.group(1))
    if isinstance(e, OSError) and re.search(r"\d+ requested and \d+ written", str(e)):
        return errno.ENOSPC
    return None


def write_error(e: BaseException, path: Path) -> WriteError | None:
    """A one-line `WriteError` for a write of ``path`` that failed because of the place, else None."""
    if isinstance(e, LowbitError):
        return None
    code = _os_errno(e)
    path = Path(path)
    if code in _FULL:
        free = _free_bytes(path.parent)
        return WriteError(f"cannot write {path}: no space left on its device ({_size(free)} free); free some space "
                          "there, or write somewhere else, and rerun")
    if code == errno.ENAMETOOLONG:
        return WriteError(f"cannot write {path}: a file name there is too long for the file system; choose a "
                          "shorter name")
    if code in _DENIED:
        return WriteError(f"cannot write {path} (permission denied or a read-only file system); write somewhere "
                          "else")
    return None


def _free_bytes(folder: Path) -> int:
    folder = existing_ancestor(folder)
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where a folder about to be created will live)."""
    path = Path(path)
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


# Temporary names add ".", ".lowbit-", 8 random characters and ".partial" to a name.
STAGE_EXTRA = len(f"..{_STAGE}") + 8 + len(".partial")


def check_name_length(path: Path, flag: str = "--out") -> None:
    """Refuse, before any work, a name whose temporary or lock name would be too long for its file system."""
    path = Path(path)
    try:
        limit = os.pathconf(existing_ancestor(path.parent), "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    n = len(os.fsencode(path.name))
    if n + STAGE_EXTRA > limit:
        raise OutputError(f"{flag} {path}: its name is {n} bytes, and lowbit writes it under a temporary name "
                          f"{STAGE_EXTRA} bytes longer, over this file system's limit of {limit}; choose a name of "
                          f"at most {limit - STAGE_EXTRA} bytes")


def check_free_space(path: Path, need: int, what: str, flag: str = "--out") -> None:
    """Refuse, before any work, an output of about ``need`` bytes on a device with less free space."""
    free = _free_bytes(Path(path).parent)
    if need > free:
        raise OutputError(f"{what} needs about {_size(need)} at {path}, and its device has {_size(free)} free; "
                          f"free some space or choose another {flag}")


# ------------------------------------------------------------------ bounded reads
JSON_MAX_BYTES = 64 << 20  # lowbit's own JSON files are kilobytes to a few megabytes
JSON_MAX_DEPTH = 100  # and nest a dozen levels at most


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path, error: type[LowbitError], fix: str) -> IO[bytes]:
    """``path`` opened for reading, refused unless it is a regular file (FIFOs, devices, sockets, folders).

    The file is opened without blocking first: opening a FIFO that no one writes to would
    otherwise hang, and a device such as ``/dev/zero`` never ends.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{path} does not exist; {fix}") from None
    except IsADirectoryError:
        raise error(f"{path} is a folder, not a file; {fix}") from None
    except OSError as e:
        raise error(f"cannot open {path} ({e.strerror}); {fix}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{path} is {_kind(mode)}, not a regular file; {fix}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_regular(path: Path, max_bytes: int, error: type[LowbitError], fix: str) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``; a larger one is refused as soon as that is clear."""
    with open_regular(path, error, fix) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise error(f"cannot read {path} ({e.strerror}); {fix}") from None
    if len(data) > max_bytes:
        raise error(f"{path} is larger than {_size(max_bytes)}, more than lowbit reads from such a file; {fix}")
    return data


def parse_json(data: bytes | str, where: str, error: type[LowbitError], fix: str,
               max_depth: int = JSON_MAX_DEPTH) -> Any:
    """``data`` parsed as JSON, or ``error`` naming ``where`` (bad UTF-8 or JSON, or nested too deeply).

    Python's parser recurses once per nesting level, so ``[[[[...`` a few thousand deep
    raised RecursionError (a traceback) in every reader; the depth is also checked
    against a stated limit after parsing, so the rule does not depend on the stack.
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        value = json.loads(text)
    except RecursionError:
        raise error(f"{where} is nested deeper than {max_depth} levels, which no JSON file lowbit reads is; "
                    f"{fix}") from None
    except ValueError as e:  # UnicodeDecodeError included
        raise error(f"{where} is not valid JSON ({str(e)[:80]}); {fix}") from None
    if _depth_exceeds(value, max_depth):
        raise error(f"{where} is nested deeper than {max_depth} levels, which no JSON file lowbit reads is; {fix}")
    return value


def _depth_exceeds(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        elif not isinstance(v, list):
            continue
        if d > limit:
            return True
        stack.extend((c, d + 1) for c in v if isinstance(c, (dict, list)))
    return False


def read_json(path: Path, error: type[LowbitError], fix: str, max_bytes: int = JSON_MAX_BYTES) -> Any:
    """The one reader of lowbit's JSON files: a regular file, at most ``max_bytes``, bounded nesting.

    Every failure is one ``error`` naming the file and ending with ``fix`` (what to do).
    """
    return parse_json(read_regular(path, max_bytes, error, fix), str(path), error, fix)


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
