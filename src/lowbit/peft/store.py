"""Save an adapter set on its own and load it back onto the base it was trained for.

Folder layout: ``adapter.safetensors`` (every adapter's tensors, ``<layer>.<tensor>``)
and ``adapter.json`` (format, kind, PeftConfig, per-layer constructor config, base
fingerprint, sha256 of the tensor file). The fingerprint is a sha256 over each target
layer's quantized codes/scales/zeros, so loading onto a different base (another scheme,
another model, a re-quantized checkpoint) fails with a clear message instead of
silently adding a correction meant for other weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lowbit.errors import CheckpointError
from lowbit.files.sealed import Seal, digests
from lowbit.formats.finite import require_finite
from lowbit.io import atomic_dir
from lowbit.models.layers import weight_digest
from lowbit.peft.apply import CLASSES, PeftConfig, adapters_of, attach, freeze_base

FORMAT = "lowbit-adapter"
VERSION = 1
MANIFEST = "adapter.json"
TENSORS = "adapter.safetensors"
SEAL = Seal("adapter folder", MANIFEST, FORMAT, VERSION, fix="re-create the adapter folder",
            origin="pass a folder written by `lowbit finetune --out`")


def fingerprint(model: nn.Module, names: list[str]) -> str:
    """sha256 over the named layers' base weights (quantized buffers, or float weights)."""
    return weight_digest(model, names)


def save_adapters(model: nn.Module, out: str | Path, cfg: PeftConfig, meta: dict | None = None,
                  force: bool = False) -> Path:
    """Write only the adapters (a few MB) with the base's fingerprint, atomically."""
    adapters = adapters_of(model)
    if not adapters:
        raise CheckpointError("the model has no lowbit adapters to save; apply adapters first")
    if any(a.merged for a in adapters.values()):
        raise CheckpointError("adapters are merged into the base; unmerge before saving them on their own")
    tensors = {f"{n}.{k}": t.detach().contiguous().cpu() for n, a in adapters.items() for k, t in a.state_dict().items()}
    require_finite(tensors.items(), f"cannot write the adapters to {out}", "nothing was written: the training "
                   "diverged; lower --lr (or raise --warmup)")
    manifest: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "kind": cfg.adapter, "config": cfg.to_dict(),
        "layers": {n: a.config() for n, a in adapters.items()},
        "base_fingerprint": fingerprint(model, list(adapters)), "meta": meta or {},
    }
    with atomic_dir(Path(out), force=force, kind="lowbit adapter") as tmp:
        save_file(tensors, str(tmp / TENSORS))
        manifest["sha256"] = digests(tmp, [TENSORS])[TENSORS]
        SEAL.write(tmp, manifest, indent=1)
    return Path(out)


def read_adapter_manifest(path: str | Path) -> dict:
    """``adapter.json``, checked for the entries `load_adapters` relies on (JSON only)."""
    m = SEAL.read(path)
    f = Path(path) / MANIFEST
    if not isinstance(m.get("sha256"), str):
        raise CheckpointError(f"{f} has no sha256 of {TENSORS}, so the adapter weights cannot be verified; "
                              "re-create the adapter folder")
    if m.get("kind") not in CLASSES or not isinstance(m.get("layers"), dict) or not isinstance(m.get("config"), dict):
        raise CheckpointError(f"{f} has a malformed kind/layers/config entry (kind must be one of "
                              f"{sorted(CLASSES)}); re-create the adapter folder")
    return m


def verify_adapters(path: str | Path, manifest: dict) -> Path:
    """The adapter tensor file (always ``adapter.safetensors``, inside the folder), checked against its sha256."""
    return SEAL.check(path, {TENSORS: manifest["sha256"]})[TENSORS]


def load_adapters(model: nn.Module, path: str | Path, check_base: bool = True) -> PeftConfig:
    """Attach the saved adapters to ``model``; the base fingerprint must match."""
    path = Path(path)
    m = read_adapter_manifest(path)
    weights = verify_adapters(path, m)
    names = list(m["layers"])
    missing = [n for n in names if not _has(model, n)]
    if missing:
        raise CheckpointError(f"the model lacks adapter layers {missing[:3]}; load the base it was trained on")
    if check_base and fingerprint(model, names) != m["base_fingerprint"]:
        raise CheckpointError(f"adapter {path} was trained on a different base (fingerprint mismatch); load it "
                              "onto the quantized checkpoint it was made for")
    tensors = load_file(str(weights))
    cls = CLASSES[m["kind"]]
    for name, conf in m["layers"].items():
        state = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        adapter = _construct(cls, conf, state)
        adapter.load_state_dict(state)
        layer = model.get_submodule(name)
        attach(layer, adapter.to(layer.weight.device))
    freeze_base(model)
    return PeftConfig.from_dict(m["config"])


def _construct(cls: type, conf: dict, state: dict[str, torch.Tensor]):
    if cls.kind == "qwha":
        return cls(conf["out_features"], conf["in_features"], state["rows"], state["cols"],
                   scale=conf["scale"], path=conf["path"])
    return cls(**conf)


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False

