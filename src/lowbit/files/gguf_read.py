"""GGUF files as lowbit reads them: the damage check, and the float copy kept in a cache.

`open_gguf` checks a file is whole before anything parses it (every tensor's data must
lie inside the file), so a truncated download reads as one clear line instead of a
reshape error deep in a loader; `lowbit.models.loading` converts GGUF models through
transformers and `lowbit.files.inspect` reads their types.

Converting a GGUF takes minutes on a small CPU, so the float HF folder is kept in a cache
(`cache_root`). An entry is named by the sha256 of the GGUF's *content* (a file replaced
by another of the same size and mtime is a new entry), and holds ``cache.json``, the
sha256 of each of its files: every use verifies them, and a damaged entry is converted
again with a warning. Hashing a multi-GB GGUF on every run would cost seconds, so its
digest is remembered beside the cache under the file's identity (device, inode, size,
mtime and ctime: a rewrite in place changes the ctime even when the mtime is restored).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import struct
import warnings
from pathlib import Path
from typing import Any

import torch

from lowbit.errors import CheckpointError, LowbitError, ModelError


def open_gguf(path: Path, error: type[LowbitError] = CheckpointError) -> Any:
    """A ``gguf.GGUFReader`` of ``path`` after checking the file is whole; raises ``error`` if not.

    A truncated or damaged file otherwise surfaces as a reshape error deep in a loader,
    which reads like an unsupported model; here every tensor's data must lie inside
    the file, so the message can say what is actually wrong. ``load_model`` raises
    `ModelError` like for any model it cannot load, ``inspect`` a `CheckpointError`.
    """
    try:
        import gguf
    except ModuleNotFoundError:
        raise error("reading .gguf files needs the gguf package: pip install gguf") from None

    def damaged(why: str) -> LowbitError:
        return error(f"cannot load GGUF file {path}: it is truncated, damaged or not a GGUF file ({why}); "
                     "re-download or re-export it")

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OverflowError, EOFError, TypeError, struct.error) as e:
        raise damaged(_first_line(e)[:100]) from None
    size = path.stat().st_size
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise damaged(f"tensor {t.name} ends past the end of the file")
    return reader


def cache_root() -> Path:
    """Where converted GGUF models are kept (``$XDG_CACHE_HOME/lowbit`` or ``~/.cache/lowbit``)."""
    import os

    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lowbit" / "gguf"


CACHE_MANIFEST = "cache.json"


def gguf_digest(path: Path) -> str:
    """sha256 of a GGUF file's content, remembered under the file's identity (see module docstring)."""
    from lowbit.io import atomic_write_text, read_json, sha256_file

    path = path.resolve()
    st = path.stat()
    ident = {"path": str(path), "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
             "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}
    memo = cache_root() / ".digests" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"
    with contextlib.suppress(OSError, LowbitError):
        m = read_json(memo, ModelError, "")
        if isinstance(m, dict) and {k: m.get(k) for k in ident} == ident and isinstance(m.get("sha256"), str):
            return m["sha256"]
    digest = sha256_file(path)
    with contextlib.suppress(OSError, LowbitError):  # a read-only cache only costs the hash next time
        atomic_write_text(memo, json.dumps({**ident, "sha256": digest}))
    return digest


def cache_entry(path: Path, digest: str, dtype: torch.dtype) -> Path:
    """The cache folder of a GGUF's float conversion: its name, content digest and dtype."""
    return cache_root() / f"{path.stem}-{digest[:16]}-{str(dtype).removeprefix('torch.')}"


def entry_ok(cached: Path, digest: str) -> bool:
    """Whether a cache entry exists and matches its checksums; a damaged one is reported and removed."""
    if not cached.exists():
        return False
    why = _entry_damage(cached, digest)
    if why is None:
        return True
    warnings.warn(f"the converted-GGUF cache entry {cached} is damaged ({why}); converting the GGUF again",
                  stacklevel=3)
    shutil.rmtree(cached, ignore_errors=True)
    return False


def _entry_damage(cached: Path, digest: str) -> str | None:
    """Why a cache entry cannot be used (None when every file matches ``cache.json``)."""
    from lowbit.files.sealed import damage
    from lowbit.io import MARKER, read_json

    try:
        m = read_json(cached / CACHE_MANIFEST, ModelError, "")
    except LowbitError as e:
        return f"no readable {CACHE_MANIFEST}: {str(e)[:80]}"
    files = m.get("files") if isinstance(m, dict) else None
    if not isinstance(files, dict) or m.get("source_sha256") != digest or "model.safetensors" not in files:
        return f"{CACHE_MANIFEST} does not describe this GGUF's conversion"
    extra = sorted(p.name for p in cached.iterdir() if p.name not in {*files, CACHE_MANIFEST, MARKER})
    if extra:
        return f"it holds files it did not write: {', '.join(extra[:3])}"
    return damage(cached, files, CACHE_MANIFEST)


def store_cache(cached: Path, model: Any, tok: Any, digest: str) -> bool:
    """Write config + safetensors + tokenizer and ``cache.json`` (their sha256); tied tensors are stored once."""
    from safetensors.torch import save_file

    from lowbit.files.sealed import digests
    from lowbit.io import atomic_dir

    config = model.config
    qc = config.__dict__.pop("quantization_config", None)
    shutil.rmtree(cached, ignore_errors=True)  # only ever a damaged entry of lowbit's own cache
    try:
        with atomic_dir(cached, force=True, kind="converted GGUF (cache)") as tmp:
            config.save_pretrained(tmp)
            seen, tensors = set(), {}
            for k, t in model.state_dict().items():
                if t.data_ptr() in seen:
                    continue
                seen.add(t.data_ptr())
                tensors[k] = t.contiguous()
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            tok.save_pretrained(tmp)
            files = digests(tmp)
            (tmp / CACHE_MANIFEST).write_text(json.dumps({"source_sha256": digest, "files": files}, indent=1))
        return True
    except (OSError, LowbitError):  # another process stored the same conversion first, or a read-only cache
        return False  # a read-only or full cache only costs time next run
    finally:
        if qc is not None:
            config.quantization_config = qc


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def key_length(reader: Any) -> int | None:
    """The head size llama.cpp reads (``{arch}.attention.key_length``); None when the file has none."""
    arch = reader.fields.get("general.architecture")
    field = reader.fields.get(f"{arch.contents()}.attention.key_length") if arch is not None else None
    return int(field.contents()) if field is not None else None


def head_dim(config: Any) -> int:
    """The attention head size a transformers config gives its model (``head_dim``, else hidden / heads)."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def restored_config(path: Path, reader: Any) -> Any:
    """transformers' config of a GGUF, with the head size llama.cpp uses.

    transformers' GGUF loader maps ``attention.key_length`` to ``head_dim`` for some
    architectures only (not qwen3, as of transformers 5), so a model whose head size is not
    what the config class would assume (qwen3 with head_dim != hidden / heads and != 128) is
    rebuilt with the wrong shapes; llama.cpp reads key_length, and so does lowbit here.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    want = key_length(reader)
    if want is not None and hasattr(config, "num_attention_heads") and head_dim(config) != want:
        config.head_dim = want
    return config
