"""The files lowbit's quantized models go to, registered with what each can hold.

Every target declares, from `LayerSpec`s alone (`lowbit.files.specs`: scheme, input
scheme, shape, online rotation), whether it can hold a plan, and the ones `lowbit export`
writes from a checkpoint say how. Asking the registry is how every job learns an export's
limits, at the earliest point it can: `lowbit export` checks the checkpoint's manifest
before reading a weight, and `lowbit quantize` checks its plan against every target
before tuning (a warning names each target that cannot hold it; with ``--export-to``
named, the run is refused instead).

| target | loaded by | holds | written by |
| --- | --- | --- | --- |
| ``native`` | lowbit | every layer lowbit quantizes | `lowbit quantize` (`lowbit.files.native`) |
| ``transformers`` | ``from_pretrained`` after ``import lowbit`` | what ``native`` holds (it reads that folder), quantized experts not yet | the same folder (`lowbit.files.hf_quantizer`) |
| ``compressed-tensors`` | vLLM, transformers | INT and FP weight recipes vLLM runs, their input schemes; quantized experts per expert (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral; one recipe per MoE layer; not gpt-oss) | `lowbit export --to compressed-tensors` |
| ``gguf`` | llama.cpp | weight-only schemes with an exact GGUF type (others with ``--allow-requant``); experts of the MoE architectures llama.cpp maps (`lowbit.files.gguf_moe`) | `lowbit export --to gguf` |

A new target is one entry here plus its writer module. This module stays light (no torch
at import): the command line reads the names for its ``--to`` / ``--export-to`` choices;
each target's check and writer import their module on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowbit.errors import LowbitError

if TYPE_CHECKING:
    from lowbit.files.specs import LayerSpec


# GGUF's embedding choices: token_embd / output in llama.cpp's types for the file's mix, or kept 16-bit
EMBEDDINGS = ("llama.cpp", "f16")


@dataclass(frozen=True)
class WriteRequest:
    """What a writer needs beyond the model: the checkpoint's metadata and the user's choices."""

    meta: Mapping[str, Any] = field(default_factory=dict)
    allow_requant: bool = False
    source_gguf: Path | None = None  # the GGUF the checkpoint came from (its tokenizer keys), when there is one
    mix: str | None = None  # the llama.cpp mix the plan followed (GGUF's general.file_type), read by plans.kmix
    embeddings: str | None = None  # GGUF: "llama.cpp" (its types for the file type, the default) or "f16"


@dataclass(frozen=True)
class Target:
    """One file format a quantized model can be kept in.

    check: raises the target's own refusal when it cannot hold these layers (of a
    ``model_type`` model; ``allow_requant`` where the target can re-quantize).
    write: (model, tokenizer, out, request) -> the summary of what was written; None for the
    targets `lowbit quantize` writes itself rather than `lowbit export`.
    ours: for a one-file target, whether the file at a path is one lowbit wrote in this
    format (the only file ``--force`` may replace); the format's own marker stays with its writer.
    """

    name: str
    loaded_by: str
    check: Callable[[list[LayerSpec], str | None, bool], None]
    write: Callable[[Any, Any, Path, WriteRequest], dict[str, Any]] | None = None
    file_output: bool = False  # one file rather than a folder
    requant: bool = False  # --allow-requant means something here
    source_tokenizer: bool = False  # takes its tokenizer keys from the GGUF the checkpoint came from, if any
    ours: Callable[[Path], bool] | None = None


def _holds_every_layer(specs: list[LayerSpec], model_type: str | None, allow_requant: bool) -> None:
    """Native checkpoints store every QuantLinear lowbit builds (weights, inputs, online rotations)."""


def _hf_check(specs: list[LayerSpec], model_type: str | None, allow_requant: bool) -> None:
    from lowbit.files.specs import refuse_experts

    refuse_experts(specs, "transformers' loader of lowbit checkpoints")


def _ct_check(specs: list[LayerSpec], model_type: str | None, allow_requant: bool) -> None:
    from lowbit.files import compressed_tensors

    compressed_tensors.check_specs(specs, model_type)


def _ct_write(model: Any, tokenizer: Any, out: Path, request: WriteRequest) -> dict[str, Any]:
    from lowbit.files import compressed_tensors

    compressed_tensors.export(model, tokenizer, out, force=True)
    return {"out": str(out)}


def _gguf_check(specs: list[LayerSpec], model_type: str | None, allow_requant: bool) -> None:
    from lowbit.files import gguf_export

    if model_type is not None:
        gguf_export.arch_for(model_type, moe=any(s.experts for s in specs))
    gguf_export.check_specs(specs, allow_requant)


def _gguf_write(model: Any, tokenizer: Any, out: Path, request: WriteRequest) -> dict[str, Any]:
    from lowbit.files import gguf_export

    meta = request.meta
    result = gguf_export.export(model, tokenizer, out, force=True, allow_requant=request.allow_requant,
                                source_gguf=request.source_gguf, name=str(meta.get("source") or "lowbit"),
                                file_type=gguf_export.FILE_TYPES.get(request.mix or "", 1),
                                embeddings=request.embeddings or "llama.cpp",
                                output_importance=gguf_export.recorded_importance(meta))
    result["tokenizer_from"] = str(request.source_gguf) if request.source_gguf else "checkpoint tokenizer"
    return result


def _gguf_ours(path: Path) -> bool:
    from lowbit.files import gguf_export

    return gguf_export.written_by_lowbit(path)


REGISTRY: dict[str, Target] = {t.name: t for t in (
    Target("native", "lowbit", _holds_every_layer),
    Target("transformers", "transformers (after import lowbit)", _hf_check),
    Target("compressed-tensors", "vLLM, transformers", _ct_check, _ct_write),
    Target("gguf", "llama.cpp", _gguf_check, _gguf_write, file_output=True, requant=True, source_tokenizer=True,
           ours=_gguf_ours),
)}
# the targets `lowbit export --to` writes from a checkpoint (and `lowbit quantize --export-to` can aim at)
TARGETS = tuple(name for name, t in REGISTRY.items() if t.write is not None)
REQUANT = tuple(name for name, t in REGISTRY.items() if t.requant)


FILE_TARGETS = tuple(name for name, t in REGISTRY.items() if t.file_output)


def written_by_lowbit(path: Path) -> str | None:
    """The one-file target whose file lowbit wrote at ``path`` (its marker says so), or None."""
    return next((t.name for t in REGISTRY.values() if t.ours is not None and t.ours(Path(path))), None)


def get(name: str) -> Target:
    if name not in REGISTRY:
        raise ValueError(f"unknown export target {name!r}; one of {TARGETS}")
    return REGISTRY[name]


def check(to: str, specs: list[LayerSpec], model_type: str | None = None, allow_requant: bool = False) -> None:
    """Raise the target's own refusal when ``to`` cannot hold these layers (of a ``model_type`` model)."""
    get(to).check(specs, model_type, allow_requant)


def refusals(specs: list[LayerSpec], model_type: str | None = None) -> dict[str, str]:
    """target -> why it cannot hold these layers, for every target that cannot (none: every one can)."""
    out = {}
    for name, target in REGISTRY.items():
        try:
            target.check(specs, model_type, False)
        except LowbitError as e:
            out[name] = str(e)
    return out


def vllm_notes(specs: list[LayerSpec]) -> list[str]:
    """What keeps vLLM from loading a compressed-tensors file transformers does load (fused parts' recipes)."""
    from lowbit.files import compressed_tensors

    return compressed_tensors.vllm_fused_notes(specs)
