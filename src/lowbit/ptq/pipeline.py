"""The block-wise PTQ pipeline shared by every tuning method (SignRound, SignRoundV2, ...).

capture the inputs of decoder block 0 (a forward pre-hook that stops the model there),
then for each block: FP targets ``Y = block_fp(X_fp)``, tune the block's quantization on
``X_q`` (outputs of the already quantized blocks), freeze, propagate ``X_q = block_q(X_q)``,
``X_fp = Y``. Only the block being tuned sits on the compute device; with an offload
folder the FP weights of all other blocks live on disk (safetensors, one file per block)
so peak memory grows with one block plus the cached activations.

After each block its quantized weights are written atomically to the work folder. A
rerun with the same settings replays the finished blocks (forward passes only, the same
chunking and order, hence bit-identical activations) and continues with the next one;
a rerun with different settings is refused rather than mixing two runs.

Recipes that quantize inputs: each such Linear gets an `InputQuantizer` before its
block is tuned (``BlockJob.inputs``), so the tuner sees quantized inputs inside the
block, and the installed `QuantLinear` keeps it. Static input scales are the abs-max
of the Linear's FP inputs on the calibration batches, taken by hooks during the pass
that computes the block's FP targets (so a resumed block gets the same scales again).
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import load_file, save
from torch import nn
from tqdm.auto import tqdm

from lowbit.configs import check_fields
from lowbit.errors import CheckpointError, ConfigError
from lowbit.formats import QTensor, Scheme
from lowbit.formats.finite import require_finite
from lowbit.io import atomic_write_bytes, atomic_write_text, read_json
from lowbit.models.activations import activation_stats
from lowbit.models.attention import tuning_attention
from lowbit.models.fused import fused_groups, shared_amax, shared_tensor_scales
from lowbit.models.layers import block_path, decoder_blocks
from lowbit.models.lazy import is_lazy, load_block, materialize
from lowbit.models.placement import check_device
from lowbit.nn import QuantLinear, replace_linears, set_module
from lowbit.nn.input_quant import InputQuantizer
from lowbit.nn.input_rotation import rotation_of
from lowbit.plans.plan import Plan

_DROP_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
# one block's planned layers (full name -> (relative name, scheme)) and their (out, in) shapes
BlockLayout = tuple[Mapping[str, tuple[str, Scheme]], Mapping[str, tuple[int, int]]]


class _StopForward(Exception):
    """Raised by the capture hook once block 0's inputs are recorded."""


@dataclass
class BlockJob:
    """Everything a tuner needs for one block.

    layers: full layer name -> (module name relative to the block, scheme).
    kwargs: the extra arguments the block is called with (mask, position embeddings).
    imp: full layer name -> ``[in]`` importance, when the tuner asked for it.
    inputs: full layer name -> the quantizer of its input (layers whose recipe has one);
    a tuner runs each layer's input through it inside the block.
    """

    index: int
    block: nn.Module
    layers: dict[str, tuple[str, Scheme]]
    x: torch.Tensor
    y: torch.Tensor | None  # FP targets; None for a tuner that does not ask for them
    kwargs: dict[str, Any]
    imp: dict[str, torch.Tensor] | None
    device: torch.device | None = None  # compute device (None = where ``x`` is)
    dtype: torch.dtype | None = None  # the block's activation dtype (None = ``x``'s)
    shard: Shard | None = None  # this process's part of each mini-batch under torch.distributed
    inputs: dict[str, InputQuantizer] = field(default_factory=dict)  # input quantizers of the recipe
    # full layer name -> the weight tensor scale to quantize with (schemes that have one; fused groups share it)
    tensor_scales: dict[str, torch.Tensor] = field(default_factory=dict)

    def fetch(self, cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` of ``x`` or ``y`` on the compute device in the block's dtype (see `gather_rows`)."""
        return gather_rows(cache, idx, self.device or cache.device, self.dtype or cache.dtype)


class BlockTuner(Protocol):
    """Turns one block's FP Linears into QTensors; returns (name -> QTensor, info dict).

    needs_importance: the FP pass collects each Linear's input sum of squares (``job.imp``).
    needs_targets: the tuner reads the block's FP outputs (``job.y``); a tuner that only
    reads the quantized inputs (GPTQ) sets it False and the FP chain is not run at all
    (one block forward per block saved), unless static input scales need it.
    """

    needs_importance: bool
    needs_targets: bool

    def __call__(self, job: BlockJob) -> tuple[dict[str, QTensor], dict[str, float]]: ...


# ------------------------------------------------------------------ model access
def module_names(model: nn.Module) -> dict[int, str]:
    return {id(m): n for n, m in model.named_modules()}


def block_layers(plan: Plan, block_name: str) -> dict[str, tuple[str, Scheme]]:
    """Plan entries inside one block: full name -> (relative name, weight scheme)."""
    pre = block_name + "."
    return {n: (n[len(pre):], r.weight) for n, r in plan.items() if n.startswith(pre)}


def block_tensor_scales(block: nn.Module, layers: Mapping[str, tuple[str, Scheme]]) -> dict[str, torch.Tensor]:
    """Weight tensor scales of a block's planned layers from their float weights: a fused group's parts share one."""
    weights = {n: block.get_submodule(rel).weight for n, (rel, _) in layers.items()}
    return shared_tensor_scales(weights, {n: s for n, (_, s) in layers.items()})


def input_quantizers(plan: Plan, layers: Mapping[str, Any], amax: Mapping[str, torch.Tensor],
                     device: torch.device) -> dict[str, InputQuantizer]:
    """An `InputQuantizer` per layer of ``layers`` whose recipe quantizes its input, on ``device``."""
    return {n: InputQuantizer(plan[n].input, amax.get(n)).to(device)  # type: ignore[arg-type]
            for n in layers if plan[n].input is not None}


def run_block(block: nn.Module, x: torch.Tensor, kwargs: Mapping[str, Any], chunk: int) -> torch.Tensor:
    """``block(x)`` in chunks of samples (outputs of tuple-returning blocks unwrapped)."""
    outs = []
    for part in x.split(chunk):
        y = block(part, **kwargs)
        outs.append(y[0] if isinstance(y, tuple) else y)
    return torch.cat(outs)


# ------------------------------------------------------------------ the caches
CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CACHE_DEVICES = ("device", "cpu")


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world`` processes (torch.distributed) tuning one model together."""

    rank: int = 0
    world: int = 1

    def rows(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` samples (``n`` divisible by ``world``)."""
        k = n // self.world
        return slice(self.rank * k, (self.rank + 1) * k)


def current_shard() -> Shard:
    """The torch.distributed rank and world size (rank 0 of 1 without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return Shard(dist.get_rank(), dist.get_world_size())
    return Shard()


def new_cache(shape: tuple[int, ...], dtype: torch.dtype, where: torch.device, device: torch.device
              ) -> torch.Tensor:
    """An empty activation cache on ``where``; page-locked when it sits on the host of a GPU ``device``.

    Page-locked memory lets each mini-batch copy to the GPU asynchronously (``non_blocking``).
    """
    pin = where.type == "cpu" and device.type == "cuda"
    return torch.empty(shape, dtype=dtype, device=where, pin_memory=pin)


def gather_rows(cache: torch.Tensor, idx: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``cache[idx]`` on ``device`` in ``dtype``, without synchronising the host.

    ``idx`` lives with the cache. A host cache is gathered into page-locked memory from
    torch's caching host allocator (which does not hand a buffer out again before its
    copy has finished), then copied asynchronously.
    """
    if cache.device == device or cache.device.type == device.type == "cpu":
        return cache[idx].to(dtype)
    buf = torch.empty((len(idx), *cache.shape[1:]), dtype=cache.dtype, pin_memory=device.type == "cuda")
    torch.index_select(cache, 0, idx, out=buf)
    return buf.to(device, non_blocking=True).to(dtype)


def map_block(block: nn.Module, src: torch.Tensor, dst: torch.Tensor, kwargs: Mapping[str, Any], chunk: int,
              device: torch.device, dtype: torch.dtype, shard: Shard = Shard()) -> None:
    """``dst = block(src)`` in chunks of samples, computed on ``device`` in ``dtype``; ``dst`` may be ``src``.

    Writing in place keeps one cache instead of two: a chunk is read before its output
    overwrites it, and samples never mix. Under torch.distributed each rank runs its own
    share of the samples and the outputs are all-gathered chunk by chunk, so every rank
    ends with the whole ``dst``; chunks are cut as in one process, so outputs are the same.
    """
    rows = shard.rows(src.shape[0])
    for start in range(rows.start, rows.stop, chunk):
        stop = min(start + chunk, rows.stop)
        part = src[start:stop].to(device, non_blocking=True).to(dtype)
        y = block(part, **kwargs)
        y = (y[0] if isinstance(y, tuple) else y).to(dst.dtype)
        if shard.world == 1:
            dst[start:stop].copy_(y, non_blocking=True)
            continue
        import torch.distributed as dist

        parts = [torch.empty_like(y) for _ in range(shard.world)]
        dist.all_gather(parts, y.contiguous())
        k = src.shape[0] // shard.world
        for r, got in enumerate(parts):
            dst[r * k + start - rows.start: r * k + stop - rows.start].copy_(got, non_blocking=True)
    if dst.device.type == "cpu" and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the host reads dst next (once per pass, not per step)


def reduce_tensor(x: torch.Tensor, shard: Shard, op: str = "sum") -> torch.Tensor:
    """``x`` summed (or, ``op="max"``, maxed) over the ranks, as a new tensor (``x`` itself in one process)."""
    if shard.world == 1:
        return x
    import torch.distributed as dist

    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return x


def reduce_across(stats: Mapping[str, torch.Tensor], shard: Shard, op: str = "sum") -> dict[str, torch.Tensor]:
    """Per-rank activation statistics reduced over the ranks (`reduce_tensor` on each)."""
    return {name: reduce_tensor(t, shard, op) for name, t in stats.items()}


# ---------------------------------------------------------------------- capture
def capture_inputs(model: nn.Module, block0: nn.Module, calib: torch.Tensor, device: torch.device,
                   dtype: torch.dtype | None = None, where: torch.device | None = None,
                   shard: Shard = Shard()) -> tuple[torch.Tensor, dict[str, Any]]:
    """Hidden states entering block 0 for every sample, and the kwargs the block gets.

    Samples go one at a time (only embeddings run before the hook stops the model), so
    every captured kwarg has batch dimension 1 and broadcasts over any mini-batch. The
    embeddings run where the model's input embedding lives (the model stays off the
    compute device; only one block at a time goes there). The hidden states are written
    into one cache on ``where`` (default ``device``) in ``dtype`` (default the model's);
    the kwargs go to ``device``. Under torch.distributed each rank embeds its own share
    of the samples and the rows are all-gathered (embedding is a lookup: no arithmetic
    to differ).
    """
    if len(calib) == 0:
        raise ConfigError("no calibration samples; pass nsamples >= 1")
    store: list[tuple[tuple, dict]] = []
    src = input_device(model)

    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        store.append((args, kwargs))
        raise _StopForward

    handle = block0.register_forward_pre_hook(hook, with_kwargs=True)
    cache, first = None, {}
    rows = shard.rows(len(calib))
    try:
        with torch.no_grad():
            for i in range(rows.start, rows.stop):
                try:
                    model(input_ids=calib[i].unsqueeze(0).to(src), use_cache=False)
                except _StopForward:
                    pass
                args, kw = store.pop()
                h = (args[0] if args else kw["hidden_states"]).detach()
                if cache is None:
                    first = kw
                    cache = new_cache((len(calib), *h.shape[1:]), dtype or h.dtype, where or device, device)
                cache[i].copy_(h[0])
    finally:
        handle.remove()
    kwargs = {k: v for k, v in first.items() if k not in _DROP_KWARGS and k != "hidden_states"}
    kwargs["use_cache"] = False
    if shard.world > 1:
        _gather_rows(cache, rows, shard, device)
    return cache, _to(kwargs, device)


def _gather_rows(cache: torch.Tensor, rows: slice, shard: Shard, device: torch.device) -> None:
    """Every rank's captured rows into every rank's cache (sample by sample, through ``device``)."""
    import torch.distributed as dist

    comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
    for j in range(rows.stop - rows.start):
        mine = cache[rows.start + j].to(comm)
        parts = [torch.empty_like(mine) for _ in range(shard.world)]
        dist.all_gather(parts, mine)
        for r, got in enumerate(parts):
            cache[r * (rows.stop - rows.start) + j].copy_(got)


def input_device(model: nn.Module) -> torch.device:
    """Where the token ids must go: the input embedding's device (CPU for a lazy model's meta stub)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(emb, "weight", None)
    if weight is None or weight.device.type == "meta":
        return torch.device("cpu")
    return weight.device


# ---------------------------------------------------------------- resume state
def fingerprint(model: nn.Module, calib: torch.Tensor) -> dict[str, str]:
    """Cheap identity of the model (shapes + a sample of every tensor) and of the tokens."""
    h = hashlib.sha256()
    for n, p in model.state_dict().items():
        h.update(n.encode() + str(tuple(p.shape)).encode())
        if p.device.type != "meta":
            h.update(p.detach().reshape(-1)[:256].float().cpu().numpy().tobytes())
    tok = hashlib.sha256(calib.cpu().to(torch.int64).numpy().tobytes()).hexdigest()
    return {"model": h.hexdigest(), "calib": tok}


def work_settings(settings: Mapping[str, Any], plan: Plan, options: PipelineOptions, model: nn.Module,
                  calib: torch.Tensor) -> dict[str, Any]:
    """Everything that decides a block-wise run's result, as its work folder's ``run.json`` records it."""
    return {**settings, "plan": plan.to_dict(), "fp_inputs": options.fp_inputs, "chunk": options.chunk,
            **_cache_setting(options), **_fused_setting(plan), **fingerprint(model, calib)}


def check_work_folder(path: str | Path, settings: Mapping[str, Any], later: tuple[str, ...] = ()) -> None:
    """Refuse a work folder that holds a run with other settings, before any heavy work.

    later: keys that cannot be known yet (the plan of a mixed-precision run, the model's
    fingerprint after a rotation or AWQ pre-step); the pipeline checks them when it opens
    the folder. A folder without ``run.json`` has nothing to disagree with.
    """
    meta = Path(path) / "run.json"
    if meta.exists():
        _compare(Path(path), _read_json(meta), _jsonable(settings), later)


def _jsonable(d: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, sort_keys=True, default=str))


def _compare(path: Path, old: dict[str, Any], new: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
    diff = sorted(k for k in set(old) | set(new) if k not in skip and old.get(k) != new.get(k))
    if diff:
        raise ConfigError(f"work folder {path} holds a run with different settings ({', '.join(diff)}); resume "
                          "with the same settings, or pass a new --workdir (or delete it) to start over")


class WorkDir:
    """Per-block results on disk: ``run.json`` (settings), ``block_NNNN.safetensors`` + ``block_NNNN.json``.

    The small JSON sidecar holds the block file's sha256 and is written after it, so a
    block counts as finished only when both exist and agree and the file decodes to the
    block's layers: a crash between the two, a truncated file, a flipped byte or a file
    that is not safetensors at all read as "not finished" and the block is tuned again
    (with a warning) instead of being installed with wrong codes.
    """

    def __init__(self, path: str | Path, settings: dict[str, Any]) -> None:
        self.path = Path(path)
        self.settings = _jsonable(settings)
        self.damaged: dict[int, str] = {}  # block index -> why its saved result was discarded
        self.path.mkdir(parents=True, exist_ok=True)
        meta = self.path / "run.json"
        if meta.exists():
            _compare(self.path, _read_json(meta), self.settings)
        else:
            atomic_write_text(meta, json.dumps(self.settings, indent=1, sort_keys=True))

    def block_file(self, i: int) -> Path:
        return self.path / f"block_{i:04d}.safetensors"

    def sidecar(self, i: int) -> Path:
        return self.path / f"block_{i:04d}.json"

    def done(self, nblocks: int, expect: Callable[[int], BlockLayout] | None = None) -> int:
        """Number of leading blocks whose saved result is intact; results after it are removed.

        Every block is tuned on the outputs of the blocks before it, so once block k must
        be redone (missing, truncated, corrupted, unreadable) the saved blocks after it are
        stale too: they are deleted, so that a run interrupted while redoing them can never
        pick them up. A damaged block is reported with ``warnings.warn`` and recorded in
        ``damaged``. expect: block index -> its layers and shapes, to decode each file now.
        """
        k = 0
        while k < nblocks and self.block_file(k).exists():
            why = self._check(k, expect)
            if why:
                self.damaged[k] = why
                warnings.warn(f"work folder {self.path}: block {k}'s saved result is {why}; tuning block {k} "
                              f"and the {nblocks - k - 1} block(s) after it again", stacklevel=2)
                break
            k += 1
        self._prune(k)
        return k

    def _check(self, i: int, expect: Callable[[int], BlockLayout] | None = None) -> str | None:
        """Why block ``i``'s file cannot be used (None when it matches its checksum and decodes)."""
        if not self.sidecar(i).exists():
            return f"unverified (no {self.sidecar(i).name}: interrupted while saving, or an older lowbit)"
        try:
            meta = read_json(self.sidecar(i), CheckpointError, "")
        except CheckpointError:
            return f"unverified ({self.sidecar(i).name} is damaged)"
        if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str):
            return f"unverified ({self.sidecar(i).name} is damaged)"
        size = self.block_file(i).stat().st_size
        if isinstance(meta.get("bytes"), int) and size != meta["bytes"]:
            return f"truncated ({size} of {meta['bytes']} bytes)"
        data = self.block_file(i).read_bytes()
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            return "corrupted (checksum mismatch)"
        if expect is not None:
            try:
                self._decode(i, data, *expect(i))
            except (CheckpointError, ConfigError) as e:
                return f"unreadable ({str(e)[:120]})"
        return None

    def _prune(self, first: int) -> None:
        """Delete saved results of blocks ``first`` and later (they are stale once an earlier block is redone)."""
        for f in [*self.path.glob("block_*.safetensors"), *self.path.glob("block_*.json")]:
            index = f.stem.removeprefix("block_")
            if index.isdigit() and int(index) >= first:
                f.unlink(missing_ok=True)

    def save_block(self, i: int, qts: Mapping[str, QTensor]) -> None:
        tensors = {f"{n}::{k}": v.detach().cpu().contiguous() for n, q in qts.items() for k, v in q.pack().items()}
        require_finite(tensors.items(), f"block {i}'s result", "nothing was written: a quantizer made NaN or inf "
                       "from finite weights, which is a lowbit bug (please report it with the command)")
        data = save(tensors)
        atomic_write_bytes(self.block_file(i), data)
        atomic_write_text(self.sidecar(i), json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}))

    def load_block(self, i: int, layers: Mapping[str, tuple[str, Scheme]],
                   shapes: Mapping[str, tuple[int, int]]) -> dict[str, QTensor]:
        data = self.block_file(i).read_bytes()
        if hashlib.sha256(data).hexdigest() != _read_json(self.sidecar(i)).get("sha256"):  # changed since done()
            raise CheckpointError(f"{self.block_file(i)} changed while the run was resuming; rerun to tune it again")
        return self._decode(i, data, layers, shapes)

    def _decode(self, i: int, data: bytes, layers: Mapping[str, tuple[str, Scheme]],
                shapes: Mapping[str, tuple[int, int]]) -> dict[str, QTensor]:
        """Block ``i``'s saved bytes as QTensors of its layers; anything else is a `CheckpointError`."""
        try:
            raw = st_load(data)
        except SafetensorError as e:
            raise CheckpointError(f"{self.block_file(i)} is not a safetensors file ({str(e)[:80]}); delete the "
                                  "work folder and rerun") from None
        out = {}
        for name, (_rel, scheme) in layers.items():
            d = {k.split("::", 1)[1]: v for k, v in raw.items() if k.split("::", 1)[0] == name}
            if not d:
                raise ConfigError(f"{self.block_file(i)} lacks layer {name}; delete the work folder and rerun")
            try:
                out[name] = QTensor.from_packed(d, shapes[name], scheme)
            except CheckpointError as e:
                raise CheckpointError(f"{self.block_file(i)}, layer {name}: {e}; delete the work folder and "
                                      "rerun") from None
        return out


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object lowbit wrote into the work folder; anything else is a `CheckpointError`."""
    d = read_json(path, CheckpointError, f"delete the work folder {path.parent} and rerun")
    if not isinstance(d, dict):
        raise CheckpointError(f"{path} is not what lowbit wrote; delete the work folder {path.parent} and rerun")
    return d


# ---------------------------------------------------------------- disk offload
class DiskOffload:
    """FP weights of every block in ``dir/fp_NNNN.safetensors``; at most one block in memory."""

    def __init__(self, path: str | Path, blocks: nn.ModuleList) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        for i, b in enumerate(blocks):  # always rewritten: files of another model must never be reused
            tensors = {k: v.detach().contiguous().cpu() for k, v in _tensors(b).items()}
            atomic_write_bytes(self.path / f"fp_{i:04d}.safetensors", save(tensors))
            b.to_empty(device="meta")

    def load(self, i: int, block: nn.Module, device: torch.device) -> None:
        """Put block ``i``'s FP tensors back, each in memory of its own.

        ``load_file`` hands out views of one memory map of the whole file, so the block's
        norm weights, which outlive the tuning, would keep every page of its replaced
        Linear weights resident: RSS grew by one FP block per tuned block. Copying each
        tensor out (one at a time) lets the map go when the Linears are swapped out.
        """
        for name, t in load_file(str(self.path / f"fp_{i:04d}.safetensors"), device=str(device)).items():
            t = t.clone() if t.device.type == "cpu" else t
            parent, _, leaf = name.rpartition(".")
            mod = block.get_submodule(parent) if parent else block
            if leaf in mod._parameters:
                mod._parameters[leaf] = nn.Parameter(t, requires_grad=False)
            else:
                mod._buffers[leaf] = t


class ShardBlocks:
    """Blocks of a lazily loaded model (``lowbit.models.lazy``), read from its own checkpoint."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.prefix = model, block_path(model)

    def load(self, i: int, block: nn.Module, device: torch.device) -> None:
        load_block(self.model, f"{self.prefix}.{i}", block, device)


def block_loader(model: nn.Module, blocks: nn.ModuleList, offload_dir: str | None) -> ShardBlocks | DiskOffload | None:
    """Where each block's FP weights come from: the checkpoint (lazy model), an offload folder, or memory."""
    if is_lazy(model):
        return ShardBlocks(model)  # already on disk in the checkpoint: nothing to write
    return DiskOffload(offload_dir, blocks) if offload_dir else None


def _tensors(block: nn.Module) -> dict[str, torch.Tensor]:
    d = dict(block.named_parameters())
    d.update(dict(block.named_buffers()))
    return d


# --------------------------------------------------------------------- the run
@dataclass(frozen=True)
class PipelineOptions:
    """Knobs of the pipeline itself (the tuner has its own config).

    fp_inputs: tune on FP inputs X_fp instead of the quantized blocks' outputs.
    chunk: samples per forward when computing targets / propagating.
    device: compute device for the block being tuned.
    offload_dir: keep FP block weights on disk, loading one block at a time.
    cache_dtype: storage of the cached block inputs and FP targets ("fp32" | "bf16"); the
        block always computes in its own dtype, each mini-batch is cast on the way in.
    cache_device: where those caches live: "device" (the compute device) or "cpu" (host
        memory, page-locked on a GPU machine, streamed per mini-batch: the leanest mode,
        for large models on small GPUs).
    """

    fp_inputs: bool = False
    chunk: int = 8
    device: str = "cpu"
    offload_dir: str | None = None
    cache_dtype: str = "fp32"
    cache_device: str = "device"

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "pipeline option")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ConfigError(f"cache dtype must be one of {sorted(CACHE_DTYPES)}, got {self.cache_dtype!r}")
        if self.cache_device not in CACHE_DEVICES:
            raise ConfigError(f"--cache-device must be one of {list(CACHE_DEVICES)}, got {self.cache_device!r}")
        if self.chunk < 1:
            raise ConfigError(f"chunk must be >= 1 sample, got {self.chunk}")


def check_world(nsamples: int, shard: Shard) -> None:
    """Under torch.distributed the calibration samples split evenly over the ranks, or it is an error."""
    if nsamples % shard.world:
        raise ConfigError(f"{nsamples} calibration samples do not split over {shard.world} processes; pass "
                          f"--nsamples a multiple of {shard.world} (or launch a world size that divides it)")


def quantize_blockwise(model: nn.Module, plan: Plan, calib: torch.Tensor, tuner: BlockTuner,
                       settings: Mapping[str, Any], options: PipelineOptions = PipelineOptions(),
                       workdir: str | Path | None = None, progress: bool = True,
                       on_block: Callable[[int], None] | None = None) -> list[dict[str, float]]:
    """Quantize ``model`` in place block by block; returns per-block info (loss, seconds).

    settings: everything that determines the result (method, config); stored in the
    work folder so a resume with different settings is refused.
    on_block: called with the block index after each block is saved (tests interrupt here).

    Caches: the quantized inputs ``X_q`` and one FP buffer that holds ``X_fp`` until the
    block's targets overwrite it in place (``Y`` is the next block's ``X_fp``); with
    ``fp_inputs`` the tuner reads ``X_fp`` itself, so ``Y`` gets a buffer of its own.
    Under torch.distributed (torchrun) every rank computes its share of the samples in
    the forward passes, the caches are all-gathered, and only rank 0 writes the work folder.
    """
    shard = current_shard()
    check_world(len(calib), shard)
    blocks = decoder_blocks(model)
    names = module_names(model)
    device = check_device(options.device) or torch.device("cpu")
    where = device if options.cache_device == "device" else torch.device("cpu")
    x, kwargs = capture_inputs(model, blocks[0], calib, device, CACHE_DTYPES[options.cache_dtype], where, shard)
    dtype = _block_dtype(blocks[0])
    wd = _workdir(workdir, work_settings(settings, plan, options, model, calib), shard)
    offload = block_loader(model, blocks, _rank_folder(options.offload_dir, shard))

    def layout(i: int) -> BlockLayout:
        layers = block_layers(plan, names[id(blocks[i])])
        return layers, _shapes(blocks[i], layers)

    start = _resume_point(wd, len(blocks), shard, layout)
    x_fp, x_q = x, None
    if not options.fp_inputs and not _tracks_fp(tuner, plan):
        x_fp, x_q = None, x  # only the quantized chain is needed: the captured inputs become X_q
    elif not options.fp_inputs:
        x_q = new_cache(x.shape, x.dtype, x.device, device)
        x_q.copy_(x)
    infos: list[dict[str, float]] = []
    bar = tqdm(range(len(blocks)), desc="ptq blocks", unit="block", disable=not progress or shard.rank != 0)
    for i in bar:
        block = blocks[i]
        layers = block_layers(plan, names[id(block)])
        if offload:
            offload.load(i, block, device)
        block.to(device)
        t0 = time.perf_counter()
        want_imp = tuner.needs_importance and i >= start
        static = [n for n in layers if plan[n].needs_calibration]
        hooked = {n: block.get_submodule(r) for n, (r, _) in layers.items() if want_imp or n in static}
        kinds = ("sumsq",) * want_imp + ("absmax",) * bool(static)
        x_in = x_q if x_q is not None else x_fp
        # the targets overwrite X_fp in place, unless the tuner reads X_fp itself
        y = x_fp if x_q is not None else new_cache(x_fp.shape, x_fp.dtype, x_fp.device, device)
        with torch.no_grad(), activation_stats(hooked, kinds) as h, tuning_attention(model):
            if y is not None:
                map_block(block, x_fp, y, kwargs, options.chunk, device, dtype, shard)
        x_fp = None
        amax = shared_amax({n: a.amax() for n, a in reduce_across(h.result("absmax"), shard, "max").items()
                            if n in static}) if static else {}
        inputs = input_quantizers(plan, layers, amax, device)
        if i < start:
            qts = wd.load_block(i, layers, _shapes(block, layers))  # type: ignore[union-attr]
            info: dict[str, float] = {"resumed": 1.0}
        else:
            # summed over the ranks in float64 and cast once: the scales searched from it must not
            # depend on how many processes share the samples
            imp = ({n: t.float() for n, t in reduce_across(h.result("sumsq", torch.float64), shard).items()}
                   if want_imp else None)
            job = BlockJob(i, block, layers, x_in, y, kwargs, imp, device, dtype, shard, inputs,
                           block_tensor_scales(block, layers))
            with tuning_attention(model):
                qts, info = tuner(job)
            if wd and i in wd.damaged:
                info["retuned_damaged"] = 1.0
            if wd and shard.rank == 0:
                wd.save_block(i, qts)
        x_in = None
        _install(block, layers, qts, device, inputs)
        if x_q is not None:
            with torch.no_grad(), tuning_attention(model):
                map_block(block, x_q, x_q, kwargs, options.chunk, device, dtype, shard)
        x_fp = y
        block.to("cpu")
        info["seconds"] = time.perf_counter() - t0
        infos.append(info)
        bar.set_postfix({k: f"{v:.3g}" for k, v in info.items() if k in ("loss", "rtn_loss")})
        if on_block is not None and i >= start:
            on_block(i)
    _quantize_rest(model, plan, names, blocks)
    if is_lazy(model):
        materialize(model)  # every block is loaded by now: this only drops the marker
    return infos


def _tracks_fp(tuner: BlockTuner, plan: Plan) -> bool:
    """Whether the FP chain (``X_fp``, targets ``Y``) must run: the tuner reads targets or importance, or a
    recipe's static input scale is taken from the FP inputs."""
    return (tuner.needs_targets or tuner.needs_importance
            or any(r.needs_calibration for _, r in plan.items()))


def _block_dtype(block: nn.Module) -> torch.dtype:
    """The dtype the block computes in (its first floating parameter's)."""
    for t in [*block.parameters(), *block.buffers()]:
        if t.is_floating_point() and t.device.type != "meta":
            return t.dtype
    return torch.float32


def _cache_setting(options: PipelineOptions) -> dict[str, str]:
    """The cache dtype changes results, so resuming needs the same one (fp32 caches kept the old record)."""
    return {} if options.cache_dtype == "fp32" else {"cache_dtype": options.cache_dtype}


def _fused_setting(plan: Plan) -> dict[str, int]:
    """Fused groups now share one tensor scale: a work folder whose blocks were tuned with one per layer
    (lowbit before the change) must not be resumed into the new numbers; plans without such groups keep theirs."""
    scaled = [n for n, s in plan.weights().items() if s.tensor_scale]
    return {"shared_tensor_scales": 1} if fused_groups(scaled) else {}


def _workdir(path: str | Path | None, settings: dict[str, Any], shard: Shard) -> WorkDir | None:
    """The work folder; under torch.distributed rank 0 creates it before the others open it."""
    if path is None:
        return None
    if shard.world == 1:
        return WorkDir(path, settings)
    import torch.distributed as dist

    wd = WorkDir(path, settings) if shard.rank == 0 else None
    dist.barrier()
    return wd or WorkDir(path, settings)


def _resume_point(wd: WorkDir | None, nblocks: int, shard: Shard,
                  layout: Callable[[int], BlockLayout] | None = None) -> int:
    """Blocks already finished; rank 0 checks (and prunes) the folder before the other ranks read it."""
    if wd is None:
        return 0
    if shard.world == 1:
        return wd.done(nblocks, layout)
    import torch.distributed as dist

    start = wd.done(nblocks, layout) if shard.rank == 0 else 0
    dist.barrier()
    return start if shard.rank == 0 else wd.done(nblocks, layout)


def _rank_folder(folder: str | None, shard: Shard) -> str | None:
    """Each rank offloads into a folder of its own (ranks on one machine must not share the files)."""
    if folder is None or shard.world == 1:
        return folder
    return str(Path(folder) / f"rank{shard.rank}")


def _to(kwargs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    def mv(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.to(device)
        if isinstance(v, tuple):
            return tuple(mv(t) for t in v)
        return v

    return {k: mv(v) for k, v in kwargs.items()}


def _shapes(block: nn.Module, layers: Mapping[str, tuple[str, Scheme]]) -> dict[str, tuple[int, int]]:
    out = {}
    for n, (rel, _) in layers.items():
        m = block.get_submodule(rel)
        out[n] = (m.out_features, m.in_features)
    return out


def _install(block: nn.Module, layers: Mapping[str, tuple[str, Scheme]], qts: Mapping[str, QTensor],
             device: torch.device, inputs: Mapping[str, InputQuantizer] | None = None) -> None:
    """Swap the block's Linears for frozen QuantLinears holding the tuned weights, on ``device``.

    A resumed block's codes were read onto the CPU; tuned ones are already on ``device``.
    inputs: the layers' input quantizers (the ones the tuning used).
    """
    for name, (rel, _) in layers.items():
        old = block.get_submodule(rel)
        bias = getattr(old, "bias", None)
        new = QuantLinear(qts[name], None if bias is None else bias.detach(),
                          input_quant=(inputs or {}).get(name), input_rotation=rotation_of(old))
        set_module(block, rel, new.to(device))


def _quantize_rest(model: nn.Module, plan: Plan, names: Mapping[int, str], blocks: nn.ModuleList) -> None:
    """Planned layers outside the decoder blocks (e.g. lm_head) get plain RTN."""
    prefixes = tuple(names[id(b)] + "." for b in blocks)
    rest = {n: r for n, r in plan.items() if not n.startswith(prefixes)}
    if rest:
        static = [n for n in rest if plan[n].needs_calibration]
        if static:
            raise ConfigError(f"{static[0]} lies outside the decoder blocks, where the block-wise pipeline cannot "
                              "calibrate static input scales; give it a dynamic input scheme (e.g. fp8, mxfp4) "
                              "or none")
        weights = {n: model.get_submodule(n).weight for n in rest}
        replace_linears(model, rest, tensor_scales=shared_tensor_scales(weights, {n: r.weight for n, r in rest.items()}))
