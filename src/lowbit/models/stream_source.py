"""A safetensors checkpoint read tensor by tensor under the model's own names, dequantized when quantized.

The streaming quantizer (`lowbit.ptq.stream`) never builds the model with its weights: it
builds the skeleton on the meta device (names, shapes, which tensors are matmul weights)
and asks this module for one tensor, or one expert's matrix, at a time. Two things stand
between the model's names and the files:

* transformers 5 saves fused experts per expert (``mlp.experts.{e}.gate_proj.weight``,
  ``up_proj``, ``down_proj``; Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``) and fuses
  them on load into ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``; gpt-oss
  keeps them fused (``[E, H, 2I]``, transposed). `expert` returns expert ``e``'s ``[out, in]``
  matrix from whichever layout the file has, reading only that expert's bytes;
* quantized sources (FP8 with its scales, gpt-oss MXFP4 ``_blocks`` / ``_scales``) are
  dequantized on the fly (`lowbit.models.source_dequant`), and each tensor's source precision
  is recorded (`precision`).

Every source tensor read is marked, so the caller can refuse a source holding tensors the
model has no place for (`unused`): nothing in the file is silently dropped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowbit.errors import ModelError
from lowbit.files.safetensors_stream import DTYPES, Entry, read_header, read_tensor
from lowbit.formats.finite import require_finite
from lowbit.models import source_dequant as dq
from lowbit.models.experts import ExpertTensor
from lowbit.models.hf_folder import INDEX, weight_files
from lowbit.models.source_dequant import FP8_DTYPES

_FP8_SCALES = ("weight_scale_inv", "weight_scale")
_IGNORED = ("input_scale", "input_global_scale")  # static activation scales: the requantized model picks its own
_EXPERT_PARTS = {  # fused param -> (per-expert module names on disk, in the order they are stacked)
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "down_proj": (("down_proj",), ("w2",)),
}


@dataclass
class StreamSource:
    """The tensors of an HF folder's safetensors files, by name (headers only until a tensor is read)."""

    folder: Path
    entries: dict[str, Entry]
    used: set[str] = field(default_factory=set)
    precision: dict[str, str] = field(default_factory=dict)  # model tensor -> its source precision

    @classmethod
    def open(cls, folder: Path) -> StreamSource:
        """Every shard's header read and checked against the index; a missing shard or tensor is one error."""
        folder = Path(folder)
        entries: dict[str, Entry] = {}
        for name in weight_files(folder):  # refuses an index naming a file that is not there
            got, _ = read_header(folder / name)
            entries.update(got)
        _check_index(folder, entries)
        return cls(folder, entries)

    kind = "hf_folder (streamed)"
    gguf_path: Path | None = None  # a GGUF source's file (`lowbit.models.gguf_source`)

    @property
    def folder_for_files(self) -> Path:
        """Where the tokenizer files a checkpoint copies are."""
        return self.folder

    def skeleton(self) -> nn.Module:
        """The model of config.json with every parameter on the meta device (buffers real)."""
        from lowbit.models.hf_folder import read_config

        return skeleton_of(read_config(self.folder))

    def tokenizer(self) -> Any:
        """The folder's tokenizer (None when it has none)."""
        from lowbit.files.native import tokenizer_files

        if not tokenizer_files(self.folder):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.folder)

    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def has(self, name: str) -> bool:
        return name in self.entries or f"{name}_blocks" in self.entries or f"{name}_packed" in self.entries

    def unused(self) -> list[str]:
        return [n for n in self.entries if n not in self.used and not n.endswith(_IGNORED)]

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as float32 (integers as stored), FP8, MXFP4 and compressed-tensors sources dequantized;
        NaN / inf refused by name (the in-model path refuses them when it loads the model)."""
        return self._finite(name, self._tensor(name))

    def rows(self, name: str, i: int) -> torch.Tensor:
        """``tensor(name)[i]`` reading only that slice (fused experts: one expert)."""
        return self._finite(f"{name}[{i}]", self._rows(name, i))

    def chunks(self, name: str, elements: int) -> Iterator[torch.Tensor] | None:
        """A plain float tensor as float32 pieces of about ``elements`` values, each read on its own (whole rows);
        None when ``name`` is not one (dequantized or integer tensors are read whole by `tensor`)."""
        e = self.entries.get(name)
        if e is None or e.dtype not in ("F32", "F16", "BF16") or not e.shape:
            return None
        self.used.add(name)
        self.precision[name] = str(DTYPES[e.dtype]).removeprefix("torch.")
        row = e.numel // e.shape[0] if e.shape[0] else 1
        step = max(1, elements // max(row, 1))
        per = e.nbytes // e.shape[0] if e.shape[0] else 0

        def pieces() -> Iterator[torch.Tensor]:
            for a in range(0, e.shape[0], step):
                n = min(step, e.shape[0] - a)
                t = read_tensor(Entry(e.file, e.dtype, (n, *e.shape[1:]), e.start + a * per, n * per)).float()
                yield self._finite(f"{name}[{a}:{a + n}]", t)
        return pieces()

    def _finite(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            require_finite([(name, t)], f"model {self.folder}", "lowbit quantizes finite weights only: repair the "
                           "model or re-export it from a good copy", ModelError)
        return t

    def _tensor(self, name: str) -> torch.Tensor:
        if name not in self.entries and name.endswith(".weight") and f"{name}_packed" in self.entries:
            return self._compressed(name)
        if name not in self.entries and f"{name}_blocks" in self.entries:
            blocks, scales = self._raw(f"{name}_blocks"), self._raw(f"{name}_scales")
            self.precision[name] = "mxfp4"
            return dq.mxfp4(blocks, scales, name)
        return self._float(name, self._raw(name))

    def _rows(self, name: str, i: int) -> torch.Tensor:
        if name not in self.entries and f"{name}_blocks" in self.entries:
            self.precision[name] = "mxfp4"
            return dq.mxfp4(self._slice(f"{name}_blocks", i), self._slice(f"{name}_scales", i), name)
        return self._float(name, self._slice(name, i))

    def expert(self, t: ExpertTensor, e: int, model_type: str | None) -> torch.Tensor:
        """Expert ``e``'s float32 ``[out, in]`` matrix of the fused experts tensor ``t``."""
        fused = f"{t.module}.{t.param}"
        if self.has(fused):
            m = self.rows(fused, e)
            self.precision[t.name] = self.precision[fused]
            return m.T if t.transposed and f"{fused}_blocks" not in self.entries else m  # MXFP4 blocks are [out, in]
        for module, parts in _expert_layouts(t, model_type):
            keys = [f"{module}.{e}.{p}.weight" for p in parts]
            if all(k in self.entries for k in keys):
                m = torch.cat([self.tensor(k) for k in keys], dim=0)
                self.precision[t.name] = self.precision[keys[0]]
                return m
        raise ModelError(f"{self.folder}: the checkpoint holds neither {fused} nor its experts one by one "
                         f"({t.module}.{e}.{_EXPERT_PARTS.get(t.param, (('?',),))[0][0]}.weight); it does not match "
                         "its config.json — re-download or re-save the model")

    def _compressed(self, name: str) -> torch.Tensor:
        """A compressed-tensors ``weight_packed`` layer: INT (int32 bit stream) or FP4 (uint8 nibbles)."""
        packed, scale = self._raw(f"{name}_packed"), self._raw(f"{name}_scale")
        opt = {k: self._raw(f"{name}_{k}") if f"{name}_{k}" in self.entries else None
               for k in ("zero_point", "global_scale", "shape")}
        if opt["shape"] is not None:
            shape = (int(opt["shape"][0]), int(opt["shape"][1]))
        else:  # FP4 layouts store no shape: two codes a byte
            shape = (packed.shape[0], packed.shape[1] * 2)
        if packed.dtype == torch.int32:
            self.precision[name] = f"compressed-tensors int{packed.shape[1] * 32 // shape[1]}"
            return dq.ct_int(packed, scale, opt["zero_point"], shape, name)
        if packed.dtype == torch.uint8:
            self.precision[name] = "compressed-tensors " + ("mxfp4" if scale.dtype == torch.uint8 else "nvfp4")
            return dq.ct_fp4(packed, scale, opt["global_scale"], shape[1], name)
        raise ModelError(f"{self.folder}: {name}_packed is {packed.dtype}, a compressed-tensors layout lowbit cannot "
                         "dequantize (it reads int32 pack-quantized INT and uint8 NVFP4 / MXFP4)")

    def _raw(self, name: str) -> torch.Tensor:
        e = self._entry(name)
        self.used.add(name)
        return read_tensor(e)

    def _slice(self, name: str, i: int) -> torch.Tensor:
        e = self._entry(name)
        self.used.add(name)
        if not e.shape or not 0 <= i < e.shape[0]:
            raise ModelError(f"{self.folder}: tensor {name} {list(e.shape)} has no row {i}")
        per = e.nbytes // e.shape[0]
        return read_tensor(Entry(e.file, e.dtype, e.shape[1:], e.start + i * per, per))

    def _entry(self, name: str) -> Entry:
        if name not in self.entries:
            raise ModelError(f"{self.folder}: the checkpoint has no tensor {name!r}{_near(self.entries, name)}; it does "
                             "not match its config.json — re-download or re-save the model")
        return self.entries[name]

    def _float(self, name: str, t: torch.Tensor) -> torch.Tensor:
        prefix = name.rpartition(".")[0]
        if t.dtype in FP8_DTYPES:
            scale = next((f"{prefix}.{s}" for s in _FP8_SCALES if f"{prefix}.{s}" in self.entries), None)
            if scale is None:
                raise ModelError(f"{self.folder}: {name} is stored as {t.dtype} without a weight_scale or "
                                 "weight_scale_inv beside it; lowbit cannot dequantize it")
            s = self._raw(scale)
            block = "per block" if s.dim() == 2 and s.shape[1] > 1 else "per channel" if s.numel() > 1 else "per tensor"
            self.precision[name] = f"fp8 {str(t.dtype).removeprefix('torch.')} {block}"
            return dq.fp8(t, s, name)
        if t.is_floating_point():
            self.precision[name] = str(t.dtype).removeprefix("torch.")
            return t.float()
        if name.endswith(".weight"):
            raise ModelError(f"{self.folder}: {name} is stored as {t.dtype}, a quantized layout lowbit cannot "
                             "dequantize here (it reads float, FP8 with weight_scale / weight_scale_inv, and gpt-oss "
                             "MXFP4); dequantize it to bf16 first")
        return t


def skeleton_of(config: Any) -> nn.Module:
    """The model of ``config`` with every parameter on the meta device (buffers real); a quantized source's
    ``quantization_config`` dropped (the skeleton is the float model)."""
    from transformers import AutoModelForCausalLM

    from lowbit.models.hf_folder import quiet
    from lowbit.nn.meta import params_on_meta

    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with params_on_meta(), quiet():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _expert_layouts(t: ExpertTensor, model_type: str | None) -> list[tuple[str, tuple[str, ...]]]:
    """Where expert matrices live on disk: (module prefix, part names stacked along out) per known layout."""
    qwen, mixtral = _EXPERT_PARTS.get(t.param, ((), ()))
    out = [(t.module, qwen)]
    if model_type == "mixtral" or ".block_sparse_moe." in t.module:
        out.append((t.module.replace(".mlp.", ".block_sparse_moe."), mixtral))
    return out


def model_key(source: StreamSource, name: str, model_type: str | None) -> str | None:
    """The source name of model tensor ``name`` (Mixtral's ``block_sparse_moe`` for ``mlp``), or None."""
    for cand in (name, name.replace(".mlp.", ".block_sparse_moe.") if model_type == "mixtral" else None):
        if cand is not None and source.has(cand):
            return cand
    return None


def _near(entries: dict[str, Entry], name: str) -> str:
    prefix = name.rpartition(".")[0] + "."
    near = sorted(n for n in entries if n.startswith(prefix))[:3]
    return f" (it has {', '.join(near)})" if near else ""


def _check_index(folder: Path, entries: dict[str, Entry]) -> None:
    """Every tensor the index names must be in the shard it names (a truncated download lists more than it has)."""
    index = folder / INDEX
    if not index.is_file():
        return
    from lowbit.io import read_json

    weight_map = read_json(index, ModelError, "re-download or re-save the model").get("weight_map", {})
    for name, file in weight_map.items():
        e = entries.get(name)
        if e is None or e.file.name != file:
            where = f"it is in {e.file.name}" if e is not None else "no shard holds it"
            raise ModelError(f"{index} names tensor {name!r} in {file}, but {where}; the download is incomplete or "
                             "the index is stale — re-download the model")
