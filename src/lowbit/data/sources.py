"""Text sources and their deterministic calibration / evaluation split.

Every source is reduced to an ordered list of documents, then split by position:
even positions (0, 2, 4, ...) are the calibration/training split, odd positions the
evaluation split. The rule is the same for every source, needs no random state, and
guarantees that no document is ever in both splits.

- None: the bundled corpus, Python's own documentation (``pydoc_data.topics``), one
  document per topic, topics in sorted key order.
- ``.txt``: documents are paragraphs separated by blank lines.
- ``.jsonl``: one record per non-empty line, split by its position among the non-empty
  lines (`jsonl_records`, the one reader every command uses, instruction data
  included); a record's document is its ``"text"`` field or its chat ``"messages"``
  rendered with the tokenizer's chat template.
- a folder written by ``datasets``' ``save_to_disk``: one document per row (``text``
  column, or ``messages``). A DatasetDict that has a ``train`` split and a held-out one
  (``validation``, else ``test``) already separates the data, so ``train`` is the
  calibration split and the held-out one the evaluation split, whole; any other
  DatasetDict is split by row parity over ``train`` (else its first split).

Limits, stated so that no input can make a read unbounded: a source file must be a
regular file (a FIFO or a device such as ``/dev/zero`` is refused by name, never opened
for reading) of at most `MAX_SOURCE_BYTES`, and one document (a .jsonl line, a .txt
paragraph, a dataset row) at most `MAX_RECORD_CHARS`; a saved dataset is read row by row
and stops at the same total. Reading stops as soon as a limit is passed, and binary
content is refused from the first 8 KiB, before the rest is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lowbit.errors import DataError
from lowbit.io import open_regular, parse_json

SPLITS = ("calib", "eval")
# The whole text of a split is tokenized in one call (about 10-20x its size in memory), and
# even a long training run needs far less: 256 MiB is about 60M tokens.
MAX_SOURCE_BYTES = 256 << 20
MAX_RECORD_CHARS = 16 << 20  # one document: a .jsonl line, a .txt paragraph, a dataset row
_SOURCE_FIX = ("pass a regular UTF-8 .txt or .jsonl file, a saved HF dataset folder, or omit --data for the "
               "bundled corpus")


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
    path = None if source is None else Path(source).expanduser()
    if path is not None and path.is_dir():
        named = _dataset_named_split(path, split, tokenizer)
        if named is not None:
            return named
    if path is not None and path.suffix.lower() == ".jsonl" and path.is_file():
        docs = [d for i, rec in jsonl_records(path, split) if (d := row_text(rec, tokenizer, f"{path}:{i}")).strip()]
        if not docs:
            raise DataError(f"the {split} split of {path} has no text; give it more records (lines alternate "
                            "between the calibration/training and the evaluation split)")
        return docs
    return split_documents(load_documents(source, tokenizer), split)


def _read_text(path: Path) -> str:
    """A text source's contents: a regular file, binary refused from its first 8 KiB, at most `MAX_SOURCE_BYTES`."""
    with open_regular(path, DataError, _SOURCE_FIX) as f:
        head = f.read(8192)
        if b"\x00" in head:
            raise DataError(f"{path} looks binary, not text; pass a UTF-8 .txt or .jsonl file")
        raw = head + f.read(MAX_SOURCE_BYTES + 1 - len(head))
    if len(raw) > MAX_SOURCE_BYTES:
        raise DataError(f"{path} is larger than {MAX_SOURCE_BYTES >> 20} MiB, the most lowbit reads from a --data "
                        "file (its whole text is tokenized at once); pass a sample of it — calibration needs only "
                        "nsamples x seqlen tokens")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from None


def check_record(text: str, where: str) -> str:
    """``text`` if it is within `MAX_RECORD_CHARS`, else one `DataError` naming the record and the limit."""
    if len(text) > MAX_RECORD_CHARS:
        raise DataError(f"{where} is a record of {len(text) / (1 << 20):.0f} MiB, over the limit of "
                        f"{MAX_RECORD_CHARS >> 20} MiB per record (a .jsonl line, a .txt paragraph, a dataset row); "
                        "split it into smaller records")
    return text


def _txt_documents(path: Path) -> list[str]:
    text = _read_text(path).replace("\r\n", "\n")
    return [check_record(p.strip(), f"{path}, paragraph {k + 1}") for k, p in enumerate(text.split("\n\n"))
            if p.strip()]


def jsonl_records(path: str | Path, split: str | None = None) -> list[tuple[int, dict]]:
    """(line number, record) of a .jsonl file, all of them or those of one split.

    The split rule is the one for every source: even positions (0, 2, ...) among the
    non-empty lines are the calibration/training split, odd positions the evaluation
    split. Every command reads .jsonl through here, so the same file given as training
    and evaluation data never puts a record in both. Each line must be a JSON object.
    """
    if split is not None and split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of {SPLITS}")
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path} does not exist; pass a .jsonl file with one JSON record per line")
    lines = [(i, line) for i, line in enumerate(_read_text(path).splitlines(), 1) if line.strip()]
    if split is not None:
        lines = lines[0::2] if split == "calib" else lines[1::2]
    out = []
    for i, line in lines:
        row = parse_json(check_record(line, f"{path}:{i}"), f"{path}:{i}", DataError,
                         "each line must be one JSON object")
        if not isinstance(row, dict):
            raise DataError(f"{path}:{i} is a JSON {type(row).__name__}, not an object; each line must be one "
                            "JSON object such as {\"text\": \"...\"}")
        out.append((i, row))
    return out


def _jsonl_documents(path: Path, tokenizer: Any) -> list[str]:
    return [row_text(row, tokenizer, f"{path}:{i}") for i, row in jsonl_records(path)]


def check_messages(messages: Any, where: str) -> list[dict]:
    """``messages`` if it is a non-empty list of ``{"role": str, "content": str}``; else one `DataError`."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{\"role\": ..., \"content\": ...}} "
                        f"objects, got {type(messages).__name__}")
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{where}: message {k} is a {type(m).__name__}, not an object with 'role' and 'content'")
        bad = [f for f in ("role", "content") if not isinstance(m.get(f), str)]
        if bad:
            raise DataError(f"{where}: message {k} lacks a string {' and '.join(repr(f) for f in bad)}; every "
                            "message needs {\"role\": \"user\"|\"assistant\"|..., \"content\": \"...\"}")
    return messages


PROMPT_KEYS = ("instruction", "prompt", "question")
ANSWER_KEYS = ("output", "response", "answer", "completion")


def record_messages(rec: dict, where: str) -> list[dict]:
    """A chat or instruction record as chat messages: ``{"messages": [...]}``, or one of
    PROMPT_KEYS (+ optional ``input``) and one of ANSWER_KEYS as a user/assistant turn."""
    if "messages" in rec:
        return check_messages(rec["messages"], where)
    prompt = next((rec[k] for k in PROMPT_KEYS if k in rec), None)
    answer = next((rec[k] for k in ANSWER_KEYS if k in rec), None)
    if not isinstance(prompt, str) or not isinstance(answer, str):
        raise DataError(f"{where}: need a 'text' string, 'messages', or one of {PROMPT_KEYS} and one of "
                        f"{ANSWER_KEYS} as strings")
    if rec.get("input"):
        prompt = f"{prompt}\n\n{rec['input']}"
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def row_text(row: Any, tokenizer: Any, where: str) -> str:
    """The text of one record: its ``text`` field, or its chat/instruction turns rendered by the chat template."""
    if isinstance(row, dict) and isinstance(row.get("text"), str):
        return row["text"]
    if not isinstance(row, dict) or not ("messages" in row or any(k in row for k in PROMPT_KEYS)):
        raise DataError(f"{where} has neither a 'text' string nor a 'messages' list (nor instruction fields)")
    messages = record_messages(row, where)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where} has chat messages but the tokenizer has no chat template; "
                        "use records with a 'text' field")
    return tokenizer.apply_chat_template(messages, tokenize=False)


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
    """Each row's text, read row by row and stopped at the limits of a file source."""
    out, total = [], 0
    for i, r in enumerate(ds):
        text = check_record(row_text(r, tokenizer, f"{where} row {i}"), f"{where} row {i}")
        total += len(text)
        if total > MAX_SOURCE_BYTES:
            raise DataError(f"{where} holds more than {MAX_SOURCE_BYTES >> 20} MiB of text, the most lowbit reads "
                            "from one --data source; save a sample of it (dataset.select(range(n)).save_to_disk)")
        out.append(text)
    return out


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
