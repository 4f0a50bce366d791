"""Sealed folders: files lowbit wrote, and a JSON manifest holding their sha256, checked on every read.

Five kinds of folder are sealed this way, each with the manifest layout it has always had
(so folders written by an earlier lowbit still read):

| kind | manifest | what it checksums |
| --- | --- | --- |
| native checkpoint (`lowbit.files.native`) | ``lowbit.json`` ``files`` | every file of the folder |
| converted-GGUF cache entry (`lowbit.files.gguf_read`) | ``cache.json`` ``files`` | every file of the entry |
| adapter folder (`lowbit.peft.store`) | ``adapter.json`` ``sha256`` | ``adapter.safetensors`` |
| training checkpoint (`lowbit.train.checkpoint`) | ``checkpoint.json`` ``tensors`` + ``sha256`` | the current tensor file |
| PTQ work folder (`lowbit.ptq.blockwise.store`) | one ``block_NNNN.json`` sidecar per block (`SealedFile`) | that block's file |

What they share lives here, once: a `Seal` names a kind (manifest file, format, version,
the error it raises and the fix its messages name); `Seal.read` is the one manifest
reader (bounded JSON, an object of this format and version); `Seal.check` the one
verification (each listed name a plain file inside the folder, present, matching its
sha256); `damage` says what is wrong without raising, for folders lowbit rebuilds instead
of refusing; `digests` and `Seal.write` seal a folder: the manifest is written last and
atomically (temp file, then rename), after every file it covers, so a crash leaves either
no manifest or one that matches complete files.

A folder whose files are written one at a time over a long run (a PTQ work folder, one
file per finished block) cannot wait for one manifest at the end: each file is sealed on
its own by a `SealedFile`, a small JSON sidecar beside it (``{"sha256": ..., "bytes": ...}``,
the layout work folders have always had) written atomically after the file, and
`SealedFile.read` says why a file cannot be used instead of raising, because such a
folder's owner redoes the file rather than refusing the run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowbit.errors import CheckpointError, LowbitError
from lowbit.io import atomic_write_bytes, atomic_write_text, file_inside, read_json, sha256_file


@dataclass(frozen=True)
class Seal:
    """One kind of sealed folder, and what its messages say.

    fix: what the user does about a damaged folder; ``{folder}`` is replaced by the folder.
    origin: how a folder of this kind is made (named when a path holds no manifest at all).
    """

    kind: str
    manifest: str
    format: str
    version: int
    fix: str
    origin: str = ""
    error: type[LowbitError] = CheckpointError

    def fix_for(self, folder: Path) -> str:
        return self.fix.format(folder=folder)

    def read(self, folder: str | Path) -> dict[str, Any]:
        """The folder's manifest: a JSON object of this format and version, or one error naming the fix."""
        folder = Path(folder)
        f = folder / self.manifest
        if not f.is_file():
            raise self.error(f"{folder} is not a lowbit {self.kind} (no {self.manifest}); {self.origin}")
        m = read_json(f, self.error, f"the {self.kind} is damaged or corrupted — {self.fix_for(folder)}")
        if not isinstance(m, dict) or m.get("format") != self.format or m.get("version") != self.version:
            got = (m.get("format"), m.get("version")) if isinstance(m, dict) else (type(m).__name__, None)
            raise self.error(f"{f} has format {got[0]!r} version {got[1]!r}; this lowbit reads {self.format!r} "
                             f"version {self.version} — {self.fix_for(folder)}")
        return m

    def check(self, folder: str | Path, digests: Mapping[str, object]) -> dict[str, Path]:
        """Each file ``digests`` names (name -> sha256), verified; their paths. Anything wrong is one error."""
        folder = Path(folder)
        paths = {}
        for name, digest in digests.items():
            f = file_inside(folder, name, str(folder / self.manifest))
            why = _file_damage(f, digest)
            if why == "missing":
                raise self.error(f"{f} is missing; the {self.kind} is incomplete — {self.fix_for(folder)}")
            if why is not None:
                raise self.error(f"{f} does not match its checksum (truncated or corrupted, or edited); "
                                 f"{self.fix_for(folder)}")
            paths[name] = f
        return paths

    def write(self, folder: Path, manifest: Mapping[str, Any], indent: int | None = None) -> Path:
        """Write the manifest into ``folder`` atomically; call it after every file it covers is complete."""
        path = Path(folder) / self.manifest
        atomic_write_text(path, json.dumps(manifest, indent=indent))
        return path


def digests(folder: Path, names: Iterable[str] | None = None, known: Mapping[str, str] | None = None
            ) -> dict[str, str]:
    """sha256 of each named file of ``folder``; of every regular file in name order when ``names`` is None.

    known: digests the caller already holds (files it hashed while writing them, e.g. the streaming
    quantizer's shards, gigabytes each), taken as they are instead of read and hashed again.
    """
    folder = Path(folder)
    known = known or {}
    if names is None:
        names = sorted(p.name for p in folder.iterdir() if p.is_file())
    return {n: known[n] if n in known else sha256_file(folder / n) for n in names}


def damage(folder: Path, digests: Mapping[str, object], manifest: str) -> str | None:
    """Why a folder's listed files cannot be used (None when every one is present and matches).

    For folders lowbit rebuilds rather than refuses (a cache entry): the reason goes into a
    warning, so it names the file and never raises.
    """
    for name, digest in digests.items():
        try:
            f = file_inside(folder, name, str(Path(folder) / manifest))
            if _file_damage(f, digest) is not None:
                return f"{name} does not match its checksum"
        except (LowbitError, OSError) as e:
            return f"{name}: {str(e)[:80]}"
    return None


def _file_damage(f: Path, digest: object) -> str | None:
    """``"missing"``, ``"mismatch"`` or None for one file and the sha256 its manifest gives."""
    if not f.is_file():
        return "missing"
    if not isinstance(digest, str) or sha256_file(f) != digest:
        return "mismatch"
    return None


@dataclass(frozen=True)
class SealedFile:
    """One file sealed by its own sidecar: ``NAME.json`` beside ``NAME.EXT``, holding its sha256 and size.

    The sidecar is written after the file, both atomically, so a file counts as sealed only
    when both exist and agree: a crash between the two, a truncated file or a flipped byte
    all read as "not usable", never as a good file.
    """

    path: Path

    @property
    def sidecar(self) -> Path:
        return self.path.with_suffix(".json")

    def write(self, data: bytes) -> None:
        """The file, then its sidecar (the seal): both atomic, in this order."""
        atomic_write_bytes(self.path, data)
        atomic_write_text(self.sidecar, json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}))

    def seal(self, sha256: str, nbytes: int) -> None:
        """The sidecar of a file already complete in place (written and renamed by its writer, hashed on the way).

        For files too big to hold as bytes (the streaming quantizer's shards); the seal still
        comes after the file, so a crash between the two leaves it unsealed.
        """
        atomic_write_text(self.sidecar, json.dumps({"sha256": sha256, "bytes": nbytes}))

    def sha256(self) -> str | None:
        """The sha256 the seal records (None without a readable seal); says nothing about the file itself:
        for a caller that wrote or `check`-ed the file in this run."""
        try:
            meta = read_json(self.sidecar, CheckpointError, "")
        except (CheckpointError, OSError):
            return None
        digest = meta.get("sha256") if isinstance(meta, dict) else None
        return digest if isinstance(digest, str) else None

    def check(self) -> str | None:
        """Why the file cannot be used (None when its sidecar vouches for it), hashing it in chunks, not in memory."""
        if not self.sidecar.is_file():
            return f"unverified (no {self.sidecar.name})"
        try:
            meta = read_json(self.sidecar, CheckpointError, "")
        except CheckpointError:
            meta = None
        if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str) or not isinstance(meta.get("bytes"), int):
            return f"unverified ({self.sidecar.name} is damaged)"
        if not self.path.is_file():
            return f"missing ({self.path.name})"
        if self.path.stat().st_size != meta["bytes"]:
            return f"truncated ({self.path.stat().st_size} of {meta['bytes']} bytes)"
        return None if sha256_file(self.path) == meta["sha256"] else "corrupted (checksum mismatch)"

    def read(self) -> tuple[bytes | None, str | None]:
        """(the file's bytes, None) when its sidecar vouches for them; else (None, why it cannot be used).

        The file is read once; the reason names what is wrong (no sidecar, a damaged
        sidecar, a truncated or corrupted file) for the owner's warning. A sidecar without
        ``bytes`` (an older lowbit) is checked by its sha256 alone.
        """
        if not self.sidecar.is_file():
            return None, f"unverified (no {self.sidecar.name}: interrupted while saving, or an older lowbit)"
        try:
            meta = read_json(self.sidecar, CheckpointError, "")
        except CheckpointError:
            meta = None
        if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str):
            return None, f"unverified ({self.sidecar.name} is damaged)"
        if not self.path.is_file():
            return None, f"missing ({self.path.name})"
        size = self.path.stat().st_size
        if isinstance(meta.get("bytes"), int) and size != meta["bytes"]:
            return None, f"truncated ({size} of {meta['bytes']} bytes)"
        data = self.path.read_bytes()
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            return None, "corrupted (checksum mismatch)"
        return data, None
