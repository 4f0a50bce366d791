"""What each export can hold of a quantized KV cache, and the compressed-tensors form of the one vLLM reads.

vLLM reads compressed-tensors' ``kv_cache_scheme`` only as 8-bit floats (E4M3) with static
symmetric scales per tensor or per attention head (its ``CompressedTensorsKVCacheMethod``
refuses anything else), and loads ``model.layers.{l}.self_attn.k_scale`` / ``v_scale``
(float32, ``[1]`` or ``[kv_heads, 1, 1]`` as llm-compressor writes them; ``fp8 = x / k_scale``).
So FP8 static KV exports; INT8, dynamic and 4-bit KV, and keys rotated by a Hadamard (whose
queries would need the same rotation at run time, which vLLM does not apply) are lowbit-only:
they live in the native checkpoint and `lowbit eval`; so do centered caches (``:center``, an offset per head
and channel added back at dequantization), which vLLM's cache cannot hold: it stores ``fp8(x / k_scale)``
and accepts only symmetric scales (``CompressedTensorsKVCacheMethod.validate_kv_cache_scheme``, vLLM 0.32:
"Only support symmetric scaling factor for compressed-tensors KV cache"). GGUF has no KV-cache format at all
(llama.cpp picks its cache type at run time, ``--cache-type-k``), so a GGUF export of a
model with a KV scheme writes the weights only, and only when asked (``--drop-kv``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowbit.formats.kv import KVScheme

VLLM_LIMIT = ("vLLM reads a compressed-tensors kv_cache_scheme only as FP8 (E4M3) with static per-tensor or "
              "per-head scales (kv fp8 / fp8-head)")


def kv_refusal(to: str, kv: KVScheme, drop_kv: bool = False, mixed: bool = False) -> str | None:
    """Why the export ``to`` cannot hold ``kv`` (None: it can); one line naming the fix.
    mixed: the layers hold different KV schemes (``kv`` is the one most hold)."""
    if to == "gguf":
        return None if drop_kv else (f"GGUF has no KV-cache format (llama.cpp chooses its cache type at run time, "
                                     f"--cache-type-k), so the KV scheme {kv.name} cannot go into the file; pass "
                                     "--drop-kv to write the weights only")
    if to == "transformers":
        return (f"transformers' loader of lowbit checkpoints does not apply the KV scheme {kv.name} (the cache "
                "would stay float); evaluate the checkpoint with `lowbit eval`")
    if to != "compressed-tensors":
        return None
    if mixed:
        return ("the KV cache has a scheme per layer (mixed precision), and vLLM's kv_cache_scheme / kv_cache_dtype "
                f"is one for all layers; {VLLM_LIMIT}, one for every layer")
    if kv.center:
        return (f"KV scheme {kv.name} stores keys and values minus a calibrated offset per head and channel, and "
                "vLLM's cache holds fp8(x / k_scale) with no offset (its compressed-tensors KV loader accepts only "
                f"symmetric scales); {VLLM_LIMIT}, without :center, or keep {kv.name} in the native checkpoint "
                "(lowbit eval)")
    if kv.rotate:
        return (f"KV scheme {kv.name} rotates the keys, which needs the queries rotated at run time and vLLM does "
                f"not do that; {VLLM_LIMIT}, without -rot")
    served = vllm_cache_dtype(kv)
    if served is not None:
        return (f"KV scheme {kv.name} has no checkpoint form ({VLLM_LIMIT}); vLLM computes the same per-token, "
                f"per-head scales itself when served with kv_cache_dtype={served} (its Triton backend): export "
                "without --kv and pass that at serve time")
    if not (kv.static and kv.elements.elem == "e4m3"):
        return f"KV scheme {kv.name}: {VLLM_LIMIT}; keep {kv.name} in the native checkpoint (lowbit eval)"
    return None


def vllm_cache_dtype(kv: KVScheme) -> str | None:
    """vLLM's run-time ``kv_cache_dtype`` that quantizes the cache as ``kv`` does, for a dynamic per-token scheme:
    vLLM 0.32's ``int8_per_token_head`` / ``fp8_per_token_head`` (scale = abs-max / qmax of each token's head at
    cache write, fp32 scales; INT8 rounds halves away from zero where lowbit rounds them to even). None: none."""
    e = kv.elements
    if kv.static or kv.rotate or kv.center or e.group_size != -1 or e.bits != 8:
        return None
    return {"int": "int8_per_token_head", "e4m3": "fp8_per_token_head"}.get(e.elem)


def kv_cache_args(kv: KVScheme) -> dict[str, Any]:
    """compressed-tensors' ``kv_cache_scheme`` (a QuantizationArgs dict) for an exportable scheme."""
    return {"num_bits": 8, "type": "float", "strategy": "attn_head" if kv.per_head else "tensor",
            "dynamic": False, "symmetric": True}


def kv_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``...self_attn.k_scale`` / ``v_scale`` float32 in vLLM's layout ([1] per tensor, [kv_heads, 1, 1] per head)."""
    from lowbit.nn.kv_quant import SCALES, STATE, attention_modules

    out = {}
    for name, attn in attention_modules(model).items():
        state = getattr(attn, STATE, None)
        if state is None:
            continue
        for s in SCALES:
            t = getattr(attn, s).detach().float().cpu()
            out[f"{name}.{s}"] = t.reshape(-1, 1, 1) if state.scheme.per_head else t.reshape(1)
    return out


def add_kv_cache(model: nn.Module, tensors: dict[str, torch.Tensor], qconfig: dict[str, Any]) -> None:
    """Put the model's KV scheme into a compressed-tensors export (refused where vLLM cannot read it)."""
    from lowbit.errors import SchemeError
    from lowbit.nn.kv_quant import kv_scheme_of, kv_schemes

    kv = kv_scheme_of(model)
    if kv is None:
        return
    why = kv_refusal("compressed-tensors", kv, mixed=len(set(kv_schemes(model).values())) > 1)
    if why is not None:
        raise SchemeError(why)
    tensors.update(kv_tensors(model))
    qconfig["kv_cache_scheme"] = kv_cache_args(kv)
