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
    export_to: str | None = None  # None / native / transformers: lowbit's checkpoint; compressed-tensors; gguf
    source: PlanSource = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from lowbit.ptq.stream_exports import EXPORTS

        check_fields(self, ConfigError, "stream setting")
        object.__setattr__(self, "keep", keep_patterns(self.keep))
        object.__setattr__(self, "source", source.plan_source(self.scheme, self.plan_file, None, self.lm_head))
        if not self.shard_mb > 0:
            raise ConfigError(f"--shard-mb must be positive, got {self.shard_mb}")
        if self.export_to not in (None, *EXPORTS):
            raise ConfigError(f"--export-to {self.export_to!r}: --stream writes one of {', '.join(EXPORTS)}")

    @property
    def export(self) -> str:
        return "native" if self.export_to in (None, "transformers") else self.export_to


def _folder(model: str | Path) -> Path:
    path = Path(model)
    if not (path.is_dir() and (path / "config.json").is_file()):
        raise ModelError(f"--stream reads a Hugging Face model folder (config.json and safetensors shards); {model} "
                         "is not one — download the model to a folder (huggingface-cli download), or drop --stream")
    return path


def stream_quantize(job: StreamJob) -> dict[str, Any]:
    """Run ``job``; returns the summary the CLI prints."""
    from lowbit.ptq import stream
    from lowbit.ptq import stream_exports as ex

    t0 = time.perf_counter()
    src, folder = _source(job.model)
    settings = stream.StreamSettings(job.search, max(1, int(job.shard_mb * 2**20)), job.keep)
    with outputs.claim(job.out, job.force, [job.model, job.plan_file], file_output=job.export == ex.GGUF) as out:
        model = src.skeleton()
        plan = stream.make_plan(model, job.source, settings)
        lay = stream.layout(model, plan)
        ex.check(job.export, lay)
        need = sum(u.nbytes for u in lay.units)
        check_free_space(out, need, f"the quantized {'checkpoint' if job.export == ex.NATIVE else job.export + ' file'}")
        report = _reporter(job.progress)
        mix = source.mix_name(job.source)
        if job.export == ex.GGUF:
            q = stream.Quantizer(lay, src)
            tok = src.tokenizer() if src.gguf_path is None else None  # a GGUF source's keys are copied as they are
            written = ex.write_gguf(out, q, mix, str(folder), tok, src.gguf_path, job.force, report)
            _check_unused(src)
            records = [{"layers": {u.name: {} for u in lay.units if u.kind == "linear"},
                        "precision": stream._precision([u.name for u in lay.units], q), "fallbacks": q.fallbacks}]
            summary = _summary(lay, records, plan, mix, folder) | {"gguf": written}
            parts: list = []
        else:
            parts = stream.plan_shards(lay.units, settings.shard_bytes)
            work = stream.work_folder(out)
            stream.open_work(work, stream.run_record(folder, src, plan, settings, parts, job.export))
            q = (ex.CTQuantizer if job.export == ex.CT else stream.Quantizer)(lay, src)
            records = [r for _, r in stream.stream_shards(work, parts, q, report)]
            if not q.resumed:  # a resumed run read only the rest of the source
                _check_unused(src)
            summary = _summary(lay, records, plan, mix, folder)
            if job.export == ex.CT:
                ex.finish_ct(out, work, src.folder_for_files, lay, records, parts, force=True)
            else:
                meta = {"source": str(folder), "source_kind": src.kind, "method": "rtn",
                        "search": job.search, "plan": summary["scheme"], **kmix.mix_meta(mix),
                        "matmul_weights": summary["matmul_weights"],
                        "source_precision": summary["source_precision"]}
                stream.finish(out, work, src.folder_for_files, model, lay, records, parts, meta, force=True,
                              tokenizer=src.tokenizer() if src.gguf_path is not None else None)
    summary |= {"out": str(out), "export": job.export, "shards": len(parts), "output_bytes": _size(out),
                "seconds": round(time.perf_counter() - t0, 2),
                "evaluate": f"lowbit eval {out} (--stream builds no model, so it reports no perplexity)"}
    return summary


def _source(model: str | Path) -> tuple[Any, Path]:
    """The tensor source of MODEL: an HF folder of safetensors, or a .gguf file (dequantized per tensor)."""
    from lowbit.models.stream_source import StreamSource

    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        from lowbit.models.gguf_source import GgufSource

        src = GgufSource.open(path)
        return src, path
    folder = _folder(model)
    return StreamSource.open(folder), folder


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


def _check_unused(src: Any) -> None:
    """Source matrices the model has no place for are an error (they would be dropped); other leftovers a warning."""
    import warnings

    folder = src.folder
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
    return out.stat().st_size if out.is_file() else sum(p.stat().st_size for p in out.iterdir() if p.is_file())


def _reporter(progress: bool):
    def report(line: str) -> None:
        if progress:
            print(line, file=sys.stderr, flush=True)
    return report
