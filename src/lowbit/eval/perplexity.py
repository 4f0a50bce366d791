"""Perplexity over non-overlapping windows.

Convention: the evaluation tokens are cut into consecutive windows of ``seqlen`` tokens
(a final partial window is dropped so every window sees the same context length);
within a window of L tokens, tokens 2..L are predicted from their prefix, so each
window counts L-1 tokens. ppl = exp(total NLL / tokens counted).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lowbit.errors import DataError
from lowbit.models.placement import model_device


@dataclass(frozen=True)
class PplResult:
    ppl: float
    nll: float  # mean token NLL (nats)
    tokens: int
    windows: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def eval_windows(tokens: torch.Tensor, seqlen: int = 512, windows: int | None = 40) -> torch.Tensor:
    """``[n, seqlen]`` windows from the start of ``tokens`` ([1, T] or [T]); windows None/0 = all."""
    ids = tokens.reshape(-1)
    if seqlen < 2:
        raise DataError(f"seqlen must be at least 2 tokens, got {seqlen}")
    avail = len(ids) // seqlen
    if avail == 0:
        raise DataError(f"the evaluation text has {len(ids)} tokens, fewer than one window of seqlen "
                        f"{seqlen}; use a smaller --seqlen (at most {len(ids)}) or more text")
    n = avail if not windows else min(windows, avail)
    return ids[: n * seqlen].reshape(n, seqlen)


@torch.inference_mode()
def perplexity(model: torch.nn.Module, tokens: torch.Tensor, seqlen: int = 512, windows: int | None = 40,
               batch_size: int | None = None, progress: bool = True) -> PplResult:
    """exp(mean token NLL) of ``model`` over the first ``windows`` windows of ``tokens``.

    batch_size: windows per forward; None = 4 on a GPU, 1 on the CPU (as fast there, and
    the progress bar then moves every window instead of every fourth).
    """
    t0 = time.perf_counter()
    win = eval_windows(tokens, seqlen, windows)
    device = model_device(model)
    batch_size = batch_size or (1 if device.type == "cpu" else 4)
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    bar = tqdm(total=len(win), desc="perplexity", disable=not progress, unit="window", leave=False)
    for batch in win.split(batch_size):
        batch = batch.to(device)
        logits = model(input_ids=batch, use_cache=False).logits.float()
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                              reduction="sum")
        total += float(nll)
        count += batch[:, 1:].numel()
        bar.update(len(batch))
    bar.close()
    model.train(was_training)
    mean = total / count
    return PplResult(math.exp(mean), mean, count, len(win), round(time.perf_counter() - t0, 3))
