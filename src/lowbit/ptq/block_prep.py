"""The float pre-steps (rotation, AWQ) and the range fit, done to each block of a lazily loaded model as the walk reads it.

On a model in memory the pre-steps run on the whole float model before the method
(`lowbit.ptq.conductor.prepare_model`): the rotation turns every tensor on the residual
stream, AWQ walks the blocks once to search and fold its scales, the range fit reads every
planned weight, then the method walks the blocks again. None of them needs more than one
block at a time:

- the rotation's new value of each tensor depends on that tensor alone (and the norm folded
  into it): the embedding is turned before block 0 is captured, each block as it is read,
  the lm_head (the final norm folded in; no block reads it, so it stays in the checkpoint's
  dtype until then) after the last block (`lowbit.ptq.rotation.rotate_embedding`,
  `rotate_block`, `rotate_head`: the functions `rotate_model` itself runs);
- AWQ's scale groups and folds lie inside one block (norm -> q/k/v, v -> o, norm ->
  gate/up, up -> down): its own `AWQPass` runs on the block, on its own chain of inputs,
  right before the method's pass on the same block;
- the range fit checks the block's planned weights once they are rotated and scaled.

So a lazily loaded model gets, block by block, the weights the whole-model path gives and
the method's pass sees the same block it would have seen (tests/test_bigmodel_memory.py).
`PrepPass` wraps the method's `BlockPass` so the walk (`lowbit.ptq.blockwise.loop`) runs
both in one pass over the checkpoint; the work folder keeps both results per block. RTN
without calibration data walks the blocks for the rotation alone (`lowbit.ptq.blockwise.rounding`):
its one sample is the whole-model path's probe, what block 0's check runs on.

What differs from the whole-model path, on purpose: the rotation's probe check (logits of
the whole model before and after) needs the whole model, so block 0's output is compared
before and after its rotation on one calibration sample instead (each block's norms are
checked to be plain RMSNorms as it is read); and a layer whose transformed weights the
planned scales cannot hold (a range fallback) is an error naming it, since the plan the work
folder records cannot change half-way through the walk (the whole-model path falls back).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowbit.errors import ConfigError, ModelError
from lowbit.formats.ranges import fit
from lowbit.models.layers import block_path, decoder_blocks
from lowbit.models.lazy import SOURCE_ATTR, fill
from lowbit.models.narrow_tables import fits_half, keep_narrow, widen
from lowbit.models.structure import block_layout, check_block_norms, residual_map
from lowbit.nn.input_rotation import attach
from lowbit.plans.plan import Plan
from lowbit.ptq.awq import AWQPass, AWQSettings
from lowbit.ptq.blockwise import new_cache, run_block
from lowbit.ptq.blockwise.loop import BlockPass, Walk
from lowbit.ptq.rotation import (
    _ROWS,
    Rotation,
    RotationSettings,
    _residual_info,
    kept_channels,
    online_layers,
    rotate_block,
    rotate_embedding,
    rotate_head,
    untie_head,
)

FIT_FIX = ("block by block the plan cannot change half-way through the walk: quantize without --offload-dir (the "
           "whole-model path falls back for it), or give the layer a scheme that holds it (--keep / a plan file)")


@dataclass(frozen=True)
class PreSteps:
    """The pre-steps of a run on a lazily loaded model, applied per block (see the module doc).

    plan: the plan before the fit (what AWQ scores candidates with and the fit checks).
    keep16: the run rounds the float tables to fp16 values after the method (`conductor.round_unquantized_to_half`):
    the rotated ones take those values in fp16 as soon as nothing reads them in float32 any more (the embedding once
    block 0's inputs are captured, the lm_head after the walk: `LazyRotation.narrow`).
    info: what the pre-steps did, filled as the walk goes (``rotation`` / ``awq`` keys, as `prepare_model`'s).
    """

    plan: Plan
    rotate: RotationSettings | None = None
    awq: AWQSettings | None = None
    fit: bool = True
    keep16: bool = True
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    def record(self) -> dict[str, Any]:
        """What the work folder records about them (they change every block's result)."""
        return {"rotation": None if self.rotate is None else self.rotate.to_dict(),
                "awq": None if self.awq is None else self.awq.to_dict(), "fit": self.fit}

    def wrap(self, model: nn.Module, task: BlockPass) -> PrepPass:
        """``task`` with the pre-steps before it on every block; the tables are rotated now (before the capture)."""
        return PrepPass(model, task, self)


class LazyRotation:
    """`lowbit.ptq.rotation.rotate_model` for a model whose blocks arrive one at a time."""

    def __init__(self, model: nn.Module, settings: RotationSettings) -> None:
        t0 = time.perf_counter()
        self.rmap = residual_map(model, "rotation") if settings.residual else None
        blocks = [f"{block_path(model)}.{i}" for i in range(len(decoder_blocks(model)))]
        online_layers(model, blocks, settings.online)  # checked up front: names and widths (read from the modules)
        self.online = settings.online
        self.rot = None
        self.info: dict[str, Any] = settings.to_dict()
        if self.rmap is not None:
            with _norms_read(model, self.rmap) if settings.keep != 0 else _nothing():
                kept = kept_channels(model, self.rmap, settings.keep, dense=settings.kind == "haar")
            self.rot = Rotation.make(self.rmap.width, settings, kept)
            # the embedding now (the capture reads it), widened to the compute dtype as the whole-model path
            # (materialize) rotates it; the lm_head, which no block reads, after the walk (`finish`), kept in the
            # checkpoint's dtype until then (a tied one untied into a copy of its stored values)
            if self.rmap.tied:
                untie_head(model, self.rmap)
            widen(model.get_submodule(self.rmap.embed))
            rotate_embedding(model, self.rmap, self.rot)
            self.info.update(_residual_info(self.rmap, self.rot))
        self.info["online_layers"] = 0
        self.info["probe"] = "block 0: its output before and after the rotation, on one calibration sample"
        self.seconds = time.perf_counter() - t0

    def block(self, i: int, block: nn.Module, probe: tuple[torch.Tensor, Mapping[str, Any]] | None = None) -> None:
        """Rotate block ``i`` (just read); with ``probe`` (an input and the block's kwargs) check first that the
        rotated block computes the float block's function turned by ``R`` (the whole-model path's logit probe,
        for one block: the blocks share one architecture, and each block's norms are checked anyway)."""
        t0 = time.perf_counter()
        # the float block's output, taken before it is turned in place (a copy of the block to compare with afterwards
        # was one more block in memory: 0.8 GiB at the 8B shape)
        want = self._float_output(block, *probe) if probe is not None else None
        if self.rmap is not None and self.rot is not None:
            check_block_norms(block, self.rmap.layout, i, "rotation")
            rotate_block(block, self.rmap.layout, self.rot)
        for short in self.online:
            for rel, m in block.named_modules():
                if rel.rpartition(".")[2] == short and isinstance(m, nn.Linear):
                    attach(m)
                    self.info["online_layers"] += 1
        if want is not None and probe is not None:
            self.info["probe_rel_diff"] = self._check(want, block, *probe)
        self.seconds += time.perf_counter() - t0

    def finish(self, model: nn.Module) -> None:
        """After the walk: the lm_head's part (widened, the final norm folded in, turned)."""
        t0 = time.perf_counter()
        if self.rmap is not None and self.rot is not None:
            widen(model.get_submodule(self.rmap.head))
            rotate_head(model, self.rmap, self.rot)
        self.seconds += time.perf_counter() - t0

    def narrow(self, model: nn.Module, head: bool) -> list[str]:
        """A rotated table that stays float takes now the fp16 values the run gives it at its end, stored in fp16 and
        widened where it is used (`lowbit.models.narrow_tables`): the embedding once block 0's inputs are captured
        (nothing in the walk reads it again), the lm_head (``head``) after the walk and the method, unless planned.
        Returns their names.

        Turned, they are float32 tables (the products are rounded once to float32, as on the whole model), which
        the walk held whole and the end of the run copied whole: an abs-max and an fp16 copy to round them, the
        checkpoint writer's fp16 copies and its file buffer beside both float32 tables (6.3 GiB at the 3B shape,
        tied, against 4.0 for the walk: bigmodel_calib.md). Rounded here 8192 rows at a time to the values
        `round_unquantized_to_half` gives (the same cast, under the same fp16-range condition, which then finds
        nothing left to round), they hold half the bytes and the writer stores them as they are."""
        done: list[str] = []
        if self.rmap is None:
            return done
        for name in (self.rmap.head,) if head else (self.rmap.embed,):
            mod = model.get_submodule(name)
            w = mod.weight
            if type(mod) not in (nn.Embedding, nn.Linear) or w.dtype != torch.float32 or w.device.type == "meta":
                continue
            if not fits_half(w, _ROWS):
                continue  # beyond fp16's range: the whole-model path keeps such a table's values too
            with torch.no_grad():
                half = torch.empty(w.shape, dtype=torch.float16, device=w.device)
                for r in range(0, w.shape[0], _ROWS):
                    half[r: r + _ROWS] = w[r: r + _ROWS]
            mod.weight = nn.Parameter(half, requires_grad=False)
            del w
            done.append(name)
        keep_narrow(model, torch.float32)
        return done

    def _turn(self, t: torch.Tensor) -> torch.Tensor:
        return self.rot.rows(t) if self.rot is not None else t

    def _float_output(self, block: nn.Module, x: torch.Tensor, kwargs: Mapping[str, Any]) -> torch.Tensor:
        """``R``-turned output of the float block on the probe, in float64; the block's own function, not what
        observes it (its hooks are set aside for the call)."""
        pre, post = block._forward_pre_hooks, block._forward_hooks
        block._forward_pre_hooks, block._forward_hooks = type(pre)(), type(post)()
        try:
            with torch.no_grad():
                return self._turn(run_block(block, x, kwargs, 1).double())
        finally:
            block._forward_pre_hooks, block._forward_hooks = pre, post

    def _check(self, want: torch.Tensor, after: nn.Module, x: torch.Tensor, kwargs: Mapping[str, Any]) -> float:
        with torch.no_grad():
            got = run_block(after, self._turn(x.double()).to(x.dtype), kwargs, 1).double()
        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
        if not err < 1e-3:
            raise ModelError(f"the rotated {type(after).__name__} no longer computes the same function (relative "
                             f"difference {err:.3g} on block 0); its blocks are not the pre-norm residual stream "
                             "lowbit rotates. Quantize without --rotate")
        return err


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _norms_read:
    """The blocks' norm scales read from the checkpoint for the duration (``keep`` ranks channels by them), then
    put back on meta: a few KiB per block."""

    def __init__(self, model: nn.Module, rmap: Any) -> None:
        self.model, self.rmap = model, rmap
        self.saved: list[tuple[nn.Module, nn.Parameter]] = []

    def __enter__(self) -> None:
        source = getattr(self.model, SOURCE_ATTR, None)
        for bname in self.rmap.blocks:
            for n in self.rmap.layout.norms:
                norm = self.model.get_submodule(f"{bname}.{n}")
                if norm.weight.device.type == "meta" and source is not None:
                    self.saved.append((norm, norm.weight))
                    fill(norm, {"weight": source.read([f"{bname}.{n}.weight"])[f"{bname}.{n}.weight"]})

    def __exit__(self, *exc: object) -> None:
        for norm, w in self.saved:
            norm._parameters["weight"] = w


class PrepPass:
    """The method's `BlockPass` with the pre-steps before it on each block (see the module doc).

    A block's result is the pair (AWQ's result or None, the method's result); the work folder keeps AWQ's
    tensors under ``awq/`` and the method's under ``q/`` when AWQ runs, the method's alone otherwise.
    """

    changes_float = False

    def __init__(self, model: nn.Module, inner: BlockPass, pre: PreSteps) -> None:
        self.inner, self.pre = inner, pre
        self.desc = inner.desc
        self.rotation = LazyRotation(model, pre.rotate) if pre.rotate is not None else None
        self.awq = AWQPass(pre.plan, pre.awq, block_layout(model, "AWQ")) if pre.awq is not None else None
        # AWQ's chain starts in the model's dtype: capture in it, and hand the method its own copy in its dtype
        self.cache_dtype = inner.cache_dtype if self.awq is None else None
        self.model = model
        self.awq_seconds = 0.0

    def begin(self, walk: Walk, x: torch.Tensor) -> None:
        self.walk = walk
        if self.rotation is not None and self.pre.keep16:  # captured: the embedding's fp16 values now (`narrow`)
            self.rotation.narrow(self.model, head=False)
        self.probe = (x[:1].to(walk.device, walk.dtype).clone(), walk.kwargs) if self.rotation is not None else None
        if self.awq is not None:
            own = new_cache(tuple(x.shape), x.dtype, x.device, walk.device)
            own.copy_(x)
            self.awq.begin(walk, own)
            want = self.inner.cache_dtype or x.dtype
            if want != x.dtype:
                cast = new_cache(tuple(x.shape), want, x.device, walk.device)
                cast.copy_(x)
                x = cast
        self.inner.begin(walk, x)

    def home(self, i: int) -> torch.device:
        return self.inner.home(i)

    def decode(self, i: int, raw: Mapping[str, torch.Tensor], path: Path) -> tuple[Any, Any]:
        if self.awq is None:
            return None, self.inner.decode(i, raw, path)
        parts: dict[str, dict[str, torch.Tensor]] = {"awq": {}, "q": {}}
        for k, v in raw.items():
            head, _, rest = k.partition("/")
            if head not in parts:
                raise ConfigError(f"{path} holds {k!r}, which is neither AWQ's nor the method's; delete the work "
                                  "folder and rerun")
            parts[head][rest] = v
        return self.awq.decode(i, parts["awq"], path), self.inner.decode(i, parts["q"], path)

    def pack(self, result: tuple[Any, Any]) -> dict[str, torch.Tensor]:
        if self.awq is None:
            return self.inner.pack(result[1])
        return ({f"awq/{k}": v for k, v in self.awq.pack(result[0]).items()}
                | {f"q/{k}": v for k, v in self.inner.pack(result[1]).items()})

    def step(self, i: int, block: nn.Module, saved: tuple[Any, Any] | None) -> tuple[tuple[Any, Any], dict[str, float]]:
        if self.rotation is not None:
            self.rotation.block(i, block, self.probe if i == 0 else None)
            self.probe = None
        scales = None
        if self.awq is not None:
            t0 = time.perf_counter()
            check_block_norms(block, self.awq.layout, i, "AWQ")
            scales, _ = self.awq.step(i, block, None if saved is None else saved[0])
            self.awq.finish(i, block, scales)
            self.awq_seconds += time.perf_counter() - t0
        if self.pre.fit:
            prefix = self.walk.names[id(block)] + "."
            _check_fit(block, {n: n[len(prefix):] for n in self.pre.plan if n.startswith(prefix)}, self.pre.plan)
        result, info = self.inner.step(i, block, None if saved is None else saved[1])
        return (scales, result), info

    def finish(self, i: int, block: nn.Module, result: tuple[Any, Any]) -> None:
        self.inner.finish(i, block, result[1])

    def end(self) -> None:
        if self.rotation is not None:
            self.rotation.finish(self.model)
        if self.pre.fit:  # planned layers outside the blocks (a quantized lm_head), as transformed, before rounding
            prefix = block_path(self.model) + "."
            _check_fit(self.model, {n: n for n in self.pre.plan if not n.startswith(prefix)}, self.pre.plan)
        self.inner.end()
        if self.rotation is not None and self.pre.keep16:  # the tables' fp16 values now, in fp16 (see `narrow`)
            self.rotation.narrow(self.model, head=True)
        if self.rotation is not None:
            self.pre.info["rotation"] = {**self.rotation.info, "seconds": round(self.rotation.seconds, 3)}
        if self.awq is not None:
            gains, scaled = self.awq.gains, self.awq.scaled
            self.pre.info["awq"] = {**self.pre.awq.to_dict(), "groups": len(gains), "scaled": sum(scaled),  # type: ignore[union-attr]
                                    "mean_error_ratio": round(sum(gains) / max(len(gains), 1), 4),
                                    "seconds": round(self.awq_seconds, 2)}


def _check_fit(root: nn.Module, names: Mapping[str, str], plan: Plan) -> None:
    """Each planned layer (full name -> name under ``root``) must fit its scheme as its weights are now."""
    for full, rel in names.items():
        try:
            w = root.get_submodule(rel).weight
            mats = [w]
        except AttributeError:  # a fused experts tensor (a parameter, not a module): one scheme for every expert
            w = root.get_parameter(rel)
            mats = list(w)
        if w.device.type == "meta":
            continue
        for m in mats:
            f = fit(m.detach(), plan[full].weight)
            if f.reason is not None:
                raise ConfigError(f"layer {full}: {f.reason}; {FIT_FIX}")
