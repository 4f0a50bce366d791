"""A Hugging Face folder whose weights are already quantized (gpt-oss MXFP4, FP8), loaded as a float model.

gpt-oss ships its experts as MXFP4 (``gate_up_proj_blocks`` / ``_scales``), DeepSeek-V3 and
many others ship FP8 weights with ``weight_scale_inv`` / ``weight_scale``. ``--stream``
reads such sources tensor by tensor (`lowbit.models.stream_source`); the in-model path
(`lowbit quantize` without ``--stream``, `lowbit eval`) needs the whole float model, and
leaving that to transformers is wrong in two ways: a folder without a matching
``quantization_config`` loads its FP8 bytes as if they were the weights (the scales are
"unexpected keys" and dropped, measured: other codes than its dequantization), and where
transformers' quantizer has a kernel (MXFP4 with ``kernels`` on a GPU) it keeps the experts
quantized in its own module, which lowbit cannot requantize or account for.

So lowbit dequantizes them itself, with the very readers ``--stream`` uses: the model is
built from its config (``quantization_config`` dropped, no weight initialisation), every
tensor of its state dict is read from the source by its name (fused experts expert by
expert, in the parameter's own layout), and a source tensor the model has no place for
is refused (but for those its class declares it does not load, as transformers skips them:
DeepSeek-V3's multi-token-prediction layer). Both paths then start from the same float32 values, so in-model and streaming
requantization of one source agree, and both agree with requantizing a float copy of the
dequantized weights.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowbit.errors import ModelError
from lowbit.models.source_dequant import FP8_DTYPES

_SCALES = (".weight_scale_inv", ".weight_scale", "_scales")


def quantized_layout(entries: dict[str, Any]) -> str | None:
    """What marks a header set as a quantized source lowbit dequantizes (None for float weights): MXFP4 blocks, FP8
    weights, or their scales. compressed-tensors folders (``weight_packed``) go through their own reader."""
    from lowbit.files.safetensors_stream import DTYPES

    for name, e in entries.items():
        if name.endswith("_blocks") and name.removesuffix("_blocks") + "_scales" in entries:
            return "mxfp4"
        if name.endswith(".weight") and DTYPES.get(e.dtype) in FP8_DTYPES:
            return "fp8"
        if name.endswith(".weight_scale_inv"):
            return "fp8"
    return None


def is_quantized_source(folder: Path) -> bool:
    """Whether ``folder``'s safetensors hold MXFP4 or FP8 weights (headers only)."""
    from lowbit.models.stream_source import StreamSource

    return quantized_layout(StreamSource.open(folder).entries) is not None


def load_dequantized(folder: Path, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, dict[str, int]]:
    """The float model of a quantized source and how many tensors came from each source precision.

    Refuses (`ModelError`, naming the tensor) a model tensor the source lacks and a source tensor the
    model has no place for: nothing is left random, nothing in the file is dropped.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from lowbit.models.experts import expert_tensors
    from lowbit.models.stream_source import StreamSource, model_key

    source = StreamSource.open(folder)
    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights arrive dequantized: transformers must not quantize on build
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model_type = getattr(config, "model_type", None)
    experts = expert_tensors(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: dict[int, str] = {}  # tied parameters (embeddings / lm_head) are one tensor: filled once
    missing = []
    with torch.no_grad():
        for name, p in params.items():
            if id(p) in filled:
                continue
            t = experts.get(name)
            if t is not None:
                w = torch.stack([source.expert(t, e, model_type) for e in range(t.count)])
                value = w.transpose(1, 2) if t.transposed else w
            else:
                key = model_key(source, name, model_type)
                if key is None:
                    missing.append(name)
                    continue
                value = source.tensor(key)
            if tuple(value.shape) != tuple(p.shape):
                raise ModelError(f"{folder}: {name} is {list(value.shape)} in the weights but {list(p.shape)} in "
                                 "config.json's model; fix config.json or use the matching weights")
            p.copy_(value.to(p.dtype))
            filled[id(p)] = name
        for name, b in model.named_buffers():
            key = model_key(source, name, model_type)
            if key is not None:  # persistent buffers the checkpoint holds (DeepSeek's e_score_correction_bias)
                b.copy_(source.tensor(key).to(b.dtype))
    tied = [n for n in missing if _tied(model, n)]
    missing = [n for n in missing if n not in tied]
    if tied:  # built without initialisation, the output embeddings are tied only now
        model.tie_weights()
        out = model.get_output_embeddings().weight
        if not any(out is p for n, p in params.items() if n not in tied):
            raise ModelError(f"{folder}: {tied[0]} is tied to the input embeddings by config.json but transformers "
                             "did not tie it; lowbit will not leave it uninitialised")
    if missing:
        raise ModelError(f"the weights in {folder} lack {missing[0]}" + (f" and {len(missing) - 1} more tensor(s)"
                         if len(missing) > 1 else "") + " that config.json's model needs; fix config.json or use the "
                         "complete weights")
    # what the model class itself declares it does not load (DeepSeek-V3's multi-token-prediction layer 61)
    skip = [re.compile(r) for r in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    unused = [n for n in source.unused() if not any(r.search(n) for r in skip)]
    if unused:
        raise ModelError(f"{folder} holds {len(unused)} tensor(s) config.json's model has no place for, e.g. "
                         f"{unused[0]}; lowbit drops nothing silently: fix config.json or use the matching weights")
    counts: dict[str, int] = {}
    for name in filled.values():
        prec = source.precision.get(name if name in experts else model_key(source, name, model_type) or name)
        counts[prec or "float"] = counts.get(prec or "float", 0) + 1
    return model.eval(), counts


def _tied(model: nn.Module, name: str) -> bool:
    """A parameter transformers ties to another (the output embeddings to the input ones) needs no tensor of its own."""
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    return bool(getattr(model.config, "tie_word_embeddings", False)) and out is not None and \
        name.startswith(next((n for n, m in model.named_modules() if m is out), "\0") + ".")
