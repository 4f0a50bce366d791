"""The streaming quantize job (``lowbit quantize --stream``): data-free RTN of a checkpoint bigger than memory.

Why a flag of ``quantize`` and not a command of its own: the user asks for the same thing
(this model, this scheme, a lowbit checkpoint at --out) and gets the same checkpoint the
in-model RTN path writes, byte for byte; only how the weights travel differs. The flags
that need the model in memory or calibration data (another method, --avg-bits, --awq,
--rotate, the perplexity passes) are refused by name with --stream, never ignored.

Everything that can be refused is refused before the first tensor is read: the source
folder (missing shards, an index naming tensors no shard holds, tensor types lowbit
cannot dequantize are found when each is reached, named), the plan (float weights left
unasked, experts, static input scales), the free disk space for the output (with the
numbers). See `lowbit.ptq.stream` for the engine.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowbit.api import outputs
from lowbit.configs import check_fields
from lowbit.errors import ConfigError, ModelError
from lowbit.io import check_free_space
from lowbit.models.accounting import keep_patterns
from lowbit.plans import kmix, source
from lowbit.plans.source import PlanSource


@dataclass(frozen=True)
class StreamJob:
    """One streamed, data-free RTN run from an HF folder of safetensors (float, FP8 or gpt-oss MXFP4) to --out.

    search: RTN's scale search on the weights alone (uniform importance); False = plain
    round-to-nearest. shard_mb: about how many MiB of output one shard (and the memory
    holding it before it is written) takes.
    """

    model: str | Path
    out: str | Path
    scheme: str | None = None
    plan_file: str | None = None
    lm_head: bool = False
    search: bool = True
    keep: tuple[str, ...] = ()
    shard_mb: float = 256
    force: bool = False
    progress: bool = True
    source: PlanSource = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "stream setting")
        object.__setattr__(self, "keep", keep_patterns(self.keep))
        object.__setattr__(self, "source", source.plan_source(self.scheme, self.plan_file, None, self.lm_head))
        if not self.shard_mb > 0:
            raise ConfigError(f"--shard-mb must be positive, got {self.shard_mb}")


def _folder(model: str | Path) -> Path:
    path = Path(model)
    if not (path.is_dir() and (path / "config.json").is_file()):
        raise ModelError(f"--stream reads a Hugging Face model folder (config.json and safetensors shards); {model} "
                         "is not one — download the model to a folder (huggingface-cli download), or drop --stream")
    return path


def stream_quantize(job: StreamJob) -> dict[str, Any]:
    """Run ``job``; returns the summary the CLI prints."""
    from lowbit.models.stream_source import StreamSource
    from lowbit.ptq import stream

    t0 = time.perf_counter()
    folder = _folder(job.model)
    settings = stream.StreamSettings(job.search, max(1, int(job.shard_mb * 2**20)), job.keep)
    with outputs.claim(job.out, job.force, [job.model, job.plan_file]) as out:
        src = StreamSource.open(folder)
        model = stream.skeleton(folder)
        plan = stream.make_plan(model, job.source, settings)
        lay = stream.layout(model, plan)
        parts = stream.plan_shards(lay.units, settings.shard_bytes)
        need = sum(u.nbytes for u in lay.units)
        check_free_space(out, need, "the quantized checkpoint")
        work = stream.work_folder(out)
        stream.open_work(work, stream.run_record(folder, src, plan, settings, parts))
        q = stream.Quantizer(lay, src)
        report = _reporter(job.progress)
        records = [r for _, r in stream.stream_shards(work, parts, q, report)]
        if not q.resumed:  # a resumed run read only the rest of the source
            _check_unused(folder, src)
        mix = source.mix_name(job.source)
        summary = _summary(lay, records, plan, mix, folder)
        meta = {"source": str(folder), "source_kind": "hf_folder (streamed)", "method": "rtn",
                "search": job.search, "plan": summary["scheme"], **kmix.mix_meta(mix),
                "matmul_weights": summary["matmul_weights"], "source_precision": summary["source_precision"]}
        stream.finish(out, work, folder, model, lay, records, parts, meta, force=True)
    summary |= {"out": str(out), "shards": len(parts), "output_bytes": _size(out),
                "seconds": round(time.perf_counter() - t0, 2),
                "evaluate": f"lowbit eval {out} (--stream builds no model, so it reports no perplexity)"}
    return summary


def _summary(lay: Any, records: list[dict[str, Any]], plan: Any, mix: str | None, folder: Path) -> dict[str, Any]:
    from lowbit.ptq import stream

    precision: dict[str, int] = {}
    fallbacks: dict[str, str] = {}
    for r in records:
        for k, v in r["precision"].items():
            precision[k] = precision.get(k, 0) + v
        fallbacks |= r["fallbacks"]
    out = {"model": str(folder), "method": "rtn (streamed)", "scheme": mix or plan.describe(),
           "matmul_weights": stream.accounting(lay, records), "source_precision": precision}
    if fallbacks:
        out["range_fallbacks"] = fallbacks
    return out


def _check_unused(folder: Path, src: Any) -> None:
    """Source matrices the model has no place for are an error (they would be dropped); other leftovers a warning."""
    import warnings

    left = src.unused()
    matrices = [n for n in left if len(src.entries[n].shape) >= 2]
    if matrices:
        raise ModelError(f"{folder}: the checkpoint holds {len(matrices)} matrices the model built from config.json "
                         f"has no place for ({matrices[0]}, ...); they would be dropped — check that config.json "
                         "belongs to these weights")
    if left:
        warnings.warn(f"{folder}: {len(left)} tensors of the checkpoint are not part of the model and are not written "
                      f"({left[0]}, ...)", stacklevel=2)


def _size(out: Path) -> int:
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file())


def _reporter(progress: bool):
    def report(line: str) -> None:
        if progress:
            print(line, file=sys.stderr, flush=True)
    return report
