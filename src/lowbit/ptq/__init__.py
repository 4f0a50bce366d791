"""Post-training quantization: one entry point over a registry of methods.

Each method module registers a `Method` (frozen settings dataclass + run function) in
`lowbit.ptq.methods`; the built-in ones are imported here so the registry is complete
whenever ``lowbit.ptq`` is. Two pre-steps change the float model without changing its
function, before any method: a Hadamard rotation of the residual stream
(`lowbit.ptq.rotation`) and AWQ's activation-aware channel scales (`lowbit.ptq.awq`).
Mixed precision (`lowbit.ptq.mixed`) then chooses a plan; any method applies it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowbit.formats.plan import Plan
from lowbit.models.lazy import materialize
from lowbit.ptq import gptq, rtn, signround  # noqa: F401  (register gptq, rtn, signround, signround2)
from lowbit.ptq.awq import AWQSettings, awq_run
from lowbit.ptq.fit import fit_plan
from lowbit.ptq.gptq import GPTQSettings
from lowbit.ptq.methods import RunContext, coerce_settings, get, make_settings, names
from lowbit.ptq.mixed import MixedSettings, mixed_plan
from lowbit.ptq.rotation import RotationSettings, rotate_model
from lowbit.ptq.rtn import RTNSettings
from lowbit.ptq.signround import SignRoundSettings

__all__ = ["AWQSettings", "GPTQSettings", "MixedSettings", "RTNSettings", "RotationSettings", "RunContext",
           "SignRoundSettings", "check_resume", "make_settings", "names", "prepare_model", "quantize_model",
           "round_unquantized_to_half"]


def check_resume(method: str, settings: Any, plan: Plan, model: nn.Module, calib: torch.Tensor,
                 ctx: RunContext, later: tuple[str, ...] = ()) -> None:
    """Refuse a work folder (``ctx.workdir``) that holds a run with other settings, before any heavy work.

    Builds what the method's pipeline will record (`lowbit.ptq.blockwise.work_settings`)
    from the model and calibration tokens as they are now. later: recorded keys that only
    the run itself can know (``model`` after a pre-step changes the weights, ``plan`` of
    a mixed-precision run); the pipeline compares those when it opens the folder.
    """
    from lowbit.ptq.blockwise import check_work_folder, work_settings

    spec = get(method)
    if ctx.workdir is None or spec.work is None or calib is None:
        return
    recorded, options, applied = spec.work(coerce_settings(method, settings), plan, ctx)
    check_work_folder(ctx.workdir, work_settings(recorded, applied, options, model, calib), later)


def prepare_model(model: nn.Module, plan: Plan, calib: torch.Tensor | None = None,
                  rotate: RotationSettings | None = None, awq: AWQSettings | None = None,
                  device: str | None = None, progress: bool = True, ctx: RunContext | None = None) -> dict[str, Any]:
    """The float pre-steps, in this order: rotate the residual stream, then AWQ scales; returns what each did.

    Both keep the float model's function (each checks it) and need the whole model, so a
    lazily loaded one is loaded first. Nothing is done when neither is asked for.
    ctx: the run's context, whole (AWQ walks the blocks on the block-wise engine with its
    work folder, offload folder and cache placement); None = one from calib, device, progress.
    """
    ctx = ctx or RunContext(calib=calib, device=device, progress=progress)
    done: dict[str, Any] = {}
    if rotate is None and awq is None:
        return done
    materialize(model)
    if rotate is not None:
        done["rotation"] = rotate_model(model, rotate)
    if awq is not None:
        done["awq"] = awq_run(model, plan, awq, ctx)
    return done


def quantize_model(model: nn.Module, plan: Plan, method: str = "rtn", settings: Any = None, *,
                   calib: torch.Tensor | None = None, mixed: MixedSettings | None = None,
                   rotate: RotationSettings | None = None, awq: AWQSettings | None = None,
                   device: str | None = None, workdir: str | None = None, offload_dir: str | None = None,
                   progress: bool = True, keep16: bool = True, cache_device: str = "device",
                   fit: bool = True) -> Plan:
    """Quantize ``model`` in place with ``method``; returns the applied plan.

    settings: the method's settings dataclass, a mapping of its fields (checked strictly),
    or None for its defaults. mixed: choose the plan's schemes by DeltaLoss first (the
    plan's own schemes are then ignored; its layers are the ones allocated).
    rotate / awq: the float pre-steps of `prepare_model`, before everything else.
    keep16: round the embeddings and an unquantized lm_head to fp16 values, so the
    checkpoint stores them in 16 bits exactly (the numbers evaluated are the numbers saved).
    cache_device: block-wise methods' activation caches on the compute "device" or the "cpu".
    fit: first give each layer the scales its weights need (`lowbit.ptq.fit`: fp32 scales where
    fp16 would overflow, 16 bits where the format cannot hold the layer), with a warning each;
    False = the caller did so already (``lowbit.api`` does, to report the changes).
    """
    spec = get(method)
    settings = coerce_settings(method, settings)
    if spec.check_plan is not None:
        spec.check_plan(settings, plan)
    ctx = RunContext(calib=calib, device=device, workdir=workdir, offload_dir=offload_dir, progress=progress,
                     cache_device=cache_device)
    prepare_model(model, plan, rotate=rotate, awq=awq, ctx=ctx)
    if not spec.blockwise or mixed is not None:
        materialize(model)  # a lazily loaded model, for passes that need all of it at once
    if mixed is not None:
        plan = mixed_plan(model, plan, mixed, calib, device=device, progress=progress).plan
    if fit:
        plan = fit_plan(model, plan)[0]
    plan = spec.run(model, plan, settings, ctx)
    if keep16:
        round_unquantized_to_half(model)
    return plan


def round_unquantized_to_half(model: nn.Module) -> None:
    """Embedding tables and a plain-Linear lm_head take fp16 values (dtype unchanged).

    A table with values beyond fp16's range keeps its float32 values (fp16 would make them inf).
    """
    heads = [model.get_output_embeddings()] if hasattr(model, "get_output_embeddings") else []
    for mod in [m for m in model.modules() if isinstance(m, nn.Embedding)] + heads:
        if (isinstance(mod, (nn.Embedding, nn.Linear)) and mod.weight.dtype == torch.float32 and mod.weight.numel()
                and bool(mod.weight.detach().abs().amax() <= torch.finfo(torch.float16).max)):
            with torch.no_grad():
                mod.weight.copy_(mod.weight.half().float())
