"""safetensors files read one tensor at a time and written one tensor at a time, without a memory map.

The streaming quantizer (`lowbit.ptq.stream`) must keep its peak memory at the largest
tensor plus a constant however big the checkpoint is. ``safe_open`` maps the whole file,
and every page a ``get_tensor`` touches stays in the process's resident set until the file
is closed, so reading a 5 GB shard tensor by tensor through it grows the RSS the kernel
reports to the shard's size. Here a tensor is read with ``readinto`` straight into its own
buffer (one copy, freed when dropped), and a file is written header first and then each
tensor's bytes in turn (no second serialised copy of the whole file in memory).

The header is validated as safetensors does (offsets inside the file, contiguous, the
bytes each dtype and shape need), so a truncated or lying file is one error naming it.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.errors import ModelError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}
_HEADER_MAX = 100 << 20  # safetensors' own limit


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: where its bytes are, and what they hold."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset of its first byte in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: Path) -> tuple[dict[str, Entry], dict[str, str]]:
    """(name -> `Entry`, the file's ``__metadata__``), every offset checked against the file's size."""
    fix = "re-download or re-save the model"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if n < 2 or n > _HEADER_MAX or 8 + n > size:
                raise ModelError(f"{path} is not a safetensors file (header length {n} in a file of {size} bytes); "
                                 f"it is truncated or another format; {fix}")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ModelError(f"cannot read {path} as safetensors ({str(e)[:80]}); {fix}") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path}: its safetensors header is not a JSON object; {fix}")
    meta = header.pop("__metadata__", None) or {}
    base, entries, end = 8 + n, {}, 0
    for name, h in sorted(header.items(), key=lambda kv: _offsets(kv[1])[0]):
        a, b = _offsets(h)
        dtype, shape = h.get("dtype") if isinstance(h, dict) else None, tuple(h.get("shape", ())) if isinstance(h, dict) else ()
        if dtype not in DTYPES:
            raise ModelError(f"{path}: tensor {name!r} has dtype {dtype!r}, which lowbit cannot read (it reads "
                             f"{', '.join(DTYPES)}); convert the checkpoint to one of them")
        e = Entry(path, dtype, shape, base + a, b - a)
        if a != end or e.nbytes != e.numel * _itemsize(dtype) or base + b > size:
            raise ModelError(f"{path}: tensor {name!r} has offsets [{a}, {b}] that do not match its shape "
                             f"{list(shape)} and dtype {dtype}, or run past the end of the file (truncated?); {fix}")
        end = b
        entries[name] = e
    return entries, {str(k): str(v) for k, v in meta.items()}


def _offsets(h: object) -> tuple[int, int]:
    off = h.get("data_offsets") if isinstance(h, dict) else None
    if not (isinstance(off, list) and len(off) == 2 and all(isinstance(x, int) and x >= 0 for x in off)
            and off[0] <= off[1]):
        return (-1, -1)
    return off[0], off[1]


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


def read_tensor(e: Entry) -> torch.Tensor:
    """The tensor's bytes read into a buffer of its own (no memory map stays behind)."""
    buf = torch.empty(e.nbytes, dtype=torch.uint8)
    with open(e.file, "rb") as f:
        f.seek(e.start)
        got = f.readinto(memoryview(buf.numpy()))
    if got != e.nbytes:
        raise ModelError(f"{e.file}: read {got} of {e.nbytes} bytes of a tensor (the file shrank while it was read?)")
    return buf.view(DTYPES[e.dtype]).reshape(e.shape)


def write_file(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> str:
    """Write ``tensors`` as a safetensors file at ``path`` (header, then each tensor's bytes); returns its sha256.

    The caller writes to a temporary path and renames it (`lowbit.io.atomic_file`).
    """
    header: dict[str, object] = {"__metadata__": dict(metadata or {})} if metadata else {}
    off, order = 0, sorted(tensors)
    for name in order:
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    sha = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in _chunks(raw, order, tensors):
            f.write(chunk)
            sha.update(chunk)
    return sha.hexdigest()


def _chunks(raw: bytes, order: Iterable[str], tensors: Mapping[str, torch.Tensor]) -> Iterable[bytes | memoryview]:
    yield struct.pack("<Q", len(raw))
    yield raw
    for name in order:
        t = tensors[name].detach().cpu().contiguous()
        if t.numel():
            yield memoryview(t.reshape(-1).view(torch.uint8).numpy())
