"""Read a mixture-of-experts GGUF that lowbit wrote back into a transformers model with fused experts.

transformers' own GGUF loader does not rebuild these files faithfully (measured with
transformers 5.25 on lowbit's files: qwen3moe / qwen2moe fail on mismatched sizes, gpt-oss
loads with other logits, a Mixtral file -- llama.cpp's ``llama`` architecture with experts --
loads as a dense Llama that ignores its experts, olmoe is unsupported). lowbit's MoE GGUFs
carry the model's transformers config (``lowbit.hf_config``), so the model is built from it
and every tensor is read back by inverting the export's own mapping: each parameter's GGUF
name is the one the exporter gives it (`lowbit.files.gguf_export`), gate and up join back at
row I (gpt-oss: interleaved, transposed), q/k rows of the llama graph are un-permuted. Values
are gguf-py's dequantization: the float model llama.cpp computes with. A MoE GGUF without
that config is refused with one line rather than loaded wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lowbit.errors import ModelError

CONFIG_KEY = "lowbit.hf_config"


def is_moe_file(reader: Any) -> bool:
    """Whether a GGUF declares experts (``{arch}.expert_count`` > 0)."""
    fields = getattr(reader, "fields", None) or {}
    arch = fields.get("general.architecture")
    field = fields.get(f"{arch.contents()}.expert_count") if arch is not None else None
    return field is not None and int(field.contents()) > 0


def hf_config(reader: Any) -> dict | None:
    field = reader.fields.get(CONFIG_KEY)
    return None if field is None else json.loads(field.contents())


def refuse_foreign(path: Path) -> ModelError:
    return ModelError(f"{path} is a mixture-of-experts GGUF lowbit did not write: lowbit reads back the MoE GGUFs it "
                      "exports (they carry their transformers config), and transformers' own GGUF loader rebuilds "
                      "these models wrongly (a Mixtral file as a dense Llama); load the original Hugging Face folder")


def load(path: Path, reader: Any, dtype: torch.dtype) -> tuple[nn.Module, Any]:
    """(model with fused float experts, tokenizer) of a MoE GGUF lowbit wrote."""
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    cfg = hf_config(reader)
    if cfg is None:
        raise refuse_foreign(path)
    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = {t.name: t for t in reader.tensors}
    state = read_state(model, tensors)
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelError(f"{path}: no tensor for {missing[0]} ({len(missing)} in all); the file is not one lowbit wrote "
                         "for this config")
    _materialise_buffers(model)
    tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.to(dtype).eval(), tok


def _materialise_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (rotary inverse frequencies), rebuilt on the CPU by the module's own constructor."""
    for mod in model.modules():
        if any(b.is_meta for b in mod.buffers(recurse=False)) and hasattr(mod, "config"):
            fresh = type(mod)(mod.config)
            for name, b in fresh.named_buffers(recurse=False):
                mod._buffers[name] = b
    meta = [n for n, b in model.named_buffers() if b.is_meta]
    if meta:
        raise ModelError(f"cannot rebuild buffer {meta[0]} of this model from a GGUF file")


def dequantized(t: Any, where: str = "the GGUF file") -> torch.Tensor:
    """One GGUF tensor dequantized by gguf-py, as float32 in the model's dimension order (GGUF lists
    dimensions fastest first); a type gguf-py cannot dequantize is named."""
    import gguf

    try:
        with np.errstate(over="ignore", invalid="ignore"):
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except (NotImplementedError, ValueError, KeyError) as e:
        raise ModelError(f"{where}: tensor {t.name} is {t.tensor_type.name}, which gguf-py cannot dequantize "
                         f"({str(e)[:80]}); convert the file with llama.cpp to a type gguf-py reads (F16, Q8_0, "
                         "the K-quants, ...)") from None
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(shape)  # its own, writable


def rope_rows_back(w: torch.Tensor, key: str, config: Any, arch: Any) -> torch.Tensor:
    """``w`` (state_dict ``key``) with q/k rows back from llama.cpp's interleaved rotary order, where the
    writer permuted them; any other tensor as it is."""
    from lowbit.files import gguf_export

    heads = gguf_export._heads_for(key.rsplit(".", 1)[0], config, arch) if key.endswith(".weight") else None
    return w[torch.argsort(gguf_export.rope_rows(w.shape[0], heads))] if heads and w.dim() == 2 else w


def read_state(model: nn.Module, tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    """state_dict key -> float tensor from the GGUF tensors, by the exporter's own name mapping inverted."""
    from lowbit.files import gguf_export, gguf_mla, gguf_moe

    config = model.config
    arch = gguf_export.arch_of(config, moe=True)
    name_map = gguf_export._tensor_name_map(arch, config)
    experts = gguf_moe.experts_modules(model)
    inter = gguf_moe.interleaved(config.model_type)
    out: dict[str, torch.Tensor] = {}
    for mname, mod in experts.items():
        out |= _expert_state(mname, mod, tensors, inter)
    for key, p in model.state_dict().items():
        if key in out or "rotary_emb" in key or key.rsplit(".", 1)[0] in experts:
            continue
        if gguf_mla.is_mla(config) and gguf_mla.is_kv_b(key):  # DeepSeek's kv_b_proj: its two halves joined back
            halves = [n for n in gguf_export._kv_b_names(name_map, key) if n in tensors]
            if len(halves) != 2:
                raise ModelError(f"GGUF file lacks attn_k_b / attn_v_b for {key}; it is not a file lowbit wrote for "
                                 "this config")
            out[key] = gguf_mla.kv_b(*(dequantized(tensors[n]) for n in halves), config)
            continue
        name = gguf_mla.bias_name(key) or gguf_export._gguf_name(name_map, key) + (
            ".weight" if key.endswith(".sinks") else "")
        if name not in tensors:
            continue  # a tied lm_head, when the file has no output.weight
        out[key] = rope_rows_back(dequantized(tensors[name]).reshape(tuple(p.shape)), key, config, arch)
    return out


def _expert_state(mname: str, mod: nn.Module, tensors: dict[str, Any], inter: bool) -> dict[str, torch.Tensor]:
    """The fused experts parameters (and gpt-oss's biases) of one module from its block's ffn_*_exps tensors."""
    from lowbit.files import gguf_moe

    block = gguf_moe.block_of(mname)
    transposed = bool(getattr(mod, "is_transposed", False))

    def get(part: str, suffix: str = "weight") -> torch.Tensor:
        name = f"blk.{block}.{part}.{suffix}"
        if name not in tensors:
            raise ModelError(f"GGUF file has no {name}; it is not a file lowbit wrote for this config")
        return dequantized(tensors[name])

    gate, up, down = get("ffn_gate_exps"), get("ffn_up_exps"), get("ffn_down_exps")  # [E, out, in]
    gate_up = torch.stack([gate, up], 2).flatten(1, 2) if inter else torch.cat([gate, up], 1)
    state = {f"{mname}.gate_up_proj": gate_up.transpose(1, 2) if transposed else gate_up,
             f"{mname}.down_proj": down.transpose(1, 2) if transposed else down}
    if isinstance(getattr(mod, "gate_up_proj_bias", None), torch.Tensor):
        gb, ub = get("ffn_gate_exps", "bias"), get("ffn_up_exps", "bias")
        state[f"{mname}.gate_up_proj_bias"] = torch.stack([gb, ub], 2).flatten(1, 2) if inter else torch.cat([gb, ub], 1)
        state[f"{mname}.down_proj_bias"] = get("ffn_down_exps", "bias")
    return state
