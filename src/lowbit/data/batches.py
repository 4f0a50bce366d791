"""Token batches: calibration samples, training windows, evaluation tokens.

Tokenizing the bundled corpus takes seconds and is needed several times per run (FP
eval, calibration, quantized eval), so tokenized splits are cached per process.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lowbit.data.sources import load_corpus
from lowbit.errors import DataError, ModelError


def tokenize_split(tokenizer: Any, source: str | Path | None = None, split: str = "calib") -> torch.Tensor:
    """``LongTensor [1, T]`` of a whole split, cached per tokenizer object and source.

    The cache is keyed weakly by the tokenizer object itself, not its ``name_or_path``,
    because in-memory tokenizers often share an empty name and must not see each
    other's tokens; files are keyed by path, size and mtime so an edited file is re-read.
    A copy is returned, so a caller editing it in place cannot corrupt the cache.
    """
    if tokenizer is None:  # a lowbit checkpoint saved without tokenizer files loads with tokenizer None
        raise ModelError("the model has no tokenizer, so text cannot be turned into tokens; copy the tokenizer "
                         "files (tokenizer.json, tokenizer_config.json, ...) from the source model into its folder")
    key = (_source_key(source), split)
    try:
        per_tok = _CACHE.setdefault(tokenizer, {})
    except TypeError:  # an object without weak references: tokenize every time
        per_tok = {}
    if key not in per_tok:
        per_tok[key] = _tokenize(tokenizer, source, split)
    return per_tok[key].clone()


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _source_key(source: str | Path | None) -> tuple:
    if source is None:
        return ("bundled",)
    path = Path(source).expanduser()
    try:
        st = path.stat()
    except OSError:
        return (str(path),)
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


def _tokenize(tokenizer: Any, source: str | Path | None, split: str) -> torch.Tensor:
    text = load_corpus(source, split, tokenizer)
    ids = tokenizer(text, return_attention_mask=False, verbose=False)["input_ids"]
    if len(ids) < 2:
        raise DataError(f"the {split} split of {source or 'the bundled corpus'} has {len(ids)} tokens; "
                        "give it more text")
    return torch.tensor(ids, dtype=torch.long).unsqueeze(0)


def eval_tokens(tokenizer: Any, source: str | Path | None = None) -> torch.Tensor:
    return tokenize_split(tokenizer, source, "eval")


def calibration_batches(tokenizer: Any, source: str | Path | None = None, nsamples: int = 32,
                        seqlen: int = 256, seed: int = 0) -> torch.Tensor:
    """``nsamples`` random windows of ``seqlen`` tokens from the calibration split.

    Windows start at seeded random offsets (a ``torch.Generator``), so the same seed
    gives the same samples on every machine.
    """
    ids = tokenize_split(tokenizer, source, "calib")[0]
    need = nsamples * seqlen
    if len(ids) <= seqlen:
        raise DataError(f"the calibration text has {len(ids)} tokens, too few for even one sample of {seqlen} "
                        f"tokens; use more text, or samples of at most {max(len(ids) - 1, 1)} tokens (--seqlen)")
    if len(ids) < need:
        raise DataError(f"the calibration text has {len(ids)} tokens, fewer than nsamples x seqlen = "
                        f"{nsamples} x {seqlen} = {need}; use more text or at most "
                        f"{len(ids) // seqlen} samples of {seqlen} tokens (--nsamples)")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seqlen + 1, (nsamples,), generator=g)
    return torch.stack([ids[s:s + seqlen] for s in starts.tolist()])


def training_windows(tokenizer: Any, source: str | Path | None = None, seqlen: int = 256,
                     split: str = "calib") -> torch.Tensor:
    """All non-overlapping ``seqlen`` windows of a split, in order: ``[n, seqlen]``."""
    ids = tokenize_split(tokenizer, source, split)[0]
    n = len(ids) // seqlen
    if n == 0:
        raise DataError(f"the {split} text has {len(ids)} tokens, fewer than one window of {seqlen}")
    return ids[: n * seqlen].reshape(n, seqlen)


def training_batches(tokenizer: Any, source: str | Path | None = None, seqlen: int = 256, batch_size: int = 8,
                     seed: int = 0, epochs: int | None = None) -> Iterator[torch.Tensor]:
    """Shuffled batches of training windows, reshuffled each epoch (seeded); endless by default."""
    windows = training_windows(tokenizer, source, seqlen)
    g = torch.Generator().manual_seed(seed)
    epoch = 0
    while epochs is None or epoch < epochs:
        order = torch.randperm(len(windows), generator=g)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield windows[order[i:i + batch_size]]
        epoch += 1
