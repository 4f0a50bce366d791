"""Export a lowbit-quantized llama-family model as one GGUF file (llama.cpp, transformers).

lowbit schemes map onto GGUF block types *exactly* where the grids agree, so llama.cpp
computes with the very weights lowbit evaluated:

| lowbit scheme                                   | GGUF  | block bytes                       |
| ----------------------------------------------- | ----- | --------------------------------- |
| INT4 symmetric, group 32 (full-range or classic) | Q4_0  | fp16 d, 16 B nibbles (u = q + 8)  |
| INT4 asymmetric, group 32                        | Q4_1  | fp16 d, fp16 m = -z*d, 16 B       |
| INT8 symmetric, group 32                         | Q8_0  | fp16 d, 32 int8                   |
| MXFP4 (E2M1, block 32, E8M0, no tensor scale)    | MXFP4 | E8M0 e, 16 B nibbles              |

Q4_0/MXFP4 nibbles hold element j in the low and j+16 in the high half of byte j.
Q4_1 stores the block minimum ``m`` in fp16, so an asymmetric group is exact only when
``-z*d`` is an fp16 number; otherwise it needs ``allow_requant`` (m is then rounded).
Every other scheme has no exact GGUF type and is refused unless ``allow_requant``, which
re-quantizes the lowbit weights with the ``gguf`` package's own Q4_0 / Q8_0 quantizer.
Unquantized tensors are written as F16 or BF16 when that holds them exactly, else F32.

llama.cpp's llama graph expects q/k rows in interleaved-rotary order; converters permute
them and transformers' GGUF loader undoes it, so the same permutation is applied here
(to codes and scales together: it moves whole rows, never a group).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lowbit.errors import LowbitError, ModelError, SchemeError
from lowbit.formats import QTensor, Scheme
from lowbit.io import atomic_file
from lowbit.nn import quant_layers

# every GGUF lowbit writes carries this key, so --force can tell its own files from others
MARKER_KEY = "lowbit.written_by"
EXACT = ("Q4_0 (INT4 sym, group 32)", "Q4_1 (INT4 asym, group 32, when zero*scale is an fp16 number)",
         "Q8_0 (INT8 sym, group 32)", "MXFP4 (E2M1, block 32, E8M0 scales)")
ARCHS = ("llama",)


def _gguf():
    import gguf

    return gguf


# ------------------------------------------------------------------ mapping
def exact_type(scheme: Scheme, in_features: int) -> str | None:
    """The GGUF type that holds ``scheme`` exactly (None: no such type)."""
    if in_features % 32 or scheme.group_for(in_features) != 32:
        return None
    if scheme.elem == "int" and scheme.bits == 4:
        return "Q4_0" if scheme.sym else "Q4_1"
    if scheme.elem == "int" and scheme.bits == 8 and scheme.sym:
        return "Q8_0"
    if scheme.elem == "e2m1" and scheme.scale == "e8m0" and not scheme.tensor_scale:
        return "MXFP4"
    return None


def requant_type(scheme: Scheme) -> str:
    """GGUF type used with ``allow_requant`` when no exact one exists."""
    return "Q4_0" if scheme.bits <= 4 else "Q8_0"


# ------------------------------------------------------------------ packing
def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., 32]`` 4-bit codes -> ``[..., 16]`` bytes: element j low, j+16 high."""
    return codes[..., :16] | (codes[..., 16:] << 4)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[out, ng]`` values -> ``[out, ng, 2]`` little-endian fp16 bytes."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def q4_1_exact(q: QTensor) -> bool:
    """Q4_1 keeps the block minimum ``m = -z*d`` in fp16: exact only if every m is an fp16 number."""
    m = -q.zeros * q.scales
    return bool(torch.equal(m.to(torch.float16).float(), m))


def pack_blocks(q: QTensor, qtype: str, where: str = "layer") -> np.ndarray:
    """GGUF block bytes ``uint8 [out, bytes_per_row]`` of a QTensor whose scheme maps onto ``qtype``.

    Exact for every type but Q4_1, whose fp16 minimum may round (see `q4_1_exact`).
    """
    out = q.shape[0]
    if qtype == "Q4_0":
        blocks = torch.cat([_f16_bytes(q.scales), _nibbles(q.codes)], -1)
    elif qtype == "Q4_1":
        blocks = torch.cat([_f16_bytes(q.scales), _f16_bytes(-q.zeros * q.scales), _nibbles(q.codes)], -1)
    elif qtype == "Q8_0":
        levels = (q.codes.to(torch.int16) + q.scheme.qmin).to(torch.int8).view(torch.uint8)
        blocks = torch.cat([_f16_bytes(q.scales), levels], -1)
    elif qtype == "MXFP4":
        e = (torch.log2(q.scales).round() + 127).clamp(0, 254).to(torch.uint8).unsqueeze(-1)
        blocks = torch.cat([e, _nibbles(q.codes)], -1)
    else:
        raise SchemeError(f"{where}: no exact packing for {qtype}")
    return blocks.reshape(out, -1).numpy()


def requantize(w: torch.Tensor, qtype: str) -> np.ndarray:
    """The gguf package's own quantizer on lowbit's dequantized weight (``allow_requant`` only)."""
    gguf = _gguf()
    return gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType[qtype])


# ------------------------------------------------------------- permutation
def rope_rows(out: int, n_head: int) -> torch.Tensor:
    """Row order that turns HF's half-split rotary layout into llama.cpp's interleaved one."""
    hd = out // n_head
    return torch.arange(out).reshape(n_head, 2, hd // 2).transpose(1, 2).reshape(-1)


def permute_qtensor(q: QTensor, rows: torch.Tensor) -> QTensor:
    return QTensor(q.codes[rows], q.scales[rows], None if q.zeros is None else q.zeros[rows],
                   q.tensor_scale, q.shape, q.scheme)


def _heads_for(name: str, config: Any) -> int | None:
    if name.endswith("q_proj"):
        return config.num_attention_heads
    if name.endswith("k_proj"):
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return None


# --------------------------------------------------------------- metadata
def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    if kind != "default":
        raise ModelError(f"rope type {kind!r} has no GGUF mapping in lowbit yet; only plain rope is exported")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(config, "rope_theta", 10000.0))


def add_model_metadata(writer: Any, config: Any, name: str) -> None:
    """llama.* keys that llama.cpp and transformers' GGUF loader read."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(name)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads))
    writer.add_rope_dimension_count(int(head_dim))
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))
    writer.add_file_type(1)  # mostly F16-or-better; per-tensor types are what readers use
    writer.add_string(MARKER_KEY, "lowbit")


def written_by_lowbit(path: str | Path) -> bool:
    """Whether ``path`` is a readable GGUF file that lowbit wrote (its metadata says so)."""
    gguf = _gguf()
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return False
        field = gguf.GGUFReader(str(path)).fields.get(MARKER_KEY)
        return field is not None and field.contents() == "lowbit"
    except (OSError, ValueError, IndexError, KeyError):
        return False


def copy_tokenizer_fields(writer: Any, source_gguf: Path) -> None:
    """Copy every ``tokenizer.*`` key of a source GGUF (the model lowbit started from)."""
    gguf = _gguf()
    reader = gguf.GGUFReader(str(source_gguf))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def add_hf_tokenizer(writer: Any, tokenizer: Any) -> None:
    """A byte-level BPE tokenizer (GPT-2 style, what llama-family HF models use) as GGUF keys."""
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise ModelError(f"GGUF export writes BPE tokenizers only, this one is {model.get('type')!r}; "
                         "export from a model whose tokenizer is byte-level BPE")
    vocab: dict[str, int] = dict(model["vocab"])
    for tok in data.get("added_tokens", []):
        vocab.setdefault(tok["content"], tok["id"])
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [5] * size  # UNUSED
    for tok, i in vocab.items():
        tokens[i], types[i] = tok, 1  # NORMAL
    for tok in data.get("added_tokens", []):
        types[tok["id"]] = 3 if tok.get("special") else 4  # CONTROL / USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for attr, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("pad_token_id", writer.add_pad_token_id), ("unk_token_id", writer.add_unk_token_id)):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            add(int(value))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        writer.add_chat_template(template)


# ------------------------------------------------------------------ export
@dataclass(frozen=True)
class TensorPlan:
    """One tensor's GGUF name, type, and whether it holds lowbit's numbers exactly."""

    name: str
    qtype: str
    exact: bool


def plan_types(model: nn.Module, allow_requant: bool = False) -> dict[str, TensorPlan]:
    """GGUF type per quantized layer; refuses inexact ones unless ``allow_requant``."""
    out: dict[str, TensorPlan] = {}
    bad, rounded = [], []
    acts = [f"{n} ({m.input_quant.scheme.name})" for n, m in quant_layers(model).items()
            if getattr(m, "input_quant", None) is not None]
    if acts:  # --allow-requant cannot help: no GGUF type says anything about activations
        raise SchemeError(f"GGUF cannot hold activation quantization ({len(acts)} layer(s) quantize their inputs, "
                          f"e.g. {acts[0]}): llama.cpp runs the quantized weights with unquantized inputs. GGUF "
                          f"holds weight-only layers: {'; '.join(EXACT)}. Export this recipe with --to "
                          "compressed-tensors, or re-quantize weight-only")
    for name, layer in quant_layers(model).items():
        t = exact_type(layer.scheme, layer.in_features)
        exact = t is not None and (t != "Q4_1" or q4_1_exact(layer.qweight))
        if t is None:
            bad.append(f"{name} ({layer.scheme.name})")
        elif not exact:
            rounded.append(name)
        out[name] = TensorPlan(name, t or requant_type(layer.scheme), exact)
    if rounded and not allow_requant:
        raise SchemeError(f"{len(rounded)} asymmetric layer(s), e.g. {rounded[0]}: Q4_1 stores the block minimum "
                          "in fp16 and -zero*scale is not an fp16 number for some groups, so the export would "
                          "change the weights; pass --allow-requant to round it, or use w4g32 (-> Q4_0)")
    if bad and not allow_requant:
        raise SchemeError(f"no exact GGUF type for {len(bad)} layer(s), e.g. {', '.join(bad[:3])}. GGUF types "
                          f"lowbit maps exactly: {'; '.join(EXACT)}. Re-quantize with w4g32, w4g32a, w8g32 or "
                          "mxfp4, or pass --allow-requant to let gguf re-quantize them (numbers change)")
    return out


def _gguf_name(name_map: Any, key: str) -> str:
    got = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
    if got is None:
        raise ModelError(f"tensor {key} has no GGUF llama name; only llama-family models export to GGUF")
    return got


def _layer_array(layer: Any, name: str, plan: TensorPlan, config: Any) -> tuple[np.ndarray, str]:
    q = layer.qweight
    heads = _heads_for(name, config)
    rows = rope_rows(q.shape[0], heads) if heads else None
    if plan.exact or exact_type(q.scheme, q.shape[1]) == plan.qtype:  # exact, or Q4_1 with a rounded min
        if rows is not None:
            q = permute_qtensor(q, rows)
        return pack_blocks(q, plan.qtype, name), plan.qtype
    w = q.dequantize()
    return requantize(w if rows is None else w[rows], plan.qtype), plan.qtype


def dense_blocks(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """The narrowest GGUF float type that holds ``t`` exactly: F16, BF16, else F32 (1-D: F32).

    A model loaded from fp16/bf16 weights keeps its exact values at half the size; one
    whose float32 weights need all 24 bits (e.g. dequantized from a GGUF source) stays F32.
    """
    t = t.detach().float().contiguous()
    if t.dim() == 2:
        for dt, name in ((torch.float16, "F16"), (torch.bfloat16, "BF16")):
            narrow = t.to(dt)
            if torch.equal(narrow.float(), t):
                return narrow.view(torch.uint8 if dt == torch.bfloat16 else torch.float16).numpy(), name
    return t.numpy(), "F32"


def _dense_tensor(key: str, t: torch.Tensor, config: Any) -> tuple[np.ndarray, str]:
    heads = _heads_for(key.rsplit(".", 1)[0], config) if key.endswith(".weight") else None
    if heads and t.dim() == 2:
        t = t[rope_rows(t.shape[0], heads)]
    return dense_blocks(t)


def export(model: nn.Module, tokenizer: Any, out: str | Path, force: bool = False, allow_requant: bool = False,
           source_gguf: str | Path | None = None, name: str = "lowbit") -> dict[str, Any]:
    """Write ``model`` as a GGUF file atomically; returns per-type counts and requantized layers."""
    gguf = _gguf()
    out = Path(out)
    config = model.config
    if getattr(config, "model_type", None) not in ARCHS:
        raise ModelError(f"GGUF export supports {ARCHS} models, not {getattr(config, 'model_type', None)!r}")
    if out.exists() and not (force and written_by_lowbit(out)):
        raise LowbitError(f"{out} already exists and is not a GGUF lowbit wrote; choose another --out"
                          if force else f"{out} already exists; choose another --out or pass --force to replace it")
    types = plan_types(model, allow_requant)
    qlayers = quant_layers(model)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    with atomic_file(out) as tmp:
        writer = gguf.GGUFWriter(str(tmp), "llama")
        add_model_metadata(writer, config, name)
        if source_gguf is not None:
            copy_tokenizer_fields(writer, Path(source_gguf))
        elif tokenizer is not None:
            add_hf_tokenizer(writer, tokenizer)
        counts = _add_tensors(writer, model, qlayers, types, name_map)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
        writer.close()
    return {"out": str(out), "types": counts,
            "requantized": sorted(n for n, p in types.items() if not p.exact)}


def _add_tensors(writer: Any, model: nn.Module, qlayers: dict, types: dict[str, TensorPlan], name_map: Any
                 ) -> dict[str, int]:
    gguf = _gguf()
    counts: dict[str, int] = {}
    own = {f"{n}.{k}" for n in qlayers for k in ("codes", "scales", "zeros", "tensor_scale")}
    seen: set[tuple] = set()
    for key, t in model.state_dict().items():
        ident = (t.data_ptr(), tuple(t.shape), t.dtype)
        if key in own or (t.numel() and ident in seen) or "rotary_emb" in key:
            continue
        seen.add(ident)
        arr, kind = _dense_tensor(key, t, model.config)
        raw = gguf.GGMLQuantizationType.BF16 if kind == "BF16" else None
        writer.add_tensor(_gguf_name(name_map, key), arr, raw_dtype=raw)
        counts[kind] = counts.get(kind, 0) + 1
    for name, layer in qlayers.items():
        arr, qtype = _layer_array(layer, name, types[name], model.config)
        writer.add_tensor(_gguf_name(name_map, f"{name}.weight"), arr, raw_dtype=gguf.GGMLQuantizationType[qtype])
        counts[qtype] = counts.get(qtype, 0) + 1
    return counts
