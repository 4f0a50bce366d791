"""The quantize job: load -> (FP perplexity) -> [mixed-precision plan] -> PTQ -> perplexity -> save.

Everything that can be checked without the model is checked when the job is built
(`QuantizeJob`), and everything that needs only paths before the model loads; the data
splits are tokenized and checked before the first heavy pass, so a bad input never
costs a tuning run. So are a work folder holding a run with other settings and an
output that cannot fit its device: both are refused before the float perplexity pass.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowbit.api import outputs
from lowbit.api.common import Calibration, Evaluation, Phases, bits_summary, checkpoint_bytes, job_device
from lowbit.api.export import TARGETS as EXPORT_TARGETS
from lowbit.configs import check_fields
from lowbit.errors import ConfigError
from lowbit.formats.kv import KVScheme, parse_kv_options
from lowbit.io import WriteError, check_free_space
from lowbit.models.accounting import keep_patterns
from lowbit.plans import kmix, source
from lowbit.plans.plan import Plan
from lowbit.plans.source import DEFAULT_SCHEME, MixedBudget, PlanFile, PlanSource, build_plan
from lowbit.ptq import memory
from lowbit.ptq import methods as ptq_methods
from lowbit.ptq.awq import AWQSettings
from lowbit.ptq.conductor import PtqOutcome, PtqSpec, conduct, preflight
from lowbit.ptq.memory import Estimate
from lowbit.ptq.methods import FlagSpec, RunContext, coerce_settings, get, make_settings, walks_blocks
from lowbit.ptq.mixed import MixedSettings
from lowbit.ptq.rotation import RotationSettings

__all__ = ["DEFAULT_SCHEME", "AWQSettings", "FlagSpec", "MixedSettings", "QuantizeJob", "RotationSettings",
           "build_plan", "check_memory", "job_estimate", "make_settings", "memory_help", "method_flags",
           "method_names", "method_options", "quantize"]


@dataclass(frozen=True)
class QuantizeJob:
    """One PTQ run.

    scheme / plan_file / mixed: where the per-layer schemes come from (one of them; none =
    w4g128 everywhere); parsed once into ``source`` (`lowbit.plans.source`: a uniform
    recipe, a llama.cpp mix, a plan file or a mixed budget), which the run reads.
    settings: the method's settings dataclass (or a mapping of its fields; None = defaults). calib: used when the method or the mixed plan needs data.
    evaluation: None = no perplexity passes. workdir / offload_dir / cache_device: block-wise
    passes only, a block-wise method's or the AWQ pre-step's (which walks the blocks on the same
    engine, so ``--method rtn --awq`` takes them too); cache_device "cpu" keeps their cached
    activations in host memory.
    rotate / awq: float pre-steps before the method (True = their default settings): a
    Hadamard rotation of the residual stream, AWQ's activation-aware channel scales.
    export_to: the export the checkpoint is for ("compressed-tensors" | "gguf"): a plan it
    cannot hold is refused before any heavy pass. None = every export that cannot hold the
    plan is named in a warning (and in the summary's ``not_exportable``).
    """

    out: str | Path
    model: str | None = None
    scheme: str | None = None
    plan_file: str | None = None
    lm_head: bool = False
    method: str = "rtn"
    settings: Any = None
    mixed: MixedSettings | None = None
    calib: Calibration = field(default_factory=Calibration)
    evaluation: Evaluation | None = field(default_factory=Evaluation)
    device: str | None = None
    workdir: str | None = None
    offload_dir: str | None = None
    cache_device: str | None = None
    rotate: RotationSettings | bool | None = None
    awq: AWQSettings | bool | None = None
    force: bool = False
    progress: bool = True
    export_to: str | None = None
    keep: tuple[str, ...] = ()
    kv: str | None = None
    kv_bits: float | None = None
    source: PlanSource = field(init=False, repr=False, compare=False)
    kv_scheme: KVScheme | None = field(init=False, repr=False, compare=False)
    kv_options: tuple[KVScheme, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "quantize setting")
        spec = get(self.method)
        if self.export_to is not None and self.export_to not in EXPORT_TARGETS:
            raise ConfigError(f"--export-to must be one of {', '.join(EXPORT_TARGETS)}, got {self.export_to!r}")
        object.__setattr__(self, "settings", coerce_settings(self.method, self.settings))
        object.__setattr__(self, "keep", keep_patterns(self.keep))
        object.__setattr__(self, "rotate", _switch(self.rotate, RotationSettings, "rotate"))
        object.__setattr__(self, "awq", _switch(self.awq, AWQSettings, "awq"))
        object.__setattr__(self, "source", source.plan_source(self.scheme, self.plan_file, self.mixed, self.lm_head))
        self._parse_kv()
        if self.kv_scheme is not None and self.export_to is not None:
            why = _kv_refusal(self, self.export_to)
            if why is not None:
                raise ConfigError(f"--export-to {self.export_to}: {why}")
        if self.mixed is not None and self.loads_lazily and (self.rotate is not None or self.awq is not None):
            from lowbit.ptq.conductor import MIXED_PRE_STEPS

            raise ConfigError(MIXED_PRE_STEPS)
        if self.kv_scheme is not None and self.loads_lazily:
            raise ConfigError("--kv calibrates and checks the KV cache on the whole model, which --offload-dir does "
                              "not hold in memory; drop --offload-dir (or --kv)")
        if self.cache_device is not None and self.cache_device not in ("device", "cpu", "disk"):
            raise ConfigError(f"--cache-device must be device, cpu or disk, got {self.cache_device!r}")
        if self.cache_device == "disk" and self.offload_dir is None:
            raise ConfigError("--cache-device disk keeps the activations in files in --offload-dir; pass --offload-dir")
        # RTN walks the blocks only on a lazily loaded model (a model in memory keeps its one calibration pass)
        walks = spec.blockwise or (walks_blocks(self.method, self.needs_calib, self.rotate is not None)
                                   and self.offload_dir is not None)
        for name, value in (("--workdir", self.workdir), ("--offload-dir", self.offload_dir),
                            ("--cache-device", self.cache_device)):
            if value is not None and not walks and self.awq is None:  # AWQ walks the blocks on the engine
                raise ConfigError(f"{name} applies to the block-wise methods ({' | '.join(_block_methods())}), to "
                                  "--method rtn with calibration data or --rotate and --offload-dir (block by block "
                                  f"on the checkpoint) and to the --awq pre-step; --method {self.method} here "
                                  "quantizes the whole model at once, so there is nothing block-wise for it to hold "
                                  "(a model bigger than memory without data or rotation: --stream)")
        if self.cache_device is not None and self.rotates_without_data:
            raise ConfigError("--cache-device places the activation caches of a calibrated walk; --method rtn "
                              "without data and with --rotate walks the blocks with none (it only rotates and "
                              "rounds each block): drop --cache-device")

    def _parse_kv(self) -> None:
        """``kv`` -> ``kv_options`` (one scheme, or the candidates of ``kv_bits``) and ``kv_scheme``: the one
        scheme, or for a per-layer choice the first candidate, which stands for what they share (rotation)."""
        options = () if self.kv is None else parse_kv_options(self.kv)
        if self.kv_bits is not None:
            if len(options) < 2:
                raise ConfigError("--kv-bits chooses each layer's KV scheme among several by DeltaLoss; list them in "
                                  "--kv, e.g. --kv fp8,int8,int4 --kv-bits 6")
            if get(self.method).blockwise:
                raise ConfigError(f"--kv-bits chooses the KV schemes on the quantized model, after --method "
                                  f"{self.method} has tuned its blocks under one cache; use one --kv scheme with it, "
                                  "or --method rtn")
            if not 0 < self.kv_bits <= 16:
                raise ConfigError(f"--kv-bits is the average bits per cached key / value element (scales "
                                  f"included), between the smallest option's and 16; got {self.kv_bits}")
        elif len(options) > 1:
            raise ConfigError(f"--kv lists {len(options)} schemes ({', '.join(o.name for o in options)}): add "
                              "--kv-bits B to choose one per layer within B bits per cached element, or name one")
        object.__setattr__(self, "kv_options", options)
        object.__setattr__(self, "kv_scheme", options[0] if options else None)

    @property
    def kv_mixed(self) -> bool:
        """A KV scheme chosen per layer (``--kv A,B,... --kv-bits B``)."""
        return self.kv_bits is not None

    @property
    def needs_calib(self) -> bool:
        return (get(self.method).needs_calib(self.settings) or self.mixed is not None or self.static_inputs
                or self.awq is not None or self.kv_mixed or any(o.needs_calibration for o in self.kv_options))

    @property
    def rotates_without_data(self) -> bool:
        """Data-free RTN with a rotation on a lazily loaded model: the walk reads no data, it rotates each block as it
        reads it and rounds it (`lowbit.ptq.blockwise.rounding`)."""
        return self.loads_lazily and not self.needs_calib and not get(self.method).blockwise

    @property
    def static_inputs(self) -> bool:
        """Whether some recipe quantizes inputs with static scales (calibrated on the calibration split)."""
        return source.needs_calibration(self.source)

    @property
    def loads_lazily(self) -> bool:
        """A run on the block-wise engine with --offload-dir reads blocks from disk (the pre-steps --rotate / --awq
        per block as they are read, `lowbit.ptq.block_prep`; RTN without data walks them only to rotate them;
        mixed precision's DeltaLoss passes block by block, `lowbit.ptq.streamed_deltaloss`)."""
        return self.offload_dir is not None and walks_blocks(self.method, self.needs_calib, self.rotate is not None)

    @property
    def releases_blocks(self) -> bool:
        """A lazy run that evaluates nothing writes each finished block to --offload-dir and frees it, so its
        memory stays flat in the model's depth (`lowbit.ptq.blockwise.release`); a perplexity pass needs them."""
        return self.loads_lazily and self.evaluation is None and self.kv_scheme is None

    def inputs(self) -> list[str | None]:
        return [self.model, self.plan_file, self.calib.data, self.evaluation and self.evaluation.data]


def _switch(value: Any, kind: type, name: str) -> Any:
    """A pre-step's settings: None / False = off, True = defaults, else its settings dataclass."""
    if value is None or value is False:
        return None
    if value is True:
        return kind()
    if not isinstance(value, kind):
        raise ConfigError(f"{name} takes True, False or a {kind.__name__}, got {type(value).__name__}")
    return value


def method_flags() -> list[FlagSpec]:
    """The method-settings flags of ``lowbit quantize``, from each registered method's settings dataclass."""
    return ptq_methods.method_flags()


def method_names() -> list[str]:
    """The registered methods, in registration order (``--method``'s choices)."""
    return list(ptq_methods.METHODS)


def method_options(method: str) -> list[str]:
    """The settings fields method ``method`` takes (its command-line flags, underscores as dashes)."""
    return get(method).settable()


def _block_methods() -> list[str]:
    return sorted(n for n, m in ptq_methods.METHODS.items() if m.blockwise)


def quantize(job: QuantizeJob) -> dict[str, Any]:
    """Run ``job``; returns the summary the CLI prints (see README for the keys)."""
    from lowbit.models import load_model

    t0 = time.perf_counter()
    device = job_device(job.device)
    for flag, folder in (("--workdir", job.workdir), ("--offload-dir", job.offload_dir)):
        if folder is not None:
            outputs.check_folder(folder, job.out, flag, job.inputs())
    need, job = check_memory(job)
    rank, world = _join_world(job)
    phases = Phases()
    if rank != 0:  # under torchrun: tunes its share of the samples; rank 0 alone writes --out
        with phases("load"):
            lm = load_model(job.model, lazy=job.loads_lazily)
        result = _Run(job, lm, device, phases).execute()
        return {**result, "rank": rank, "seconds": round(time.perf_counter() - t0, 2)}
    with outputs.claim(job.out, job.force, job.inputs()) as out, outputs.hold_folder(job.workdir), \
            outputs.hold_folder(job.offload_dir, "--offload-dir"):
        with phases("load"):
            lm = load_model(job.model, lazy=job.loads_lazily)
        run = _Run(job, lm, device, phases)
        check_free_space(out, checkpoint_bytes(lm.model, run.plan), "the quantized checkpoint")
        result = run.execute()
        with phases("save"):
            run.save(out, result)
    result["out"] = str(out)
    if need is not None:
        result["memory_estimate"] = need.to_dict()
    if world > 1:
        result["world"] = world
    result["seconds"] = round(time.perf_counter() - t0, 2)
    result["time_s"] = phases.report()
    return result


def job_estimate(job: QuantizeJob) -> Estimate | None:
    """The memory and disk ``job`` takes (`lowbit.ptq.memory`), from the model folder's config.json alone; None
    for a source without one (the bundled model, a GGUF file, a hub id: read after loading) or without the sizes."""
    from lowbit.io import read_json

    folder = Path(job.model).expanduser() if job.model is not None else None
    if folder is None or not (folder / "config.json").is_file():
        return None
    from lowbit.models.loading import check_hf_folder

    check_hf_folder(folder)  # a config.json that contradicts its weights is named, not estimated from
    try:
        config = read_json(folder / "config.json", ConfigError, "fix the model's config")
        shape = memory.Shape.from_config(memory.with_stored_dtype(config, folder) if isinstance(config, dict)
                                         else config)
    except (ConfigError, TypeError, ValueError):
        return None
    tokens = (job.calib.nsamples, job.calib.seqlen) if job.needs_calib else (0, 0)
    bits = (job.source.recipe.weight.bits_per_weight(shape.hidden) if isinstance(job.source, source.Uniform)
            else memory.WEIGHT_BITS)  # a mix or a plan file: about 4 bits (the output is checked after loading)
    return memory.estimate(shape, job.method, *tokens, lazy=job.loads_lazily,
                           search=bool(getattr(job.settings, "search", False)), evaluate=not job.releases_blocks,
                           batch_size=getattr(job.settings, "batch_size", 8) or 8, lm_head=job.lm_head,
                           weight_bits=bits, rotate=job.rotate is not None, awq=job.awq is not None,
                           deltaloss=_deltaloss_tokens(job))


def _deltaloss_tokens(job: QuantizeJob) -> tuple[int, int, bool] | None:
    """(samples, seqlen, lm_head planned) of mixed precision's DeltaLoss passes (block by block on a lazily loaded
    model, else on the whole model)."""
    if job.mixed is None:
        return None
    return min(job.mixed.nsamples, job.calib.nsamples), job.calib.seqlen, job.lm_head


def memory_help() -> str:
    """What --help says about memory: the formula and examples (`lowbit.ptq.memory`)."""
    return ("Memory of such a run: ~0.45 GiB of runtime + the embeddings and lm_head in the checkpoint's dtype "
            "(bf16: 2 bytes per entry) + one block in fp32 + "
            "nsamples x seqlen x hidden x 4 bytes per activation cache (gptq 1, signround 2) + the method's state "
            "(gptq: 16 bytes x widest Linear input^2, its Hessian and the factorization's copies, + the widest Linear "
            "group's weights 4 times in fp32; signround: 20 bytes per block weight and a mini-batch's backward); "
            f"at 128 x 2048 calibration tokens: {memory.help_table()}. --rotate (the embedding widened to fp32 and turned "
            "before the walk, then held in fp16, the lm_head turned after the last block) and --awq (two more activation caches; its search holds 12 bytes x "
            "the widest Linear input^2 and a group's weights 4 times in fp32) run per block too, and so does --method "
            "rtn with calibration data (2 caches, its widest Linear 8 times in fp32); --method rtn without data and with "
            "--rotate / --rotate-online walks the blocks without caches (the tables, one block in fp32 and one "
            f"Linear's rounding: {memory.rotate_example()}; --stream, which does not rotate, holds about one tensor). "
            "--avg-bits scores its options "
            "block by block before the walk: one block's weights 4 times in fp32, a chunk of 4 samples' backward "
            "through it and through the lm_head (3 x 4 x seqlen x vocab x 4 bytes of logits), and (layers + 2) "
            "activation caches of min(--nsamples, 16) samples, on disk in --offload-dir when they do not "
            "fit. Without --offload-dir (or with --method rtn without data nor rotation: --stream for that) the whole "
            "float model is loaded (4 bytes per weight; --avg-bits then back-propagates all of it: 12 bytes more per "
            "planned weight, every block's activations of 4 samples and the logits). The run is "
            "refused before loading, with these numbers, when free memory (MemAvailable) or the disk of --out / "
            "--offload-dir cannot hold it")


def _whole_by(job: QuantizeJob) -> str | None:
    """The flag that loads the whole model although --offload-dir asks for one block at a time."""
    if job.offload_dir is None or job.loads_lazily:
        return None
    return f"--method {job.method}"


def check_memory(job: QuantizeJob) -> tuple[Estimate | None, QuantizeJob]:
    """Refuse, before loading anything, a job this machine's free memory (a CPU run) or disk cannot hold.

    A lazy run whose activation caches alone do not fit keeps them on disk in --offload-dir
    instead (``--cache-device disk``, with a warning), when the user did not place them.
    Returns the estimate and the job as it will run.
    """
    import shutil

    from lowbit.io import OutputError, existing_ancestor

    est = job_estimate(job)
    if est is None:
        return None, job
    cpu = job.device is None or str(job.device).startswith("cpu")
    available = memory.mem_available() if cpu else None
    if job.cache_device is None and job.loads_lazily:
        moved = memory.caches_on_disk(est)
        if available is not None and est.peak * 1.1 > available and moved.peak * 1.1 <= available:
            warnings.warn(f"the activation caches ({est.parts['caches'] / memory.GiB:.2f} GiB) do not fit in the "
                          f"{available / memory.GiB:.1f} GiB of free memory: they are kept in files in --offload-dir "
                          "(--cache-device disk)", stacklevel=2)
            est, job = moved, replace(job, cache_device="disk")
    elif job.cache_device == "disk":
        est = memory.caches_on_disk(est)
    folders = {"out": job.out, "offload": job.offload_dir}
    free = {role: shutil.disk_usage(existing_ancestor(Path(f).expanduser().absolute())).free
            for role, f in folders.items() if f is not None}
    why = memory.refusal(est, available, free, whole_by=_whole_by(job),
                         fix=memory.ROTATE_FIX if job.rotates_without_data else None)
    if why is not None:
        raise (OutputError if why.startswith("--") else ConfigError)(why)
    return est, job


def _join_world(job: QuantizeJob) -> tuple[int, int]:
    """(rank, world) under torchrun (joining its process group), checked against the job before any work.

    Block-wise tuning splits the calibration samples and each mini-batch evenly over the
    ranks; any other method would only repeat the same work on every rank.
    """
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1
    spec = get(job.method)
    world = int(os.environ["WORLD_SIZE"])
    if not spec.blockwise or job.mixed is not None:
        raise ConfigError(f"--method {job.method}{' with mixed precision' if job.mixed else ''} does not run "
                          f"data-parallel; launch it as one process (torchrun gave {world}), or use a block-wise "
                          f"method ({' | '.join(_block_methods())})")
    if job.calib.nsamples % world:
        raise ConfigError(f"--nsamples {job.calib.nsamples} does not split over the {world} torchrun processes; "
                          f"pass a multiple of {world}")
    batch = getattr(job.settings, "batch_size", None)
    if batch is not None and min(batch, job.calib.nsamples) % world:
        raise ConfigError(f"a tuning mini-batch of {min(batch, job.calib.nsamples)} samples does not split over "
                          f"the {world} torchrun processes; pass --batch-size a multiple of {world}")
    from lowbit.train.distributed import init_from_env

    return init_from_env()


class _Run:
    """The steps of one quantize job on a loaded model (kept apart so each stays short)."""

    def __init__(self, job: QuantizeJob, lm: Any, device: torch.device | None, phases: Phases | None = None) -> None:
        self.job, self.lm, self.device = job, lm, device
        self.phases = phases or Phases()
        self.plan = _keep(lm.model, build_plan(lm.model, job.source), job)
        self.spec = PtqSpec(job.method, job.settings, job.mixed, job.rotate, job.awq)
        preflight(lm.model, self.plan, self.spec)
        self.outcome: PtqOutcome | None = None
        from lowbit.nn.kv_quant import check_kv

        # a refusal comes before the export-limit warnings, so a refused run prints its one error line only
        for kv in job.kv_options:
            check_kv(lm.model, kv)
        self.not_exportable = _export_limits(job, lm.model, self.plan)
        self._check_whole_model_fits()
        with self.phases("data"):
            self.ev = job.evaluation.tokens(lm.tokenizer) if job.evaluation is not None else None
            self.calib = job.calib.batches(lm.tokenizer) if job.needs_calib else None
        self._check_resume()

    def _kv_choice(self, model: nn.Module) -> KVScheme | dict[str, KVScheme]:
        """The job's KV scheme, or with --kv-bits each attention's, chosen now on the quantized model: DeltaLoss's
        KV term per option (`lowbit.ptq.sensitivity.kv_delta_loss`), then the exact knapsack on the cache's bits."""
        job = self.job
        if not job.kv_mixed:
            return job.kv_scheme
        from lowbit.ptq.mixed import mixed_kv

        return mixed_kv(model, [o.name for o in job.kv_options], job.kv_bits, self.calib, progress=job.progress)

    def _check_resume(self) -> None:
        """A --workdir holding a run with other settings (the method's, or AWQ's in WORKDIR/awq) is refused now,
        not after the float perplexity pass."""
        from lowbit.ptq import check_resume

        job = self.job
        if job.workdir is None:
            return
        # tuned blocks run under the quantized cache, whose static scales (buffers) are installed before the
        # pre-steps and so enter the model's fingerprint; -rot folds the value rotation into the weights first
        kv = job.kv_scheme if get(job.method).blockwise else None
        kv_changes = job.kv_scheme is not None and (job.kv_scheme.rotate or kv is not None and kv.needs_calibration)
        changed = job.rotate is not None or kv_changes
        later = (("model",) if changed or job.awq is not None else ()) + \
                (("plan", "shared_tensor_scales") if job.mixed is not None else ()) + \
                (("pre_steps",) if job.loads_lazily and (job.rotate or job.awq) else ())  # recorded by the walk
        check_resume(job.method, job.settings, self.plan, self.lm.model, self.calib, self._context(), later,
                     awq=job.awq, awq_later=("model",) if changed else (), kv=kv)

    def _context(self) -> RunContext:
        """What the method runs with: the device as resolved once by `quantize`, the job's folders."""
        job = self.job
        return RunContext(calib=self.calib, device=self.device, workdir=job.workdir, offload_dir=job.offload_dir,
                          progress=job.progress, cache_device=job.cache_device or "device",
                          release=job.releases_blocks)

    def _check_whole_model_fits(self) -> None:
        """The whole-model passes (perplexities, RTN, DeltaLoss) must fit the device: checked before any work.

        A lazily loaded model is evaluated only once quantized: its planned weights then take
        about a byte each (codes, plus scales), the rest its own size.
        """
        from lowbit.models.lazy import is_lazy
        from lowbit.models.placement import check_fits, model_bytes

        job, model = self.job, self.lm.model
        whole = (job.evaluation is not None
                 or not walks_blocks(job.method, job.needs_calib, job.rotate is not None and job.offload_dir is not None)
                 or (job.mixed is not None and not job.loads_lazily))
        if not whole or self.device is None:
            return
        if is_lazy(model):
            size = model_bytes(model, dict.fromkeys(self.plan, 1))
            what = "evaluating the quantized model"
        else:
            size = model_bytes(model)
            what = "the float perplexity" if job.evaluation is not None else f"--method {job.method}"
        check_fits(size, self.device, what)

    def execute(self) -> dict[str, Any]:
        from lowbit.models.accounting import account_model
        from lowbit.models.lazy import is_lazy
        from lowbit.models.placement import on_device
        job, model = self.job, self.lm.model
        result: dict[str, Any] = {"model": self.lm.source, "method": job.method}
        if self.ev is not None and not is_lazy(model):
            with self.phases("ppl_fp"), on_device(model, self.device):
                result["ppl_fp"] = job.evaluation.perplexity(model, self.ev, job.progress).ppl
        elif self.ev is not None:
            result["ppl_fp_skipped"] = "lazy load (--offload-dir): run `lowbit eval MODEL` for the float perplexity"
        t0 = time.perf_counter()
        if job.kv_scheme is not None and job.kv_scheme.rotate:  # a float pre-step: exact, before any weight rounds
            from lowbit.nn.kv_quant import fold_value_rotation

            fold_value_rotation(model)
        if job.kv_scheme is not None and get(job.method).blockwise:  # tuned blocks run with the quantized cache
            from lowbit.nn.kv_quant import calibrate_kv

            with self.phases("kv"), on_device(model, self.device):
                calibrate_kv(model, self.calib, job.kv_scheme, values_folded=job.kv_scheme.rotate)
        # digest: the float weights the method quantizes (rotated / scaled), what a fine-tune's error init must match
        self.outcome = conduct(model, self.plan, self.spec, self._context(), self.phases, digest=True)
        self.plan = self.outcome.plan
        result.update(self.outcome.prepared)
        if self.outcome.fallbacks:
            result["range_fallbacks"] = dict(self.outcome.fallbacks)
        if job.kv_scheme is not None:
            with self.phases("kv"), on_device(model, self.device):
                result["kv_cache"] = _kv_cache(model, self._kv_choice(model), self.calib)
        result["quantize_seconds"] = round(time.perf_counter() - t0, 2)
        mix = source.mix_name(job.source)
        result["scheme"] = mix or self.plan.describe()
        if mix or any(s.family.name == "kquant" for s in self.plan.weights().values()):
            result |= _kquant_summary(model, self.plan)
        if mix:
            result["gguf_embeddings"] = _gguf_embeddings(model, mix)
            self.output_importance = self._output_importance(model, mix)
        if self.ev is not None:
            with self.phases("ppl_q"), on_device(model, self.device):
                r = job.evaluation.perplexity(model, self.ev, job.progress)
            result["ppl_q"], result["eval_tokens"] = r.ppl, r.tokens
        result.update(bits_summary(model, self.plan, job.lm_head))
        result["matmul_weights"] = account_model(model).to_dict()
        tokens = expert_tokens(model)
        if tokens:
            result["expert_tokens"] = tokens
        if self.not_exportable:
            result["not_exportable"] = self.not_exportable
        return result

    def _output_importance(self, model: nn.Module, mix: str) -> list[float] | None:
        """Mean squared input of the output tensor on the calibration split (the quantized model's final hidden
        states), for the GGUF export's search on the output / tied embedding table; None when no calibration
        data was read, the table stays 16-bit, or a whole-model pass is not otherwise made (a model too big)."""
        from lowbit.files.gguf_export import embedding_plan, output_table
        from lowbit.models.activations import importance
        from lowbit.models.lazy import is_lazy
        from lowbit.models.placement import on_device

        job = self.job
        whole = job.evaluation is not None or not get(job.method).blockwise
        key, head = output_table(model)
        if self.calib is None or not whole or is_lazy(model) or key not in embedding_plan(model, mix):
            return None
        with on_device(model, self.device):
            imp = importance(model, self.calib, [head])[head]
        return (imp / self.calib.numel()).tolist()

    def save(self, out: Path, result: dict[str, Any]) -> None:
        from lowbit.files.native import save
        from lowbit.ptq.blockwise.release import released

        mix = source.mix_name(self.job.source)
        meta = {"source": self.lm.source, "source_kind": self.lm.kind,
                "source_digest": self.outcome.float_digest if self.outcome is not None else None,
                "method": self.job.method, "plan": mix or self.plan.describe(), **kmix.mix_meta(mix),
                **({} if getattr(self, "output_importance", None) is None
                   else {"gguf_output_importance": self.output_importance}),
                **{k: result[k] for k in ("ppl_fp", "ppl_q", "matmul_weights", "kv_cache") if k in result},
                **{k: s.to_dict() for k, s in (("rotation", self.job.rotate), ("awq", self.job.awq)) if s is not None}}
        rel = released(self.lm.model)
        written = [rel.files[i] for i in sorted(rel.files)] if rel is not None else []
        try:
            save(self.lm.model, self.lm.tokenizer, out, meta=meta, force=True, extra_files=self._plan_files(),
                 written=written)
        except WriteError as e:
            blockwise = get(self.job.method).blockwise
            kept = (f"; the tuned blocks are kept in --workdir {self.job.workdir}: rerun the same command to resume "
                    "from them" if self.job.workdir and blockwise else
                    "; pass --workdir to keep the tuned blocks for a rerun" if blockwise else "")
            raise WriteError(f"{e}{kept}") from None

    def _plan_files(self) -> dict[str, bytes]:
        tokens = expert_tokens(self.lm.model)
        files = {"expert_tokens.json": json.dumps(tokens, indent=1).encode()} if tokens else {}
        if self.outcome is None or self.outcome.allocation is None:
            return files
        from lowbit.ptq.allocate import plot_bits

        sizes = {n: (m.out_features, m.in_features) for n, m in
                 ((n, self.lm.model.get_submodule(n)) for n in self.plan)}
        return {**files, "plan.json": self.plan.to_json().encode(), "plan.png": plot_bits(self.plan, sizes)}


def expert_tokens(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Experts module -> calibration tokens per expert (routed by the router / behind its statistics), for every
    experts module a data-aware method quantized: the run's coverage report (also ``expert_tokens.json``)."""
    from lowbit.nn.quant_experts import QuantExperts

    return {n: m.calibration for n, m in model.named_modules() if isinstance(m, QuantExperts) and m.calibration}


def _keep(model: nn.Module, plan: Plan, job: QuantizeJob) -> Plan:
    """The plan without the Linears --keep keeps in float; refused when it leaves more in float unasked."""
    from lowbit.models.accounting import gate

    dropped = gate(model, list(plan), job.keep, explicit=isinstance(job.source, PlanFile))
    return Plan({n: r for n, r in plan.items() if n not in dropped}) if dropped else plan


def _kv_cache(model: nn.Module, kv: KVScheme | dict[str, KVScheme], calib: torch.Tensor | None) -> dict[str, Any]:
    """The KV scheme (or per-attention schemes) installed on the quantized model, static scales calibrated on the
    calibration split; the summary names the schemes and the cache's bytes per token."""
    from lowbit.nn.kv_quant import cache_shape, cache_shapes, calibrate_kv

    calibrate_kv(model, calib, kv, values_folded=(kv if isinstance(kv, KVScheme) else next(iter(kv.values()))).rotate)
    layers, heads, dim = cache_shape(model)
    out: dict[str, Any] = {"bytes_per_token_16bit": 2 * layers * heads * dim * 2}
    if isinstance(kv, KVScheme):
        return {"scheme": kv.name, "bytes_per_token": kv.bytes_per_token(layers, heads, dim), **out}
    shapes = cache_shapes(model)
    names = [s.name for s in kv.values()]
    return {"scheme": "per layer", "per_layer": {n: s.name for n, s in kv.items()},
            "counts": {n: names.count(n) for n in dict.fromkeys(names)},
            "bytes_per_token": sum(s.bytes_per_token(1, *shapes[n]) for n, s in kv.items()), **out}


def _kv_refusal(job: QuantizeJob, to: str) -> str | None:
    """Why export ``to`` cannot hold the job's KV cache (None: it can)."""
    from lowbit.files.kv_export import kv_refusal

    for kv in job.kv_options:
        why = kv_refusal(to, kv, mixed=job.kv_mixed)
        if why is not None:
            return why
    return None


def _kv_limits(job: QuantizeJob, found: dict[str, str]) -> None:
    """The exports that cannot hold the job's KV scheme, added to ``found`` (target -> why)."""
    from lowbit.files import targets as limits

    for to in limits.REGISTRY:
        why = _kv_refusal(job, to)
        if why is not None:
            found.setdefault(to, why)


def _export_limits(job: QuantizeJob, model: nn.Module, plan: Plan) -> dict[str, str]:
    """Export -> why it cannot hold the plan, known before tuning; refused when the job names that export.

    A mixed-precision run is judged on each of its options as a uniform plan (the knapsack
    may pick any of them anywhere), the others on their plan. Each export that cannot hold
    it gets a warning now rather than an error after the run.
    """
    from lowbit.files import specs
    from lowbit.files import targets as limits  # the export registry (files/targets.py)
    from lowbit.models.experts import expert_tensors

    mixed = isinstance(job.source, MixedBudget)
    options = [Plan({n: r for n in plan}) for r in job.source.options] if mixed else [plan]
    online = set(job.rotate.online) if job.rotate is not None else set()
    rotated = frozenset(n for n in plan if n.rpartition(".")[2] in online)
    experts = {n: t for n, t in expert_tensors(model).items() if n in plan}
    shapes = {n: (t.out_features, t.in_features) for n, t in experts.items()}
    shapes |= {n: (model.get_submodule(n).out_features, model.get_submodule(n).in_features)
               for n in plan if n not in experts}
    counts = {n: t.count for n, t in experts.items()}
    kind = getattr(getattr(model, "config", None), "model_type", None)
    found: dict[str, str] = {}
    for p in options:
        layer_specs = specs.from_plan(p.layers, shapes, rotated, counts)
        for to, why in limits.refusals(layer_specs, kind).items():
            found.setdefault(to, why)
        if "compressed-tensors" not in found:
            notes = limits.vllm_notes(layer_specs)
            if notes:
                found["vllm"] = notes[0]
    _kv_limits(job, found)
    if job.export_to is not None:  # the one export the user named: refused if it cannot hold the plan
        if job.export_to in found:
            raise ConfigError(f"--export-to {job.export_to}: {found[job.export_to]}")
        found = {k: v for k, v in found.items() if k == "vllm" and job.export_to == "compressed-tensors"}
    for to, why in found.items():
        what = "its compressed-tensors export would not load in vLLM" if to == "vllm" else f"--to {to} cannot hold it"
        warnings.warn(f"this plan cannot be exported as it is: {what}: {why}", stacklevel=2)
    return found


def _gguf_embeddings(model: nn.Module, mix: str) -> str:
    """What `lowbit export --to gguf` will make of the embedding / output tables of a mix (llama.cpp's types)."""
    from lowbit.files.gguf_export import embedding_plan

    types = embedding_plan(model, mix)
    if not types:
        return "16-bit in the GGUF (no block type fits their rows, as in llama.cpp's file)"
    return (", ".join(f"{k.removesuffix('.weight')}: {t}" for k, t in types.items())
            + f" in `lowbit export --to gguf` (llama.cpp's {mix} types; --embeddings f16 keeps them 16-bit); "
            "the perplexity here has them in 16 bits")


def _kquant_summary(model: nn.Module, plan: Plan) -> dict[str, Any]:
    """Layers per scheme of a K-quant plan, and how many took llama.cpp's width fallback."""
    counts: dict[str, int] = {}
    for _, s in plan.items():
        counts[s.name] = counts.get(s.name, 0) + 1
    sizes = {n: (m.out_features, m.in_features) for n, m in ((n, model.get_submodule(n)) for n in plan)}
    fb = kmix.fallbacks(plan, sizes)
    out: dict[str, Any] = {"layer_schemes": counts}
    if fb:
        out["kquant_fallbacks"] = (f"{len(fb)} layer(s) with rows not a multiple of 256 hold llama.cpp's "
                                   f"fallback type ({', '.join(sorted(set(fb.values())))}), as llama.cpp does")
    return out
