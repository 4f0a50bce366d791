"""Loading a compressed-tensors folder (lowbit's export, or anyone's) for evaluation on CPU, in any dtype.

transformers loads such a folder compressed and decompresses it on the first forward, in
compressed-tensors' own dtype (FP4 values are unpacked to bf16): a float32 model then
multiplies float32 inputs by bf16 weights and fails ("expected m1 and m2 to have the same
dtype"). Here every layer is decompressed right after loading and every parameter is
cast to the dtype asked for, so `lowbit eval` runs an export in float32 or bf16 alike.
FP4 weights pass through compressed-tensors' bf16 on the way (its decompression), so a
float32 evaluation of an NVFP4 export sees bf16-rounded weights.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

from lowbit.errors import LowbitError

QUANT_METHOD = "compressed-tensors"


def is_compressed_tensors(config: dict) -> bool:
    """Whether a config.json dict describes a compressed-tensors checkpoint."""
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def require_compressed_tensors() -> None:
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise LowbitError("compressed-tensors folders need the `compressed-tensors` package; "
                          "`pip install compressed-tensors` (or lowbit[export])") from None


def load_decompressed(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a compressed-tensors folder with transformers and decompress every layer on CPU.

    transformers' own ``dequantize=True`` path decompresses all dense layers with one
    config group's scheme, so a mixed plan would fail there; loading compressed and
    calling compressed-tensors' ``decompress_module`` per layer uses each layer's scheme.
    Layers with ``input_activations`` keep compressed-tensors' forward, which quantizes
    their inputs as the config says (its CPU reference of what an engine computes).
    """
    require_compressed_tensors()
    from compressed_tensors.compressors.base import decompress_module
    from transformers import AutoModelForCausalLM

    # compressed-tensors before 0.20 (vLLM 0.32 pins 0.17) always leaves the quantized forward in place
    keeps = "leave_decompressed" in inspect.signature(decompress_module).parameters
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        stored = hasattr(module, "weight_packed") or (
            weight is not None and weight.dtype in (torch.int8, torch.float8_e4m3fn))
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None and stored:
            # a layer with input_activations keeps compressed-tensors' quantized forward (its
            # inputs are fake-quantized at run time); weight-only layers become plain Linears
            if keeps:
                decompress_module(module, leave_decompressed=scheme.input_activations is not None)
            else:
                decompress_module(module)
    hook = getattr(model, "ct_decompress_hook", None)
    if hook is not None:  # decompressed above, layer by layer: a second pass on first forward would fail
        hook.remove()
    for p in model.parameters():
        p.data = p.data.to(dtype) if p.is_floating_point() else p.data
    return model.eval()
