"""The `lowbit qat` job: load -> QAT layers -> train (ste | winq) -> QuantLinear -> eval -> save.

Every input is validated before the model loads (scheme vs quantizer, steps vs warm-up,
an existing --out), so a typo fails in a second. Training artifacts (metrics.jsonl,
checkpoint/, loss.png) live in a work folder next to --out so an interrupted run resumes
from its last checkpoint; the finished model is saved in the native format, so it
evaluates and exports exactly like a PTQ result. Under ``torchrun`` every rank trains
its share of each global batch (DDP) and rank 0 alone evaluates and saves.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowbit.errors import ConfigError, LowbitError
from lowbit.qat.convert import to_qat, to_quant_linear
from lowbit.qat.quantizers import resolve
from lowbit.qat.winq import STE, WinQCallback, WinQConfig
from lowbit.train import TrainConfig, smooth, steps_to_reach, train
from lowbit.train.distributed import init_from_env
from lowbit.train.loop import causal_lm_loss, kd_loss

METHODS = ("ste", "winq")


@dataclass(frozen=True)
class QatJob:
    """What to train; ``train`` holds the loop settings, ``winq`` the WinQ switches."""

    scheme: str
    method: str
    train: TrainConfig
    winq: WinQConfig = field(default_factory=WinQConfig)
    quantizer: str = "auto"
    seqlen: int = 256
    kd: bool = False
    kd_temperature: float = 1.0
    smooth_window: int = 10

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown QAT method {self.method!r}; choose one of {METHODS}")
        if self.seqlen < 2:
            raise ConfigError(f"--seqlen must be >= 2 tokens, got {self.seqlen}")
        resolve(self.scheme, self.quantizer)  # refuse an inexpressible scheme now
        self.callback_config().period(self.train.steps) if self.callback_config().reinit else None

    def callback_config(self) -> WinQConfig:
        return self.winq if self.method == "winq" else STE


def baseline_target(baseline: str | float | None, window: int) -> float | None:
    """Final smoothed loss of a baseline run: a number, or the metrics.jsonl of that run."""
    if baseline is None:
        return None
    try:
        return float(baseline)
    except ValueError:
        pass
    p = Path(baseline)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        raise ConfigError(f"--baseline {baseline} is neither a loss value nor a metrics.jsonl / run folder")
    losses = [d["loss"] for d in map(json.loads, p.read_text().splitlines()) if "loss" in d]
    if not losses:
        raise ConfigError(f"{p} holds no training losses")
    return smooth(losses, window)[-1]


def qat_pipeline(job: QatJob, out: Path, model: str | None = None, data: str | None = None,
                 evaluate: bool = True, eval_seqlen: int = 512, windows: int = 40, baseline: str | None = None,
                 workdir: Path | None = None, resume: bool = True, force: bool = False) -> dict[str, Any]:
    from lowbit.data import eval_tokens
    from lowbit.data.batches import training_windows
    from lowbit.eval import perplexity
    from lowbit.export.native import save
    from lowbit.models import load_model

    out = Path(out)
    if out.exists() and not force:
        raise LowbitError(f"{out} already exists; choose another --out or pass --force to replace it")
    target = baseline_target(baseline, job.smooth_window)
    work = Path(workdir) if workdir else out.with_name(out.name + ".train")
    cfg = job.train if job.train.out_dir else _with_out(job.train, work)
    t0 = time.perf_counter()
    rank, world = init_from_env()  # under torchrun: one process per rank, rank 0 evaluates and saves
    lm = load_model(model)
    ev = eval_tokens(lm.tokenizer, data) if evaluate and rank == 0 else None
    res: dict[str, Any] = {"model": lm.source, "scheme": job.scheme, "method": job.method, "world": world}
    if ev is not None:
        res["ppl_fp"] = perplexity(lm.model, ev, seqlen=eval_seqlen, windows=windows).ppl
    if job.kd and lm.kind == "lowbit":
        raise ConfigError(f"{lm.source} is already quantized, so it cannot be the distillation teacher; "
                          "start QAT from the full-precision model for --kd, or drop --kd")
    teacher = copy.deepcopy(lm.model) if job.kd else None
    quantizer = resolve(job.scheme, job.quantizer)
    names = to_qat(lm.model, quantizer)
    rows = training_windows(lm.tokenizer, data, job.seqlen, "calib")
    cb = WinQCallback(job.callback_config())
    extra = {"scheme": job.scheme, "quantizer": quantizer.name, "method": job.method, "source": lm.source,
             "winq": job.callback_config().to_dict(), "kd": job.kd, "kd_t": job.kd_temperature,
             "seqlen": job.seqlen, "data": data}
    loss_fn = kd_loss(teacher, job.kd_temperature) if teacher is not None else causal_lm_loss
    r = train(lm.model, rows, cfg, callbacks=[cb], loss_fn=loss_fn, resume=resume, extra=extra)
    if rank != 0:
        return {"rank": rank, "steps": r.steps, "final_loss": r.final_loss}
    to_quant_linear(lm.model)
    sm = smooth(r.losses, job.smooth_window)
    res.update(quantizer=quantizer.name, layers=len(names), steps=r.steps, final_loss=r.final_loss,
               final_loss_smoothed=sm[-1], initial_loss=r.losses[0], train_seconds=r.seconds,
               reinits=cb.reinits, train_rows=len(rows), resumed_from=r.resumed_from,
               steps_to_baseline_loss=steps_to_reach(r.losses, target, job.smooth_window) if target else None,
               baseline_loss=target, smoothing=f"trailing mean, window {job.smooth_window}")
    if ev is not None:
        res["ppl"] = perplexity(lm.model, ev, seqlen=eval_seqlen, windows=windows).ppl
    meta = {"source": lm.source, "method": f"qat-{job.method}", "plan": job.scheme, "quantizer": quantizer.name,
            "steps": r.steps, **{k: res[k] for k in ("ppl_fp", "ppl") if k in res}}
    save(lm.model, lm.tokenizer, out, meta=meta, force=force)
    for name in ("metrics.jsonl", "loss.png"):
        if (work / name).is_file():
            shutil.copyfile(work / name, out / name)
    res["out"], res["workdir"] = str(out), str(work)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def _with_out(cfg: TrainConfig, work: Path) -> TrainConfig:
    from dataclasses import replace

    return replace(cfg, out_dir=str(work))
