"""Loading a compressed-tensors folder (lowbit's export, or anyone's) for evaluation on CPU, in any dtype.

transformers loads such a folder compressed and decompresses it on the first forward, in
compressed-tensors' own dtype (FP4 values are unpacked to bf16): a float32 model then
multiplies float32 inputs by bf16 weights and fails ("expected m1 and m2 to have the same
dtype"). Here every layer is decompressed right after loading and every parameter is
cast to the dtype asked for, so `lowbit eval` runs an export in float32 or bf16 alike.
FP4 weights pass through compressed-tensors' bf16 on the way (its decompression), so a
float32 evaluation of an NVFP4 export sees bf16-rounded weights.

Per-expert quantized mixture-of-experts tensors (``...experts.{e}.gate_proj.weight_packed``,
`lowbit.files.compressed_experts`) are read here, not by transformers: its MoE loader
decompresses every layer's experts with one config group and drops zero points and NVFP4
global scales. lowbit rebuilds each expert's codes and scales exactly (`read_experts`)
into `QuantExperts`, so the loaded model runs the very codes the file holds. Experts that
quantize their inputs (``input_activations``) get the input scheme whose written args are
the file's (`input_scheme_from`) and, for static schemes, each expert's calibrated abs-max
back from its stored ``input_scale`` / ``input_global_scale`` (`amax_from`), so they run
`QuantStack.with_input` exactly as the model that was exported did.
"""

from __future__ import annotations

import inspect
import json
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from lowbit.errors import CheckpointError, LowbitError
from lowbit.files import compressed_experts as moe
from lowbit.formats import InputScheme, QTensor, Scheme
from lowbit.formats.inputs import encode_scale
from lowbit.formats.minifloat import e8m0_from_code

QUANT_METHOD = "compressed-tensors"


class ForeignLayout(CheckpointError):
    """Experts stored in a way lowbit's groups cannot hold code for code (another tool's act-order, a format lowbit
    has no scheme for): transformers' MoE loader reads them instead. Damage (missing experts, wrong shapes) is a
    plain `CheckpointError`."""


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
    Quantized experts: the rest of the folder goes through transformers without them, then
    `read_experts` puts them in as `QuantExperts` (the module doc says why).
    """
    require_compressed_tensors()
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    keys = {k: f for f in files for k in _keys(f)}
    layout = moe.LAYOUTS.get(config.get("model_type"), moe.STANDARD)
    experts = {m: e for m, e in moe.expert_keys(list(keys), layout).items()  # quantized ones: float stay transformers'
               if any("weight_scale" in parts for projs in e.values() for parts in projs.values())}
    if not experts:
        return _load(path, dtype)
    with tempfile.TemporaryDirectory(prefix="lowbit-ct-") as tmp:
        skip = {k for e in experts.values() for projs in e.values() for parts in projs.values() for k in parts.values()}
        _without(path, Path(tmp), config, keys, skip)
        model = _load(Path(tmp), dtype)
    from lowbit.nn.replace import set_module

    try:
        stacks = read_experts(path, config, model, keys, experts, layout)
    except ForeignLayout as e:  # another tool's layout lowbit does not rebuild: transformers' MoE loader reads it
        warnings.warn(f"{path}: the experts are decompressed by transformers, not rebuilt code for code ({e})",
                      stacklevel=2)
        return _load(path, dtype)
    for module, q in stacks.items():
        set_module(model, module, q)
    return model.eval()


def _load(path: Path, dtype: torch.dtype) -> nn.Module:
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


def _keys(file: Path) -> list[str]:
    with safe_open(str(file), "pt") as f:
        return list(f.keys())


def _without(src: Path, dst: Path, config: dict, keys: dict[str, Path], skip: set[str]) -> None:
    """A copy of the folder's config and dense tensors without the per-expert ones (and their config targets)."""
    qc = dict(config["quantization_config"])
    groups = {}
    for name, g in qc.get("config_groups", {}).items():
        targets = [t for t in g.get("targets", []) if not (t.startswith("re:") and ".experts" in t)]
        if targets:
            groups[name] = {**g, "targets": targets}
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    if groups:
        out["quantization_config"] = {**qc, "config_groups": groups}
    (dst / "config.json").write_text(json.dumps(out))
    tensors = {}
    for k, f in keys.items():
        if k not in skip:
            with safe_open(str(f), "pt") as h:
                tensors[k] = h.get_tensor(k)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


# ------------------------------------------------------------------ experts, exactly
def read_experts(path: str | Path, config: dict, model: nn.Module, keys: dict[str, Path] | None = None,
                 found: dict | None = None, layout: moe.Layout | None = None) -> dict[str, nn.Module]:
    """experts module -> `QuantExperts` holding the file's codes and scales, for every per-expert quantized layer.

    ``model``: the float model of the config (its experts modules give the shapes and expert counts).
    Each expert's gate and up rows are stacked back into its ``gate_up_proj`` matrix.
    """
    from lowbit.nn.quant_experts import QuantExperts, QuantStack

    path = Path(path)
    if keys is None:
        keys = {k: f for f in sorted(path.glob("*.safetensors")) for k in _keys(f)}
    layout = layout or moe.LAYOUTS.get(config.get("model_type"), moe.STANDARD)
    found = found if found is not None else moe.expert_keys(list(keys), layout)
    groups = config["quantization_config"].get("config_groups", {})
    out: dict[str, nn.Module] = {}
    handles: dict[Path, Any] = {}

    def tensor(key: str) -> torch.Tensor:
        f = keys[key]
        if f not in handles:
            handles[f] = safe_open(str(f), "pt").__enter__()
        return handles[f].get_tensor(key)

    for ckpt_module, experts in found.items():
        module = moe.model_name(ckpt_module, layout)
        try:
            float_experts = model.get_submodule(module)
        except AttributeError:
            raise CheckpointError(f"{path}: the file holds experts {ckpt_module} but the model has no {module}") from None
        up_p, down_p = (float_experts._parameters.get(n) for n in (moe.GATE_UP, moe.DOWN))
        if up_p is None or down_p is None or getattr(float_experts, "is_transposed", False):
            raise CheckpointError(f"{path}: {module} ({type(float_experts).__name__}) has no gate_up_proj / "
                                  "down_proj stacks in the layout lowbit reads")
        moe.check_count(ckpt_module, experts, up_p.shape[0])
        half, hidden = up_p.shape[1] // 2, up_p.shape[2]
        ups, downs = [], []
        inputs: dict[str, InputScheme | None] = {}
        amax: dict[str, list[torch.Tensor]] = {moe.GATE_UP: [], moe.DOWN: []}
        for e in range(up_p.shape[0]):
            parts = experts[e]
            want = {layout.gate: (half, hidden), layout.up: (half, hidden), layout.down: tuple(down_p.shape[1:])}
            if set(parts) != set(want):
                raise CheckpointError(f"{ckpt_module}.{e}: the file holds {sorted(parts)}, not {sorted(want)}")
            q, a = {}, {}
            for proj, shape in want.items():
                name = f"{ckpt_module}.{e}.{proj}"
                fmt, args, inp_args = _group_for(name, groups, config["quantization_config"].get("format"))
                stored = {k: tensor(v) for k, v in parts[proj].items()}
                q[proj] = qtensor_from(stored, fmt, args, shape, name)
                role = moe.DOWN if proj == layout.down else moe.GATE_UP
                inp = None if inp_args is None else input_scheme_from(inp_args, name)
                if inputs.setdefault(role, inp) != inp:
                    raise CheckpointError(f"{name}: its input scheme differs from the other experts' of {module}")
                a[proj] = None if inp is None else amax_from(inp, stored, name)
            ups.append(_stack_rows(q[layout.gate], q[layout.up], f"{ckpt_module}.{e}"))
            downs.append(q[layout.down])
            if a[layout.gate] is not None and not torch.equal(a[layout.gate], a[layout.up]):
                raise CheckpointError(f"{ckpt_module}.{e}: gate and up have different input scales; they read the "
                                      "same input (vLLM refuses such files too: input_scales of w1 and w3 must be "
                                      "equal)")
            amax[moe.GATE_UP].append(a[layout.gate])
            amax[moe.DOWN].append(a[layout.down])
        try:
            stacks = {moe.GATE_UP: QuantStack(ups), moe.DOWN: QuantStack(downs)}
            for role, stack in stacks.items():
                if inputs.get(role) is not None:
                    static = amax[role][0] is not None
                    stack.with_input(inputs[role], torch.stack(amax[role]) if static else None)
            out[module] = QuantExperts(float_experts, stacks)
        except LowbitError as err:
            raise CheckpointError(f"{ckpt_module}: {err}") from None
    for h in handles.values():
        h.__exit__(None, None, None)
    return out


def _group_for(name: str, groups: dict, top_format: str | None) -> tuple[str, dict, dict | None]:
    """The (format, weight args, input args or None) of the config group whose targets match ``name`` (exact,
    ``re:``, or a class)."""
    for g in groups.values():
        for t in g.get("targets", []):
            hit = re.match(t[3:], name) if t.startswith("re:") else (t == name or "." not in t)
            if hit:
                inp = g.get("input_activations")
                return g.get("format") or top_format, dict(g["weights"]), (dict(inp) if inp else None)
    raise CheckpointError(f"{name}: no config group of the file targets it, yet it holds quantized tensors")


def _input_candidates() -> list[InputScheme]:
    """lowbit's input schemes that compressed-tensors can hold: every preset, and the MX ones with the ``even``
    E8M0 rounding compressed-tensors computes (the only MX rounding `compressed_tensors.input_args` writes)."""
    out = list(InputScheme.presets().values())
    out += [InputScheme.parse(f"{s.name}:round=even") for s in out if s.scale == "e8m0"]
    return out


def _comparable(args: dict) -> dict:
    """Input args as JSON holds them (dtypes as the strings compressed-tensors serialises, unknown keys dropped)."""
    keys = ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic")
    return {k: args.get(k) for k in keys if args.get(k) is not None}


def input_scheme_from(args: dict, where: str) -> InputScheme:
    """The lowbit input scheme whose compressed-tensors ``input_activations`` are ``args`` (the writer's inverse).

    Where several lowbit schemes write the same args (they differ in nothing the file records), the first
    preset wins: it is the one the file's consumers (vLLM, compressed-tensors) compute.
    """
    from lowbit.files.compressed_tensors import input_args

    want = _comparable(args)
    for s in _input_candidates():
        try:
            if _comparable(input_args(s)) == want:
                return s
        except LowbitError:
            continue
    raise ForeignLayout(f"{where}: input_activations {args} are no input scheme lowbit runs")


def amax_from(inp: InputScheme, parts: dict[str, torch.Tensor], where: str) -> torch.Tensor | None:
    """The calibrated abs-max a stored static input scale stands for: the float whose `encode_scale` is the stored
    value exactly (None for dynamic schemes, which store none).

    static: ``input_scale = amax / qmax``; NVFP4: ``input_global_scale = 6 * 448 / amax``. The inverse is
    computed in float64 and then checked, and nudged by an ulp where float32 rounding of the quotient differs,
    so the loaded experts quantize their inputs with the very scale the file holds.
    """
    if not inp.needs_calibration:
        return None
    key = "input_global_scale" if inp.tensor_scale else "input_scale"
    if key not in parts:
        raise CheckpointError(f"{where}: input scheme {inp.name} needs its calibrated {key}, which the file lacks")
    stored = parts[key].float().reshape(-1)
    if stored.numel() != 1 or not bool(torch.isfinite(stored).all()) or not bool((stored > 0).all()):
        raise CheckpointError(f"{where}: {key} must be one finite positive value, got {stored.tolist()}")
    one = torch.ones((), dtype=torch.float64)
    if inp.tensor_scale:
        num = float(encode_scale(inp, one))  # enc of amax 1 = elem_max * S_max
        guess = torch.tensor(num / float(stored[0]), dtype=torch.float32)
    else:
        guess = torch.tensor(float(stored[0]) * inp.qmax, dtype=torch.float32)
    a = guess
    for _ in range(8):  # a float32 quotient is at most an ulp or two off
        got = encode_scale(inp, a).float().reshape(())
        if torch.equal(got, stored[0]):
            return a
        a = torch.nextafter(a, torch.tensor(float("inf") if (got > stored[0]) == bool(inp.tensor_scale) else 0.0))
    raise CheckpointError(f"{where}: no input abs-max gives the stored {key} {float(stored[0]):.9g} exactly")


def scheme_from(fmt: str, args: dict) -> Scheme:
    """The lowbit scheme a compressed-tensors weight format + args stands for (the canonical one of its layout)."""
    bits, strategy, gs = args.get("num_bits"), args.get("strategy"), args.get("group_size")
    if fmt == "pack-quantized" and args.get("type", "int") == "int":
        name = f"w{bits}" + (f"g{gs}" if strategy == "group" else "") + ("" if args.get("symmetric", True) else "a")
    elif fmt == "int-quantized" and bits == 8 and strategy == "channel":
        name = "w8"
    elif fmt == "nvfp4-pack-quantized":
        name = "nvfp4"
    elif fmt == "mxfp4-pack-quantized":
        name = "mxfp4"
    elif fmt == "float-quantized" and bits == 8 and strategy == "channel":
        name = "fp8"
    elif fmt == "mxfp8-quantized":
        name = "mxfp8"
    else:
        raise ForeignLayout(f"compressed-tensors format {fmt} with {args} has no lowbit scheme to read it into")
    return Scheme.parse(name)


def qtensor_from(parts: dict[str, torch.Tensor], fmt: str, args: dict, shape: tuple[int, int],
                 where: str) -> QTensor:
    """The exact `QTensor` one Linear's compressed-tensors parts hold (inverse of `compressed_tensors.layer_tensors`)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from lowbit.formats import packing

    s = scheme_from(fmt, args)
    out, cols = shape
    if "weight_shape" in parts and tuple(int(v) for v in parts["weight_shape"]) != (out, cols):
        raise CheckpointError(f"{where}: weight_shape {parts['weight_shape'].tolist()} is not the model's {[out, cols]}")
    g = s.group_for(cols)
    ng = cols // g
    zeros = tensor_scale = None
    try:
        if "weight_g_idx" in parts and not torch.equal(parts["weight_g_idx"].long(), torch.arange(cols) // g):
            raise ForeignLayout(f"{where}: its columns are permuted into groups (weight_g_idx, act-order), which "
                                "lowbit's groups of consecutive columns do not hold")
        if fmt == "pack-quantized":
            offset = 1 << (s.bits - 1)
            levels = unpack_from_int32(parts["weight_packed"], s.bits, torch.Size([out, cols]))
            codes = (levels.to(torch.int16) + offset).to(torch.uint8)
            if "weight_zero_point" in parts and not s.sym:  # symmetric files may carry all-zero points
                zp = unpack_from_int32(parts["weight_zero_point"], s.bits, torch.Size([out, ng]), packed_dim=0)
                zeros = (zp.to(torch.int16) + offset).float()
            scales = parts["weight_scale"].float()
        elif fmt == "int-quantized":
            codes = (parts["weight"].to(torch.int16) - s.qmin).to(torch.uint8)
            scales = parts["weight_scale"].float()
        elif fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
            codes = packing.unpack(parts["weight_packed"].view(torch.uint8), 4, cols)
            scales = parts["weight_scale"].float() if fmt.startswith("nvfp4") else e8m0_from_code(parts["weight_scale"])
            if fmt.startswith("nvfp4"):
                tensor_scale = parts["weight_global_scale"].float().reshape(())
        else:  # float-quantized, mxfp8-quantized: the E4M3 bytes
            codes = parts["weight"].view(torch.uint8)
            scales = parts["weight_scale"].float() if fmt == "float-quantized" else e8m0_from_code(parts["weight_scale"])
        return QTensor(codes.reshape(out, ng, g).contiguous(), scales.reshape(out, ng).contiguous(),
                       None if zeros is None else zeros.reshape(out, ng).contiguous(), tensor_scale, (out, cols), s)
    except (KeyError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{where}: its {fmt} tensors do not hold a {out}x{cols} {s.name} matrix ({e})") from None


def _stack_rows(gate: QTensor, up: QTensor, where: str) -> QTensor:
    """One expert's gate_up_proj matrix: gate rows over up rows (one scheme, one NVFP4 global scale)."""
    if gate.scheme != up.scheme:
        raise CheckpointError(f"{where}: gate and up have different schemes ({gate.scheme.name}, {up.scheme.name}); "
                              "lowbit's experts hold one scheme per fused gate_up_proj")
    ts = gate.tensor_scale
    if ts is not None and not torch.equal(ts, up.tensor_scale):
        raise CheckpointError(f"{where}: gate and up have different NVFP4 global scales ({float(ts):.6g}, "
                              f"{float(up.tensor_scale):.6g}); lowbit's experts share one per gate_up_proj, as vLLM "
                              "serves them")
    zeros = None if gate.zeros is None else torch.cat([gate.zeros, up.zeros])
    return QTensor(torch.cat([gate.codes, up.codes]), torch.cat([gate.scales, up.scales]), zeros, ts,
                   (gate.shape[0] + up.shape[0], gate.shape[1]), gate.scheme)
