"""Post-training quantization: one entry point over a registry of methods.

Each method module registers a `Method` (frozen settings dataclass + run function) in
`lowbit.ptq.methods`; the built-in ones are imported here so the registry is complete
whenever ``lowbit.ptq`` is. Two pre-steps change the float model without changing its
function, before any method: a Hadamard rotation of the residual stream
(`lowbit.ptq.rotation`) and AWQ's activation-aware channel scales (`lowbit.ptq.awq`).
Mixed precision (`lowbit.ptq.mixed`) then chooses a plan; any method applies it.
`lowbit.ptq.conductor.conduct` is the one place that runs these steps in order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowbit.formats.kv import KVScheme
from lowbit.models.placement import check_device
from lowbit.plans.plan import Plan
from lowbit.ptq import gptq, rtn, signround  # noqa: F401  (register gptq, rtn, signround, signround2)
from lowbit.ptq.awq import AWQSettings
from lowbit.ptq.conductor import PtqOutcome, PtqSpec, conduct, prepare_model, round_unquantized_to_half
from lowbit.ptq.gptq import GPTQSettings
from lowbit.ptq.methods import RunContext, coerce_settings, get, make_settings, names
from lowbit.ptq.mixed import MixedSettings
from lowbit.ptq.rotation import RotationSettings
from lowbit.ptq.rtn import RTNSettings
from lowbit.ptq.signround import SignRoundSettings

__all__ = ["AWQSettings", "GPTQSettings", "MixedSettings", "PtqOutcome", "PtqSpec", "RTNSettings",
           "RotationSettings", "RunContext", "SignRoundSettings", "check_resume", "conduct", "make_settings", "names",
           "prepare_model", "quantize_model", "round_unquantized_to_half"]


def check_resume(method: str, settings: Any, plan: Plan, model: nn.Module, calib: torch.Tensor,
                 ctx: RunContext, later: tuple[str, ...] = (), awq: AWQSettings | None = None,
                 awq_later: tuple[str, ...] = (), kv: KVScheme | None = None) -> None:
    """Refuse a work folder (``ctx.workdir``) that holds a run with other settings, before any heavy work.

    Builds what the method's pipeline will record (`lowbit.ptq.blockwise.work_settings`)
    from the model and calibration tokens as they are now. later: recorded keys that only
    the run itself can know (``model`` after a pre-step changes the weights, ``plan`` of
    a mixed-precision run); the pipeline compares those when it opens the folder.
    awq: the AWQ pre-step's settings, whose own record (``WORKDIR/awq``) is checked too, for
    every method (AWQ walks the blocks before any of them); awq_later: its keys only the run
    can know (``model`` after a rotation).
    kv: the KV scheme the blocks will be tuned under (installed only later, on the way to the
    method); its static scales are buffers of the model, so its fingerprint is then compared
    by the pipeline too.
    """
    from lowbit.nn.kv_quant import kv_entry
    from lowbit.ptq.awq import awq_record, awq_workdir
    from lowbit.ptq.blockwise import check_work_folder, work_settings

    if ctx.workdir is None or calib is None:
        return
    if awq is not None:
        check_work_folder(awq_workdir(ctx.workdir), awq_record(model, plan, awq, calib), awq_later)
    spec = get(method)
    if spec.work is None:
        return
    recorded, options, applied = spec.work(coerce_settings(method, settings), plan, ctx)
    entry = {} if kv is None else {"kv_cache": kv_entry(kv, kv.rotate)}
    if kv is not None and (kv.needs_calibration or kv.rotate):
        later = (*later, "model")
    check_work_folder(ctx.workdir, work_settings(recorded, applied, options, model, calib, kv=entry), later)


def quantize_model(model: nn.Module, plan: Plan, method: str = "rtn", settings: Any = None, *,
                   calib: torch.Tensor | None = None, mixed: MixedSettings | None = None,
                   rotate: RotationSettings | None = None, awq: AWQSettings | None = None,
                   device: str | torch.device | None = None, workdir: str | None = None,
                   offload_dir: str | None = None, progress: bool = True, keep16: bool = True,
                   cache_device: str = "device", fit: bool = True) -> Plan:
    """Quantize ``model`` in place with ``method``; returns the applied plan (`conduct` runs the steps).

    settings: the method's settings dataclass, a mapping of its fields (checked strictly),
    or None for its defaults. mixed: choose the plan's schemes by DeltaLoss first (the
    plan's own schemes are then ignored; its layers are the ones allocated).
    rotate / awq: the float pre-steps of `prepare_model`, before everything else.
    device: checked here, once (None = where the model is).
    keep16: round the embeddings and an unquantized lm_head to fp16 values, so the
    checkpoint stores them in 16 bits exactly (the numbers evaluated are the numbers saved).
    cache_device: block-wise methods' activation caches on the compute "device" or the "cpu".
    fit: first give each layer the scales its weights need (`lowbit.ptq.fit`: fp32 scales where
    fp16 would overflow, 16 bits where the format cannot hold the layer), with a warning each.
    """
    spec = PtqSpec(method, settings, mixed, rotate, awq, keep16, fit)
    ctx = RunContext(calib=calib, device=check_device(device), workdir=workdir, offload_dir=offload_dir,
                     progress=progress, cache_device=cache_device)
    return conduct(model, plan, spec, ctx).plan
