"""The jobs behind the CLI, as plain functions (usable from Python and scripts).

Each job validates all of its inputs before any heavy work (a bad scheme, a missing
path or an existing --out fails in a second, not after loading a model), and writes
its result only when complete.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from lowbit.errors import ConfigError, LowbitError, SchemeError
from lowbit.formats import Scheme
from lowbit.formats.plan import Plan


def build_plan(model: Any, scheme: str | None, plan_file: str | None, lm_head: bool = False) -> Plan:
    """The plan for a model: a uniform scheme over its decoder Linears, or a plan file."""
    from lowbit.models import linear_layers

    layers = linear_layers(model, include_lm_head=lm_head)
    if plan_file:
        plan = Plan.load(plan_file)
        unknown = [n for n in plan if n not in layers and not _is_linear(model, n)]
        if unknown:
            raise ConfigError(f"plan {plan_file} names layers this model lacks: {unknown[:3]}")
    else:
        plan = Plan.uniform(layers, Scheme.parse(scheme or "w4g128"))
    for name, s in plan.items():
        s.check_width(model.get_submodule(name).in_features, name)
    return plan


def _is_linear(model: Any, name: str) -> bool:
    import torch

    try:
        return isinstance(model.get_submodule(name), torch.nn.Linear)
    except AttributeError:
        return False


def layer_sizes(model: Any, names) -> dict[str, tuple[int, int]]:
    out = {}
    for n in names:
        m = model.get_submodule(n)
        out[n] = (m.out_features, m.in_features)
    return out


def quantize_pipeline(model: str | None, scheme: str, method: str, out: Path, data: str | None = None,
                      search: bool = False, plan_file: str | None = None, lm_head: bool = False,
                      nsamples: int = 32, seqlen: int = 256, seed: int = 0, evaluate: bool = True,
                      eval_seqlen: int = 512, windows: int = 40, force: bool = False,
                      tuning: dict | None = None) -> dict:
    """Load -> FP perplexity -> quantize -> quantized perplexity -> save; returns the summary."""
    from lowbit.data import calibration_batches, eval_tokens
    from lowbit.eval import perplexity
    from lowbit.export.native import save
    from lowbit.models import load_model
    from lowbit.models.lazy import is_lazy
    from lowbit.models.placement import check_device, on_device
    from lowbit.ptq import methods, quantize_model, streams_blocks

    options = (tuning or {}).get("options")
    if options and not plan_file:  # mixed precision: every layer starts from a candidate scheme
        for opt in options.split(","):
            Scheme.parse(opt)
        scheme = options.split(",")[0]
    if not plan_file:
        Scheme.parse(scheme)
    if method not in methods():
        raise ConfigError(f"unknown method {method!r}; choose one of {methods()}")
    if Path(out).exists() and not force:
        raise LowbitError(f"{out} already exists; choose another --out or pass --force to replace it")
    device = check_device((tuning or {}).get("device"))
    # with --offload-dir a block-wise method reads each block from the checkpoint when it gets
    # there: the float model is never whole in memory (so its perplexity is not measured here)
    lazy = bool((tuning or {}).get("offload_dir")) and streams_blocks(method, tuning or {})
    lm = load_model(model, lazy=lazy)
    plan = build_plan(lm.model, scheme, plan_file, lm_head)
    ev = eval_tokens(lm.tokenizer, data) if evaluate else None
    result: dict[str, Any] = {"model": lm.source, "scheme": plan.describe(), "method": method}
    if ev is not None and not is_lazy(lm.model):
        with on_device(lm.model, device):
            result["ppl_fp"] = perplexity(lm.model, ev, seqlen=eval_seqlen, windows=windows).ppl
    elif ev is not None:
        result["ppl_fp_skipped"] = "lazy load (--offload-dir): run `lowbit eval MODEL` for the float perplexity"
    needs_calib = search or method != "rtn" or (tuning or {}).get("avg_bits") is not None
    calib = calibration_batches(lm.tokenizer, data, nsamples=nsamples, seqlen=seqlen, seed=seed) if needs_calib else None
    tuning = dict(tuning or {})
    side = None
    if tuning.get("avg_bits") is not None and "plan_out" not in tuning:
        side = Path(tempfile.mkdtemp(prefix="lowbit-plan-"))
        tuning["plan_out"] = str(side)  # plan.json / plan.png, copied into the checkpoint
    t0 = time.perf_counter()
    # RTN works on the whole model at once; the block-wise methods place blocks themselves
    with on_device(lm.model, device if method == "rtn" else None):
        plan = quantize_model(lm.model, plan, method, calib=calib, search=search, tokenizer=lm.tokenizer, **tuning)
    result["quantize_seconds"] = round(time.perf_counter() - t0, 2)
    result["scheme"] = plan.describe()
    if ev is not None:
        with on_device(lm.model, device):
            r = perplexity(lm.model, ev, seqlen=eval_seqlen, windows=windows)
        result["ppl_q"] = r.ppl
        result["eval_tokens"] = r.tokens
    result["bits_per_weight"] = round(plan.average_bits(layer_sizes(lm.model, plan)), 4)
    meta = {"source": lm.source, "method": method, "plan": plan.describe(),
            **{k: result[k] for k in ("ppl_fp", "ppl_q") if k in result}}
    extra = {p.name: p for p in side.iterdir()} if side is not None else {}
    save(lm.model, lm.tokenizer, out, meta=meta, force=force, extra_files=extra)
    if side is not None:
        shutil.rmtree(side, ignore_errors=True)
    result["out"] = str(out)
    return result


def evaluate_pipeline(model: str | None, data: str | None = None, seqlen: int = 512, windows: int = 40,
                      tasks: list[str] | None = None, limit: int | None = None, device: str | None = None) -> dict:
    from lowbit.data import eval_tokens
    from lowbit.eval import perplexity
    from lowbit.models import load_model
    from lowbit.models.placement import check_device, on_device

    if seqlen <= 1:
        raise SchemeError("--seqlen must be at least 2 tokens")
    dev = check_device(device)
    lm = load_model(model)
    with on_device(lm.model, dev):
        r = perplexity(lm.model, eval_tokens(lm.tokenizer, data), seqlen=seqlen, windows=windows)
        result: dict[str, Any] = {"model": lm.source, "ppl": r.ppl, "tokens": r.tokens, "windows": r.windows}
        if tasks:
            from lowbit.eval import zero_shot

            result["tasks"] = zero_shot(lm.model, lm.tokenizer, tasks, limit=limit)
    return result
