"""The resume store: a work folder holding each finished block's result, so an interrupted run continues.

``run.json`` records everything that decides the run's result (the method's settings, the
plan, the pipeline's knobs, a fingerprint of the model and the calibration tokens); a
rerun with other settings is refused rather than mixing two runs. Each block's result is a
safetensors file sealed by a JSON sidecar with its sha256 (`lowbit.files.sealed.SealedFile`,
the one sealed-file helper), written atomically after the block;
a rerun replays the finished blocks (forward passes only, the same chunking and order,
hence bit-identical activations) and continues with the next one.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save
from torch import nn

from lowbit.errors import CheckpointError, ConfigError
from lowbit.files.sealed import SealedFile
from lowbit.formats.finite import require_finite
from lowbit.io import atomic_write_text, read_json
from lowbit.models.fused import fused_groups
from lowbit.plans.plan import Plan
from lowbit.ptq.blockwise.options import PipelineOptions
from lowbit.ptq.blockwise.shards import Shard, rank0_first

# a pass's reader of one block's saved tensors: (block index, tensors, file) -> its result, or
# CheckpointError / ConfigError when the tensors are not what that block's result must be
Decoder = Callable[[int, Mapping[str, torch.Tensor], Path], Any]

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
                  calib: torch.Tensor, kv: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Everything that decides a block-wise run's result, as its work folder's ``run.json`` records it.

    kv: the KV-cache entry the blocks are tuned under (`kv_setting`); None = read it from ``model``
    (whose static KV scales, as buffers, are also in its fingerprint)."""
    return {**settings, "plan": plan.to_dict(), "fp_inputs": options.fp_inputs, "chunk": options.chunk,
            **_cache_setting(options), **_fused_setting(plan), **fingerprint(model, calib),
            **(kv_setting(model) if kv is None else kv)}


def kv_setting(model: nn.Module) -> dict[str, Any]:
    """``{"kv_cache": ...}`` when a KV scheme is installed (tuned blocks ran with that quantized cache), else {}:
    a run without one records nothing, so its folders read as before."""
    from lowbit.nn.kv_quant import kv_entry, kv_schemes, values_folded

    schemes = kv_schemes(model)
    return {"kv_cache": kv_entry(schemes, values_folded(model))} if schemes else {}


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

    The small JSON sidecar (`SealedFile`) holds the block file's sha256 and is written after it, so a
    block counts as finished only when both exist and agree and the pass's decoder reads
    the file as that block's result (the tuned layers' codes, AWQ's scales): a crash
    between the two, a truncated file, a flipped byte or a file that is not safetensors at
    all read as "not finished" and the block is done again (with a warning) instead of
    being installed with wrong codes.
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
        return self.sealed(i).sidecar

    def sealed(self, i: int) -> SealedFile:
        """Block ``i``'s file with its sidecar ``block_NNNN.json`` (`lowbit.files.sealed`)."""
        return SealedFile(self.block_file(i))

    def done(self, nblocks: int, decode: Decoder | None = None) -> int:
        """Number of leading blocks whose saved result is intact; results after it are removed.

        Every block is tuned on the outputs of the blocks before it, so once block k must
        be redone (missing, truncated, corrupted, unreadable) the saved blocks after it are
        stale too: they are deleted, so that a run interrupted while redoing them can never
        pick them up. A damaged block is reported with ``warnings.warn`` and recorded in
        ``damaged``. decode: the pass's reader of a block's tensors, to decode each file now.
        """
        k = 0
        while k < nblocks and self.block_file(k).exists():
            why = self._check(k, decode)
            if why:
                self.damaged[k] = why
                warnings.warn(f"work folder {self.path}: block {k}'s saved result is {why}; tuning block {k} "
                              f"and the {nblocks - k - 1} block(s) after it again", stacklevel=2)
                break
            k += 1
        self._prune(k)
        return k

    def _check(self, i: int, decode: Decoder | None = None) -> str | None:
        """Why block ``i``'s file cannot be used (None when its seal holds and it decodes)."""
        data, why = self.sealed(i).read()
        if data is None:
            return why
        if decode is not None:
            try:
                self._decode(i, data, decode)
            except (CheckpointError, ConfigError) as e:
                return f"unreadable ({str(e)[:120]})"
        return None

    def _prune(self, first: int) -> None:
        """Delete saved results of blocks ``first`` and later (they are stale once an earlier block is redone)."""
        for f in [*self.path.glob("block_*.safetensors"), *self.path.glob("block_*.json")]:
            index = f.stem.removeprefix("block_")
            if index.isdigit() and int(index) >= first:
                f.unlink(missing_ok=True)

    def save_block(self, i: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Block ``i``'s result (the pass's tensors, finite), then its sidecar: the block is finished."""
        require_finite(tensors.items(), f"block {i}'s result", "nothing was written: a quantizer made NaN or inf "
                       "from finite weights, which is a lowbit bug (please report it with the command)")
        self.sealed(i).write(save(dict(tensors)))

    def load_block(self, i: int, decode: Decoder) -> Any:
        data, why = self.sealed(i).read()
        if data is None:  # it was intact when done() checked it
            raise CheckpointError(f"{self.block_file(i)} changed while the run was resuming ({why}); rerun to "
                                  "tune it again")
        return self._decode(i, data, decode)

    def _decode(self, i: int, data: bytes, decode: Decoder) -> Any:
        """Block ``i``'s saved bytes through the pass's reader; anything else is a `CheckpointError`."""
        try:
            raw = st_load(data)
        except SafetensorError as e:
            raise CheckpointError(f"{self.block_file(i)} is not a safetensors file ({str(e)[:80]}); delete the "
                                  "work folder and rerun") from None
        return decode(i, raw, self.block_file(i))


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object lowbit wrote into the work folder; anything else is a `CheckpointError`."""
    d = read_json(path, CheckpointError, f"delete the work folder {path.parent} and rerun")
    if not isinstance(d, dict):
        raise CheckpointError(f"{path} is not what lowbit wrote; delete the work folder {path.parent} and rerun")
    return d


def _cache_setting(options: PipelineOptions) -> dict[str, str]:
    """The cache dtype changes results, so resuming needs the same one (fp32 caches kept the old record)."""
    return {} if options.cache_dtype == "fp32" else {"cache_dtype": options.cache_dtype}


def _fused_setting(plan: Plan) -> dict[str, int]:
    """Fused groups now share one tensor scale: a work folder whose blocks were tuned with one per layer
    (lowbit before the change) must not be resumed into the new numbers; plans without such groups keep theirs."""
    scaled = [n for n, s in plan.weights().items() if s.tensor_scale]
    return {"shared_tensor_scales": 1} if fused_groups(scaled) else {}


def open_workdir(path: str | Path | None, settings: dict[str, Any], shard: Shard) -> WorkDir | None:
    """The work folder; under torch.distributed rank 0 creates it before the others open it."""
    if path is None:
        return None
    return rank0_first(shard, lambda: WorkDir(path, settings))


def resume_point(wd: WorkDir | None, nblocks: int, shard: Shard, decode: Decoder | None = None) -> int:
    """Blocks already finished; rank 0 checks (and prunes) the folder before the other ranks read it."""
    if wd is None:
        return 0
    return rank0_first(shard, lambda: wd.done(nblocks, decode))
