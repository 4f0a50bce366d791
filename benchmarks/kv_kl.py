"""The KL divergence of a quantized-KV model's next-token distribution to the float-KV model's (issue 36).

Perplexity differences between FP8 scale rules are a few tenths of a percent and move by as much when
every scale is multiplied by 1.00001 (kv.md, fifth run): the change of the mean NLL is first order in the
logits' error and signed, so token by token it mostly cancels and what is left is where rounding happened
to fall. ``KL(P_float || P_quant)`` on the same evaluation tokens is second order, never negative, and
paired (both distributions at the same position), so it measures how far the cache moves the model's
prediction with far less variance than perplexity does.

The float distribution comes from a reference folder: the float-KV row (``kv == "none"``, plain weights)
writes each window's log-softmax there (fp32, ``seqlen x vocab`` per window, 1.6 GB at 8192 tokens for a
49k vocabulary), and every later row of the same weights, window length and count reads it back in
chunks (plain reads and writes, ``CHUNK`` positions at a time: no memory map grows the resident
set). The hook sits on the model's own forward, so the perplexity beside it is computed exactly as
without it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHUNK = 128  # positions compared at a time (5 temporaries of CHUNK x vocab fp32: 125 MB at 49k)


@dataclass
class KLMeter:
    """The running sum of ``KL(P_ref || P_model)`` over predicted positions (all but the last of each window)."""

    folder: Path
    write: bool  # True: this is the reference row; store the distributions instead of comparing
    total: float = 0.0
    count: int = 0
    window: int = 0
    shape: tuple[int, int] | None = None
    files: list[Path] = field(default_factory=list)

    def path(self, i: int) -> Path:
        return self.folder / f"window{i}.npy"

    def __call__(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        import numpy as np
        import torch

        logits = output.logits
        if logits.shape[0] != 1:
            raise ValueError("the KL meter compares one window per forward (perplexity's CPU batch size)")
        t, vocab = logits.shape[1], logits.shape[2]
        self.shape = (t, vocab)
        p = self.path(self.window)
        if self.write:
            tmp = p.with_suffix(".tmp")
            with open(tmp, "wb") as f:  # plain writes, chunk by chunk: no memory map to grow the resident set
                np.lib.format.write_array_header_2_0(f, {"descr": "<f4", "fortran_order": False, "shape": (t, vocab)})
                for s in range(0, t, CHUNK):
                    f.write(torch.log_softmax(logits[0, s:s + CHUNK].float(), -1).numpy().tobytes())
            tmp.rename(p)
        else:
            with open(p, "rb") as f, torch.no_grad():
                np.lib.format.read_magic(f)
                shape, _, _ = np.lib.format.read_array_header_2_0(f)
                if shape != (t, vocab):
                    raise ValueError(f"{p} holds {shape} log-probs, this forward {(t, vocab)}")
                start = f.tell()
                for s in range(0, t - 1, CHUNK):
                    e = min(s + CHUNK, t - 1)
                    f.seek(start + s * vocab * 4)
                    lp = torch.from_numpy(np.fromfile(f, dtype="<f4", count=(e - s) * vocab).reshape(e - s, vocab))
                    lq = torch.log_softmax(logits[0, s:e].float(), -1)
                    self.total += float((lp.exp() * (lp - lq)).sum(dtype=torch.float64))
                    self.count += e - s
        self.window += 1

    @property
    def mean(self) -> float:
        return self.total / self.count


def reference_folder(root: str | Path, fields: dict[str, Any]) -> Path:
    """``root/<model>-<weights>-<seqlen>x<windows>``: the references of one weight setting and window set."""
    return Path(root).expanduser() / f"{fields['model']}-{fields['weights']}-{fields['seqlen']}x{fields['windows']}"


@contextlib.contextmanager
def kl_meter(model: Any, root: str | Path, fields: dict[str, Any], is_reference: bool) -> Iterator[KLMeter]:
    """Meter the forwards of ``model`` inside the block against the reference of ``fields`` (model, weights, seqlen,
    windows; plus the CPU, checked against the folder's record); the reference row writes it instead."""
    folder = reference_folder(root, fields)
    meta = folder / "reference.json"
    want = {k: fields[k] for k in ("model", "model_sha256", "weights", "seqlen", "windows", "cpu") if k in fields}
    if is_reference:
        folder.mkdir(parents=True, exist_ok=True)
        meta.unlink(missing_ok=True)  # a reference being rewritten is not one until it is complete
    elif not meta.is_file():
        raise SystemExit(f"error: no KL reference in {folder}: measure the float-KV row ('none', plain weights) "
                         f"of the same weights, --seqlen and --windows with the same --kl first")
    elif (have := json.loads(meta.read_text())) != want:
        raise SystemExit(f"error: the KL reference in {folder} is of {have}, not {want}")
    meter = KLMeter(folder, write=is_reference)
    handle = model.register_forward_hook(meter, with_kwargs=True)
    try:
        yield meter
    finally:
        handle.remove()
    if is_reference:
        from lowbit.io import atomic_write_text

        if meter.window != fields["windows"]:
            raise SystemExit(f"error: the reference row ran {meter.window} windows, not {fields['windows']}")
        atomic_write_text(meta, json.dumps(want))
