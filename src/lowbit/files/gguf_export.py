"""Export a lowbit-quantized llama-family model as one GGUF file (llama.cpp, transformers).

lowbit schemes map onto GGUF block types *exactly* where the grids agree, so llama.cpp
computes with the very weights lowbit evaluated:

| lowbit scheme                                   | GGUF  | block bytes                       |
| ----------------------------------------------- | ----- | --------------------------------- |
| INT4 symmetric, group 32 (full-range or classic) | Q4_0  | fp16 d, 16 B nibbles (u = q + 8)  |
| INT4 asymmetric, group 32                        | Q4_1  | fp16 d, fp16 m = -z*d, 16 B       |
| INT8 symmetric, group 32                         | Q8_0  | fp16 d, 32 int8                   |
| MXFP4 (E2M1, block 32, E8M0, no tensor scale)    | MXFP4 | E8M0 e, 16 B nibbles              |
| INT5 symmetric / asymmetric, group 32            | Q5_0 / Q5_1 | d, [m], 4 B high bits, 16 B  |
| q2_k ... q6_k (two-level K-quant scales)         | Q2_K ... Q6_K | see `gguf_kquants`          |

Q4_0/MXFP4 nibbles hold element j in the low and j+16 in the high half of byte j.
Q4_1 stores the block minimum ``m`` in fp16, so an asymmetric group is exact only when
``-z*d`` is an fp16 number; otherwise it needs ``allow_requant`` (m is then rounded).
Every other scheme has no exact GGUF type and is refused unless ``allow_requant``, which
re-quantizes the lowbit weights with the ``gguf`` package's own Q4_0 / Q8_0 quantizer.
Unquantized tensors are written as F16 or BF16 when that holds them exactly, else F32
(with ``allow_requant``: F16, rounded, and listed as such).

Every quantized tensor is verified after packing: gguf-py's ``quants.dequantize`` of the
bytes written must equal lowbit's dequantized weight bit for bit, or the export fails
before the file appears.

Architectures (``ARCHS``): llama and mistral (llama.cpp's ``llama`` graph, q/k rows
permuted to its interleaved rotary order), qwen2, qwen3 and gemma3 (NEOX rotary: no
permutation; Gemma's RMSNorm weights are stored as ``1 + w``, as llama.cpp's converter does).

llama.cpp's llama graph expects q/k rows in interleaved-rotary order; converters permute
them and transformers' GGUF loader undoes it, so the same permutation is applied here
(to codes and scales together: it moves whole rows, never a group or a super-block).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lowbit.errors import LowbitError, ModelError, SchemeError
from lowbit.files import gguf_mla, gguf_moe, gguf_types, targets
from lowbit.files.gguf_kquants import pack_kquant
from lowbit.files.gguf_read import head_dim
from lowbit.files.specs import LayerSpec, from_model, refuse_rotations
from lowbit.formats import QTensor, Scheme, quantize
from lowbit.formats.finite import require_finite
from lowbit.io import atomic_file
from lowbit.nn import quant_layers
from lowbit.nn.input_rotation import refuse_online_rotations
from lowbit.nn.quant_experts import QuantExperts, quant_stacks

# every GGUF lowbit writes carries this key, so --force can tell its own files from others
MARKER_KEY = "lowbit.written_by"
EXACT = ("Q4_0 (INT4 sym, group 32)", "Q4_1 (INT4 asym, group 32, when zero*scale is an fp16 number)",
         "Q5_0 / Q5_1 (INT5 sym / asym, group 32)", "Q8_0 (INT8 sym, group 32)", "MXFP4 (E2M1, block 32, E8M0 scales)",
         "Q2_K..Q6_K (q2_k..q6_k, rows a multiple of 256)")


@dataclass(frozen=True)
class Arch:
    """How one HF ``model_type`` maps onto a llama.cpp architecture."""

    gguf: str  # general.architecture
    permute_qk: bool  # llama graph: q/k rows to interleaved rotary order
    norm_shift: float  # added to every ``*norm.weight`` (Gemma's RMSNorm scales by 1 + w)
    head_dim_keys: bool  # write attention.key_length / value_length
    pre_tokenizer: str


ARCH_MAP = {
    "llama": Arch("llama", True, 0.0, False, "default"),
    "mistral": Arch("llama", True, 0.0, False, "default"),
    "qwen2": Arch("qwen2", False, 0.0, False, "qwen2"),
    "qwen3": Arch("qwen3", False, 0.0, True, "qwen2"),
    "gemma3_text": Arch("gemma3", False, 1.0, True, "default"),
    # mixture-of-experts models (`lowbit.files.gguf_moe`): 3-D ffn_*_exps tensors, expert counts in the metadata
    "qwen3_moe": Arch("qwen3moe", False, 0.0, True, "qwen2"),
    "qwen2_moe": Arch("qwen2moe", False, 0.0, False, "qwen2"),
    "mixtral": Arch("llama", True, 0.0, False, "default"),
    "olmoe": Arch("olmoe", False, 0.0, False, "default"),
    "gpt_oss": Arch("gpt-oss", False, 0.0, True, "default"),
    # multi-head latent attention (`lowbit.files.gguf_mla`): kv_b_proj split into attn_k_b / attn_v_b, MLA keys
    "deepseek_v3": Arch("deepseek2", False, 0.0, False, "deepseek-v3"),
}
ARCHS = tuple(ARCH_MAP)
MOE_ARCHS = tuple(gguf_moe.MOE_ARCHS)
# general.file_type of llama.cpp's mixes (gguf.LlamaFileType), for readers that show it
FILE_TYPES = {"q2_k_s": 21, "gguf:q2_k": 10, "q3_k_s": 11, "q3_k_m": 12, "q3_k_l": 13, "q4_k_s": 14, "q4_k_m": 15,
              "q5_k_s": 16, "q5_k_m": 17, "gguf:q6_k": 18, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9}
EMBEDDINGS = targets.EMBEDDINGS  # what `export(embeddings=...)` accepts


def _gguf():
    import gguf

    return gguf


# ------------------------------------------------------------------ mapping
def exact_type(scheme: Scheme, in_features: int) -> str | None:
    """The GGUF type that holds ``scheme`` exactly (None: no such type)."""
    family = scheme.family.name
    if family == "kquant":
        return f"Q{scheme.bits}_K" if in_features % 256 == 0 else None
    if in_features % 32 or scheme.group_for(in_features) != 32:
        return None
    if family == "int" and scheme.scale != "fp16":  # the legacy types store fp16 scales (fp32: a wide layer)
        return None
    if family == "int" and scheme.bits in (4, 5):
        return f"Q{scheme.bits}_0" if scheme.sym else f"Q{scheme.bits}_1"
    if family == "int" and scheme.bits == 8 and scheme.sym:
        return "Q8_0"
    if scheme.elem == "e2m1" and scheme.scale == "e8m0" and not scheme.tensor_scale:
        return "MXFP4"
    return None


def requant_type(scheme: Scheme) -> str:
    """GGUF type used with ``allow_requant`` when no exact one exists."""
    return "Q4_0" if scheme.bits <= 4 else "Q5_0" if scheme.bits == 5 else "Q8_0"


# ------------------------------------------------------------------ packing
def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., 32]`` 4-bit codes -> ``[..., 16]`` bytes: element j low, j+16 high."""
    return codes[..., :16] | (codes[..., 16:] << 4)


def _high_bits(codes: torch.Tensor) -> torch.Tensor:
    """``[..., 32]`` 5-bit codes -> ``[..., 4]`` bytes: bit 4 of element j in bit j (little-endian u32)."""
    bits = (codes.to(torch.int64) >> 4) & 1
    word = (bits << torch.arange(32, dtype=torch.int64)).sum(-1, keepdim=True)
    return ((word >> torch.arange(0, 32, 8, dtype=torch.int64)) & 0xFF).to(torch.uint8)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[out, ng]`` values -> ``[out, ng, 2]`` little-endian fp16 bytes."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def q4_1_exact(q: QTensor) -> bool:
    """Q4_1/Q5_1 keep the block minimum ``m = -z*d`` in fp16: exact only if every m is an fp16 number."""
    m = -q.zeros * q.scales
    return bool(torch.equal(m.to(torch.float16).float(), m))


def pack_blocks(q: QTensor, qtype: str, where: str = "layer") -> np.ndarray:
    """GGUF block bytes ``uint8 [out, bytes_per_row]`` of a QTensor whose scheme maps onto ``qtype``.

    Exact for every type but Q4_1, whose fp16 minimum may round (see `q4_1_exact`).
    """
    out = q.shape[0]
    if q.scheme.family.name == "kquant":
        return pack_kquant(q)
    if qtype == "Q5_0":
        blocks = torch.cat([_f16_bytes(q.scales), _high_bits(q.codes), _nibbles(q.codes & 0xF)], -1)
    elif qtype == "Q5_1":
        blocks = torch.cat([_f16_bytes(q.scales), _f16_bytes(-q.zeros * q.scales), _high_bits(q.codes),
                            _nibbles(q.codes & 0xF)], -1)
    elif qtype == "Q4_0":
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
    with np.errstate(over="ignore", invalid="ignore"):  # a scale fp16 cannot hold: `written_values` names it
        return gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType[qtype])


# ------------------------------------------------------------- permutation
def rope_rows(out: int, n_head: int) -> torch.Tensor:
    """Row order that turns HF's half-split rotary layout into llama.cpp's interleaved one."""
    hd = out // n_head
    return torch.arange(out).reshape(n_head, 2, hd // 2).transpose(1, 2).reshape(-1)


def permute_qtensor(q: QTensor, rows: torch.Tensor) -> QTensor:
    """Rows reordered; the K-quants' super-block scales are per row too, NVFP4's tensor scale is not."""
    ts = q.tensor_scale[rows] if q.scheme.family.name == "kquant" else q.tensor_scale
    return QTensor(q.codes[rows], q.scales[rows], None if q.zeros is None else q.zeros[rows], ts, q.shape, q.scheme)


def _heads_for(name: str, config: Any, arch: Arch | None = None) -> int | None:
    if arch is not None and not arch.permute_qk:
        return None
    if name.endswith("q_proj"):
        return config.num_attention_heads
    if name.endswith("k_proj"):
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return None


# --------------------------------------------------------------- metadata
def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # Gemma-3: the global layers' rope (llama.cpp's freq_base)
    kind = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    if kind == "yarn" and getattr(config, "model_type", None) in YARN_ARCHS:  # written by `_add_yarn`
        kind = "default"
    if kind != "default":
        raise ModelError(f"rope type {kind!r} has no GGUF mapping in lowbit yet; only plain rope is exported")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(config, "rope_theta", 10000.0))


# model types whose YaRN rope llama.cpp computes as transformers does (checked against llama.cpp's logits)
YARN_ARCHS = ("gpt_oss", "deepseek_v3")


def _add_yarn(writer: Any, config: Any) -> None:
    """YaRN rope scaling keys (gpt-oss ships with it): type, factor, original context, betas."""
    gguf = _gguf()
    params = getattr(config, "rope_parameters", None) or {}
    if not isinstance(params, dict) or params.get("rope_type") != "yarn":
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(params["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(params.get("original_max_position_embeddings") or 4096))
    for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                     ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
        if params.get(key) is not None:
            add(float(params[key]))
    if gguf_mla.is_mla(config) and params.get("mscale_all_dim"):  # MLA's softmax scale (`gguf_mla.check_config`)
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(params["mscale_all_dim"]))


def arch_of(config: Any, moe: bool = False) -> Arch:
    """The llama.cpp architecture of a model config; anything else is refused, naming the supported list."""
    return arch_for(getattr(config, "model_type", None), moe)


def arch_for(kind: str | None, moe: bool = False) -> Arch:
    """The llama.cpp architecture of a ``model_type``; anything else is refused, naming the supported list.

    ``moe``: the model has fused experts, so only the architectures with a llama.cpp MoE mapping qualify.
    """
    if moe and kind not in MOE_ARCHS:
        raise ModelError(f"GGUF export of mixture-of-experts models supports {', '.join(MOE_ARCHS)} (llama.cpp's "
                         f"{', '.join(sorted(set(gguf_moe.MOE_ARCHS.values())))}), not {kind!r}: lowbit has no "
                         "mapping of its experts onto llama.cpp's tensors; export it with --to compressed-tensors or "
                         "keep lowbit's native checkpoint")
    if kind not in ARCH_MAP:
        raise ModelError(f"GGUF export supports {', '.join(ARCHS)} models, not {kind!r}; export this model "
                         "with --to compressed-tensors, or quantize a model of a supported architecture")
    return ARCH_MAP[kind]


def add_model_metadata(writer: Any, config: Any, name: str, arch: Arch | None = None, file_type: int = 1) -> None:
    """``{arch}.*`` keys that llama.cpp and transformers' GGUF loader read."""
    arch = arch or arch_of(config)
    hd = head_dim(config)
    writer.add_name(name)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(config.num_attention_heads))
    if not gguf_mla.is_mla(config):  # MLA's head counts and sizes: `gguf_mla.add_metadata`
        writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads))
    if arch.gguf == "llama":
        writer.add_rope_dimension_count(hd)
    if not gguf_mla.is_mla(config) and (arch.head_dim_keys or hd * config.num_attention_heads != config.hidden_size):
        writer.add_key_length(hd)
        writer.add_value_length(hd)
    writer.add_rope_freq_base(_rope_theta(config))
    if config.model_type in YARN_ARCHS:
        _add_yarn(writer, config)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))
    if config.model_type in MOE_ARCHS:
        gguf_moe.add_metadata(writer, config)
    if arch.gguf == "gemma3":
        if getattr(config, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
        if getattr(config, "sliding_window", None):
            writer.add_sliding_window(int(config.sliding_window))
    writer.add_file_type(file_type)
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


def add_hf_tokenizer(writer: Any, tokenizer: Any, pre: str = "default") -> None:
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
    writer.add_tokenizer_pre(pre)
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


def check_specs(specs: list[LayerSpec], allow_requant: bool = False) -> None:
    """Refuse, before any weight is read, a plan GGUF cannot hold: rotated or quantized inputs, and (unless
    ``allow_requant``) schemes without an exact GGUF type. Q4_1's fp16 minimum is checked on the numbers later."""
    refuse_rotations(specs, "GGUF")
    acts = [f"{s.name} ({s.input.name})" for s in specs if s.input is not None]
    if acts:  # --allow-requant cannot help: no GGUF type says anything about activations
        raise SchemeError(f"GGUF cannot hold activation quantization ({len(acts)} layer(s) quantize their inputs, "
                          f"e.g. {acts[0]}): llama.cpp runs the quantized weights with unquantized inputs. GGUF "
                          f"holds weight-only layers: {'; '.join(EXACT)}. Export this recipe with --to "
                          "compressed-tensors, or re-quantize weight-only")
    bad = [f"{s.name} ({s.scheme.name}, {s.in_features} columns)" for s in specs
           if exact_type(s.scheme, s.in_features) is None]
    if bad and not allow_requant:
        raise SchemeError(f"no exact GGUF type for {len(bad)} layer(s), e.g. {', '.join(bad[:3])}. GGUF types "
                          f"lowbit maps exactly: {'; '.join(EXACT)}. Re-quantize with one of those (K-quants need "
                          "rows that are multiples of 256: the mixes such as q4_k_m pick llama.cpp's fallback "
                          "types themselves), or pass --allow-requant to let gguf re-quantize them (numbers change)")


def plan_types(model: nn.Module, allow_requant: bool = False) -> dict[str, TensorPlan]:
    """GGUF type per quantized layer; refuses inexact ones unless ``allow_requant``."""
    out: dict[str, TensorPlan] = {}
    rounded = []
    refuse_online_rotations(model, "GGUF")
    check_specs(from_model(model), allow_requant)
    for name, layer in quant_layers(model).items():
        t = exact_type(layer.scheme, layer.in_features)
        exact = t is not None and (t not in ("Q4_1", "Q5_1") or q4_1_exact(layer.qweight))
        if t is not None and not exact:
            rounded.append(name)
        out[name] = TensorPlan(name, t or requant_type(layer.scheme), exact)
    for name, stack in quant_stacks(model).items():
        t = exact_type(stack.scheme, stack.in_features)
        exact = t is not None and (t not in ("Q4_1", "Q5_1") or all(q4_1_exact(stack.expert(e))
                                                                     for e in range(stack.num_experts)))
        if t is not None and not exact:
            rounded.append(name)
        out[name] = TensorPlan(name, t or requant_type(stack.scheme), exact)
    if rounded and not allow_requant:
        raise SchemeError(f"{len(rounded)} asymmetric layer(s), e.g. {rounded[0]}: Q4_1/Q5_1 store the block "
                          "minimum in fp16 and -zero*scale is not an fp16 number for some groups, so the export "
                          "would change the weights; pass --allow-requant to round it, or use a symmetric scheme")
    return out


def _gguf_name(name_map: Any, key: str) -> str:
    got = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
    if got is None:
        raise ModelError(f"tensor {key} has no GGUF name in lowbit's mapping; this model's layout is not one "
                         f"GGUF export covers ({', '.join(ARCHS)})")
    return got


def verify_blocks(raw: np.ndarray, qtype: str, want: torch.Tensor, where: str) -> None:
    """gguf-py's dequantization of ``raw`` must equal ``want`` exactly, or nothing is written.

    Exactly = every float32 value equal (the K-quants agree to the bit; MXFP4's negative-zero
    code dequantizes to -0.0 in lowbit and +0.0 in gguf-py, the same number).
    """
    got = written_values(raw, qtype, tuple(want.shape), where)
    w = want.detach().float().contiguous().numpy()
    if not np.array_equal(got, w):
        bad = int((got != w).sum())
        raise LowbitError(f"{where}: the {qtype} blocks lowbit packed dequantize differently from its own weights "
                          f"at {bad} of {w.size} values; nothing was written (this is a lowbit bug: please report)")


def written_values(raw: np.ndarray, qtype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    """What llama.cpp will read from ``raw`` (gguf-py's dequantization), refused if any value is not finite.

    GGUF block types store fp16 scales: a weight needing a larger scale (fp32-scaled layers
    re-quantized with --allow-requant) would become inf there, so it is caught here,
    before the file is renamed into place.
    """
    gguf = _gguf()
    with np.errstate(over="ignore", invalid="ignore"):
        got = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(shape)
    require_finite([(where, got)], "GGUF export", f"nothing was written: {qtype} stores fp16 block scales, which "
                   "cannot hold this layer's weights; export it with --to compressed-tensors, or keep the layer in "
                   "16 bits with a plan")
    return got


def _layer_array(layer: Any, name: str, plan: TensorPlan, config: Any, arch: Arch) -> tuple[np.ndarray, str]:
    q = layer.qweight
    heads = _heads_for(name, config, arch)
    rows = rope_rows(q.shape[0], heads) if heads else None
    if plan.exact:
        if rows is not None:
            q = permute_qtensor(q, rows)
        raw = pack_blocks(q, plan.qtype, name)
        verify_blocks(raw, plan.qtype, q.dequantize(), name)
        return raw, plan.qtype
    if exact_type(q.scheme, q.shape[1]) == plan.qtype:  # Q4_1 / Q5_1 with a rounded fp16 min (allow_requant)
        if rows is not None:
            q = permute_qtensor(q, rows)
        raw = pack_blocks(q, plan.qtype, name)
        written_values(raw, plan.qtype, q.shape, name)
        return raw, plan.qtype
    w = q.dequantize()
    raw = requantize(w if rows is None else w[rows], plan.qtype)
    written_values(raw, plan.qtype, tuple(w.shape), name)
    return raw, plan.qtype


def dense_blocks(t: torch.Tensor, allow_f16: bool = False) -> tuple[np.ndarray, str]:
    """The narrowest GGUF float type that holds ``t`` exactly: F16, BF16, else F32 (1-D: F32).

    A model loaded from fp16/bf16 weights keeps its exact values at half the size; one
    whose float32 weights need all 24 bits (e.g. dequantized from a GGUF source) stays F32,
    or with ``allow_f16`` (--allow-requant) is rounded to F16.
    """
    t = t.detach().float().contiguous()
    if t.dim() >= 2:
        for dt, name in ((torch.float16, "F16"), (torch.bfloat16, "BF16")):
            narrow = t.to(dt)
            if torch.equal(narrow.float(), t):
                return narrow.view(torch.uint8 if dt == torch.bfloat16 else torch.float16).numpy(), name
        if allow_f16:
            return t.to(torch.float16).numpy(), "F16 (rounded)"
    return t.numpy(), "F32"


def _dense_tensor(key: str, t: torch.Tensor, config: Any, arch: Arch, allow_f16: bool) -> tuple[np.ndarray, str]:
    heads = _heads_for(key.rsplit(".", 1)[0], config, arch) if key.endswith(".weight") else None
    if heads and t.dim() == 2:
        t = t[rope_rows(t.shape[0], heads)]
    if arch.norm_shift and key.endswith("norm.weight"):
        t = t.float() + arch.norm_shift
    return dense_blocks(t, allow_f16)


def _tensor_name_map(arch: Arch, config: Any) -> Any:
    gguf = _gguf()
    kind = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
            "gemma3": gguf.MODEL_ARCH.GEMMA3, "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
            "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE, "olmoe": gguf.MODEL_ARCH.OLMOE,
            "gpt-oss": gguf.MODEL_ARCH.GPT_OSS, "deepseek2": gguf.MODEL_ARCH.DEEPSEEK2}[arch.gguf]
    return gguf.get_tensor_name_map(kind, config.num_hidden_layers)


def export(model: nn.Module, tokenizer: Any, out: str | Path, force: bool = False, allow_requant: bool = False,
           source_gguf: str | Path | None = None, name: str = "lowbit", file_type: int = 1,
           embeddings: str = "llama.cpp", output_importance: torch.Tensor | None = None) -> dict[str, Any]:
    """Write ``model`` as a GGUF file atomically; returns per-type counts and what was not exact.

    Checks the architecture, the output path and every layer's GGUF type before writing;
    each quantized tensor is verified against gguf-py's dequantization while it is packed.
    ``file_type`` (a `FILE_TYPES` number) names llama.cpp's file type; with ``embeddings``
    "llama.cpp" the token embedding and a float output tensor take that file type's types
    (`embedding_plan`), "f16" keeps them 16-bit. A uniform legacy plan (every layer Q4_0,
    Q8_0, ...) is that legacy file type. ``output_importance`` (``[hidden]`` mean squared final
    hidden state, recorded by `lowbit quantize`) weights the search on the output table.
    """
    gguf = _gguf()
    out = Path(out)
    config = model.config
    moe = gguf_moe.is_moe(model)
    arch = arch_of(config, moe)
    if moe:
        gguf_moe.check_config(config)
    if out.exists() and not (force and written_by_lowbit(out)):
        raise LowbitError(f"{out} already exists and is not a GGUF lowbit wrote; choose another --out"
                          if force else f"{out} already exists; choose another --out or pass --force to replace it")
    if embeddings not in EMBEDDINGS:
        raise SchemeError(f"embeddings={embeddings!r}: choose one of {', '.join(EMBEDDINGS)}")
    types = plan_types(model, allow_requant)
    qlayers = quant_layers(model)
    stacks = quant_stacks(model)
    ftype = file_type_of(file_type, types)
    file_type = FILE_TYPES.get(ftype or "", file_type)
    embeds = embedding_plan(model, ftype) if embeddings == "llama.cpp" else {}
    key = output_table(model)[0]
    imps = {} if output_importance is None or key is None or output_importance.numel() != \
        model.get_output_embeddings().in_features else {key: output_importance}
    name_map = _tensor_name_map(arch, config)
    # asked again at the rename: a file that appeared (or was swapped in) meanwhile is replaced only if lowbit's
    with atomic_file(out, may_replace=lambda p: force and written_by_lowbit(p)) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch.gguf)
        add_model_metadata(writer, config, name, arch, file_type)
        if source_gguf is not None:
            copy_tokenizer_fields(writer, Path(source_gguf))
        elif tokenizer is not None:
            add_hf_tokenizer(writer, tokenizer, arch.pre_tokenizer)
        floats: dict[str, str] = {}
        counts, rounded = _add_tensors(writer, model, qlayers, types, name_map, arch, allow_requant, embeds, imps,
                                       floats)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
        writer.close()
    result = {"out": str(out), "arch": arch.gguf, "types": counts,
              "verified": sum(p.exact * (2 if n in stacks and n.endswith("gate_up_proj") else 1)
                              for n, p in types.items()) + len(embeds),
              "requantized": sorted(n for n, p in types.items() if not p.exact)}
    fallback = sorted(n for n, layer in qlayers.items() if layer.in_features % 256 and
                      any(lay.scheme.family.name == "kquant" for lay in qlayers.values())
                      and layer.scheme.family.name != "kquant")
    if fallback:
        result["fallback"] = (f"{len(fallback)} tensor(s) with rows not a multiple of 256 hold llama.cpp's 32-block "
                              "fallback types (Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), "
                              "as llama.cpp does")
    if rounded:
        result["rounded_to_f16"] = rounded
    if floats:
        result["float_tensors"] = floats
    result["embeddings"] = _embeddings_note(model, embeds, ftype, embeddings, bool(imps.keys() & embeds.keys()))
    unread = transformers_readback(out, config)
    if unread is not None:
        warnings.warn(unread, stacklevel=2)
        result["transformers_readback"] = unread
    return result


def transformers_readback(path: Path, config: Any) -> str | None:
    """Why transformers' own GGUF loader would rebuild the written file wrongly (None: it restores the heads).

    Asked of transformers itself (its config from the file's metadata): a qwen3 whose head
    size is not the config class's default comes back with the wrong head size, because
    transformers does not read ``attention.key_length`` for it; llama.cpp does, and so does
    lowbit's loader (`lowbit.files.gguf_read.restored_config`).
    """
    from transformers import AutoConfig

    if getattr(config, "model_type", None) in MOE_ARCHS:
        return ("transformers' own GGUF loader does not rebuild mixture-of-experts files faithfully (a Mixtral file "
                "loads as a dense Llama); llama.cpp runs this file, and `lowbit eval` / `lowbit quantize` read it "
                "back with lowbit's reader (`lowbit.files.gguf_moe_read`)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, KeyError, ImportError) as e:
        return f"transformers' own GGUF loader cannot read this file's config ({str(e).splitlines()[0][:100]})"
    theirs, ours = head_dim(got), head_dim(config)
    if theirs == ours:
        return None
    return (f"transformers' own GGUF loader cannot read this file back: it ignores "
            f"attention.key_length for {config.model_type} and rebuilds heads of {theirs}, not {ours}; "
            "llama.cpp reads it, and `lowbit eval` / `lowbit quantize` load it with the head size from key_length")


def file_type_of(file_type: int, types: dict[str, TensorPlan]) -> str | None:
    """llama.cpp's file type of this export: the one ``file_type`` names, else the legacy type every
    layer holds exactly (a uniform w4g32 plan is llama.cpp's Q4_0), else None (no llama.cpp rule)."""
    named = {v: k for k, v in FILE_TYPES.items()}.get(file_type)
    if named is not None:
        return named
    held = {p.qtype for p in types.values() if p.exact}
    if len(held) == 1 and all(p.exact for p in types.values()) and held <= {t.upper() for t in gguf_types.LEGACY}:
        return held.pop().lower()
    return None


def embedding_plan(model: nn.Module, ftype: str | None) -> dict[str, str]:
    """state_dict key -> GGUF type of the token embedding and a float output tensor in file type ``ftype``.

    Tied (the lm_head is the embedding's own tensor, or there is none): one ``token_embd``
    that llama.cpp also uses as the output, typed by the output rule. A quantized lm_head is
    ``output.weight`` already, so the embedding is untied. Tables whose rows no block type
    fits (F16 by llama.cpp's fallback) are left out: they stay 16-bit.
    """
    if ftype is None:
        return {}
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    tied = head is None or (isinstance(head, nn.Linear) and head.weight is emb.weight)
    got = gguf_types.embedding_types(ftype, emb.weight.shape[1], tied)
    plan = {f"{names[id(emb)]}.weight": got["token_embd"]}
    if "output" in got and isinstance(head, nn.Linear):  # a QuantLinear head is in the layer plan
        plan[f"{names[id(head)]}.weight"] = got["output"]
    return {k: t for k, t in plan.items() if t != "F16"}


def recorded_importance(meta: Any) -> torch.Tensor | None:
    """The output table's importance `lowbit quantize` recorded in a checkpoint's manifest (None: none, or not
    a list of finite non-negative numbers)."""
    got = meta.get("gguf_output_importance") if hasattr(meta, "get") else None
    if not isinstance(got, list) or not got or not all(isinstance(v, (int, float)) for v in got):
        return None
    t = torch.tensor(got, dtype=torch.float32)
    return t if bool(torch.isfinite(t).all()) and bool((t >= 0).all()) else None


def output_table(model: nn.Module) -> tuple[str | None, str | None]:
    """(state_dict key of the float table llama.cpp multiplies the final hidden states by, the head's module
    name): the tied embedding or a float lm_head; (None, None) when the head is quantized (a plan layer) or absent."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return None, None
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    table = emb if head.weight is emb.weight else head
    return f"{names[id(table)]}.weight", names[id(head)]


def _embeddings_note(model: nn.Module, embeds: dict[str, str], ftype: str | None, embeddings: str,
                     weighted: bool = False) -> str:
    if embeds:
        head = model.get_output_embeddings()
        tied = head is None or (isinstance(head, nn.Linear) and head.weight is model.get_input_embeddings().weight)
        return (", ".join(f"{k}: {t}" for k, t in embeds.items())
                + (" (tied: llama.cpp also uses it as the output)" if tied else "")
                + f", llama.cpp's {ftype} types, quantized here by lowbit's search"
                + ("" if not weighted else " (the output table weighted by the calibration's final hidden states)"))
    if embeddings == "f16":
        return "16-bit (kept as asked); llama.cpp's own file would quantize them"
    if ftype is None:
        return "16-bit: the plan follows no llama.cpp file type (a mix such as q4_k_m, or a uniform Q4_0/Q8_0 ...)"
    return "16-bit: no GGUF block type fits their rows (llama.cpp's fallback keeps F16 too)"


def embedding_array(key: str, t: torch.Tensor, qtype: str, imp: torch.Tensor | None = None) -> np.ndarray:
    """The GGUF blocks of an embedding table in ``qtype``, quantized by lowbit's search and verified.

    imp: ``[cols]`` importance of the table's columns as the output matmul's inputs (None: every column alike,
    the weights' own magnitudes still weighting the K-quant search)."""
    require_finite([(key, t)], "GGUF export", "nothing was written: the checkpoint's weights are not finite")
    q = quantize(t.detach().float(), gguf_types.gguf_scheme(qtype), imp)
    raw = pack_blocks(q, qtype, key)
    if qtype in ("Q4_1", "Q5_1") and not q4_1_exact(q):  # the fp16 block minimum rounds: what llama.cpp reads
        written_values(raw, qtype, q.shape, key)
    else:
        verify_blocks(raw, qtype, q.dequantize(), key)
    return raw


def _add_tensors(writer: Any, model: nn.Module, qlayers: dict, types: dict[str, TensorPlan], name_map: Any,
                 arch: Arch, allow_f16: bool, embeds: dict[str, str], imps: dict[str, torch.Tensor],
                 floats: dict[str, str] | None = None) -> tuple[dict[str, int], list[str]]:
    """Every tensor of ``model`` into ``writer``; (count per GGUF type, keys rounded to F16). ``floats`` collects
    GGUF name -> why, for the tensors of quantized layers that a float type holds (DeepSeek's attn_k_b)."""
    gguf = _gguf()
    counts: dict[str, int] = {}
    rounded: list[str] = []
    own = {f"{n}.{k}" for n in qlayers for k in ("codes", "scales", "zeros", "tensor_scale")}
    own |= gguf_moe.owned_keys(model)
    seen: set[tuple] = set()
    for key, t in model.state_dict().items():
        ident = (t.data_ptr(), tuple(t.shape), t.dtype)
        if key in own or (t.numel() and ident in seen) or "rotary_emb" in key:
            continue
        seen.add(ident)
        if gguf_mla.is_mla(model.config) and gguf_mla.is_kv_b(key):  # a float kv_b_proj (kept by a plan)
            require_finite([(key, t)], "GGUF export", "nothing was written: the checkpoint's weights are not finite")
            for gname, part in _kv_b_float(key, t.detach().float(), name_map, model.config):
                arr, kind = dense_blocks(part, allow_f16)
                kind = "F16" if kind.startswith("F16") else kind
                writer.add_tensor(gname, arr, raw_dtype=gguf.GGMLQuantizationType.BF16 if kind == "BF16" else None)
                counts[kind] = counts.get(kind, 0) + 1
            continue
        bias = gguf_mla.bias_name(key)
        if bias is not None or gguf_moe.is_router(key) or key.endswith("self_attn.sinks"):  # F32, as llama.cpp's converter writes them
            require_finite([(key, t)], "GGUF export", "nothing was written: the checkpoint's weights are not finite")
            name = bias or _gguf_name(name_map, key) + (".weight" if key.endswith(".sinks") else "")
            writer.add_tensor(name, t.detach().float().contiguous().numpy())
            counts["F32"] = counts.get("F32", 0) + 1
            continue
        if key in embeds:
            raw = embedding_array(key, t, embeds[key], imps.get(key))
            writer.add_tensor(_gguf_name(name_map, key), raw, raw_dtype=gguf.GGMLQuantizationType[embeds[key]])
            counts[embeds[key]] = counts.get(embeds[key], 0) + 1
            continue
        arr, kind = _dense_tensor(key, t, model.config, arch, allow_f16)
        require_finite([(key, t), (key, arr)], "GGUF export", "nothing was written: "
                       + ("F16 cannot hold this tensor's values; drop --allow-requant" if kind.endswith("(rounded)")
                          else "the checkpoint's weights are not finite; re-create it"))
        if kind.endswith("(rounded)"):
            rounded.append(key)
            kind = "F16"
        raw = gguf.GGMLQuantizationType.BF16 if kind == "BF16" else None
        writer.add_tensor(_gguf_name(name_map, key), arr, raw_dtype=raw)
        counts[kind] = counts.get(kind, 0) + 1
    for name, layer in qlayers.items():
        if gguf_mla.is_mla(model.config) and gguf_mla.is_kv_b(name):
            for gname, arr, qtype in _kv_b_quantized(name, layer.qweight, types[name], name_map, model.config, arch):
                writer.add_tensor(gname, arr, raw_dtype=gguf.GGMLQuantizationType[qtype])
                counts[qtype] = counts.get(qtype, 0) + 1
                if qtype in ("F16", "BF16", "F32") and floats is not None:
                    floats[gname] = f"{qtype}: {gguf_mla.K_B_WHY}"
            continue
        arr, qtype = _layer_array(layer, name, types[name], model.config, arch)
        writer.add_tensor(_gguf_name(name_map, f"{name}.weight"), arr, raw_dtype=gguf.GGMLQuantizationType[qtype])
        counts[qtype] = counts.get(qtype, 0) + 1
    for name, mod in gguf_moe.experts_modules(model).items():
        for gname, arr, qtype in _expert_arrays(name, mod, types, model.config, allow_f16):
            writer.add_tensor(gname, arr, raw_dtype=None if qtype in ("F32", "F16") else
                              gguf.GGMLQuantizationType[qtype])
            counts[qtype] = counts.get(qtype, 0) + 1
    return counts, rounded


def _kv_b_names(name_map: Any, key: str) -> tuple[str, str]:
    """GGUF names of a kv_b_proj's key and value halves (llama.cpp's attn_k_b, attn_v_b)."""
    base = key.removesuffix(".weight").removesuffix("kv_b_proj")
    return _gguf_name(name_map, f"{base}k_b_proj.weight"), _gguf_name(name_map, f"{base}v_b_proj.weight")


def _kv_b_float(key: str, w: torch.Tensor, name_map: Any, config: Any) -> list[tuple[str, torch.Tensor]]:
    """(GGUF name, float tensor) of a float kv_b_proj's two halves (`lowbit.files.gguf_mla`)."""
    k_name, v_name = _kv_b_names(name_map, key)
    return [(k_name, gguf_mla.k_b(w, config)), (v_name, gguf_mla.v_b(w, config))]


def _kv_b_quantized(name: str, q: QTensor, plan: TensorPlan, name_map: Any, config: Any, arch: Arch
                    ) -> list[tuple[str, np.ndarray, str]]:
    """(GGUF name, array, type) of a quantized kv_b_proj: attn_v_b from lowbit's codes (its blocks run along
    kv_lora_rank, as lowbit grouped them), attn_k_b -- transposed, blocks impossible -- as the narrowest float
    type that holds lowbit's dequantized weights exactly (`gguf_mla.K_B_WHY`; listed in the result)."""
    from types import SimpleNamespace

    k_name, v_name = _kv_b_names(name_map, name)
    heads, v = int(config.num_attention_heads), int(config.v_head_dim)
    qv = gguf_moe.cut_rows(q, gguf_mla.kv_b_rows(config)[1])
    raw, qtype = _layer_array(SimpleNamespace(qweight=qv), name, plan, config, arch)
    arr, kind = dense_blocks(gguf_mla.k_b(q.dequantize(), config))  # exact: never rounded, whatever allow_requant
    return [(k_name, arr, kind), (v_name, raw.reshape(heads, v, -1), qtype)]


def _expert_arrays(name: str, mod: nn.Module, types: dict[str, TensorPlan], config: Any, allow_f16: bool
                   ) -> list[tuple[str, np.ndarray, str]]:
    """(GGUF name, array, type) of one experts module's ``ffn_*_exps`` tensors and biases (`lowbit.files.gguf_moe`).

    Quantized stacks are packed expert by expert and verified like a Linear; float experts (kept by a plan)
    take the narrowest float type that holds them, biases F32.
    """
    block = gguf_moe.block_of(name)
    inter = gguf_moe.interleaved(getattr(config, "model_type", None))
    stacks = mod.stacks() if isinstance(mod, QuantExperts) else {}
    out = []
    for part in gguf_moe.PARTS:
        gname = f"blk.{block}.{part.gguf}"
        stack = stacks.get(part.param)
        if stack is not None:
            plan = types[f"{name}.{part.param}"]
            rows = gguf_moe.part_rows(part, stack.out_features, inter)
            arr = gguf_moe.stack_array(gguf_moe.stack_rows(stack, rows), plan.qtype, gname, plan.exact)
            out.append((f"{gname}.weight", arr, plan.qtype))
        else:
            w = gguf_moe.float_rows(mod, part, inter)
            require_finite([(gname, w)], "GGUF export", "nothing was written: the checkpoint's weights are not finite")
            arr, kind = dense_blocks(w, allow_f16)
            out.append((f"{gname}.weight", arr, "F16" if kind.startswith("F16") else kind))
        bias = gguf_moe.bias_rows(mod, part, inter)
        if bias is not None:
            require_finite([(gname, bias)], "GGUF export", "nothing was written: the checkpoint's biases are not finite")
            out.append((f"{gname}.bias", bias.contiguous().numpy(), "F32"))
    return out
