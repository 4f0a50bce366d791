"""Attention inside the tuned block: SDPA kernels that exist for the dtype the block runs in.

Models load with transformers' ``sdpa`` attention. For grouped-query attention (fewer
key/value heads than query heads, e.g. Llama 3, TinyLlama, SmolLM2) it asks
``scaled_dot_product_attention`` for ``enable_gqa``. On a GPU the fused kernels that take
that flag are flash attention (fp16/bf16 only) and cuDNN (fp16/bf16 only); the
memory-efficient kernel, the one that runs fp32, does not take it. Block tuning runs the
block in fp32 (its targets, residuals, norms and attention stay fp32; only the tuned
Linears' products may be bf16), so SDPA fell back to its math path: one fp32 ``bmm`` for
``Q K^T``, a softmax, another ``bmm``, with the full ``[batch, heads, T, T]`` score
matrix stored for the backward. That was the "eager" attention of the H200 profile
(issue 22): ~1.6 s of 4.6 s per block, and most of the peak memory at 2048 tokens.

`tuning_attention` swaps the model's implementation for one that repeats the key/value
heads itself when the inputs are fp32 on a GPU, so SDPA can pick the memory-efficient
kernel (no score matrix, ``O(T)`` memory); everywhere else (CPU, bf16, no GQA, masks or
biases SDPA handles its own way) it is transformers' ``sdpa`` function unchanged. On the
CPU that keeps today's path: the fused CPU kernel takes ``enable_gqa`` in fp32, and
repeating the heads was no faster there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

NAME = "lowbit_sdpa"


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[b, kv, t, d]`` -> ``[b, kv * n_rep, t, d]`` (each key/value head serves ``n_rep`` query heads)."""
    b, kv, t, d = x.shape
    return x[:, :, None].expand(b, kv, n_rep, t, d).reshape(b, kv * n_rep, t, d)


def needs_expanded_kv(query: torch.Tensor, module: nn.Module) -> bool:
    """True where no fused SDPA kernel takes grouped KV heads for these inputs: fp32 on a GPU."""
    return (getattr(module, "num_key_value_groups", 1) > 1 and query.device.type == "cuda"
            and query.dtype == torch.float32)


def block_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, with the KV heads repeated first where `needs_expanded_kv`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = kwargs.get("softcap") is None and kwargs.get("position_bias") is None and kwargs.get("s_aux") is None
    if not (plain and needs_expanded_kv(query, module)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    n_rep = module.num_key_value_groups
    key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > q_len:  # as transformers does: the causal kernels want q_len == kv_len
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=causal)
    return out.transpose(1, 2).contiguous(), None


def _register() -> bool:
    try:
        from transformers import AttentionInterface
    except ImportError:  # a transformers without the interface: nothing to swap
        return False
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, block_attention)
    return True


@contextlib.contextmanager
def tuning_attention(model: nn.Module) -> Iterator[None]:
    """Run the body with `block_attention` in place of the model's ``sdpa`` attention (others untouched)."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current != "sdpa" or not _register():
        yield
        return
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = current
