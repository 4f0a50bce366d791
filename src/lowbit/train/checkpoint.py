"""Training checkpoints that resume exactly, stored as tensors + JSON only.

A checkpoint holds everything the next step depends on: the trainable parameters (the
frozen ones are rebuilt by the caller from the same source), the AdamW moments, the
step (which fixes the learning rate and the data position, both pure functions of it),
the RNG states, the loss history and the config fingerprint.

Nothing read back can run code: tensors live in a safetensors file and everything else
(step, losses, optimizer param groups, the non-tensor optimizer state, the Python RNG
state) in ``checkpoint.json``, through a small tagged encoding that keeps tuples and
integer keys exact. Pickles (the old ``checkpoint.pt``) are never opened.

The folder is crash-safe without a rename of the folder: each save writes a new
``tensors-<step>.safetensors`` first, then ``checkpoint.json`` (atomically, last), which
names that file and its sha256; only then are older tensor files removed. A crash at
any point leaves a manifest that points at a complete, matching file.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from lowbit.errors import CheckpointError, ConfigError
from lowbit.files.sealed import Seal
from lowbit.formats.finite import require_finite
from lowbit.io import atomic_write_bytes, file_inside

FORMAT = "lowbit-train-checkpoint"
VERSION = 2
MANIFEST = "checkpoint.json"
LEGACY = "checkpoint.pt"  # version 1: a pickle; refused, never unpickled
_TAGS = ("tensor", "list", "tuple", "dict")
SEAL = Seal("training checkpoint", MANIFEST, FORMAT, VERSION, fix="delete the folder {folder} to start over")


def rng_state() -> dict[str, Any]:
    d: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        d["cuda"] = torch.cuda.get_rng_state_all()
    return d


def set_rng_state(d: dict[str, Any]) -> None:
    torch.set_rng_state(d["torch"])
    random.setstate(d["python"])
    if "cuda" in d and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(d["cuda"])


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


# ------------------------------------------------------- tagged JSON encoding
def encode(obj: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` as JSON, its tensors moved to ``tensors`` under keys derived from ``key``.

    Scalars stay JSON scalars; containers and tensors become one-key objects
    (``{"tuple": [...]}``, ``{"dict": [[k, v], ...]}``, ``{"tensor": name}``) so tuples,
    integer dict keys (optimizer state is keyed by parameter index) and tensors come back
    exactly as they were.
    """
    if isinstance(obj, torch.Tensor):
        while key in tensors:  # a dict key containing "/" could repeat a path: keep both
            key += "'"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"tensor": key}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in obj):
            raise CheckpointError(f"cannot store {key} in a training checkpoint: its keys are not str/int")
        return {"dict": [[k, encode(v, f"{key}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        tag = "tuple" if isinstance(obj, tuple) else "list"
        return {tag: [encode(v, f"{key}/{i}", tensors) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"cannot store {key} ({type(obj).__name__}) in a training checkpoint")


def decode(node: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """Inverse of `encode`; anything not produced by it is a `CheckpointError`."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if not (isinstance(node, dict) and len(node) == 1 and next(iter(node)) in _TAGS):
        raise CheckpointError(f"{where} holds an entry lowbit did not write ({str(node)[:60]}); "
                              "delete the checkpoint folder to start over")
    tag, value = next(iter(node.items()))
    if tag == "tensor":
        if not isinstance(value, str) or value not in tensors:
            raise CheckpointError(f"{where} refers to tensor {value!r}, which its tensor file lacks; "
                                  "delete the checkpoint folder to start over")
        return tensors[value]
    if not isinstance(value, list):
        raise CheckpointError(f"{where} has a malformed {tag} entry; delete the checkpoint folder to start over")
    if tag == "dict":
        if not all(isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], (str, int)) for kv in value):
            raise CheckpointError(f"{where} has a malformed dict entry; delete the checkpoint folder to start over")
        return {k: decode(v, tensors, where) for k, v in value}
    items = [decode(v, tensors, where) for v in value]
    return tuple(items) if tag == "tuple" else items


# ------------------------------------------------------------- save / load
def save_checkpoint(folder: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    losses: list[float], evals: list[dict], fingerprint: str, settings: dict) -> Path:
    """Write the checkpoint of ``step`` into ``folder``; returns the manifest's path."""
    folder = Path(folder)
    tensors: dict[str, torch.Tensor] = {}
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "losses": list(losses),
                "evals": list(evals), "fingerprint": fingerprint, "settings": _jsonable(settings),
                "params": encode(trainable_state(model), "params", tensors), "optimizer": encode(optimizer.state_dict(), "optimizer", tensors),
                "rng": encode(rng_state(), "rng", tensors)}
    require_finite(tensors.items(), f"training checkpoint of step {step} in {folder}",
                   "the training diverged: lower --lr (or raise --warmup, or clip gradients); the previous "
                   "checkpoint is kept")
    data = st_save(tensors)
    name = f"tensors-{step:08d}.safetensors"
    atomic_write_bytes(folder / name, data)
    manifest["tensors"], manifest["sha256"] = name, hashlib.sha256(data).hexdigest()
    path = SEAL.write(folder, manifest)
    for old in folder.glob("tensors-*.safetensors"):  # superseded only now that the manifest is in place
        if old.name != name:
            old.unlink(missing_ok=True)
    (folder / LEGACY).unlink(missing_ok=True)
    return path


def find_checkpoint(folder: Path | None) -> Path | None:
    """The manifest of the checkpoint in ``folder``, None if there is none.

    An old pickle checkpoint is refused rather than ignored, so a resume never silently
    restarts from step 0 — and it is never opened.
    """
    if folder is None:
        return None
    p = Path(folder) / MANIFEST
    if p.is_file():
        return p
    if (Path(folder) / LEGACY).exists():
        raise CheckpointError(f"{Path(folder) / LEGACY} is a pickle checkpoint of an older lowbit; lowbit no "
                              "longer reads pickles because loading one can run arbitrary code. Delete the "
                              f"folder {folder} (or pass --no-resume) to start over")
    return None


def check_checkpoint(path: Path, fingerprint: str, settings: dict) -> dict[str, Any]:
    """The manifest of a checkpoint a run may resume from: same curve settings, tensor file intact.

    Cheap next to any training (JSON and one hash), so a job calls it before its heavy
    work: a resume with other settings or a damaged checkpoint is refused at once.
    """
    path = Path(path)
    manifest = _read_manifest(path)
    if manifest.get("fingerprint") != fingerprint:
        diff = _diff(manifest.get("settings") or {}, _jsonable(settings))
        raise ConfigError(f"{path} was written by a run with different settings ({diff}); resume with the "
                          "same settings, or pass a new output folder / --no-resume to start over")
    _tensor_file(path.parent, manifest)
    return manifest


def load_checkpoint(path: Path, fingerprint: str, settings: dict) -> dict[str, Any]:
    """Read a checkpoint and refuse it if it was made with different curve settings."""
    path = Path(path)
    manifest = check_checkpoint(path, fingerprint, settings)
    tensors = _read_tensors(path.parent, manifest)
    where = str(path)
    payload = {"step": manifest["step"], "losses": manifest["losses"], "evals": manifest["evals"],
               **{k: decode(manifest.get(k), tensors, where) for k in ("params", "optimizer", "rng")}}
    params = payload["params"]
    ok = (isinstance(params, dict) and all(isinstance(t, torch.Tensor) for t in params.values())
          and isinstance(payload["optimizer"], dict) and isinstance(payload["rng"], dict))
    if not ok:
        raise CheckpointError(f"{path} lacks the parameters, optimizer or RNG state; delete the folder "
                              f"{path.parent} to start over")
    return payload


def _read_manifest(path: Path) -> dict[str, Any]:
    """Parse and sanity-check ``checkpoint.json`` (JSON only: nothing in it can execute)."""
    m = SEAL.read(path.parent)
    ok = (isinstance(m.get("step"), int) and m["step"] >= 0 and isinstance(m.get("losses"), list)
          and all(isinstance(v, (int, float)) for v in m["losses"]) and isinstance(m.get("evals"), list))
    if not ok:
        raise CheckpointError(f"{path} has a malformed step/losses/evals entry; delete the folder {path.parent} "
                              "to start over")
    return m


def _tensor_file(folder: Path, manifest: dict[str, Any]) -> Path:
    """The manifest's tensor file, checked against its sha256."""
    name = manifest.get("tensors")
    file_inside(folder, name, f"{folder / MANIFEST}")  # a name that is no plain file name: refused before use as a key
    return SEAL.check(folder, {name: manifest.get("sha256")})[name]


def _read_tensors(folder: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The manifest's tensor file, checked against its sha256 before safetensors parses it."""
    f = _tensor_file(folder, manifest)
    try:
        return st_load(f.read_bytes())
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {f} ({e}); delete the folder {folder} to start over") from None


def restore(payload: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Put the parameters, optimizer moments and RNG states of ``payload`` back in place."""
    params = dict(model.named_parameters())
    missing = [n for n in payload["params"] if n not in params]
    if missing:
        raise CheckpointError(f"checkpoint parameters {missing[:3]} are not in the model; "
                              "rebuild the model the checkpoint was trained from")
    bad = [n for n, t in payload["params"].items() if t.shape != params[n].shape]
    if bad:
        raise CheckpointError(f"checkpoint parameters {bad[:3]} have other shapes than the model's; rebuild the "
                              "model the checkpoint was trained from, or delete the checkpoint to start over")
    with torch.no_grad():
        for n, t in payload["params"].items():
            params[n].copy_(t.to(params[n].device))
    try:
        optimizer.load_state_dict(payload["optimizer"])
        set_rng_state(payload["rng"])
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"the checkpoint's optimizer/RNG state does not fit this run ({str(e)[:80]}); "
                              "delete the checkpoint folder to start over") from None


def _jsonable(d: dict) -> dict:
    """``d`` as it reads back from JSON (tuples become lists), so settings compare like for like."""
    return json.loads(json.dumps(d, sort_keys=True, default=str))


def _diff(old: dict, new: dict) -> str:
    keys = sorted(set(old) | set(new))
    parts = [f"{k}: checkpoint {old.get(k)!r} vs now {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
    return "; ".join(parts[:6]) or "unknown difference"
