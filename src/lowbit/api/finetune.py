"""The finetune job: quantized checkpoint -> adapters -> trained adapters (or a merged checkpoint).

Steps: validate everything cheap first; load the quantized checkpoint; (QWHA, LoftQ) load
the float model it was made from — verified against the weight digest the checkpoint
recorded, so another model with the same shapes is never used silently — to get the
quantization error; build training rows from the *training* split; (QWHA) calibration
``X^T X`` from the same rows; initialise; evaluate; train with the shared loop;
evaluate; save the adapter alone (with the base fingerprint) or, with ``merge``, a
re-quantized native checkpoint. Under ``torchrun`` every rank trains its share of each
global batch (DDP, or FSDP2 on GPUs) on its own GPU (the model is placed there before the
loop wraps it); rank 0 alone evaluates and writes --out.

Training metrics and checkpoints live in a work folder (``--workdir``, default
OUT.train, locked while the job runs), as for QAT: with ``checkpoint_every`` a killed
run resumes from its last checkpoint and ends byte-identical to an uninterrupted one
(adapter inits are deterministic; the checkpoint holds the trained values, AdamW's
moments and the RNG). The checkpoint's fingerprint covers the training settings, the
adapter recipe, the quantized checkpoint's weights digest and the training rows, and it
is checked right after the rows are built, before the heavy passes.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from lowbit.api import outputs
from lowbit.api.common import Evaluation, job_device, work_folder
from lowbit.configs import check_fields
from lowbit.errors import ConfigError
from lowbit.io import WriteError, check_free_space
from lowbit.peft.apply import PeftConfig, peft_config
from lowbit.train import TrainConfig

__all__ = ["DEFAULT_LR", "FinetuneJob", "PeftConfig", "TrainConfig", "TrainingData", "finetune", "peft_config",
           "work_folder"]

DEFAULT_LR = {"qwha": 2e-4, "lora": 2e-4, "loftq": 2e-4, "fourierft": 1e-3}


@dataclass(frozen=True)
class TrainingData:
    """Where training rows come from (always the training split, never evaluation text).

    source: a .jsonl of instructions (answer-only loss), a .txt, a saved HF dataset;
    None = the bundled corpus. calib_samples: rows used for QWHA's ``X^T X``.
    """

    source: str | None = None
    nsamples: int = 64
    seqlen: int = 256
    seed: int = 0
    calib_samples: int = 32

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "training data setting")
        if self.nsamples < 1 or self.seqlen < 2 or self.calib_samples < 1:
            raise ConfigError("training data needs nsamples >= 1, seqlen >= 2 and calib_samples >= 1")


@dataclass(frozen=True)
class FinetuneJob:
    """Adapters on ``quantized_dir``; ``base_model`` = the float model it came from (default: as recorded).

    workdir: metrics and training checkpoints (default OUT.train); ``train.checkpoint_every``
    sets how often a checkpoint is written; resume: continue from the one found there.
    """

    quantized_dir: str | Path
    out: str | Path
    peft: PeftConfig
    train: TrainConfig
    data: TrainingData = field(default_factory=TrainingData)
    base_model: str | None = None
    evaluation: Evaluation | None = field(default_factory=Evaluation)
    merge: bool = False
    device: str | None = None
    force: bool = False
    progress: bool = True
    workdir: str | None = None
    resume: bool = True

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "fine-tune setting")

    def inputs(self) -> list[Any]:
        return [self.quantized_dir, self.base_model, self.data.source, self.evaluation and self.evaluation.data]

    @property
    def work(self) -> Path:
        return work_folder(self.out, self.workdir)


def training_rows(tokenizer: Any, data: TrainingData) -> torch.Tensor:
    """``[N, 2, T]`` ids+labels from the training split."""
    from lowbit.peft.finetune import instruction_rows, is_instruction_file, lm_rows

    if is_instruction_file(data.source):
        return instruction_rows(tokenizer, data.source, data.seqlen, limit=data.nsamples)
    from lowbit.data import calibration_batches

    return lm_rows(calibration_batches(tokenizer, data.source, nsamples=data.nsamples, seqlen=data.seqlen,
                                       seed=data.seed))


def check_prestep(manifest: dict, adapter: str) -> None:
    """Refuse an error-initialised adapter on a checkpoint made after AWQ scaling (before any loading).

    AWQ's scales came from calibration data the checkpoint does not record, so the float
    weights that were quantized cannot be rebuilt from the base model.
    """
    from lowbit.peft.apply import NEEDS_ERROR

    if adapter in NEEDS_ERROR and manifest.get("meta", {}).get("awq") is not None:
        raise ConfigError(f"the checkpoint was quantized after AWQ scaling (--awq), so its float weights are not the "
                          f"base model's and --adapter {adapter}'s init (from the quantization error) cannot be "
                          "computed; use --adapter lora or fourierft, or a checkpoint made without --awq")


def _redo_prestep(fp: torch.nn.Module, meta: dict) -> None:
    """Turn the float base into the float weights that were quantized: the same rotation (it is data-free)."""
    if meta.get("rotation") is not None:
        from lowbit.ptq.rotation import RotationSettings, rotate_model

        rotate_model(fp, RotationSettings(**meta["rotation"]))


def base_weights(manifest: dict, names: list[str], base_model: str | None) -> tuple[dict[str, torch.Tensor], dict]:
    """The named float weights of the model the checkpoint was quantized from, checked against its digest.

    Returns the weights and what the summary reports about them (source, verified).
    """
    from lowbit.models import BUNDLED_NAME, load_model
    from lowbit.models.layers import weight_digest

    meta = manifest.get("meta", {})
    source = base_model or meta.get("source")
    if base_model is None and meta.get("source_kind") in ("hf_dir", "gguf") and not Path(source).exists():
        raise ConfigError(f"the checkpoint was quantized from {source}, which is not there any more; pass the "
                          "float model with --base-model")
    fp = load_model(None if source in (None, BUNDLED_NAME) else source).model
    _redo_prestep(fp, meta)
    try:
        weights = {n: fp.get_submodule(n).weight.detach().float().clone() for n in names}
    except AttributeError as e:
        raise ConfigError(f"the base model {source!r} lacks a quantized layer ({e}); pass the model the "
                          "checkpoint was quantized from with --base-model") from None
    digest = meta.get("source_digest")
    if digest is not None and weight_digest(fp, names) != digest:
        raise ConfigError(f"the float model {source} is not the one the checkpoint was quantized from (its "
                          "weights differ); pass that model with --base-model")
    if digest is None:
        warnings.warn(f"the checkpoint records no digest of its float weights (older lowbit, or an "
                      f"--offload-dir run): {source} is used unverified", stacklevel=2)
    return weights, {"base_model": str(source), "base_verified": digest is not None}


def finetune(job: FinetuneJob) -> dict[str, Any]:
    """Run the whole job; returns the JSON summary the CLI prints."""
    from lowbit.files.native import load, read_manifest
    from lowbit.peft.apply import NEEDS_ERROR, check_shapes

    t0 = time.perf_counter()
    manifest = read_manifest(job.quantized_dir)
    check_shapes(job.peft, {n: tuple(spec["shape"]) for n, spec in manifest["layers"].items()})
    check_prestep(manifest, job.peft.adapter)
    if job.base_model is not None and job.peft.adapter not in NEEDS_ERROR:
        raise ConfigError(f"--base-model applies to --adapter {' | '.join(NEEDS_ERROR)} (their init needs the "
                          f"float weights); --adapter {job.peft.adapter} starts from zero")
    device = job_device(job.device)
    outputs.check_folder(job.work, job.out, "--workdir", job.inputs())
    from lowbit.train.distributed import init_from_env

    rank, world = init_from_env()
    if rank != 0:  # trains its share; rank 0 evaluates and saves
        result = _Finetune(job, manifest, device, rank).run(None, load)
    else:
        with outputs.claim(job.out, job.force, job.inputs()) as out, outputs.hold_folder(job.work):
            result = _Finetune(job, manifest, device, rank).run(out, load)
    result["world"] = world
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


class _Finetune:
    def __init__(self, job: FinetuneJob, manifest: dict, device: Any, rank: int = 0) -> None:
        self.job, self.manifest, self.device, self.rank = job, manifest, device, rank

    def run(self, out: Path | None, load: Any) -> dict[str, Any]:
        from lowbit.files.native import require_tokenizer
        from lowbit.peft.apply import NEEDS_ERROR

        job = self.job
        model, tokenizer = load(job.quantized_dir)
        require_tokenizer(tokenizer, job.quantized_dir)
        names = list(self.manifest["layers"])
        rows = training_rows(tokenizer, job.data)
        ev = job.evaluation.tokens(tokenizer) if job.evaluation is not None and self.rank == 0 else None
        self._check_before_work(rows, out)
        result: dict[str, Any] = {"base": str(job.quantized_dir), "adapter": job.peft.adapter, "rank": job.peft.rank,
                                  "train_rows": len(rows)}
        fp = None
        if job.peft.adapter in NEEDS_ERROR:
            fp, info = base_weights(self.manifest, names, job.base_model)
            result.update(info)
        if self.device is not None:
            model.to(self.device)
        return self._train(model, tokenizer, names, rows, ev, fp, result, out)

    @property
    def train_config(self) -> Any:
        return replace(self.job.train, out_dir=str(self.job.work))

    def identity(self, rows: torch.Tensor) -> dict[str, Any]:
        """What besides the training settings a resumed fine-tune must share with its checkpoint."""
        job, meta = self.job, self.manifest.get("meta", {})
        return {"peft": job.peft.to_dict(), "base_weights": self.manifest.get("files", {}).get("model.safetensors"),
                "base_model": job.base_model, "source_digest": meta.get("source_digest"),
                "rows": hashlib.sha256(rows.cpu().to(torch.int64).numpy().tobytes()).hexdigest()[:32],
                "calib_samples": job.data.calib_samples}

    def _check_before_work(self, rows: torch.Tensor, out: Path | None) -> None:
        """A checkpoint written with other settings (or damaged), or an output too big for its device,
        is refused before the base model loads and before any perplexity pass."""
        from lowbit.train import check_resume

        check_resume(self.train_config, (), self.identity(rows), self.job.resume)
        if out is not None and self.job.merge:  # a merged checkpoint is about the size of the quantized one
            size = sum(f.stat().st_size for f in Path(self.job.quantized_dir).iterdir() if f.is_file())
            check_free_space(out, size + (1 << 20), "the merged checkpoint")

    def _train(self, model, tokenizer, names, rows, ev, fp, result, out) -> dict[str, Any]:  # noqa: ANN001
        from lowbit.models.activations import second_moments
        from lowbit.peft.apply import apply_adapters, count_trainable, merge_and_requantize
        from lowbit.peft.finetune import train_adapters
        from lowbit.peft.store import save_adapters

        job = self.job
        ppl = (lambda: job.evaluation.perplexity(model, ev, job.progress).ppl) if ev is not None else None
        if ppl:
            result["ppl_base"] = ppl()
        t0 = time.perf_counter()
        xtx = None
        if job.peft.adapter == "qwha" and job.peft.refine:
            xtx = second_moments(model, rows[: job.data.calib_samples, 0], names, progress=job.progress)
        made = apply_adapters(model, job.peft, fp, xtx, progress=job.progress)
        padded = {n: [a.plan.width, a.plan.n] for n, a in made.items() if getattr(a, "plan", None) and a.plan.padded}
        if padded:
            result["padded_widths"] = padded  # no Hadamard construction: zero-padded (see lowbit.transforms.hadamard)
        result["init_seconds"] = round(time.perf_counter() - t0, 2)
        result["trainable_params"] = count_trainable(model)
        if ppl:
            result["ppl_init"] = ppl()
        train_result, timer = train_adapters(model, rows, self.train_config, extra=self.identity(rows),
                                             resume=job.resume)
        result.update(steps=train_result.steps, loss_first=train_result.losses[0],
                      loss_last=train_result.final_loss, step_seconds=round(timer.median(), 4),
                      resumed_from=train_result.resumed_from, workdir=str(job.work))
        if ppl:
            result["ppl_final"] = ppl()
        model.to("cpu")
        if out is None:  # a rank other than 0 under torchrun
            return result
        meta = {"base": str(job.quantized_dir), "train": job.train.to_dict(),
                **{k: v for k, v in result.items() if k.startswith("ppl")}}
        try:
            if job.merge:
                from lowbit.files.native import save
                from lowbit.models.accounting import account_model

                errs = merge_and_requantize(model)
                result["merge_rel_error_max"] = max(errs.values())
                result["matmul_weights"] = account_model(model).to_dict()
                save(model, tokenizer, out, meta={**self.manifest.get("meta", {}), "finetune": meta,
                                                  "matmul_weights": result["matmul_weights"]}, force=True)
            else:
                save_adapters(model, out, job.peft, meta=meta, force=True)
        except WriteError as e:
            kept = (f"; --workdir {job.work} keeps the last checkpoint: rerun the same command to resume from it"
                    if job.train.checkpoint_every else "")
            raise WriteError(f"{e}{kept}") from None
        result["out"] = str(out)
        return result
