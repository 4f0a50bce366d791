"""A GGUF file as a streaming source: each tensor dequantized on its own by gguf-py, under the model's names.

Users arrive with llama.cpp files (Q4_K_M, Q8_0, ...) and want them requantized without a
float copy of the whole model. The in-model path converts a GGUF through transformers'
loader (the whole model in float); `lowbit quantize FILE.gguf --stream` instead reads one
tensor at a time through this source, which gives `lowbit.ptq.stream` what the safetensors
source (`lowbit.models.stream_source.StreamSource`) gives it:

* names: the model is built on the meta device from the file's config (transformers' own
  reading of the metadata, with llama.cpp's head size: `lowbit.files.gguf_read.restored_config`),
  and each of its tensors is found under the GGUF name lowbit's GGUF writer gives it
  (`lowbit.files.gguf_export`'s name map, the same table llama.cpp's converter uses);
* values: gguf-py's ``quants.dequantize`` of the tensor's blocks (every type it knows), as
  float32, then what the writer did undone: llama's q/k rows back from llama.cpp's interleaved
  rotary order, Gemma's ``1 + w`` norms back to ``w`` (transformers' GGUF loader does the same);
* the source precision of every tensor (``gguf Q4_1``, ``gguf F32``, ...) for the output's
  metadata.

The values are the ones transformers' loader gives the in-model path (the same dequantization,
the same row order), so a streamed requantization writes the same codes as quantizing the
loaded GGUF (tests/test_gguf_source.py). Mixture-of-experts files are refused by name (their
expert layouts are `lowbit.files.gguf_moe_read`'s, not streamed yet). Every tensor is read
whole: an 8B file's embedding table is one float32 tensor while it is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowbit.errors import ModelError
from lowbit.files import gguf_export as ge
from lowbit.files import gguf_moe_read
from lowbit.files.gguf_read import open_gguf, restored_config
from lowbit.files.safetensors_stream import Entry
from lowbit.formats.finite import require_finite
from lowbit.models.stream_source import skeleton_of


@dataclass
class GgufSource:
    """The tensors of one GGUF file by the model's names (metadata parsed once, each tensor read when asked)."""

    folder: Path  # the .gguf file (named so for the messages the safetensors source shares)
    entries: dict[str, Entry]
    reader: Any = field(repr=False)
    config: Any = field(repr=False)
    gguf_names: dict[str, str] = field(default_factory=dict)  # model name -> GGUF tensor name
    used: set[str] = field(default_factory=set)
    precision: dict[str, str] = field(default_factory=dict)
    kind = "gguf (streamed)"

    @classmethod
    def open(cls, path: Path) -> GgufSource:
        """The file checked whole (`open_gguf`), its config and every tensor's model name; MoE files refused."""
        path = Path(path)
        reader = open_gguf(path, ModelError)
        if gguf_moe_read.is_moe_file(reader):
            raise ModelError(f"{path} is a mixture-of-experts GGUF; --stream does not read those yet: drop --stream "
                             "(lowbit loads it with its own reader) or convert it to safetensors first")
        config = restored_config(path, reader)
        arch = ge.arch_of(config)
        names = ge._tensor_name_map(arch, config)
        tensors = {t.name: t for t in reader.tensors}
        model = skeleton_of(config)
        gguf_names: dict[str, str] = {}
        for key in model.state_dict():
            g = names.get_name(key, try_suffixes=(".weight", ".bias"))  # the name lowbit's GGUF writer gives it
            if g in tensors:
                gguf_names[key] = g
        entries = {k: _entry(path, tensors[g]) for k, g in gguf_names.items()}
        mapped = set(gguf_names.values())
        entries |= {g: _entry(path, t) for g, t in tensors.items() if g not in mapped}
        return cls(path, entries, reader, config, gguf_names)

    # the interface `lowbit.ptq.stream` and `lowbit.api.stream` use (see StreamSource)
    gguf_path = property(lambda self: self.folder)
    folder_for_files = property(lambda self: None)

    def skeleton(self) -> nn.Module:
        return skeleton_of(self.config)

    def tokenizer(self) -> Any:
        """transformers' tokenizer of the file (the in-model path's), saved into a native checkpoint."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.folder.parent, gguf_file=self.folder.name)

    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    @property
    def _index(self) -> dict[str, int]:
        if "_by_name" not in self.__dict__:
            self.__dict__["_by_name"] = {t.name: i for i, t in enumerate(self.reader.tensors)}
        return self.__dict__["_by_name"]

    def has(self, name: str) -> bool:
        return name in self.gguf_names

    def unused(self) -> list[str]:
        return [n for n in self.entries if n not in self.used]

    def chunks(self, name: str, elements: int) -> None:
        return None  # tensors are dequantized whole

    def tensor(self, name: str) -> torch.Tensor:
        """Model tensor ``name`` as float32: dequantized, q/k rows and Gemma norms as the model has them."""
        g = self.gguf_names.get(name)
        if g is None:
            raise ModelError(f"{self.folder}: the file has no tensor for {name!r}; it does not match its own "
                             "metadata — re-download or re-export it")
        w, qtype = self._tensor(g)
        self.used.add(name)
        self.precision[name] = f"gguf {qtype}"
        arch = ge.arch_of(self.config)
        w = gguf_moe_read.rope_rows_back(w, name, self.config, arch)
        if arch.norm_shift and name.endswith("norm.weight"):
            w = w - arch.norm_shift
        require_finite([(name, w)], f"model {self.folder}", "lowbit quantizes finite weights only: repair the model "
                       "or re-export it from a good copy", ModelError)
        return w

    def rows(self, name: str, i: int) -> torch.Tensor:
        return self.tensor(name)[i]

    def expert(self, *args: Any) -> torch.Tensor:
        raise ModelError(f"{self.folder}: --stream does not read experts from GGUF files")

    def _tensor(self, gname: str) -> tuple[torch.Tensor, str]:
        t = self.reader.tensors[self._index[gname]]
        return gguf_moe_read.dequantized(t, str(self.folder)), t.tensor_type.name


def _entry(path: Path, t: Any) -> Entry:
    """A GGUF tensor as the stream's `Entry`: its dtype is ``gguf:TYPE`` (never read as plain float pieces)."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return Entry(path, f"gguf:{t.tensor_type.name}", shape, int(t.data_offset), int(t.n_bytes))
