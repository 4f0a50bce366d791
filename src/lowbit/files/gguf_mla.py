"""DeepSeek-V3 in GGUF: multi-head latent attention as llama.cpp's ``deepseek2`` architecture reads it.

llama.cpp runs MLA in its absorbed form: the key/value cache holds the compressed latent
(``kv_lora_rank`` values plus the shared rope key), so the file declares one key/value head of
``kv_lora_rank + qk_rope_head_dim`` keys and ``kv_lora_rank`` values, and the real head sizes go
to ``key_length_mla`` / ``value_length_mla``. transformers' ``kv_b_proj`` ([heads * (nope + v),
kv_lora_rank]) is split per head into

- ``attn_v_b`` = the value rows, numpy ``[heads, v_head_dim, kv_lora_rank]``: each row is a row
  of kv_b_proj, its quantization blocks along kv_lora_rank exactly as lowbit grouped them, so
  lowbit's codes are written as they are;
- ``attn_k_b`` = the key rows TRANSPOSED, numpy ``[heads, kv_lora_rank, qk_nope_head_dim]``:
  llama.cpp multiplies each head's query by it, so its rows run along kv_lora_rank and any
  block would run along qk_nope, across lowbit's groups. No GGUF block type holds those
  numbers, so attn_k_b is written in the narrowest float type that holds lowbit's dequantized
  weights exactly (F16 / BF16 / F32) and reported as such by the export (``float_tensors``):
  the key half of kv_b_proj (0.5 B of DeepSeek-V3's 671 B weights, 0.08 %) computes with the
  very numbers lowbit evaluated, never re-quantized.

llama.cpp's older, unsplit ``attn_kv_b`` (the "non-MLA" path, still loaded when the file has no
``key_length_mla``) would keep every code, but caches full per-head keys and values: far more
memory per token for a real DeepSeek-V3, and only legacy files use it. Routing: sigmoid gating
(``expert_gating_func``), the score-correction bias as ``exp_probs_b.bias``, group-limited top-k
(``expert_group_count`` / ``expert_group_used_count``), top-k renormalisation and the routed
scaling factor; the first ``first_k_dense_replace`` blocks are dense (``leading_dense_block_count``).
"""

from __future__ import annotations

from typing import Any

import torch

from lowbit.errors import ModelError

MLA_TYPES = ("deepseek_v3",)  # HF model_type -> llama.cpp deepseek2
# why a tensor is written in a float type although its layer is quantized (said in the export's result)
K_B_WHY = ("kv_b_proj's key half, transposed per head for llama.cpp's absorbed MLA: its blocks would run along "
           "qk_nope_head_dim, across lowbit's groups, so it holds lowbit's dequantized weights exactly in a float type")


def is_mla(config: Any) -> bool:
    return getattr(config, "model_type", None) in MLA_TYPES


def _dims(config: Any) -> tuple[int, int, int]:
    return int(config.num_attention_heads), int(config.qk_nope_head_dim), int(config.v_head_dim)


def kv_b_rows(config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(key rows, value rows) of ``kv_b_proj``, head by head: each head holds nope key rows, then v value rows."""
    heads, nope, v = _dims(config)
    base = torch.arange(heads).unsqueeze(1) * (nope + v)
    return (base + torch.arange(nope)).reshape(-1), (base + nope + torch.arange(v)).reshape(-1)


def k_b(w: torch.Tensor, config: Any) -> torch.Tensor:
    """``attn_k_b`` ``[heads, kv_lora_rank, nope]`` of a float ``kv_b_proj`` weight ``[heads * (nope + v), rank]``."""
    heads, nope, _ = _dims(config)
    return w[kv_b_rows(config)[0]].reshape(heads, nope, -1).transpose(1, 2).contiguous()


def v_b(w: torch.Tensor, config: Any) -> torch.Tensor:
    """``attn_v_b`` ``[heads, v, kv_lora_rank]`` of a float ``kv_b_proj`` weight."""
    heads, _, v = _dims(config)
    return w[kv_b_rows(config)[1]].reshape(heads, v, -1)


def kv_b(kb: torch.Tensor, vb: torch.Tensor, config: Any) -> torch.Tensor:
    """``kv_b_proj`` ``[heads * (nope + v), rank]`` back from ``attn_k_b`` and ``attn_v_b`` (the reader's inverse)."""
    return torch.cat([kb.transpose(1, 2), vb], 1).reshape(-1, kb.shape[1])


def is_kv_b(name: str) -> bool:
    return name.removesuffix(".weight").endswith("self_attn.kv_b_proj")


def bias_name(key: str) -> str | None:
    """GGUF name of DeepSeek's routing score-correction bias (llama.cpp's ``exp_probs_b.bias``), None for other keys."""
    if not key.endswith("mlp.gate.e_score_correction_bias"):
        return None
    from lowbit.files.gguf_moe import block_of

    return f"blk.{block_of(key)}.exp_probs_b.bias"


def check_config(config: Any) -> None:
    """Refuse a DeepSeek-V3 that llama.cpp's deepseek2 graph would compute differently, before anything is written."""
    if not getattr(config, "rope_interleave", True):
        raise ModelError("deepseek_v3 with rope_interleave=False: llama.cpp's deepseek2 graph rotates the rope "
                         "dimensions as interleaved pairs (as DeepSeek-V3 ships); export it with --to compressed-tensors")
    if getattr(config, "attention_bias", False):
        raise ModelError("deepseek_v3 with attention_bias=True: llama.cpp's deepseek2 graph has no attention biases; "
                         "export it with --to compressed-tensors")
    rope = getattr(config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type") == "yarn" and (
            rope.get("attention_factor") is not None or rope.get("mscale") != rope.get("mscale_all_dim")):
        raise ModelError("deepseek_v3 with YaRN whose mscale differs from mscale_all_dim (or an explicit "
                         "attention_factor): lowbit writes DeepSeek-V3's own YaRN (mscale = mscale_all_dim, checked "
                         "against llama.cpp's logits), not this one; export it with --to compressed-tensors")
    experts, groups = int(config.n_routed_experts), int(getattr(config, "n_group", 1) or 1)
    if experts % groups:
        raise ModelError(f"deepseek_v3 with {experts} experts in {groups} groups: llama.cpp's group-limited routing "
                         "needs equal groups; export it with --to compressed-tensors")


def add_metadata(writer: Any, config: Any) -> None:
    """The deepseek2 keys: MLA head sizes and ranks, rope dimensions, leading dense blocks, routing."""
    import gguf

    rank, rope = int(config.kv_lora_rank), int(config.qk_rope_head_dim)
    writer.add_head_count_kv(1)  # absorbed MLA is one latent key/value head
    writer.add_key_length(rank + rope)
    writer.add_value_length(rank)
    writer.add_key_length_mla(int(config.qk_nope_head_dim) + rope)
    writer.add_value_length_mla(int(config.v_head_dim))
    writer.add_kv_lora_rank(rank)
    writer.add_q_lora_rank(int(config.q_lora_rank or 0))  # 0: a plain q_proj (llama.cpp requires the key)
    writer.add_rope_dimension_count(rope)
    writer.add_leading_dense_block_count(int(config.first_k_dense_replace or 0))
    writer.add_expert_feed_forward_length(int(config.moe_intermediate_size))
    writer.add_expert_shared_count(int(config.n_shared_experts or 0))
    writer.add_expert_weights_scale(float(config.routed_scaling_factor))
    writer.add_expert_weights_norm(bool(config.norm_topk_prob))
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    groups = int(getattr(config, "n_group", 1) or 1)
    if groups > 1:
        writer.add_expert_group_count(groups)
        writer.add_expert_group_used_count(int(config.topk_group))
