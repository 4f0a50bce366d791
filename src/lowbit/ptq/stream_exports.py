"""The streaming quantizer's other outputs: compressed-tensors shard by shard, GGUF tensor by tensor.

`lowbit.ptq.stream` quantizes one tensor at a time into lowbit's native checkpoint. A user
who wants vLLM's or llama.cpp's file from a model bigger than memory would otherwise write
that checkpoint and then run ``lowbit export``, which builds the whole model. Here the same
QTensors go straight into the target's layout, through the exporters' own functions
(`lowbit.files.compressed_tensors`, `lowbit.files.gguf_export`), so the result holds the same
tensors, byte for byte, as exporting the in-model RTN checkpoint:

* compressed-tensors: each unit's tensors in the format's names (``weight_packed``,
  ``weight_scale``, ...; dense tensors fp16 where lossless, norms float32), written in sealed
  shards exactly like the native path, so a killed run resumes at the first unsealed shard;
  the ``quantization_config`` (`compressed_tensors.build_config`), the shard index, config.json
  and the tokenizer files when the last shard is in. The weights are spread over several
  ``model-0000i-of-0000n.safetensors`` files instead of one ``model.safetensors``.
* GGUF: one file, whose header lists every tensor's type and size before any data. Types and
  sizes follow from the plan and the shapes (block types) except a dense matrix's float type
  (F16 / BF16 / F32, whichever holds it exactly), found by a first pass over the dense
  matrices (in a llama.cpp mix the embeddings are block-quantized, so there are none). Then
  each tensor is quantized, packed, checked against gguf-py's dequantization, and written in
  llama.cpp's order; embedding tables llama.cpp's mix quantizes go through in row pieces (the
  K-quants are per row), so no table is whole in float32. Written to a temporary name and
  renamed: a killed run leaves nothing that looks complete, but GGUF cannot resume (the file
  is one stream); run it again. ``--force`` replaces only a GGUF lowbit wrote.

Neither holds fused experts yet (refused by name): stream to the native format, then ``lowbit
export``.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from lowbit.errors import ConfigError, ModelError, SchemeError
from lowbit.files import compressed_tensors as ct
from lowbit.files import gguf_export as ge
from lowbit.files import native
from lowbit.files.safetensors_stream import read_header, read_tensor
from lowbit.files.specs import LayerSpec
from lowbit.formats import InputScheme, QTensor, Scheme
from lowbit.formats.finite import require_finite
from lowbit.io import atomic_dir, atomic_file
from lowbit.ptq import stream

NATIVE, CT, GGUF = "native", "compressed-tensors", "gguf"
EXPORTS = (NATIVE, "transformers", CT, GGUF)  # transformers loads the native folder itself
_EMBED_ROWS = 1 << 21  # elements per piece of an embedding table quantized for GGUF


def specs(lay: stream.Layout) -> list[LayerSpec]:
    """The plan's layers as the exporters' checks see them (before any tensor is read)."""
    shapes = {n: tuple(m.weight.shape) for n, m in lay.model.named_modules() if isinstance(m, nn.Linear)}
    out = []
    for name in lay.plan:
        r = lay.plan[name]
        if name in lay.experts:
            e = lay.experts[name]
            out.append(LayerSpec(name, r.weight, r.input, (e.out_features, e.in_features), False, e.count))
        else:
            out.append(LayerSpec(name, r.weight, r.input, shapes[name]))
    return out


def check(export: str, lay: stream.Layout) -> None:
    """Refuse, before the first tensor is read, a plan or model the chosen export cannot hold (with the fix)."""
    if export in (NATIVE, "transformers"):
        return
    if lay.experts or any(u.kind == "experts" for u in lay.units) or stream_float_experts(lay):
        raise ConfigError(f"--stream --export-to {export} does not write fused experts yet; stream to lowbit's "
                          f"native checkpoint (drop --export-to), then `lowbit export CHECKPOINT --to {export}`")
    if export == CT:
        from lowbit.files.compressed_read import require_compressed_tensors

        require_compressed_tensors()
        ct.check_specs(specs(lay), lay.model_type)
    else:
        ge.arch_of(lay.model.config)
        ge.check_specs(specs(lay), False)


def stream_float_experts(lay: stream.Layout) -> bool:
    from lowbit.models.experts import expert_tensors

    return bool(expert_tensors(lay.model))


# ------------------------------------------------------------ compressed-tensors
class CTQuantizer(stream.Quantizer):
    """The streaming quantizer writing compressed-tensors' names and layouts (`compressed_tensors.export`'s)."""

    def linear_out(self, name: str, q: QTensor, spec: dict[str, Any]) -> dict[str, torch.Tensor]:
        inp = self.lay.plan[name].input
        target = ct.recipe_target(q.scheme, inp, q.shape[1], name)
        return {f"{name}.{k}": v for k, v in ct.layer_tensors(q, target).items()}

    def float_out(self, key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        return {key: ct_dense(t)}


def ct_dense(t: torch.Tensor) -> torch.Tensor:
    """A float tensor as the compressed-tensors export stores it from the loaded model: matrices fp16 where
    lossless, everything else float32 (``t``: lowbit's native stored form, fp16 only where lossless)."""
    if t.dtype == torch.float16 and t.dim() >= 2:
        return t.contiguous()
    return ct._narrow(t.float() if t.is_floating_point() else t)


def ct_targets(records: list[dict[str, Any]]) -> dict[str, ct.Target]:
    layers = {n: spec for r in records for n, spec in r["layers"].items()}
    return {n: ct.recipe_target(Scheme.from_dict(s["scheme"]),
                                InputScheme.from_dict(s["input"]) if "input" in s else None, s["shape"][1], n)
            for n, s in layers.items()}


def finish_ct(out: Path, work: Path, folder: Path, lay: stream.Layout, records: list[dict[str, Any]],
              parts: list[stream.Shard], force: bool) -> Path:
    """The compressed-tensors folder: the sealed shards moved in, the index, config.json with its
    ``quantization_config``, the tokenizer files; fused NVFP4 global scales checked as the export does."""
    targets = ct_targets(records)
    ignore = [n for n, m in lay.model.named_modules() if isinstance(m, nn.Linear) and n not in targets]
    qconfig = ct.build_config(targets, ignore)
    scales = {}
    for s in parts:
        entries, _ = read_header(work / s.name)
        scales |= {k: read_tensor(e) for k, e in entries.items() if k.endswith("_global_scale")}
    ct.check_fused_scales(scales, list(targets))
    config = lay.model.config
    with atomic_dir(out, force=force, kind="compressed-tensors export") as tmp:
        for s in parts:
            os.replace(work / s.name, tmp / s.name)
        stream._write_index(tmp, parts)
        config.quantization_config = qconfig
        named_arch = getattr(config, "architectures", None)
        if not named_arch:
            config.architectures = [type(lay.model).__name__]
        try:
            config.save_pretrained(tmp)
        finally:
            del config.quantization_config
            config.architectures = named_arch
        for name in native.tokenizer_files(folder):
            shutil.copyfile(folder / name, tmp / name)
    shutil.rmtree(work, ignore_errors=True)
    return out


# -------------------------------------------------------------------------- GGUF
class GgufPlan:
    """Every tensor of the GGUF file in llama.cpp's order (the export's): name, kind, type."""

    def __init__(self, lay: stream.Layout, mix: str | None) -> None:
        self.lay = lay
        self.config = lay.model.config
        self.arch = ge.arch_of(self.config)
        self.names = ge._tensor_name_map(self.arch, self.config)
        linears = [u.name for u in lay.units if u.kind == "linear"]
        self.types = {n: ge.TensorPlan(n, ge.exact_type(lay.plan.weight(n), self._cols(n)), True) for n in linears}
        self.ftype = ge.file_type_of(ge.FILE_TYPES.get(mix or "", 1), self.types)
        self.file_type = ge.FILE_TYPES.get(self.ftype or "", 1)
        self.embeds = {k: t for k, t in ge.embedding_plan(lay.model, self.ftype).items()
                       if k.removesuffix(".weight") not in lay.plan}
        self.dense = [u.name for u in lay.units if u.kind == "float" and "rotary_emb" not in u.name]
        self.order = [("float", k) for k in self.dense] + [("linear", n) for n in linears]

    def _cols(self, name: str) -> int:
        return int(self.lay.model.get_submodule(name).in_features)

    def gguf_name(self, key: str) -> str:
        return ge._gguf_name(self.names, key)


def _block_bytes(qtype: str, shape: tuple[int, int]) -> tuple[int, int]:
    """(bytes per row, total bytes) of ``shape`` in block type ``qtype``."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    per_row = shape[1] // block * size
    return per_row, per_row * shape[0]


class GgufStream:
    """Quantizes and writes one tensor at a time into an open ``gguf.GGUFWriter`` (see the module doc)."""

    def __init__(self, q: stream.Quantizer, plan: GgufPlan) -> None:
        self.q, self.plan = q, plan
        self.lay = q.lay
        self.counts: dict[str, int] = {}
        self.dense_types: dict[str, str] = {}

    # ------------------------------------------------------------------ data of one tensor
    def dense_array(self, key: str) -> tuple[np.ndarray, str]:
        t = self.q.float_key(key)
        if t.dim() >= 2 and t.dtype == torch.float16 and not self._permuted(key) and not self.plan.arch.norm_shift:
            return t.contiguous().numpy(), "F16"  # what dense_blocks picks for fp16 values, without a float32 copy
        arr, kind = ge._dense_tensor(key, t, self.plan.config, self.plan.arch, False)
        require_finite([(key, t), (key, arr)], "GGUF export", "nothing was written: the checkpoint's weights are "
                       "not finite; repair the model")
        return arr, kind

    def _permuted(self, key: str) -> bool:
        return bool(key.endswith(".weight") and ge._heads_for(key.rsplit(".", 1)[0], self.plan.config,
                                                              self.plan.arch))

    def embed_array(self, key: str, qtype: str) -> np.ndarray:
        """An embedding table in llama.cpp's type for the mix, quantized in row pieces (`ge.embedding_array`'s
        numbers: the table as lowbit's native format stores it, lowbit's search, verified by gguf-py)."""
        shape = tuple(self.lay.model.state_dict(keep_vars=True)[key].shape)
        per_row, total = _block_bytes(qtype, shape)
        out = np.empty((shape[0], per_row), dtype=np.uint8)
        row = 0
        for piece in self._table_pieces(key, shape):  # rows are independent blocks: the whole table's bytes
            out[row:row + piece.shape[0]] = ge.embedding_array(key, piece, qtype)
            row += piece.shape[0]
        return out

    def _table_pieces(self, key: str, shape: tuple[int, ...]) -> Iterator[torch.Tensor]:
        """The table's float32 values as the native checkpoint would hold them (fp16-rounded when in range), in
        pieces of whole rows, each read on its own when the source is a plain float tensor."""
        from lowbit.models.stream_source import model_key

        src = model_key(self.q.source, self.lay.tied.get(key, key), self.lay.model_type)
        entry = self.q.source.entries.get(src) if src is not None else None
        rows = max(1, _EMBED_ROWS // max(1, shape[1]))
        if entry is not None and getattr(entry, "dtype", None) in ("F32", "F16", "BF16") \
                and tuple(entry.shape) == shape:
            pieces: Callable[[], Iterator[torch.Tensor]] = lambda: self.q.source.chunks(src, rows * shape[1])  # noqa: E731
        else:
            whole = self.q.float_key(key).float()
            pieces = lambda: iter(whole.split(rows))  # noqa: E731
        rounded = key in self.lay.round16 and max(float(c.abs().amax()) for c in pieces()) <= stream._F16_MAX
        for c in pieces():
            yield c.half().float() if rounded else c

    def linear_array(self, name: str) -> tuple[np.ndarray, str]:
        q, t, _ = self.q.linear_q(name)
        planned = self.plan.types[name]
        if q is None or ge.exact_type(q.scheme, q.shape[1]) != planned.qtype:
            raise SchemeError(f"layer {name}: its weights' range needs "
                              f"{'16 bits' if q is None else q.scheme.name}, which the GGUF header written for "
                              f"{planned.qtype} cannot hold; stream to lowbit's native checkpoint (drop --export-to) "
                              "and `lowbit export --to gguf` it, which keeps such a layer in float")
        exact = planned.qtype not in ("Q4_1", "Q5_1") or ge.q4_1_exact(q)
        if not exact:
            raise SchemeError(f"layer {name}: Q4_1/Q5_1 store the block minimum in fp16 and -zero*scale is not an "
                              "fp16 number for some groups, so GGUF would change the weights; use a symmetric scheme")
        return ge._layer_array(SimpleNamespace(qweight=q), name, planned, self.plan.config, self.plan.arch)

    # ------------------------------------------------------------------ the file
    def infos(self) -> list[tuple[str, tuple[int, ...], Any, int, Any]]:
        """(GGUF name, shape, numpy dtype, bytes, raw type) of every tensor, in file order."""
        import gguf

        state = self.lay.model.state_dict(keep_vars=True)
        out = []
        for kind, key in self.plan.order:
            if kind == "float" and key in self.plan.embeds:
                qtype = self.plan.embeds[key]
                shape = tuple(state[key].shape)
                per_row, total = _block_bytes(qtype, shape)
                out.append((self.plan.gguf_name(key), (shape[0], per_row), np.uint8, total,
                            gguf.GGMLQuantizationType[qtype]))
            elif kind == "float":
                shape = tuple(state[key].shape)
                ftype = self.dense_types.get(key, "F32")
                item = {"F32": 4, "F16": 2, "BF16": 2}[ftype]
                npdt = {"F32": np.float32, "F16": np.float16, "BF16": np.uint8}[ftype]
                nbytes = item * int(np.prod(shape))
                sh = shape if ftype != "BF16" else (*shape[:-1], shape[-1] * 2)
                out.append((self.plan.gguf_name(key), sh, npdt, nbytes,
                            gguf.GGMLQuantizationType.BF16 if ftype == "BF16" else None))
            else:
                qtype = self.plan.types[key].qtype
                shape = tuple(self.lay.model.get_submodule(key).weight.shape)
                per_row, total = _block_bytes(qtype, shape)
                out.append((self.plan.gguf_name(f"{key}.weight"), (shape[0], per_row), np.uint8, total,
                            gguf.GGMLQuantizationType[qtype]))
        return out

    def find_dense_types(self) -> None:
        """The float type of every dense matrix (the only types the header needs the data for); vectors are F32."""
        state = self.lay.model.state_dict(keep_vars=True)
        for key in self.plan.dense:
            if key not in self.plan.embeds and state[key].dim() >= 2:
                self.dense_types[key] = self.dense_array(key)[1]

    def array(self, kind: str, key: str) -> tuple[np.ndarray, str]:
        if kind == "float" and key in self.plan.embeds:
            return self.embed_array(key, self.plan.embeds[key]), self.plan.embeds[key]
        if kind == "float":
            arr, t = self.dense_array(key)
            if t != self.dense_types.get(key, "F32"):
                raise ModelError(f"{key}: its values changed between the two reads of the source ({t} now, "
                                 f"{self.dense_types.get(key, 'F32')} before); is the model being rewritten?")
            return arr, t
        return self.linear_array(key)


def write_gguf(out: Path, q: stream.Quantizer, mix: str | None, name: str, tokenizer: Any,
               source_gguf: Path | None, force: bool, report: Callable[[str], None]) -> dict[str, Any]:
    """The GGUF file of the streamed quantization (see the module doc); returns the export's summary fields."""
    import gguf

    plan = GgufPlan(q.lay, mix)
    g = GgufStream(q, plan)
    q.prepare({n for _, n in plan.order})
    g.find_dense_types()
    infos = g.infos()
    total = sum(i[3] for i in infos)
    with atomic_file(out, may_replace=lambda p: force and ge.written_by_lowbit(p)) as tmp:
        writer = gguf.GGUFWriter(str(tmp), plan.arch.gguf)
        ge.add_model_metadata(writer, plan.config, name, plan.arch, plan.file_type)
        if source_gguf is not None:
            ge.copy_tokenizer_fields(writer, source_gguf)
        elif tokenizer is not None:
            ge.add_hf_tokenizer(writer, tokenizer, plan.arch.pre_tokenizer)
        for gname, shape, dtype, nbytes, raw in infos:
            writer.add_tensor_info(gname, shape, np.dtype(dtype), nbytes, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done, t0, last = 0, time.perf_counter(), 0.0
        for (kind, key), info in zip(plan.order, infos, strict=True):
            arr, qtype = g.array(kind, key)
            if arr.nbytes != info[3]:
                raise ModelError(f"{key}: {arr.nbytes} bytes where the header says {info[3]} (a lowbit bug: please "
                                 "report)")
            writer.write_tensor_data(arr)
            g.counts[qtype] = g.counts.get(qtype, 0) + 1
            done += arr.nbytes
            del arr
            if time.perf_counter() - last > 10 or done == total:
                last = time.perf_counter()
                report(f"[gguf] {stream.progress_line(done, total, t0, 0)}")
        writer.close()
    result = {"out": str(out), "arch": plan.arch.gguf, "types": g.counts,
              "verified": sum(1 for t in plan.types.values() if t.exact) + len(plan.embeds),
              "embeddings": ", ".join(f"{k}: {t}" for k, t in plan.embeds.items()) or "16-bit",
              "resumable": "no: GGUF is one file whose header precedes the data; a killed run starts over"}
    unread = ge.transformers_readback(out, plan.config)
    if unread is not None:
        result["transformers_readback"] = unread
    return result
