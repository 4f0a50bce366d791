"""Adapter training on top of the shared loop (`lowbit.train.train`).

Training rows are ``[N, 2, T]`` tensors: token ids and labels, with label -100 where no
loss is taken. Plain text gives labels = ids; instruction data (.jsonl) rendered through
the tokenizer's chat template masks the prompt so only answer tokens are learned.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.data.sources import PROMPT_KEYS, jsonl_records, record_messages
from lowbit.errors import DataError
from lowbit.peft.apply import adapters_of
from lowbit.train import Callback, TrainConfig, TrainResult, TrainState, train

IGNORE = -100


def masked_lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over positions whose label is not -100 (``batch [B, 2, T]``)."""
    ids, labels = batch[:, 0], batch[:, 1]
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE)


def lm_rows(tokens: torch.Tensor) -> torch.Tensor:
    """Plain language-model rows: every token is a target."""
    return torch.stack((tokens, tokens), dim=1)


def is_instruction_file(source: str | None) -> bool:
    """Whether ``source`` is a .jsonl whose first record is a chat or an instruction (not plain text)."""
    if not source or not str(source).endswith(".jsonl"):
        return False
    records = jsonl_records(source)
    if not records:
        raise DataError(f"{source} is empty; it needs one JSON record per line")
    rec = records[0][1]
    return "messages" in rec or any(k in rec for k in PROMPT_KEYS)


def to_messages(rec: dict, line: int | str) -> list[dict]:
    """A training record as chat messages (`record_messages`) ending with the assistant's answer."""
    where = line if isinstance(line, str) else f"line {line}"
    msgs = record_messages(rec, where)
    if msgs[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message must be the assistant's answer")
    return msgs


def encode_chat(tokenizer, messages: list[dict], seqlen: int) -> tuple[list[int], list[int]] | None:
    """(ids, labels) of one conversation, prompt masked; None if the answer does not fit at all."""
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True)
    full = tokenizer.apply_chat_template(messages, tokenize=True)
    prompt, full = _ids(prompt), _ids(full)
    if full[: len(prompt)] != prompt:
        raise DataError("the chat template renders the prompt differently inside the full conversation, so "
                        "answer tokens cannot be located; use a tokenizer whose template is prefix-stable")
    if len(prompt) >= min(len(full), seqlen):
        return None  # no answer token fits in seqlen
    ids = full[:seqlen]
    return ids, [IGNORE] * len(prompt) + ids[len(prompt):]


def _ids(x) -> list[int]:
    if hasattr(x, "input_ids") or isinstance(x, dict):
        x = x["input_ids"]
    return list(x)


def instruction_rows(tokenizer, path: str | Path, seqlen: int = 256, limit: int | None = None) -> torch.Tensor:
    """``[N, 2, seqlen]`` rows from the training split of a .jsonl of instruction records (pad label -100).

    Only the training split (even record positions, `jsonl_records`) is read, so the same
    file passed as --eval-data never evaluates on a record that was trained on.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("the tokenizer has no chat template, so instruction data cannot be rendered; use an "
                        "instruct model's tokenizer or pass plain text (.txt) instead")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows, skipped = [], 0
    records = jsonl_records(path, "calib")
    if not records:
        raise DataError(f"{path} has no record in its training split (even record positions); give it at "
                        "least one record")
    for i, rec in records:
        enc = encode_chat(tokenizer, to_messages(rec, f"{path}:{i}"), seqlen)
        if enc is None:
            skipped += 1
            continue
        ids, labels = enc
        fill = seqlen - len(ids)
        rows.append(torch.tensor([ids + [pad] * fill, labels + [IGNORE] * fill]))
        if limit and len(rows) >= limit:
            break
    if not rows:
        raise DataError(f"{path}: no training record has an answer within {seqlen} tokens ({skipped} skipped); "
                        "raise --seqlen")
    return torch.stack(rows)


class StepTimer(Callback):
    """Wall time of every optimizer step (forward, backward, clip, AdamW)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_step_start(self, state: TrainState) -> None:
        self._t = time.perf_counter()

    def on_after_optimizer_step(self, state: TrainState) -> None:
        self.times.append(time.perf_counter() - self._t)

    def median(self, skip: int = 1) -> float:
        t = sorted(self.times[skip:] or self.times)
        return t[len(t) // 2] if t else float("nan")


def train_adapters(model: nn.Module, rows: torch.Tensor, config: TrainConfig, callbacks: Sequence[Callback] = (),
                   eval_fn=None, extra: dict | None = None, resume: bool = True) -> tuple[TrainResult, StepTimer]:
    """Train only the adapter parameters of ``model`` with the shared loop.

    With ``config.out_dir`` the run checkpoints there and resumes from its last checkpoint
    (``resume``), refusing one written with other curve settings or ``extra`` (the
    adapter recipe, the base checkpoint, the training rows: see `lowbit.api.finetune`).
    """
    params = [p for a in adapters_of(model).values() for p in a.parameters()]
    timer = StepTimer()
    result = train(model, rows, config, callbacks=[timer, *callbacks], trainable=params, loss_fn=masked_lm_loss,
                   eval_fn=eval_fn, resume=resume and config.out_dir is not None, extra=extra)
    return result, timer
