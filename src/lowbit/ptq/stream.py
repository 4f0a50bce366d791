"""Data-free quantization streamed tensor by tensor: a checkpoint bigger than memory, quantized in one pass.

RTN needs no calibration data, so nothing requires the whole model in memory: this module
builds the model's skeleton on the meta device from config.json (names, shapes and the
module structure, no weights), makes the plan the in-model path would make from it
(`lowbit.plans.source.build_plan`, the float-weight gate of `lowbit.models.accounting`, the
experts check, RTN's search rule), then reads one tensor, or one expert matrix, at a time
(`lowbit.models.stream_source`), decides what the in-model path would decide for it (its
scales fitted to its range, `lowbit.formats.ranges.fit`; the tensor scale a fused q/k/v or
gate/up group shares, `lowbit.models.fused`; embeddings and a float lm_head rounded to fp16
values; float tensors stored in fp16, else bf16, when lossless) and writes lowbit's native checkpoint
shard by shard. The result holds the same tensors, byte for byte, as ``lowbit quantize
--method rtn`` writes from the loaded model (the search with uniform importance, i.e. on
the weights alone, which is what RTN's experts path does too), with the weights spread
over several files.

Peak memory: the largest single tensor in float32 (or one expert matrix), plus the
output shard being filled (``shard_bytes``, default 256 MiB), plus the skeleton's real
buffers. A shard is written to a work folder beside ``--out`` and sealed by its sidecar
(`lowbit.files.sealed.SealedFile`) with its manifest entries in its own header, so a killed
run resumes at the first unsealed shard and never takes a half-written one for complete.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowbit.errors import ConfigError, ModelError
from lowbit.files import native
from lowbit.files.fused import fused_groups
from lowbit.files.safetensors_stream import read_header, write_file
from lowbit.files.sealed import SealedFile
from lowbit.formats import QTensor, Scheme, quantize
from lowbit.formats.finite import require_finite
from lowbit.formats.ranges import fit
from lowbit.io import atomic_dir, atomic_file, atomic_write_text
from lowbit.models.accounting import account_model, gate
from lowbit.models.experts import ExpertTensor, expert_tensors
from lowbit.models.fused import own_tensor_scale, shared_encodes
from lowbit.models.stream_source import StreamSource, model_key
from lowbit.plans.plan import Plan
from lowbit.plans.source import PlanFile, PlanSource, build_plan
from lowbit.ptq.experts import check_experts
from lowbit.ptq.rtn import searched

RUN = "run.json"
_F16_MAX = torch.finfo(torch.float16).max
_CHUNK = 1 << 22  # elements per step when a float tensor is converted


@dataclass(frozen=True)
class StreamSettings:
    """search: RTN's scale search on the weights alone (uniform importance); False = plain round-to-nearest
    (K-quants: their scheme's rule, `fit` by default: a few refitted range candidates, `lowbit.formats.kquant_fit`).
    shard_bytes: about how many output bytes one shard holds (a tensor bigger than this gets a shard of its own)."""

    search: bool = True
    shard_bytes: int = 256 << 20
    keep: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.shard_bytes, int) or self.shard_bytes < 1:
            raise ConfigError(f"shard size must be a positive number of bytes, got {self.shard_bytes!r}")


@dataclass(frozen=True)
class Unit:
    """One piece of work: a planned Linear, a planned fused experts tensor, or a tensor kept in float."""

    kind: str  # "linear" | "experts" | "float"
    name: str  # the Linear / fused experts tensor / state-dict key
    nbytes: int  # estimated output bytes (decides the shards; deterministic from the plan and shapes)


@dataclass
class Layout:
    """What the skeleton and plan say about every output tensor."""

    model: nn.Module
    plan: Plan
    units: list[Unit]
    aliases: dict[str, str]
    experts: dict[str, ExpertTensor]
    round16: set[str]  # state keys rounded to fp16 values (embeddings, a float lm_head)
    tied: dict[str, str] = field(default_factory=dict)  # state key -> the key whose source it reads

    @property
    def model_type(self) -> str | None:
        return getattr(self.model.config, "model_type", None)


def skeleton(folder: Path) -> nn.Module:
    """The model of ``folder``'s config.json with every parameter on the meta device (buffers real)."""
    from lowbit.models.hf_folder import read_config
    from lowbit.models.stream_source import skeleton_of

    return skeleton_of(read_config(folder))


def make_plan(model: nn.Module, source: PlanSource, settings: StreamSettings) -> Plan:
    """The plan the in-model RTN path would apply, checked the same way before any tensor is read."""
    plan = build_plan(model, source)
    dropped = gate(model, list(plan), settings.keep, explicit=isinstance(source, PlanFile))
    plan = Plan({n: r for n, r in plan.items() if n not in dropped}) if dropped else plan
    check_experts(model, plan, "rtn")
    static = plan.needs_calibration()
    if static:
        raise ConfigError(f"layer {static[0]}: its recipe quantizes inputs with static scales, which need calibration "
                          "data; the streaming path is data-free: use a weight-only scheme, or drop --stream")
    return searched(plan) if settings.search else plan


def layout(model: nn.Module, plan: Plan) -> Layout:
    """Every state-dict key of the skeleton as a unit of work, tied parameters as aliases (as `native.save` does)."""
    experts = {n: t for n, t in expert_tensors(model).items() if n in plan}
    linear_keys = {f"{n}.weight": n for n in plan if n not in experts}
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    tied: dict[str, str] = {}
    units: list[Unit] = []
    params = dict(model.named_parameters(remove_duplicate=False))
    for key, t in model.state_dict(keep_vars=True).items():
        ident = id(params[key]) if key in params else id(t)
        owner = first.setdefault(ident, key)
        if key in linear_keys:
            if owner != key:
                tied[key] = owner
            n = linear_keys[key]
            units.append(Unit("linear", n, _qbytes(tuple(t.shape), plan.weight(n))))
        elif key in experts:
            e = experts[key]
            units.append(Unit("experts", key, e.count * _qbytes((e.out_features, e.in_features), plan.weight(key))))
        elif owner != key:
            aliases[key] = owner
        else:
            units.append(Unit("float", key, t.numel() * 2))
    return Layout(model, plan, units, aliases, experts, _round16(model, set(plan)), tied)


def _qbytes(shape: tuple[int, ...], scheme: Scheme) -> int:
    return int(shape[0] * shape[1] * scheme.bits_per_weight(shape[1]) / 8)


def _round16(model: nn.Module, planned: set[str]) -> set[str]:
    """Keys `lowbit.ptq.conductor.round_unquantized_to_half` rounds: embedding tables and an unplanned output Linear."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out = set()
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Embedding) or (mod is head and isinstance(mod, nn.Linear) and name not in planned):
            out.add(f"{name}.weight")
    return out


def shards(units: list[Unit], limit: int) -> list[list[Unit]]:
    """Units packed in order into shards of about ``limit`` output bytes."""
    out: list[list[Unit]] = [[]]
    size = 0
    for u in units:
        if out[-1] and size + u.nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(u)
        size += u.nbytes
    return out


# ------------------------------------------------------------------ one unit

class Quantizer:
    """Turns units into output tensors and manifest entries, reading the source one tensor at a time."""

    def __init__(self, lay: Layout, source: StreamSource) -> None:
        self.lay, self.source = lay, source
        self.state = lay.model.state_dict(keep_vars=True)
        self.fallbacks: dict[str, str] = {}
        self.scales: dict[str, torch.Tensor] = {}
        self.fits: dict[str, Scheme | None] = {}
        self.resumed = 0  # shards a previous run had completed
        self.float_experts = {n: t for n, t in expert_tensors(lay.model).items() if n not in lay.plan}

    def prepare(self, pending: set[str]) -> None:
        """The fused groups' shared tensor scales (NVFP4): each part's fitted own scale first, then the group's."""
        plan = self.lay.plan
        linears = [u.name for u in self.lay.units if u.kind == "linear"]
        own = {}
        for group in fused_groups(linears):
            if not any(n in pending for n in group) or not any(plan.weight(n).tensor_scale for n in group):
                continue
            for n in group:
                w = self._weight(n)
                scheme = self._fit(n, w)
                if scheme is not None and (e := own_tensor_scale(w, scheme)) is not None:
                    own[n] = e
        self.scales = shared_encodes(own)

    def run(self, unit: Unit) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(output tensors, manifest layer entries) of one unit."""
        if unit.kind == "linear":
            return self._linear(unit.name)
        if unit.kind == "experts":
            return self._experts(self.lay.experts[unit.name])
        return self.float_out(unit.name, self._float_key(unit.name)), {}

    # how a unit's result is stored: lowbit's native layout here; other formats override these two
    def linear_out(self, name: str, q: Any, spec: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The stored tensors of a quantized Linear (its QTensor ``q``)."""
        return {f"{name}.{k}": v for k, v in q.pack().items()}

    def float_out(self, key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored tensors of a float one (``t`` in the dtype lowbit's native format stores it)."""
        return {key: t}

    def _weight(self, name: str) -> torch.Tensor:
        key = f"{name}.weight"
        src = model_key(self.source, self.lay.tied.get(key, key), self.lay.model_type)
        if src is None:
            raise ModelError(f"{self.source.folder}: the checkpoint has no tensor {key!r}; it does not match its "
                             "config.json — re-download or re-save the model")
        w = self.source.tensor(src)
        _check_shape(self.source, src, w, tuple(self.state[key].shape))
        self.source.precision.setdefault(key, self.source.precision.get(src, ""))
        return w

    def _fit(self, name: str, w: torch.Tensor) -> Scheme | None:
        if name not in self.fits:
            f = fit(w, self.lay.plan.weight(name))
            self.fits[name] = f.scheme
            if f.reason is not None:
                self.fallbacks[name] = "16 bits" if f.scheme is None else f"{f.scheme.scale} scales"
                warnings.warn(f"layer {name}: {f.reason}", stacklevel=2)
        return self.fits[name]

    def linear_q(self, name: str) -> tuple[QTensor | None, torch.Tensor | None, dict[str, Any]]:
        """(QTensor, None, manifest entry) of a planned Linear; (None, its stored float weight, {}) when its range
        made the in-model path keep it in 16 bits."""
        w = self._weight(name)
        scheme = self._fit(name, w)
        if scheme is None:
            return None, _narrow(w, f"{name}.weight" in self.lay.round16), {}
        q = quantize(w, scheme, None, self.scales.get(name))
        spec: dict[str, Any] = {"scheme": scheme.to_dict(), "shape": list(w.shape)}
        recipe = self.lay.plan[name]
        if recipe.input is not None:
            spec["input"] = recipe.input.to_dict()
        return q, None, spec

    def _linear(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        q, t, spec = self.linear_q(name)
        if q is None:
            return self.float_out(f"{name}.weight", t), {}
        return self.linear_out(name, q, spec), {name: spec}

    def float_key(self, key: str) -> torch.Tensor:
        """A float state-dict key as the exporters read it: lowbit's native stored form (fp16 where lossless or
        rounded), bf16 widened to float32 (the exports' own dtype rules start from the loaded model's float32)."""
        t = self._float_key(key)
        return t.float() if t.dtype == torch.bfloat16 else t

    def _experts(self, t: ExpertTensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Each expert's matrix quantized as a Linear's; one scheme for all, the first expert needing more decides."""
        planned = self.lay.plan.weight(t.name)
        scheme: Scheme | None = planned
        packs: list[dict[str, torch.Tensor]] = []
        e = 0
        while e < t.count:
            m = self.source.expert(t, e, self.lay.model_type)
            _check_shape(self.source, f"{t.name} (expert {e})", m, (t.out_features, t.in_features))
            if scheme is planned:
                f = fit(m, planned)
                if f.reason is not None:
                    self.fallbacks[t.name] = "16 bits" if f.scheme is None else f"{f.scheme.scale} scales"
                    warnings.warn(f"layer {t.name}: expert {e}: {f.reason}", stacklevel=2)
                    scheme, packs, e = f.scheme, [], 0
                    if scheme is None:
                        break
                    continue
            packs.append(quantize(m, scheme).pack())
            e += 1
        if scheme is None:
            return self._float_experts(t), {}
        out = {f"{t.name}.{k}": torch.stack([p[k] for p in packs]) for k in packs[0]}
        return out, {t.name: {"scheme": scheme.to_dict(), "shape": [t.out_features, t.in_features],
                              "experts": t.count}}

    def _float_experts(self, t: ExpertTensor) -> dict[str, torch.Tensor]:
        """A fused experts tensor kept in float, in the model's own layout, from whichever layout the file has."""
        stack = torch.stack([self.source.expert(t, i, self.lay.model_type) for i in range(t.count)])
        return {t.name: _narrow(stack.transpose(1, 2) if t.transposed else stack, False)}

    def _float_key(self, key: str) -> torch.Tensor:
        if key in self.float_experts:
            return self._float_experts(self.float_experts[key])[key]
        like = self.state[key]
        src = model_key(self.source, self.lay.tied.get(key, key), self.lay.model_type)
        if src is None:
            if like.device.type != "meta":  # a buffer the model computes itself (not in the checkpoint)
                return _narrow(like.detach().clone(), False)
            raise ModelError(f"{self.source.folder}: the checkpoint has no tensor {key!r}; it does not match its "
                             "config.json — re-download or re-save the model")
        entry = self.source.entries.get(src)
        if (like.is_floating_point() and like.numel() > _CHUNK and entry is not None
                and entry.dtype in ("F32", "F16", "BF16") and tuple(entry.shape) == tuple(like.shape)):
            return _narrow_pieces(lambda: self.source.chunks(src, _CHUNK), tuple(like.shape), key in self.lay.round16)
        t = self.source.tensor(src)
        _check_shape(self.source, src, t, tuple(like.shape))
        if not like.is_floating_point():
            return t.to(like.dtype)
        return _narrow(t, key in self.lay.round16)


def _check_shape(source: StreamSource, name: str, t: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(t.shape) != want:
        raise ModelError(f"{source.folder}: tensor {name} has shape {list(t.shape)}, config.json makes it {list(want)}; "
                         "the weights do not belong to this config.json — re-download or re-save the model")


def _narrow(t: torch.Tensor, round16: bool) -> torch.Tensor:
    """The stored form `native.save` gives a float32 tensor (after the fp16 rounding of embeddings), in chunks.

    Rounded: values within fp16's range become fp16 values; then a tensor of more than 1024
    elements whose values are all fp16 numbers is stored in fp16, else all bf16 numbers (a bf16
    source's norms, a table beyond fp16's range) in bf16, never widened (`native._narrowest`).
    """
    t = t.float()
    flat = t.reshape(-1)
    if round16 and flat.numel() and bool(_chunked_amax(flat) <= _F16_MAX):
        half = flat.half()
        return (half if flat.numel() > 1024 else half.float()).reshape(t.shape)
    if flat.numel() > 1024:
        for dt in (torch.float16, torch.bfloat16):  # `native._narrowest`'s order
            if all(torch.equal(c.to(dt).float(), c) for c in flat.split(_CHUNK)):
                return flat.to(dt).reshape(t.shape)
    return t


def _narrow_pieces(pieces: Callable[[], Iterator[torch.Tensor] | None], shape: tuple[int, ...],
                   round16: bool) -> torch.Tensor:
    """`_narrow` of a big float tensor read in pieces (an 8B model's 1 GB embedding table never in float32 whole).

    The pieces are read until the stored dtype is decided exactly as `_narrow` does, then once to fill it.
    """
    rounded = round16 and bool(max(float(c.abs().amax()) for c in pieces()) <= _F16_MAX)
    big = math.prod(shape) > 1024
    half = big and (rounded or all(torch.equal(c.half().float(), c) for c in pieces()))
    bf16 = big and not half and all(torch.equal(c.bfloat16().float(), c) for c in pieces())
    out = torch.empty(shape, dtype=torch.float16 if half else torch.bfloat16 if bf16 else torch.float32)
    flat, at = out.view(-1), 0
    for c in pieces():
        flat[at:at + c.numel()] = c.reshape(-1).half().float() if rounded and not half else c.reshape(-1)
        at += c.numel()
    return out


def _chunked_amax(flat: torch.Tensor) -> torch.Tensor:
    return torch.stack([c.abs().amax() for c in flat.split(_CHUNK)]).amax()


# ------------------------------------------------------------------ the run

@dataclass(frozen=True)
class Shard:
    """One output file: its name, its units, and its sidecar-sealed path in the work folder."""

    index: int
    name: str
    units: tuple[Unit, ...]


def plan_shards(units: list[Unit], limit: int) -> list[Shard]:
    groups = shards(units, limit)
    n = len(groups)
    return [Shard(i, f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(g)) for i, g in enumerate(groups)]


def run_record(folder: Path, source: StreamSource, plan: Plan, settings: StreamSettings,
               parts: list[Shard], export: str = "native") -> dict[str, Any]:
    """Everything that decides the output: a work folder holding another record is not resumed."""
    heads = hashlib.sha256(json.dumps(sorted((n, e.dtype, list(e.shape), e.file.name, e.nbytes)
                                             for n, e in source.entries.items())).encode()).hexdigest()
    record = {"source": str(folder.resolve()), "source_tensors": heads, "plan": json.loads(plan.to_json()),
              "search": settings.search, "shards": [[u.name for u in s.units] for s in parts],
              "lowbit_stream": 1}
    return record if export == "native" else record | {"export": export}


def sealed(work: Path, shard: Shard) -> dict[str, Any] | None:
    """The manifest entries of a shard a previous run completed (None when it is missing or not sealed)."""
    path = work / shard.name
    if SealedFile(path).check() is not None:
        return None
    _, meta = read_header(path)
    return json.loads(meta.get("lowbit", "null"))


def write_shard(work: Path, shard: Shard, tensors: dict[str, torch.Tensor], record: dict[str, Any]) -> None:
    """The shard's file (finite, atomically), then its seal: a crash between the two leaves it unsealed."""
    require_finite(tensors.items(), f"cannot write {work / shard.name}", native.WRITE_FIX)
    path = work / shard.name
    with atomic_file(path) as tmp:
        sha = write_file(tmp, tensors, {"format": "pt", "lowbit": json.dumps(record)})
    SealedFile(path).seal(sha, path.stat().st_size)


def progress_line(done: int, total: int, t0: float, start_done: int) -> str:
    """``[shard] bytes done / total, rate, ETA`` from this run's own rate (resumed work excluded)."""
    dt = time.perf_counter() - t0
    rate = (done - start_done) / dt if dt > 0 else 0.0
    eta = (total - done) / rate if rate > 0 else float("nan")
    return (f"{100 * done / max(total, 1):5.1f}%  {done / 2**30:.2f}/{total / 2**30:.2f} GiB out, "
            f"{rate / 2**20:.1f} MiB/s, ETA {eta:.0f} s")


def work_folder(out: Path) -> Path:
    """Where the shards of ``out`` wait until the last one is sealed (beside it, same file system)."""
    return out.parent / f".{out.name}.stream-parts"


def open_work(work: Path, record: dict[str, Any]) -> bool:
    """Create or reuse ``work``; True when it resumes a run with the same record (another record is cleared)."""
    if (work / RUN).is_file():
        try:
            old = json.loads((work / RUN).read_text())
        except (OSError, ValueError):
            old = None
        if old == record:
            return True
        warnings.warn(f"{work} holds the shards of a run with other settings or another source; they are removed",
                      stacklevel=2)
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_text(work / RUN, json.dumps(record))
    return False


def stream_shards(work: Path, parts: list[Shard], q: Quantizer,
                  report: Callable[[str], None]) -> Iterator[tuple[Shard, dict[str, Any]]]:
    """Each shard's record, from its seal when a previous run finished it, else quantized and written now."""
    total = sum(u.nbytes for s in parts for u in s.units)
    done_before = {s.name: r for s in parts if (r := sealed(work, s)) is not None}
    pending = {u.name for s in parts if s.name not in done_before for u in s.units}
    q.resumed = len(done_before)
    if done_before:
        report(f"resuming: {len(done_before)} of {len(parts)} shards already written in {work}")
    q.prepare(pending)
    done = sum(u.nbytes for s in parts if s.name in done_before for u in s.units)
    start, t0 = done, time.perf_counter()
    for shard in parts:
        if shard.name in done_before:
            yield shard, done_before[shard.name]
            continue
        tensors: dict[str, torch.Tensor] = {}
        layers: dict[str, Any] = {}
        for u in shard.units:
            t, spec = q.run(u)
            tensors.update(t)
            layers.update(spec)
        record = {"layers": layers, "fallbacks": {n: q.fallbacks[n] for n in layers if n in q.fallbacks}
                  | {u.name: q.fallbacks[u.name] for u in shard.units if u.name in q.fallbacks},
                  "precision": _precision([u.name for u in shard.units], q)}
        write_shard(work, shard, tensors, record)
        del tensors
        done += sum(u.nbytes for u in shard.units)
        report(f"[{shard.index + 1}/{len(parts)}] {progress_line(done, total, t0, start)}")
        yield shard, record


def _precision(names: list[str], q: Quantizer) -> dict[str, int]:
    """Source precision -> count of this shard's units read in it (the output's metadata sums them)."""
    out: dict[str, int] = {}
    for n in names:
        p = q.source.precision.get(n) or q.source.precision.get(f"{n}.weight") or ""
        if p:
            out[p] = out.get(p, 0) + 1
    return out


def finish(out: Path, work: Path, folder: Path | None, model: nn.Module, lay: Layout, records: list[dict[str, Any]],
           parts: list[Shard], meta: dict[str, Any], force: bool, tokenizer: Any = None) -> Path:
    """The sealed native checkpoint: the shards moved in, config.json, the tokenizer, the manifest last.

    folder: the source folder whose tokenizer files are copied; tokenizer: one to save instead (a GGUF source's).
    """
    layers: dict[str, Any] = {}
    for r in records:
        layers.update(r["layers"])
    known = {s.name: SealedFile(work / s.name).sha256() for s in parts}
    with atomic_dir(out, force=force, kind="lowbit checkpoint") as tmp:
        for s in parts:
            os.replace(work / s.name, tmp / s.name)
        config = model.config
        config.quantization_config = {"quant_method": native.FORMAT, "format_version": native.VERSION}
        config.save_pretrained(tmp)
        del config.quantization_config
        for name in native.tokenizer_files(folder) if folder is not None else ():
            shutil.copyfile(folder / name, tmp / name)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _write_index(tmp, parts)
        native.seal_sharded(tmp, layers, lay.aliases, meta, [s.name for s in parts],
                            {n: h for n, h in known.items() if h is not None})
    shutil.rmtree(work, ignore_errors=True)
    return out


def _write_index(folder: Path, parts: list[Shard]) -> None:
    """model.safetensors.index.json, so transformers' loader (`lowbit.files.hf_quantizer`) finds every shard."""
    weight_map = {k: s.name for s in parts for k in read_header(folder / s.name)[0]}
    atomic_write_text(folder / "model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": weight_map}))


def planned_after(lay: Layout, records: list[dict[str, Any]]) -> list[str]:
    return [n for r in records for n in r["layers"]]


def accounting(lay: Layout, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The matmul-weight accounting of the written checkpoint (the in-model summary's ``matmul_weights``)."""
    return account_model(lay.model, planned_after(lay, records)).to_dict()
