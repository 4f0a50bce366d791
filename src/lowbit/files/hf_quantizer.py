"""Load a native lowbit checkpoint with ``transformers.AutoModelForCausalLM.from_pretrained``.

A native checkpoint's ``config.json`` says ``quantization_config.quant_method = "lowbit"``.
`register` adds that method to transformers' quantizer registry (``import lowbit`` does
it as soon as transformers' quantizer module is imported), so ``from_pretrained(dir)``
builds the model with `QuantLinear` layers holding the saved codes — the same weights
and logits as ``lowbit.load(dir)``. Before any weight is read the quantizer checks the
config version, the ``lowbit.json`` manifest, every checksum, and that each quantized
layer exists in the model with the saved shape; anything else is a `CheckpointError`,
never a silent full-precision load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowbit.errors import CheckpointError
from lowbit.files import native

METHOD = native.FORMAT
_KNOWN_KEYS = {"quant_method", "format_version"}
_REGISTERED: dict[str, type] = {}


class PackedSlot(nn.Module):
    """Placeholder for a quantized Linear while transformers loads the packed tensors into it."""

    def __init__(self, spec: dict, header: dict[str, tuple[list[int], torch.dtype]], bias: bool) -> None:
        super().__init__()
        self.spec = spec
        for key, (shape, dtype) in header.items():
            self.register_buffer(key, torch.empty(shape, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(spec["shape"][0]), requires_grad=False) if bias else None

    def build(self) -> nn.Module:
        from lowbit.files.native import input_quantizer, input_rotation
        from lowbit.formats import QTensor, Scheme
        from lowbit.nn import QuantLinear

        scheme = Scheme.from_dict(self.spec["scheme"])
        shape = tuple(self.spec["shape"])
        parts = {k: b for k, b in self.named_buffers(recurse=False)}
        inputs = input_quantizer("this layer", self.spec, parts.pop("input_amax", None))
        try:
            q = QTensor.from_packed(parts, shape, scheme)  # type: ignore[arg-type]
        except (CheckpointError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"stored tensors disagree with shape {list(shape)} and scheme {scheme.name} "
                                  f"({e}); the checkpoint was edited or damaged") from None
        return QuantLinear(q, None if self.bias is None else self.bias.detach(), input_quant=inputs,
                           input_rotation=input_rotation("this layer", self.spec))


def _holding(folder: Path, manifest: dict, name: str) -> Path:
    """The weight file holding layer ``name``'s codes (a streamed checkpoint has several)."""
    files = native.weight_files(manifest)
    if len(files) > 1:
        from safetensors import safe_open

        for f in files:
            with safe_open(str(folder / f), framework="pt") as st:
                if f"{name}.codes" in st.keys():
                    return folder / f
    return folder / files[0]


def _header(weights: Path, name: str) -> dict[str, tuple[list[int], torch.dtype]]:
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        keys = set(f.keys())
        out = {}
        for k in native._QKEYS:
            if f"{name}.{k}" in keys:
                sl = f.get_slice(f"{name}.{k}")
                out[k] = (list(sl.get_shape()), _dtype(sl.get_dtype()))
    if "codes" not in out or "scales" not in out:
        raise CheckpointError(f"layer {name} has no codes/scales in {weights}; re-create the checkpoint")
    return out


_DTYPES = {"U8": torch.uint8, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
           "F8_E4M3": torch.float8_e4m3fn, "I32": torch.int32, "I64": torch.int64}


def _dtype(code: str) -> torch.dtype:
    if code not in _DTYPES:
        raise CheckpointError(f"unexpected tensor dtype {code} in a lowbit checkpoint; re-create it")
    return _DTYPES[code]


def _checkpoint_dir(checkpoint_files: list | None) -> Path:
    if not checkpoint_files:
        raise CheckpointError("a lowbit checkpoint loads from a local folder written by `lowbit quantize --out`")
    return Path(checkpoint_files[0]).parent


def prepare(model: nn.Module, folder: Path) -> list[str]:
    """Swap every manifest layer for a `PackedSlot` after checking manifest, checksums and shapes."""
    from lowbit.nn import set_module

    manifest = native.read_manifest(folder)
    native.verify(folder, manifest)
    experts = [n for n, spec in manifest["layers"].items() if "experts" in spec]
    if experts:
        raise CheckpointError(f"{folder} holds quantized mixture-of-experts experts ({experts[0]}, ...), which "
                              "transformers' loader of lowbit checkpoints does not read yet; load it with lowbit "
                              "(`lowbit eval`, lowbit.files.native.load)")
    if manifest.get("kv_cache") is not None:  # its k_scale / v_scale would be dropped and the cache left float
        raise CheckpointError(f"{folder} quantizes the KV cache, which transformers' loader of lowbit checkpoints "
                              "does not apply; load it with lowbit (`lowbit eval`, lowbit.files.native.load)")
    for name, spec in manifest["layers"].items():
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            raise CheckpointError(f"checkpoint layer {name} does not exist in this {type(model).__name__}; "
                                  "config.json and lowbit.json disagree (edited by hand?)") from None
        if not isinstance(layer, nn.Linear) or [layer.out_features, layer.in_features] != list(spec["shape"]):
            raise CheckpointError(f"checkpoint layer {name} has shape {spec['shape']} but the model has "
                                  f"{type(layer).__name__} {getattr(layer, 'weight', torch.empty(0)).shape}; "
                                  "config.json and lowbit.json disagree (edited by hand?)")
        slot = PackedSlot(spec, _header(_holding(folder, manifest, name), name), layer.bias is not None)
        set_module(model, name, slot)
    return list(manifest["layers"])


def finish(model: nn.Module) -> None:
    from lowbit.nn import set_module

    slots = [(n, m) for n, m in model.named_modules() if isinstance(m, PackedSlot)]
    for name, slot in slots:
        try:
            set_module(model, name, slot.build())
        except CheckpointError as e:
            raise CheckpointError(f"layer {name}: {e}") from None


def register() -> None:
    """Add ``quant_method = "lowbit"`` to transformers (idempotent)."""
    if _REGISTERED:
        return
    from transformers.quantizers.auto import register_quantization_config, register_quantizer
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class LowbitConfig(QuantizationConfigMixin):
        """``{"quant_method": "lowbit", "format_version": N}``: what native.save writes."""

        def __init__(self, format_version: int = native.VERSION, **kwargs: Any) -> None:
            self.quant_method = METHOD
            self.format_version = format_version
            unknown = set(kwargs) - _KNOWN_KEYS
            if unknown:
                raise CheckpointError(f"lowbit quantization_config has unknown keys {sorted(unknown)}; "
                                      f"known: {sorted(_KNOWN_KEYS)}. Re-create the checkpoint")
            if format_version != native.VERSION:
                raise CheckpointError(f"checkpoint format version {format_version!r}; this lowbit reads "
                                      f"version {native.VERSION}. Upgrade lowbit or re-create the checkpoint")

        def to_dict(self) -> dict[str, Any]:
            return {"quant_method": METHOD, "format_version": self.format_version}

    class LowbitHfQuantizer(HfQuantizer):
        """Loads pre-quantized lowbit checkpoints (no on-the-fly quantization)."""

        requires_calibration = True

        def validate_environment(self, *args: Any, **kwargs: Any) -> None:
            if not self.pre_quantized:
                raise CheckpointError("lowbit quantizes with `lowbit quantize`; transformers can only load "
                                      "checkpoints it wrote")

        def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
            return torch.float32 if dtype is None else dtype

        def _process_model_before_weight_loading(self, model: nn.Module, checkpoint_files: list | None = None,
                                                 **kwargs: Any) -> None:
            prepare(model, _checkpoint_dir(checkpoint_files))

        def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
            finish(model)
            return model

        def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
            return False

        def is_serializable(self, safe_serialization: Any = None) -> bool:
            return False

        @property
        def is_trainable(self) -> bool:
            return False

    register_quantization_config(METHOD)(LowbitConfig)
    register_quantizer(METHOD)(LowbitHfQuantizer)
    _REGISTERED.update(config=LowbitConfig, quantizer=LowbitHfQuantizer)
