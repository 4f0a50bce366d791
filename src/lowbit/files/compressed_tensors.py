"""Export a lowbit-quantized model as a compressed-tensors checkpoint (vLLM, transformers).

The codes lowbit chose are written as they are — nothing is re-quantized — so the
weights an engine decompresses are the ones lowbit evaluated:

* INT (``pack-quantized``): compressed-tensors stores signed levels ``q`` offset by
  ``2^(b-1)`` in a dense little-endian int32 bit stream, which is exactly lowbit's
  unsigned code ``u = q - qmin`` for symmetric schemes. Asymmetric zero points ``z``
  (lowbit: ``0..2^b-1``) become the signed ``z - 2^(b-1)`` and are packed along the
  output axis, as the format defines. Dequantization is ``(q - z) * scale`` in both.
* Full-range symmetric INT maps a group's largest-magnitude value to ``-2^(b-1)``, so
  its scale is negative when that value is positive. The sign cannot be folded into
  the codes (``-(-2^(b-1))`` is out of range), so the negative scale is stored as is:
  ``weight_scale`` is a plain multiplier in compressed-tensors' dequantization and in
  vLLM's group kernels, so the product is the same.
* Scales are stored in float32 (their values lie on the fp16/bf16 grid, so nothing is
  lost): compressed-tensors dequantizes in the scale's dtype, and an fp16 product would
  round differently from lowbit's exact float32 one.
* NVFP4 (``nvfp4-pack-quantized``): E2M1 nibbles ``sign<<3|mag``, low nibble = even
  column (lowbit's packing), E4M3 block scales, and ``weight_global_scale = enc``: both
  sides dequantize ``q * (s_b / enc)``. lowbit's tensor scale uses S_max = 256 for
  4-over-6 so the x1.5 scales never overflow E4M3; the block scales are already E4M3
  values, so the export is exact whichever S_max made them.
* MXFP4 (``mxfp4-pack-quantized``): the same nibbles, ``weight_scale`` holds the biased
  E8M0 exponent ``127 + log2 s`` as uint8; powers of two are exact in any float dtype.
* FP8 per-channel weights (``float-quantized``): the E4M3 bytes as ``float8_e4m3fn``,
  fp32 ``weight_scale`` per row. 8-bit per-row INT weights of a layer that quantizes its
  inputs (W8A8 INT8) go to ``int-quantized`` (int8 ``weight``), the layout INT8 GEMM
  kernels read.
* Inputs (``input_activations``), written with compressed-tensors' own QuantizationArgs;
  the exported model computes at run time what lowbit's `InputScheme` computes:
  INT8 / FP8 per token (``strategy=token, dynamic=true``), FP8 / INT8 per tensor
  (``strategy=tensor``, static ``input_scale = amax / qmax``), MXFP4 / MXFP8 (``group``
  32, dynamic, E8M0 scales: compressed-tensors rounds them by the ``even`` rule, so only
  ``round=even`` exports), NVFP4 (``tensor_group`` 16, ``dynamic="local"``, static
  ``input_global_scale = enc``; abs-max E4M3 block scales without the guard, which is
  what the engines compute: 4-over-6 / span inputs cannot be expressed).
  compressed-tensors' own reference divides an INT8 token's max by 127.5 (half the int8
  range) where lowbit and the integer kernels divide by 127: INT8 inputs match within
  one quantization step, the others bit for bit in the CPU reference.
* A mixed plan becomes one config group per distinct recipe (targets = exact layer
  names); different formats make the top-level format ``mixed-precision``.
* Quantized mixture-of-experts experts (`QuantStack`) are written per expert, one Linear
  per projection, in the layout vLLM's and transformers' MoE loaders read
  (`lowbit.files.compressed_experts`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from lowbit.errors import SchemeError
from lowbit.files import compressed_experts as moe
from lowbit.files.compressed_read import load_decompressed, require_compressed_tensors
from lowbit.files.fused import fused_groups
from lowbit.files.kv_export import add_kv_cache
from lowbit.files.native import WRITE_FIX
from lowbit.files.specs import LayerSpec, from_model, refuse_rotations
from lowbit.formats import InputScheme, QTensor, Scheme
from lowbit.formats.finite import require_finite
from lowbit.formats.inputs import encode_scale
from lowbit.io import atomic_dir
from lowbit.nn import QuantLinear, quant_layers
from lowbit.nn.input_rotation import refuse_online_rotations
from lowbit.nn.quant_experts import QuantExperts, QuantStack, quant_stacks

__all__ = ["export", "load_decompressed", "target_for"]

WEIGHTS = "model.safetensors"
PACK = "pack-quantized"
NVFP4 = "nvfp4-pack-quantized"
MXFP4 = "mxfp4-pack-quantized"
FLOAT8 = "float-quantized"
INT8 = "int-quantized"
MXFP8 = "mxfp8-quantized"
HOLDS = ("INT 2..8 bit, symmetric (full-range or classic) or asymmetric, per group (group divides the "
         "row) or per row -> pack-quantized; NVFP4 (E2M1, block 16, E4M3 scales, optional tensor scale, "
         "any rule incl. 4-over-6) -> nvfp4-pack-quantized; MXFP4 (E2M1, block 32, E8M0 scales) -> "
         "mxfp4-pack-quantized; FP8 per row (fp8) -> float-quantized; MXFP8 (E4M3, block 32, E8M0) -> "
         "mxfp8-quantized")
# where vLLM refuses a group that does not divide the row (raised for tensor_parallel_size 1 too)
VLLM_WHOLE_GROUPS = "vllm/distributed/utils.py, verify_group_size_divides_partition, from CompressedTensorsWNA16"
INPUT_HOLDS = ("int8 / fp8 per token (dynamic), int8-static / fp8-static per tensor, mxfp4 / mxfp8 with "
               "round=even (the E8M0 rule compressed-tensors computes), nvfp4 with abs-max E4M3 block scales "
               "and its static tensor scale (no guard, no 4-over-6 / span: engines compute abs-max scales)")


def _ct():
    require_compressed_tensors()
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    return QuantizationArgs, QuantizationScheme, QuantizationConfig, pack_to_int32


@dataclass(frozen=True)
class Target:
    """How one lowbit recipe is stored in compressed-tensors: format, weight args, input args."""

    format: str
    args: dict[str, Any]
    inputs: dict[str, Any] | None = None


def target_for(scheme: Scheme, in_features: int, where: str = "layer") -> Target:
    """The compressed-tensors format and QuantizationArgs fields for ``scheme``; refuses the rest."""
    family = scheme.family.name
    if family == "kquant":
        raise SchemeError(f"{where}: {scheme.name} is a llama.cpp K-quant (sub-block scale codes under fp16 "
                          f"super-block scales), which compressed-tensors cannot hold; export it with --to gguf, "
                          f"or re-quantize with one of: {HOLDS}")
    g = scheme.group_for(in_features)
    if in_features % g:
        raise SchemeError(f"{where}: group {g} does not divide its {in_features} columns, and vLLM, the engine "
                          f"compressed-tensors files are for, refuses a partial last group ({VLLM_WHOLE_GROUPS}); "
                          f"re-quantize with a group that divides "
                          f"every row (here {dividing_group(g, in_features)}, e.g. "
                          f"{scheme.replace(group_size=dividing_group(g, in_features)).name})")
    if family == "int":
        strategy = "channel" if scheme.group_size == -1 else "group"
        return Target(PACK, {"num_bits": scheme.bits, "type": "int", "symmetric": scheme.sym,
                             "strategy": strategy, "group_size": None if strategy == "channel" else g})
    if scheme.elem == "e2m1" and scheme.scale == "e4m3" and g == 16:
        return Target(NVFP4, {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                              "group_size": 16, "scale_dtype": torch.float8_e4m3fn})
    if scheme.elem == "e2m1" and scheme.scale == "e8m0" and g == 32 and not scheme.tensor_scale:
        return Target(MXFP4, {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                              "group_size": 32, "scale_dtype": torch.uint8})
    if scheme.elem == "e4m3" and scheme.scale == "fp32" and scheme.group_size == -1:
        return Target(FLOAT8, {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"})
    if scheme.elem == "e4m3" and scheme.scale == "e8m0" and g == 32:
        return Target(MXFP8, {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
                              "group_size": 32, "scale_dtype": torch.uint8})
    raise SchemeError(f"{where}: scheme {scheme.name} has no compressed-tensors format. It holds: {HOLDS}. "
                      "Re-quantize with one of those (e.g. w4g128, w8, nvfp4, nvfp4-46)")


def dividing_group(g: int, cols: int) -> int:
    """The largest power-of-two group no wider than ``g`` that divides ``cols`` (the nearest exportable one)."""
    while g > 1 and (cols % g or g & (g - 1)):
        g -= 1
    return g


def input_args(inp: InputScheme, where: str = "layer") -> dict[str, Any]:
    """compressed-tensors ``input_activations`` fields for ``inp``; refuses what it cannot express."""
    kind = "int" if inp.family.name == "int" else "float"
    if inp.static and inp.bits == 8:
        return {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "tensor", "dynamic": False}
    if inp.group_size == -1 and not inp.static and inp.bits == 8 and inp.scale == "fp32":
        return {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "token", "dynamic": True}
    if inp.scale == "e8m0" and inp.group_size == 32 and inp.e8m0_round == "even" and inp.elem in ("e2m1", "e4m3"):
        return {"num_bits": inp.bits, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                "dynamic": True, "scale_dtype": torch.uint8}
    if (inp.elem == "e2m1" and inp.scale == "e4m3" and inp.group_size == 16 and inp.tensor_scale
            and inp.rule == "absmax" and not inp.guard):
        return {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
                "dynamic": "local", "scale_dtype": torch.float8_e4m3fn}
    raise SchemeError(f"{where}: input scheme {inp.name} has no compressed-tensors form. It holds for inputs: "
                      f"{INPUT_HOLDS}. Re-quantize with one of those (e.g. w4a4-nvfp4, w8a8-fp8, "
                      "mxfp4@mxfp4:round=even), or export a weight-only recipe")


def recipe_target(scheme: Scheme, inp: InputScheme | None, in_features: int, where: str = "layer") -> Target:
    """The weight target of a recipe, with its input args (and the int8 layout W8A8 kernels read)."""
    t = target_for(scheme, in_features, where)
    if inp is None:
        return t
    fmt = t.format
    if fmt == PACK and scheme.bits == 8 and scheme.group_size == -1 and scheme.sym:
        fmt = INT8
    return Target(fmt, t.args, input_args(inp, where))


def layer_target(layer: QuantLinear, where: str = "layer") -> Target:
    return recipe_target(layer.scheme, None if layer.input_quant is None else layer.input_quant.scheme,
                         layer.in_features, where)


def check_specs(specs: list[LayerSpec], model_type: str | None = None) -> None:
    """Refuse, before any weight is read, a plan compressed-tensors cannot hold: how many layers, the first reason
    (experts: also the per-expert layout's own limits, `compressed_experts.check`)."""
    refuse_rotations(specs, "compressed-tensors")
    moe.check(specs, model_type)
    bad = []
    for sp in specs:
        try:
            recipe_target(sp.scheme, sp.input, sp.in_features, sp.name)
        except SchemeError as e:
            bad.append(str(e))
    if len(bad) == 1:
        raise SchemeError(bad[0])
    if bad:
        raise SchemeError(f"compressed-tensors cannot hold {len(bad)} of the {len(specs)} quantized layers; the "
                          f"first: {bad[0]}")


def vllm_fused_notes(specs: list[LayerSpec]) -> list[str]:
    """Fused matmuls (q/k/v, gate/up) whose parts have different recipes: vLLM loads one scheme per fused
    layer (the first part's), so such a file loads in transformers but not in vLLM. Experts: what vLLM's fused
    MoE cannot run, and what transformers' MoE loader cannot read (`compressed_experts.notes`)."""
    by_name = {s.name: s for s in specs if not s.experts}
    notes = moe.notes(specs)
    for group in fused_groups(by_name):
        kinds = {(by_name[n].scheme, by_name[n].input) for n in group}
        if len(kinds) > 1:
            notes.append(f"{', '.join(group)} have different recipes ("
                         f"{', '.join(by_name[n].scheme.name for n in group)}); vLLM runs them as one matmul with "
                         f"one scheme and cannot load this file (transformers can); give them one recipe "
                         f"(mixed precision: --tie-qkv ties q/k/v)")
    return notes


def input_tensors(layer: QuantLinear) -> dict[str, torch.Tensor]:
    """Static input scales: ``input_scale`` (+ zero point) per tensor, or NVFP4's ``input_global_scale``."""
    iq = layer.input_quant
    return {} if iq is None else static_input(iq.scheme, iq.amax)


def static_input(inp: InputScheme, amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The stored static scale of one input (a Linear's, or one expert's): none for dynamic formats."""
    if not inp.needs_calibration:
        return {}
    enc = encode_scale(inp, amax).float().reshape(1)
    if inp.tensor_scale:
        return {"input_global_scale": enc}
    zdt = torch.int8 if inp.family.name == "int" else torch.float8_e4m3fn
    return {"input_scale": enc, "input_zero_point": torch.zeros(1, dtype=zdt)}


# ------------------------------------------------------------------ tensors
def int_tensors(q: QTensor) -> dict[str, torch.Tensor]:
    """``weight_packed``/``weight_scale``/[``weight_zero_point``] of an INT QTensor."""
    *_, pack_to_int32 = _ct()
    s, (out, cols) = q.scheme, q.shape
    offset = 1 << (s.bits - 1)
    levels = (q.codes.reshape(out, -1)[:, :cols].to(torch.int16) - offset).to(torch.int8)
    d = {"weight_packed": pack_to_int32(levels, s.bits),
         "weight_scale": q.scales.float().contiguous(),
         "weight_shape": torch.tensor([out, cols], dtype=torch.int64)}
    if q.zeros is not None:
        zp = (q.zeros.to(torch.int16) - offset).to(torch.int8)
        d["weight_zero_point"] = pack_to_int32(zp, s.bits, packed_dim=0).contiguous()
    return d


def nvfp4_tensors(q: QTensor) -> dict[str, torch.Tensor]:
    """``weight_packed`` (uint8 nibbles), E4M3 ``weight_scale``, fp32 ``weight_global_scale``."""
    from lowbit.formats import packing

    out, cols = q.shape
    enc = q.tensor_scale if q.tensor_scale is not None else torch.tensor(1.0)
    return {"weight_packed": packing.pack(q.codes.reshape(out, -1)[:, :cols].contiguous(), 4),
            "weight_scale": q.scales.to(torch.float8_e4m3fn).contiguous(),
            "weight_global_scale": enc.float().reshape(1).clone()}  # its own storage: experts' gate/up share enc


def mxfp4_tensors(q: QTensor) -> dict[str, torch.Tensor]:
    """``weight_packed`` nibbles as NVFP4, ``weight_scale`` = biased E8M0 exponent ``127 + log2 s``."""
    from lowbit.formats import packing

    out, cols = q.shape
    exp = torch.log2(q.scales).round().to(torch.int32) + 127
    return {"weight_packed": packing.pack(q.codes.reshape(out, -1)[:, :cols].contiguous(), 4),
            "weight_scale": exp.clamp(0, 254).to(torch.uint8).contiguous()}


def fp8_tensors(q: QTensor) -> dict[str, torch.Tensor]:
    """``weight`` as float8_e4m3fn (lowbit's codes are its raw bytes) and the per-row fp32 ``weight_scale``."""
    out, cols = q.shape
    w = q.codes.reshape(out, -1)[:, :cols].contiguous().view(torch.float8_e4m3fn)
    return {"weight": w, "weight_scale": q.scales.float().reshape(out, -1).contiguous()}


def mxfp8_tensors(q: QTensor) -> dict[str, torch.Tensor]:
    """E4M3 ``weight`` and ``weight_scale`` as the biased E8M0 exponent, as MXFP4."""
    out, cols = q.shape
    exp = torch.log2(q.scales).round().to(torch.int32) + 127
    return {"weight": q.codes.reshape(out, -1)[:, :cols].contiguous().view(torch.float8_e4m3fn),
            "weight_scale": exp.clamp(0, 254).to(torch.uint8).contiguous()}


def int8_tensors(q: QTensor) -> dict[str, torch.Tensor]:
    """Signed int8 ``weight`` and the per-row ``weight_scale`` (``int-quantized``)."""
    out, cols = q.shape
    levels = (q.codes.reshape(out, -1)[:, :cols].to(torch.int16) + q.scheme.qmin).to(torch.int8)
    return {"weight": levels.contiguous(), "weight_scale": q.scales.float().reshape(out, -1).contiguous()}


def layer_tensors(q: QTensor, target: Target) -> dict[str, torch.Tensor]:
    return {PACK: int_tensors, NVFP4: nvfp4_tensors, MXFP4: mxfp4_tensors, FLOAT8: fp8_tensors,
            MXFP8: mxfp8_tensors, INT8: int8_tensors}[target.format](q)


# ------------------------------------------------------------------- config
def build_config(targets: dict[str, Target], ignore: list[str]) -> dict[str, Any]:
    """The ``quantization_config`` dict, built with compressed-tensors' own classes."""
    QuantizationArgs, QuantizationScheme, QuantizationConfig, _ = _ct()
    groups: dict[tuple, list[str]] = {}
    for name, t in targets.items():
        key = (t.format, tuple(sorted((k, str(v)) for k, v in t.args.items())),
               tuple(sorted((k, str(v)) for k, v in (t.inputs or {}).items())))
        groups.setdefault(key, []).append(name)
    config_groups = {}
    for i, ((fmt, _, _), names) in enumerate(groups.items()):
        t = targets[names[0]]
        inputs = None if t.inputs is None else QuantizationArgs(**t.inputs)
        config_groups[f"group_{i}"] = QuantizationScheme(targets=names, weights=QuantizationArgs(**t.args),
                                                         input_activations=inputs, format=fmt)
    formats = {fmt for fmt, _, _ in groups}
    top = formats.pop() if len(formats) == 1 else "mixed-precision"
    qc = QuantizationConfig(config_groups=config_groups, format=top, quantization_status="compressed",
                            ignore=ignore)
    return qc.to_dict()


# ------------------------------------------------------------------- export
def export(model: nn.Module, tokenizer: Any, out: str | Path, force: bool = False) -> Path:
    """Write ``model`` (with `QuantLinear` layers and / or `QuantExperts`) as a compressed-tensors folder, atomically."""
    qlayers, stacks = quant_layers(model), quant_stacks(model)
    if not qlayers and not stacks:
        raise SchemeError("the model has no quantized layers; export a checkpoint made by `lowbit quantize`")
    refuse_online_rotations(model, "compressed-tensors")
    specs = from_model(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if any(m.transposed for m in model.modules() if isinstance(m, QuantExperts)) and model_type != "gpt_oss":
        raise SchemeError(moe.GPT_OSS_WHY.replace("gpt-oss experts", "transposed experts (gpt-oss's layout)"))
    check_specs(specs, model_type)
    for note in vllm_fused_notes(specs):
        warnings.warn(note, stacklevel=2)
    for note in moe.transformers_notes(specs):
        warnings.warn(note, stacklevel=2)
    layout = moe.layout_for(model_type) if stacks else moe.STANDARD
    targets = {n: layer_target(m, n) for n, m in qlayers.items()}
    expert_targets = {n: stack_target(s, n) for n, s in stacks.items()}
    tensors = _state_tensors(model, qlayers, targets, layout)
    tensors |= _expert_tensors(stacks, expert_targets, layout)
    check_fused_scales(tensors, [layout.key(n) for n in qlayers])
    require_finite(tensors.items(), f"cannot export {out}", WRITE_FIX)
    quantized_routers = set(qlayers)  # a plan that names a router quantizes it; the rest stay 16-bit
    routers = [n for n in moe.routers(model) if n not in quantized_routers]
    ignore = [layout.key(n) for n, m in model.named_modules()
              if (isinstance(m, nn.Linear) and n not in qlayers) or n in routers]
    named = {layout.key(n): t for n, t in targets.items()}
    named |= {layout.projections(n.rpartition(".")[0]): t for n, t in expert_targets.items()
              if n.endswith(f".{moe.GATE_UP}")}  # one target per experts module: check_specs made both alike
    qconfig = build_config(named, ignore)
    add_kv_cache(model, tensors, qconfig)  # kv_cache_scheme + k_scale / v_scale (lowbit.files.kv_export)
    config = model.config
    with atomic_dir(Path(out), force=force, kind="compressed-tensors export") as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        config.quantization_config = qconfig
        named_arch = getattr(config, "architectures", None)
        if not named_arch:  # a model built from a config object: engines pick the model class by this name
            config.architectures = [type(model).__name__]
        try:
            config.save_pretrained(tmp)
        finally:
            del config.quantization_config
            config.architectures = named_arch
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(out)


def stack_target(stack: QuantStack, where: str) -> Target:
    inp, _ = moe.per_expert_amax(stack)
    return recipe_target(stack.scheme, inp, stack.in_features, where)


def _expert_tensors(stacks: dict[str, QuantStack], targets: dict[str, Target],
                    layout: moe.Layout) -> dict[str, torch.Tensor]:
    """Every expert's projections as Linears of the checkpoint layout (`compressed_experts`), with its input scales."""
    out: dict[str, torch.Tensor] = {}
    for name, stack in stacks.items():
        inp, amax = moe.per_expert_amax(stack)
        for e in range(stack.num_experts):
            scales = {} if inp is None else static_input(inp, None if amax is None else amax[e])
            for key, q, _ in moe.expert_parts(name, stack.expert(e), e, layout):
                own = {k: v.clone() for k, v in scales.items()}  # gate and up: equal values, their own storage
                for k, t in {**layer_tensors(q, targets[name]), **own}.items():
                    out[f"{key}.{k}"] = t.cpu()
    return out


def check_fused_scales(tensors: dict[str, torch.Tensor], names: list[str]) -> None:
    """Refuse to write fused parts (q/k/v, gate/up) whose NVFP4 global scales differ.

    vLLM keeps one global scale per fused layer, the largest stored (its compressed-tensors
    NVFP4 scheme, ``process_weights_after_loading``, every kernel): parts made with their own
    would be served off by the ratio, with only a warning in vLLM's log. lowbit quantizes the
    parts with a shared scale (`lowbit.models.fused`); a checkpoint made before that is refused.
    """
    for group in fused_groups(names):
        for key in ("weight_global_scale", "input_global_scale"):
            vals = [tensors.get(f"{n}.{key}") for n in group]
            if all(v is not None for v in vals) and not all(torch.equal(v, vals[0]) for v in vals):
                raise SchemeError(f"{', '.join(group)} have different NVFP4 {key}s "
                                  f"({', '.join(f'{float(v):.6g}' for v in vals)}), but vLLM runs them as one matmul "
                                  "with one global scale (the largest) and would serve wrong weights; re-quantize "
                                  "with this lowbit, which gives the parts of a fused matmul one shared scale")


def _state_tensors(model: nn.Module, qlayers: dict, targets: dict[str, Target],
                   layout: moe.Layout = moe.STANDARD) -> dict[str, torch.Tensor]:
    """Dense tensors by their checkpoint names (tied copies once) plus each layer's compressed tensors; experts
    stacks are left to `_expert_tensors`."""
    packed = [*qlayers, *quant_stacks(model)]
    own = {f"{n}.{k}" for n in packed for k in ("codes", "scales", "zeros", "tensor_scale", "input_quant.amax", "input_amax")}
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for key, t in model.state_dict().items():
        ident = (t.data_ptr(), tuple(t.shape), t.dtype)
        if key in own or (t.numel() and ident in seen):
            continue
        seen.add(ident)
        tensors[layout.key(key)] = _narrow(t.detach().cpu())
    for name, layer in qlayers.items():
        for k, t in {**layer_tensors(layer.qweight, targets[name]), **input_tensors(layer)}.items():
            tensors[f"{layout.key(name)}.{k}"] = t.cpu()
    return tensors


def _narrow(t: torch.Tensor) -> torch.Tensor:
    """fp16 when that holds a float32 tensor exactly (16-bit embeddings), else as it is."""
    if t.dtype == torch.float32 and t.dim() >= 2:
        half = t.to(torch.float16)
        if torch.equal(half.float(), t):
            return half.contiguous()
    return t.contiguous()
