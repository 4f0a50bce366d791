"""The export job: a native checkpoint to compressed-tensors (vLLM) or GGUF (llama.cpp)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowbit.api import outputs
from lowbit.configs import check_fields
from lowbit.errors import ConfigError
from lowbit.files import targets
from lowbit.io import check_free_space

TARGETS = targets.TARGETS  # what `lowbit export --to` writes: the registry's targets with a writer
EMBEDDINGS = targets.EMBEDDINGS


@dataclass(frozen=True)
class ExportJob:
    """checkpoint: a folder `lowbit quantize` wrote. out: a folder (compressed-tensors) or a .gguf file."""

    checkpoint: str | Path
    to: str
    out: str | Path
    force: bool = False
    allow_requant: bool = False
    embeddings: str | None = None  # GGUF only: "llama.cpp" (default: the mix's types) or "f16"
    drop_kv: bool = False  # GGUF only: write the weights of a checkpoint with a KV-cache scheme, without it

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "export setting")
        if self.to not in TARGETS:
            raise ConfigError(f"unknown export target {self.to!r}; choose one of {TARGETS}")
        if self.allow_requant and not targets.get(self.to).requant:
            raise ConfigError(f"--allow-requant applies to --to {' / '.join(targets.REQUANT)} only; {self.to} exports "
                              "are always exact")
        if self.embeddings is not None and self.to != "gguf":
            raise ConfigError(f"--embeddings applies to --to gguf only; {self.to} exports keep the embeddings "
                              "16-bit")
        if self.drop_kv and self.to != "gguf":
            raise ConfigError(f"--drop-kv applies to --to gguf only (GGUF has no KV-cache format); {self.to} "
                              "exports keep the checkpoint's KV scheme where they can hold it")
        if self.embeddings not in (None, *EMBEDDINGS):
            raise ConfigError(f"--embeddings {self.embeddings!r}: choose one of {', '.join(EMBEDDINGS)}")


def export(job: ExportJob) -> dict[str, Any]:
    from lowbit.files import specs
    from lowbit.files.inspect import inspect
    from lowbit.files.native import load, read_manifest

    t0 = time.perf_counter()
    target = targets.get(job.to)
    manifest = read_manifest(job.checkpoint)
    # the target's limits, from the manifest alone: a plan it cannot hold is refused before any loading
    target.check(specs.from_manifest(manifest), _model_type(job.checkpoint), job.allow_requant)
    kv = _check_kv(job, manifest)
    with outputs.claim(job.out, job.force, [job.checkpoint], file_output=target.file_output) as out:
        # both formats hold the same packed weights as the checkpoint, give or take the scale encoding
        size = sum(f.stat().st_size for f in Path(job.checkpoint).iterdir() if f.is_file())
        check_free_space(out, size + (1 << 20), f"the {job.to} export")
        model, tokenizer = load(job.checkpoint)
        if kv is not None and job.drop_kv:
            from lowbit.nn.kv_quant import remove_kv

            remove_kv(model)
        from lowbit.plans.kmix import mix_of

        meta = manifest.get("meta", {})
        request = targets.WriteRequest(meta, job.allow_requant,
                                       _source_gguf(manifest) if target.source_tokenizer else None, mix_of(meta),
                                       job.embeddings)
        result: dict[str, Any] = {"checkpoint": str(job.checkpoint), "to": job.to}
        result |= target.write(model, tokenizer, out, request)
        if kv is not None:
            result["kv_cache"] = (f"dropped: the file holds the weights only, not the KV scheme {kv.name}" if job.drop_kv
                                  else f"{kv.name} (kv_cache_scheme, k_scale / v_scale)")
    info = inspect(out)
    # the same definition as quantize and inspect, measured on the exported file, whose format may store
    # wider scales or pad differently: the checkpoint's own figure beside it says which
    result |= {"bits_per_weight": info["bits_per_weight"],
               "bits_counted": f"{info['bits_counted']}; in the exported file",
               "bits_per_weight_checkpoint": _checkpoint_bits(job.checkpoint)}
    result |= {k: info[k] for k in ("file_bytes", "fp16_bytes", "size_vs_fp16")}
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def _check_kv(job: ExportJob, manifest: dict) -> Any:
    """The checkpoint's KV scheme (None without one), refused now where the target cannot hold it."""
    from lowbit.errors import CheckpointError, SchemeError
    from lowbit.files.kv_export import kv_refusal
    from lowbit.formats.kv import KVScheme

    entry = manifest.get("kv_cache")
    if entry is None:
        if job.drop_kv:
            raise ConfigError(f"--drop-kv: {job.checkpoint} has no KV-cache scheme to drop; drop the flag")
        return None
    try:
        kv = KVScheme.from_dict(dict(entry["scheme"]))
    except (SchemeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{job.checkpoint}: its kv_cache entry cannot be read ({e}); re-create the "
                              "checkpoint") from None
    why = kv_refusal(job.to, kv, job.drop_kv, mixed="per_layer" in entry)
    if why is not None:
        raise ConfigError(f"--to {job.to}: {why}")
    return kv


def _model_type(checkpoint: str | Path) -> str | None:
    """``model_type`` from the checkpoint's config.json (None when it cannot be read: loading will say why)."""
    try:
        kind = json.loads((Path(checkpoint) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def _checkpoint_bits(folder: str | Path) -> float:
    from lowbit.files.inspect import inspect

    return inspect(folder)["bits_per_weight"]


def _source_gguf(manifest: dict) -> Path | None:
    """The GGUF the checkpoint was made from, whose tokenizer keys llama.cpp knows exactly."""
    from lowbit.models.loading import BUNDLED_NAME, bundled_gguf

    meta = manifest.get("meta", {})
    source = meta.get("source")
    if source == BUNDLED_NAME or meta.get("source_kind") == "bundled":
        return bundled_gguf()
    if isinstance(source, str) and source.endswith(".gguf") and Path(source).is_file():
        return Path(source)
    return None
