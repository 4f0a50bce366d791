"""The qat job: load -> QAT layers -> train (ste | winq) -> exact QuantLinears -> eval -> save.

Every input is validated before the model loads (scheme vs quantizer, steps vs warm-up,
WinQ switches vs method, the output place), so a typo fails in a second. Training
artifacts (metrics.jsonl, checkpoint/, loss.png) live in a work folder (``--workdir``,
default OUT.train) so an interrupted run resumes from its last checkpoint; metrics and
the loss plot are copied into the saved checkpoint. Under ``torchrun`` every rank trains
its share of each global batch (DDP / FSDP) on its own device, and rank 0 alone
evaluates and saves.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lowbit.api import outputs
from lowbit.api.common import Evaluation, checkpoint_bytes, job_device, work_folder
from lowbit.configs import check_fields
from lowbit.errors import ConfigError
from lowbit.io import WriteError, check_free_space
from lowbit.models.accounting import keep_patterns
from lowbit.qat.quantizers import resolve
from lowbit.qat.winq import STE, WinQConfig
from lowbit.train import TrainConfig, smooth

__all__ = ["QatJob", "TrainConfig", "WinQConfig", "baseline_target", "default_lr", "qat", "work_folder"]
METHODS = ("ste", "winq")


def default_lr(scheme: str, quantizer: str = "auto") -> float:
    """The peak learning rate of the GPU-scale reference: 2e-5 at <= 2 bits, 1e-5 above."""
    return 2e-5 if resolve(scheme, quantizer).bits <= 2 else 1e-5


@dataclass(frozen=True)
class QatJob:
    """What to train and where: ``train`` holds the loop settings, ``winq`` the WinQ switches."""

    out: str | Path
    scheme: str
    train: TrainConfig
    method: str = "ste"
    winq: WinQConfig = field(default_factory=WinQConfig)
    quantizer: str = "auto"
    model: str | None = None
    data: str | None = None
    seqlen: int = 256
    kd: bool = False
    kd_temperature: float = 1.0
    smooth_window: int = 10
    evaluation: Evaluation | None = field(default_factory=Evaluation)
    baseline: str | None = None
    workdir: str | None = None
    resume: bool = True
    device: str | None = None
    force: bool = False
    keep: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "QAT setting")
        object.__setattr__(self, "keep", keep_patterns(self.keep))
        if self.method not in METHODS:
            raise ConfigError(f"unknown QAT method {self.method!r}; choose one of {METHODS}")
        if self.seqlen < 2:
            raise ConfigError(f"--seqlen must be >= 2 tokens, got {self.seqlen}")
        if self.kd_temperature <= 0:
            raise ConfigError(f"--kd-temperature must be > 0, got {self.kd_temperature}")
        if self.smooth_window < 1:
            raise ConfigError(f"--smooth must be >= 1 step, got {self.smooth_window}")
        _check_baseline(self.baseline)
        resolve(self.scheme, self.quantizer)  # refuse an inexpressible scheme now
        self.callback_config().reinit_steps(self.train.steps)  # a period longer than the run is an error

    def callback_config(self) -> WinQConfig:
        return self.winq if self.method == "winq" else STE

    @property
    def work(self) -> Path:
        return work_folder(self.out, self.workdir)


def _check_baseline(baseline: str | float | None) -> None:
    """A numeric --baseline must be a finite positive loss (a path is read later, by `baseline_target`)."""
    value = _as_number(baseline)
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ConfigError(f"--baseline {baseline} is not a loss to reach; give a finite positive number or the "
                          "metrics.jsonl (or run folder) of a baseline run")


def _as_number(baseline: str | float | None) -> float | None:
    if baseline is None:
        return None
    try:
        return float(baseline)
    except ValueError:
        return None


def baseline_target(baseline: str | float | None, window: int) -> float | None:
    """Final smoothed loss of a baseline run: a number, or the metrics.jsonl of that run."""
    if baseline is None:
        return None
    value = _as_number(baseline)
    if value is not None:
        _check_baseline(value)
        return value
    from lowbit.train.metrics import read_losses

    losses = read_losses(baseline)
    if not losses:
        raise ConfigError(f"--baseline {baseline} holds no training losses")
    target = smooth(losses, window)[-1]
    if not math.isfinite(target):
        raise ConfigError(f"--baseline {baseline}: that run's final smoothed loss is {target} (it diverged), so "
                          "there is no loss to reach; give a run that converged, or a number")
    return target


def qat(job: QatJob) -> dict[str, Any]:
    from lowbit.train.distributed import init_from_env

    t0 = time.perf_counter()
    target = baseline_target(job.baseline, job.smooth_window)
    device = job_device(job.device)
    inputs = [job.model, job.data, job.evaluation and job.evaluation.data]
    outputs.check_folder(job.work, job.out, "--workdir", inputs)
    rank, world = init_from_env()  # under torchrun: one process per rank, rank 0 evaluates and saves
    if rank != 0:
        return _train(job, device, rank, world, target)[0]
    with outputs.claim(job.out, job.force, inputs) as out, outputs.hold_folder(job.work):
        res, lm, extras = _train(job, device, rank, world, target, out)
        from lowbit.files.native import save

        meta = {"source": lm.source, "method": f"qat-{job.method}", "plan": job.scheme,
                "quantizer": res["quantizer"], "steps": res["steps"],
                **{k: res[k] for k in ("ppl_fp", "ppl", "matmul_weights") if k in res}}
        try:
            save(lm.model, lm.tokenizer, out, meta=meta, force=True, extra_files=extras)
        except WriteError as e:
            kept = (f"; --workdir {job.work} keeps the last checkpoint: rerun the same command to resume from it"
                    if job.train.checkpoint_every else "")
            raise WriteError(f"{e}{kept}") from None
    res["out"], res["workdir"] = str(out), str(job.work)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def _train(job: QatJob, device: Any, rank: int, world: int, target: float | None,
           out: Path | None = None) -> tuple[dict, Any, dict]:
    """Load, convert, train and (rank 0) evaluate; returns the summary, the model and files to keep.

    Everything cheap is checked before the first heavy pass: the data, the output's
    free space (rank 0, ``out``) and a checkpoint to resume from (other settings, damage).
    """
    from lowbit.data.batches import training_windows
    from lowbit.models import load_model
    from lowbit.models.accounting import account_model
    from lowbit.qat.convert import to_qat, to_quant_linear
    from lowbit.qat.winq import WinQCallback
    from lowbit.train import check_resume, steps_to_reach, train
    from lowbit.train.loop import causal_lm_loss, kd_loss

    lm = load_model(job.model)
    targets = _targets(lm.model, job.keep)
    if job.kd and lm.kind == "lowbit":
        raise ConfigError(f"{lm.source} is already quantized, so it cannot be the distillation teacher; "
                          "start QAT from the full-precision model for --kd, or drop --kd")
    rows = training_windows(lm.tokenizer, job.data, job.seqlen, "calib")
    ev = job.evaluation.tokens(lm.tokenizer) if job.evaluation is not None and rank == 0 else None
    quantizer = resolve(job.scheme, job.quantizer)
    cb = WinQCallback(job.callback_config())
    extra = {"scheme": job.scheme, "quantizer": quantizer.name, "method": job.method, "source": lm.source,
             "winq": job.callback_config().to_dict(), "kd": job.kd, "kd_t": job.kd_temperature,
             "seqlen": job.seqlen, "data": job.data, **({"keep": list(job.keep)} if job.keep else {})}
    cfg = replace(job.train, out_dir=str(job.work))
    check_resume(cfg, [cb], extra, job.resume)
    if out is not None:  # every decoder Linear packed at about its bits, plus scales
        check_free_space(out, checkpoint_bytes(lm.model, bits=quantizer.bits + 1), "the QAT checkpoint")
    if device is not None:
        lm.model.to(device)
    res: dict[str, Any] = {"model": lm.source, "scheme": job.scheme, "method": job.method, "world": world}
    if ev is not None:
        res["ppl_fp"] = job.evaluation.perplexity(lm.model, ev).ppl
    teacher = copy.deepcopy(lm.model) if job.kd else None
    names = to_qat(lm.model, quantizer, targets)
    if ev is not None:  # the quantized model before any step: what training has to improve on
        res["ppl_before_training"] = job.evaluation.perplexity(lm.model, ev).ppl
    loss_fn = kd_loss(teacher, job.kd_temperature) if teacher is not None else causal_lm_loss
    r = train(lm.model, rows, cfg, callbacks=[cb], loss_fn=loss_fn, resume=job.resume, extra=extra)
    if rank != 0:
        return {"rank": rank, "steps": r.steps, "final_loss": r.final_loss}, lm, {}
    to_quant_linear(lm.model)
    res["matmul_weights"] = account_model(lm.model).to_dict()
    sm = smooth(r.losses, job.smooth_window)
    res.update(quantizer=quantizer.name, layers=len(names), steps=r.steps, final_loss=r.final_loss,
               final_loss_smoothed=sm[-1], initial_loss=r.losses[0], train_seconds=r.seconds,
               reinits=job.callback_config().reinit_steps(job.train.steps), train_rows=len(rows),
               resumed_from=r.resumed_from,
               steps_to_baseline_loss=steps_to_reach(r.losses, target, job.smooth_window) if target else None,
               baseline_loss=target, smoothing=f"trailing mean, window {job.smooth_window}")
    if ev is not None:
        ppl = job.evaluation.perplexity(lm.model, ev).ppl
        for key in ("ppl_fp", "ppl_before_training"):  # the three figures side by side in the summary
            res[key] = res.pop(key)
        res["ppl"] = ppl
    lm.model.to("cpu")
    extras = {name: job.work / name for name in ("metrics.jsonl", "loss.png") if (job.work / name).is_file()}
    return res, lm, extras


def _targets(model: Any, keep: tuple[str, ...]) -> list[str]:
    """The Linears QAT trains: the decoder's, less those --keep keeps; refused when float is left unasked."""
    from lowbit.models.accounting import gate
    from lowbit.qat.convert import default_targets

    names = default_targets(model)
    dropped = gate(model, names, keep)
    return [n for n in names if n not in dropped]
