"""Mixture-of-experts layers in GGUF: lowbit's fused experts as llama.cpp's 3-D ``ffn_*_exps`` tensors.

llama.cpp keeps a MoE layer's experts as three 3-D tensors per block, ``blk.N.ffn_gate_exps``,
``ffn_up_exps`` ([E, I, H] in numpy order, GGML ne {H, I, E}) and ``ffn_down_exps`` ([E, H, I]):
each expert's ``[out, in]`` matrix is one slab, its quantization blocks running along the
input exactly like a 2-D weight's. lowbit quantizes each expert's matrix as a Linear
(`lowbit.nn.quant_experts.QuantStack`), so a stack's codes and scales map onto those slabs
one expert at a time: nothing is re-quantized. transformers' fused ``gate_up_proj``
([E, 2I, H]) splits at row I into gate and up; gpt-oss's (stored transposed, gate and up
interleaved by row) splits into even and odd rows, as llama.cpp's converter de-interleaves it.

The router (``ffn_gate_inp``, and gpt-oss's bias) is written in F32, as llama.cpp's converter
writes it; gpt-oss's expert biases (``ffn_*_exps.bias``, [E, I] / [E, H]) are F32 too.
llama.cpp's graphs hard-wire some routing choices per architecture (qwen3moe renormalises the
top-k weights, qwen2moe and olmoe do not, Mixtral always does), so a model whose config asks
otherwise is refused before anything is written: the file would compute another model.
DeepSeek-V3 (llama.cpp's deepseek2) adds its MLA tensors, routing keys and checks through
`lowbit.files.gguf_mla`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from lowbit.errors import ModelError
from lowbit.files import gguf_mla
from lowbit.formats import QTensor
from lowbit.nn.quant_experts import QuantExperts, QuantStack

# HF model_type -> llama.cpp architecture, for the mixture-of-experts models GGUF export maps
MOE_ARCHS = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe",
             "gpt_oss": "gpt-oss", "deepseek_v3": "deepseek2"}
# whether llama.cpp's graph renormalises the top-k routing weights (build_moe_ffn's norm_w), per model_type
_NORM_TOPK = {"qwen3_moe": True, "qwen2_moe": False, "olmoe": False}


@dataclass(frozen=True)
class ExpertPart:
    """One GGUF expert tensor cut from a fused experts parameter: which rows of each expert's matrix."""

    gguf: str  # ffn_gate_exps / ffn_up_exps / ffn_down_exps
    param: str  # the experts module's parameter (gate_up_proj, down_proj)
    half: int | None  # 0 = gate, 1 = up of a fused gate_up_proj; None = every row


PARTS = (ExpertPart("ffn_gate_exps", "gate_up_proj", 0), ExpertPart("ffn_up_exps", "gate_up_proj", 1),
         ExpertPart("ffn_down_exps", "down_proj", None))


def part_rows(part: ExpertPart, out: int, interleaved: bool) -> torch.Tensor | None:
    """Rows of an expert's ``[out, in]`` matrix that ``part`` holds (None: all of them).

    A fused gate_up matrix holds gate rows then up rows (transformers' layout), or, for
    gpt-oss, gate and up alternating row by row.
    """
    if part.half is None:
        return None
    if interleaved:
        return torch.arange(part.half, out, 2)
    half = out // 2
    return torch.arange(part.half * half, (part.half + 1) * half)


def _float_experts(m: nn.Module) -> bool:
    """A float fused experts module: own 3-D parameters (the structure `lowbit.models.accounting` finds them by;
    ``files`` sits below ``models``), not a convolution."""
    return not isinstance(m, nn.modules.conv._ConvNd) and any(p.ndim == 3 for p in m.parameters(recurse=False))


def is_moe(model: nn.Module) -> bool:
    """Whether the model has fused experts (float or quantized)."""
    return any(isinstance(m, QuantExperts) or _float_experts(m) for m in model.modules())


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> fused experts module (float or `QuantExperts`), in model order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts) or _float_experts(m)}


def block_of(name: str) -> int:
    got = re.search(r"layers\.(\d+)\.", name + ".")
    if got is None:
        raise ModelError(f"{name}: no decoder block index in its name; GGUF's expert tensors are per block")
    return int(got.group(1))


def interleaved(model_type: str | None) -> bool:
    """gpt-oss interleaves gate and up rows in its fused matrix."""
    return model_type == "gpt_oss"


def check_config(config: Any) -> None:
    """Refuse a model that llama.cpp's graph for its architecture would compute differently (routing, layout)."""
    kind = getattr(config, "model_type", None)
    if gguf_mla.is_mla(config):  # dense leading blocks, shared experts and its routing are deepseek2's own
        gguf_mla.check_config(config)
        return
    want = _NORM_TOPK.get(kind)
    got = getattr(config, "norm_topk_prob", None)
    if want is not None and got is not None and bool(got) != want:
        raise ModelError(f"{kind} with norm_topk_prob={bool(got)}: llama.cpp's {MOE_ARCHS[kind]} graph "
                         f"{'always renormalises' if want else 'never renormalises'} the top-k routing weights, so "
                         "the GGUF file would compute another model; export it with --to compressed-tensors or "
                         "lowbit's native format")
    sparse = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    if sparse or step != 1:
        raise ModelError(f"{kind} with dense MLP layers between the MoE ones (mlp_only_layers={list(sparse)}, "
                         f"decoder_sparse_step={step}): llama.cpp's {MOE_ARCHS.get(kind, kind)} graph expects "
                         "experts in every block; export it with --to compressed-tensors")
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kind == "olmoe" and kv != heads:
        raise ModelError(f"olmoe with {kv} key/value heads for {heads} query heads: llama.cpp's olmoe graph sizes "
                         "attn_k_norm for as many key/value heads as query heads (as OLMoE ships); export it with "
                         "--to compressed-tensors")
    window = getattr(config, "sliding_window", None)
    if kind == "mixtral" and window is not None and window < int(config.max_position_embeddings):
        raise ModelError(f"mixtral with a {window}-token sliding window: llama.cpp's llama graph attends to the whole "
                         "context, so the GGUF file would compute another model past the window; export it with "
                         "--to compressed-tensors")
    if kind == "gpt_oss":
        types = list(getattr(config, "layer_types", None) or [])
        want_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(types))]
        if types != want_types:
            raise ModelError("gpt_oss with layer_types other than sliding/full alternating from the first block: "
                             "llama.cpp's gpt-oss graph hard-wires that pattern; export it with --to compressed-tensors")


def add_metadata(writer: Any, config: Any) -> None:
    """The ``{arch}.expert_*`` keys llama.cpp's loaders read for the MoE architectures."""
    kind = config.model_type
    count = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    writer.add_expert_count(int(count))
    writer.add_expert_used_count(int(config.num_experts_per_tok))
    if kind in ("qwen3_moe", "qwen2_moe"):
        writer.add_expert_feed_forward_length(int(config.moe_intermediate_size))
    if kind == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(int(config.shared_expert_intermediate_size))
    if kind == "gpt_oss":
        writer.add_expert_feed_forward_length(int(config.intermediate_size))
        writer.add_sliding_window(int(config.sliding_window))
    if kind in _NORM_TOPK:
        writer.add_expert_weights_norm(_NORM_TOPK[kind])
    if gguf_mla.is_mla(config):
        gguf_mla.add_metadata(writer, config)
    # lowbit's reader rebuilds the model from this (`lowbit.files.gguf_moe_read`): GGUF's keys do not say enough
    cfg = json.loads(config.to_json_string(use_diff=False))
    cfg.pop("quantization_config", None)  # the file's weights are GGUF blocks; the reader builds a float model
    writer.add_string("lowbit.hf_config", json.dumps(cfg))


def expert_count(config: Any) -> int:
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)


def is_router(key: str) -> bool:
    """A router's state-dict key (``mlp.gate.weight``, gpt-oss's ``mlp.router.weight`` / ``.bias``)."""
    return bool(re.search(r"\.mlp\.(gate|router)\.(weight|bias)$", key))


def owned_keys(model: nn.Module) -> set[str]:
    """State-dict keys the expert writer handles (stacks' parts, float 3-D parameters, expert biases)."""
    out = set()
    for name, mod in experts_modules(model).items():
        for key, t in mod.state_dict().items():
            stacked = key.split(".")[0] in {p.param for p in PARTS}
            if stacked or (t.dim() >= 2 and key.endswith("_bias")):
                out.add(f"{name}.{key}")
    return out


def stack_rows(stack: QuantStack, rows: torch.Tensor | None) -> list[Any]:
    """Each expert's `QTensor`, cut to ``rows`` (codes, scales, zeros and per-row super-block scales together)."""
    qs = [stack.expert(e) for e in range(stack.num_experts)]
    return qs if rows is None else [cut_rows(q, rows) for q in qs]


def cut_rows(q: QTensor, rows: torch.Tensor) -> QTensor:
    """The rows ``rows`` of a quantized matrix: codes, scales, zeros and (K-quants) per-row super-block scales."""
    ts = q.tensor_scale[rows] if q.scheme.family.name == "kquant" else q.tensor_scale
    return QTensor(q.codes[rows], q.scales[rows], None if q.zeros is None else q.zeros[rows], ts,
                   (len(rows), q.shape[1]), q.scheme)


def float_rows(mod: nn.Module, part: ExpertPart, interleaved: bool) -> torch.Tensor:
    """``[E, out, in]`` float matrices of ``part`` in a float experts module (kept float by a plan)."""
    p = mod.get_parameter(part.param).detach()
    w = p.transpose(1, 2) if getattr(mod, "is_transposed", False) else p
    rows = part_rows(part, w.shape[1], interleaved)
    return w if rows is None else w[:, rows]


def bias_rows(mod: nn.Module, part: ExpertPart, interleaved: bool) -> torch.Tensor | None:
    """gpt-oss's ``[E, out]`` expert bias of ``part``, F32 (None when the module has none)."""
    b = getattr(mod, f"{part.param}_bias", None)
    if not isinstance(b, torch.Tensor):
        return None
    b = b.detach().float()
    rows = part_rows(part, b.shape[-1], interleaved)
    return b if rows is None else b[:, rows]


def stack_array(qs: list[Any], qtype: str, where: str, exact: bool) -> np.ndarray:
    """``uint8 [E, out, bytes]`` GGUF blocks of one expert tensor, verified against lowbit's weights."""
    from lowbit.files.gguf_export import pack_blocks, requantize, verify_blocks, written_values

    parts = []
    for e, q in enumerate(qs):  # one expert at a time: a 128-expert tensor is never held in float at once
        if exact:
            raw = pack_blocks(q, qtype, f"{where} expert {e}")
            verify_blocks(raw, qtype, q.dequantize(), f"{where} expert {e}")
        else:
            raw = requantize(q.dequantize(), qtype)
            written_values(raw, qtype, q.shape, f"{where} expert {e}")
        parts.append(raw)
    return np.stack(parts)
