"""Text sources and their deterministic calibration / evaluation split.

Every source is reduced to an ordered list of documents, then split by position:
even positions (0, 2, 4, ...) are the calibration/training split, odd positions the
evaluation split. The rule is the same for every source, needs no random state, and
guarantees that no document is ever in both splits.

- None: the bundled corpus, Python's own documentation (``pydoc_data.topics``), one
  document per topic, topics in sorted key order.
- ``.txt``: documents are paragraphs separated by blank lines.
- ``.jsonl``: one document per line, from its ``"text"`` field, or its chat
  ``"messages"`` rendered with the tokenizer's chat template.
- a folder written by ``datasets``' ``save_to_disk``: one document per row (``text``
  column, or ``messages``). A DatasetDict that has a ``train`` split and a held-out one
  (``validation``, else ``test``) already separates the data, so ``train`` is the
  calibration split and the held-out one the evaluation split, whole; any other
  DatasetDict is split by row parity over ``train`` (else its first split).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lowbit.errors import DataError

SPLITS = ("calib", "eval")


def bundled_documents() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def load_documents(source: str | Path | None, tokenizer: Any = None) -> list[str]:
    """All documents of a source, in order (see module docstring)."""
    if source is None:
        return bundled_documents()
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"text source {path} does not exist; pass a .txt, a .jsonl, a saved HF dataset "
                        "folder, or omit --data for the bundled corpus")
    if path.is_dir():
        docs = _dataset_documents(path, tokenizer)
    elif path.suffix.lower() == ".jsonl":
        docs = _jsonl_documents(path, tokenizer)
    else:
        docs = _txt_documents(path)
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"{path} contains no text; give it some text (a .txt, or .jsonl with a 'text' field)")
    return docs


def split_documents(docs: list[str], split: str) -> list[str]:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of {SPLITS}")
    part = docs[0::2] if split == "calib" else docs[1::2]
    if not part:
        raise DataError(f"the text has {len(docs)} document(s), too few for a {split} split; "
                        "give it at least two documents (paragraphs, lines or rows)")
    return part


def load_corpus(source: str | Path | None = None, split: str = "calib", tokenizer: Any = None) -> str:
    """The text of one split, documents joined by blank lines."""
    return "\n\n".join(split_texts(source, split, tokenizer))


def split_texts(source: str | Path | None, split: str, tokenizer: Any = None) -> list[str]:
    """The documents of one split of ``source`` (see module docstring)."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of {SPLITS}")
    if source is not None and Path(source).expanduser().is_dir():
        named = _dataset_named_split(Path(source).expanduser(), split, tokenizer)
        if named is not None:
            return named
    return split_documents(load_documents(source, tokenizer), split)


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    if b"\x00" in raw[:8192]:
        raise DataError(f"{path} looks binary, not text; pass a UTF-8 .txt or .jsonl file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from None


def _txt_documents(path: Path) -> list[str]:
    text = _read_text(path).replace("\r\n", "\n")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def _jsonl_documents(path: Path, tokenizer: Any) -> list[str]:
    docs = []
    for i, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise DataError(f"{path}:{i} is not valid JSON ({e}); each line must be one JSON object") from None
        docs.append(row_text(row, tokenizer, f"{path}:{i}"))
    return docs


def row_text(row: Any, tokenizer: Any, where: str) -> str:
    """The text of one record: its ``text`` field or its rendered chat ``messages``."""
    if isinstance(row, dict) and isinstance(row.get("text"), str):
        return row["text"]
    if isinstance(row, dict) and isinstance(row.get("messages"), list):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{where} has chat messages but the tokenizer has no chat template; "
                            "use records with a 'text' field")
        return tokenizer.apply_chat_template(row["messages"], tokenize=False)
    raise DataError(f"{where} has neither a 'text' string nor a 'messages' list")


def _open_dataset(path: Path) -> Any:
    try:
        import datasets
    except ModuleNotFoundError:
        raise DataError(f"{path} is a folder; reading saved HF datasets needs `pip install datasets` "
                        "(or pass a .txt / .jsonl file)") from None
    try:
        return datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise DataError(f"{path} is not a dataset saved with save_to_disk ({_first_line(e)}); pass a "
                        "save_to_disk folder, a .txt or a .jsonl file") from None


def _held_out(ds: Any) -> str | None:
    """Name of the evaluation split of a DatasetDict that has train + held-out splits."""
    if not hasattr(ds, "keys") or "train" not in ds:
        return None
    return next((name for name in ("validation", "test") if name in ds), None)


def _dataset_named_split(path: Path, split: str, tokenizer: Any) -> list[str] | None:
    """Documents of ``split`` when the saved DatasetDict separates them itself, else None."""
    ds = _open_dataset(path)
    held = _held_out(ds)
    if held is None:
        return None
    name = "train" if split == "calib" else held
    docs = [d for d in _rows_text(ds[name], tokenizer, f"{path} [{name}]") if d.strip()]
    if not docs:
        raise DataError(f"split {name!r} of {path} contains no text; give it a 'text' or 'messages' column")
    return docs


def _dataset_documents(path: Path, tokenizer: Any) -> list[str]:
    ds = _open_dataset(path)
    if hasattr(ds, "keys"):  # a DatasetDict without a held-out split: parity over one split
        ds = ds["train"] if "train" in ds else ds[next(iter(ds.keys()))]
    return _rows_text(ds, tokenizer, str(path))


def _rows_text(ds: Any, tokenizer: Any, where: str) -> list[str]:
    return [row_text(r, tokenizer, f"{where} row {i}") for i, r in enumerate(ds)]


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
