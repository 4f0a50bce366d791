"""The native lowbit checkpoint: packed safetensors + JSON quant config + tokenizer.

It is the model source lowbit writes itself: every job that produces a quantized model
saves one, and every command loads one like any other model (`lowbit.models.load_model`
reads it through this module). It lives with the other files users keep in `lowbit.files`;
the checksums are a sealed folder (`lowbit.files.sealed`).

Layout of a checkpoint folder::

    config.json          the HF model config (with quantization_config.quant_method = "lowbit")
    model.safetensors    unquantized tensors by their usual names, and for each quantized
                         layer L: L.codes (packed uint8), L.scales, [L.zeros], [L.tensor_scale],
                         [L.input_amax] (the calibrated abs-max of a static input scheme);
                         a quantized fused experts tensor L (``...mlp.experts.gate_up_proj``)
                         stores the same parts, each expert's stacked on a leading axis
    lowbit.json          format version, per-layer scheme + shape (+ "input": the input
                         scheme of layers that quantize their inputs; + "experts": the
                         expert count of a fused experts tensor, "shape" each expert's), sha256 of every other
                         file (weights, config.json, tokenizer files, plans, metrics),
                         free-form metadata (source model, method, perplexities)
    tokenizer files

The folder is built under a temporary name and renamed when complete; `load` verifies
every checksum and every shape before building anything, so a truncated, corrupted or
hand-edited checkpoint fails loudly instead of loading wrong numbers. config.json is
covered too: an edited ``rms_norm_eps`` changes every output without touching a weight.

Checkpoints of an older lowbit checksum only the weights (their manifest lacks
``"checksums": "every file"``): they still load, with a warning that config.json and
the tokenizer are not verified. A file the loaders would read but the manifest does not
list is refused — except tokenizer files copied into a checkpoint saved without any,
which is how `require_tokenizer` tells users to give one a tokenizer.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from lowbit.errors import CheckpointError, ConfigError, LowbitError, SchemeError
from lowbit.files.sealed import Seal, digests
from lowbit.formats import InputScheme, QTensor, Scheme
from lowbit.formats.finite import require_finite
from lowbit.io import atomic_dir
from lowbit.nn import QuantLinear, quant_layers, set_module
from lowbit.nn.input_quant import InputQuantizer
from lowbit.nn.input_rotation import InputRotation
from lowbit.nn.kv_quant import install_kv, kv_spec
from lowbit.nn.quant_experts import QuantExperts, QuantStack, quant_stacks

FORMAT = "lowbit"
VERSION = 1
MANIFEST = "lowbit.json"
WEIGHTS = "model.safetensors"
_QKEYS = ("codes", "scales", "zeros", "tensor_scale", "input_amax")
EVERY_FILE = "every file"  # manifest["checksums"]: every file of the folder is in "files" (older lowbit: weights only)
_CONFIGS = ("config.json", "generation_config.json")
# what transformers' tokenizer loading may read from a folder
_TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
                    "chat_template.jinja", "chat_template.json")
SEAL = Seal("checkpoint", MANIFEST, FORMAT, VERSION, fix="re-create the checkpoint",
            origin="pass a folder written by `lowbit quantize --out`")
# what a writer refusing non-finite numbers tells the user (they come from training or the source, or are a bug)
WRITE_FIX = ("nothing was written. A training run that diverged makes NaN (lower --lr); a quantizer writing "
             "one is a lowbit bug (please report it with the command)")


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def save(model: nn.Module, tokenizer: Any, out: str | Path, meta: dict | None = None, force: bool = False,
         extra_files: dict[str, bytes | Path] | None = None, written: Sequence[Path] = ()) -> Path:
    """Write ``model`` (with its `QuantLinear` layers) to the folder ``out`` atomically.

    extra_files: name -> bytes, or a file to copy, written into the folder too (a
    mixed-precision plan and its plot, a training run's metrics).
    written: safetensors files already holding some of the model's tensors as this writer
    stores them (blocks written out and emptied to meta as a lazily loaded run finished
    them, `lowbit.ptq.blockwise.release`); they are moved into the folder as further weight
    files, and the tensors left on meta are not written again.
    """
    out = Path(out)
    qlayers = quant_layers(model)
    stacks = quant_stacks(model)
    tensors, aliases = _tensors_to_save(model, qlayers, stacks, skip_meta=bool(written))
    require_finite(tensors.items(), f"cannot write {out}", WRITE_FIX)
    manifest = {
        "format": FORMAT, "version": VERSION,
        "layers": {n: layer_spec(m) for n, m in qlayers.items()} | {n: stack_spec(m) for n, m in stacks.items()},
        "aliases": aliases, "meta": meta or {},
    }
    if written:
        manifest["weights"] = [WEIGHTS, *(Path(w).name for w in written)]
    kv = kv_spec(model)
    if kv is not None:  # the KV cache's scheme; its k_scale / v_scale buffers are in the state dict
        manifest["kv_cache"] = kv
    with atomic_dir(out, force=force, kind="lowbit checkpoint") as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        for w in written:
            shutil.move(str(w), tmp / Path(w).name)
        config = getattr(model, "config", None)
        if config is not None:
            config.quantization_config = {"quant_method": FORMAT, "format_version": VERSION}
            config.save_pretrained(tmp)
            del config.quantization_config
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, src in (extra_files or {}).items():
            if isinstance(src, bytes):
                (tmp / name).write_bytes(src)
            else:
                shutil.copyfile(src, tmp / name)
        manifest["files"] = digests(tmp)
        manifest["checksums"] = EVERY_FILE
        SEAL.write(tmp, manifest, indent=1)
    return out


def tokenizer_files(folder: Path) -> list[str]:
    """The tokenizer files of a model folder (what a checkpoint copies from its source)."""
    return [n for n in _TOKENIZER_NAMES if (Path(folder) / n).is_file()]


def seal_sharded(folder: Path, layers: dict, aliases: dict, meta: dict, weights: list[str],
                 known: dict[str, str] | None = None) -> None:
    """Seal a checkpoint whose weights were written shard by shard (`lowbit.ptq.stream`): the manifest, last.

    ``weights`` lists the shard files in order; `load` reads them all. Everything else
    (config.json, tokenizer) must already be in ``folder``. known: the shards' sha256 from their
    seals (hashed as they were written), so the gigabytes are not read back to hash them again.
    """
    manifest = {"format": FORMAT, "version": VERSION, "layers": layers, "aliases": aliases, "meta": meta,
                "weights": list(weights)}
    manifest["files"] = digests(folder, known=known)
    manifest["checksums"] = EVERY_FILE
    SEAL.write(folder, manifest, indent=1)


def weight_files(manifest: dict) -> list[str]:
    """The manifest's weight files: its ``weights`` list (a sharded checkpoint), else model.safetensors."""
    w = manifest.get("weights", [WEIGHTS])
    if not isinstance(w, list) or not w or not all(isinstance(n, str) for n in w):
        raise CheckpointError(f"the manifest's 'weights' must list the weight files, got {w!r}; re-create the "
                              "checkpoint")
    return w


def layer_spec(layer: QuantLinear) -> dict:
    """The manifest entry of a quantized layer: weight scheme, shape, input scheme and online rotation if any."""
    spec = {"scheme": layer.scheme.to_dict(), "shape": [layer.out_features, layer.in_features]}
    if layer.input_quant is not None:
        spec["input"] = layer.input_quant.scheme.to_dict()
    if layer.input_rotation is not None:
        spec["input_rotation"] = layer.input_rotation.spec()
    return spec


def stack_spec(stack: QuantStack) -> dict:
    """The manifest entry of a quantized fused experts tensor: its scheme, each expert's [out, in], the expert count."""
    spec = {"scheme": stack.scheme.to_dict(), "shape": [stack.out_features, stack.in_features],
            "experts": stack.num_experts}
    if stack.input_scheme is not None:
        spec["input"] = stack.input_scheme.to_dict()  # each expert's static abs-max: ``input_amax [E]``
    return spec


def layer_tensors(layer: QuantLinear) -> dict[str, torch.Tensor]:
    """The stored tensors of a quantized layer: packed weight, and a static input's abs-max."""
    d = layer.qweight.pack()
    if layer.input_quant is not None and layer.input_quant.amax is not None:
        d["input_amax"] = layer.input_quant.amax.detach().float().reshape(1)
    return d


def input_rotation(name: str, spec: dict) -> InputRotation | None:
    """The layer's online input rotation from its manifest entry (None when its input is not rotated)."""
    r = spec.get("input_rotation")
    if r is None:
        return None
    try:
        rot = InputRotation.from_spec(dict(r))
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"layer {name}: its online input rotation cannot be read ({e}); re-create the "
                              "checkpoint") from None
    if rot.width != spec["shape"][1]:
        raise CheckpointError(f"layer {name}: its online rotation has width {rot.width} but the layer "
                              f"{spec['shape'][1]} inputs; the checkpoint was edited or damaged")
    return rot


def input_quantizer(name: str, spec: dict, amax: torch.Tensor | None) -> InputQuantizer | None:
    """The layer's input quantizer from its manifest entry (None for weight-only layers)."""
    if spec.get("input") is None:
        if amax is not None:
            raise CheckpointError(f"layer {name} stores an input abs-max but no input scheme; re-create the checkpoint")
        return None
    try:
        inp = InputScheme.from_dict(dict(spec["input"]))
    except (SchemeError, TypeError) as e:
        raise CheckpointError(f"layer {name}: its input scheme cannot be read ({e}); re-create the checkpoint") from None
    if inp.needs_calibration and (amax is None or amax.numel() != 1):
        raise CheckpointError(f"layer {name}: input scheme {inp.name} needs its calibrated abs-max (one value), "
                              "which the checkpoint lacks; re-create it")
    return InputQuantizer(inp, None if amax is None else amax.float().reshape(()))


def module_tensors(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (and aliases) the checkpoint stores for ``module``, named relative to it: a block written
    out on its own (`lowbit.ptq.blockwise.release`) holds exactly what `save` would have written for it."""
    return _tensors_to_save(module, quant_layers(module), quant_stacks(module))


def _tensors_to_save(model: nn.Module, qlayers: dict[str, QuantLinear],
                     stacks: dict[str, QuantStack], skip_meta: bool = False) -> tuple[dict, dict]:
    """State dict with quantized layers (and experts stacks) packed; tensors sharing storage saved once.

    skip_meta: leave out layers and tensors on the meta device (already written elsewhere)."""
    if skip_meta:
        qlayers = {n: m for n, m in qlayers.items() if m.codes.device.type != "meta"}
        stacks = {n: s for n, s in stacks.items() if s.codes.device.type != "meta"}
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    qbuf = {f"{n}.{k}" for n in [*quant_layers(model), *quant_stacks(model)] for k in (*_QKEYS, "input_quant.amax")}
    for key, t in model.state_dict().items():
        if key in qbuf or (skip_meta and t.device.type == "meta"):
            continue
        ident = (t.data_ptr(), t.shape, t.dtype)
        if t.numel() and ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        tensors[key] = _narrowest(t.detach().contiguous().cpu())
    for name, layer in qlayers.items():
        for k, t in layer_tensors(layer).items():
            tensors[f"{name}.{k}"] = t.contiguous().cpu()
    for name, stack in stacks.items():
        for k, t in stack.pack().items():
            tensors[f"{name}.{k}"] = t.contiguous().cpu()
        if stack.input_amax is not None:
            tensors[f"{name}.input_amax"] = stack.input_amax.detach().float().contiguous().cpu()
    return tensors, aliases


def _narrowest(t: torch.Tensor) -> torch.Tensor:
    """fp32 tensors whose values are all fp16 numbers are stored in fp16, else all bf16 numbers in bf16 (lossless,
    half the bytes: a bf16 model's norms or an embedding table beyond fp16's range stay in their source dtype).
    A bf16 table (a lazily loaded run keeps it so, `lowbit.models.narrow_tables`) whose values are all fp16
    numbers is stored in fp16 too: the same file as the run that held it in fp32."""
    if t.dtype in (torch.float32, torch.bfloat16) and t.numel() > 1024:
        for dt in (torch.float16, torch.bfloat16):
            if dt == t.dtype:
                break
            h = t.to(dt)
            if torch.equal(h.to(t.dtype), t):
                return h
    return t


def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a folder written by `lowbit quantize --out`")
    m = SEAL.read(path)
    _check_layers(path / MANIFEST, m.get("layers"))
    return m


def _check_layers(f: Path, layers: object) -> None:
    """Each manifest layer must be ``{"scheme": {...}, "shape": [out, in]}``: refuse anything else up front."""
    ok = isinstance(layers, dict) and all(
        isinstance(spec, dict) and isinstance(spec.get("scheme"), dict) and isinstance(spec.get("shape"), list)
        and len(spec["shape"]) == 2 and all(isinstance(d, int) and d > 0 for d in spec["shape"])
        and (type(spec.get("experts", 1)) is int and spec.get("experts", 1) > 0)
        for spec in layers.values())
    if not ok:
        raise CheckpointError(f"{f} has a malformed 'layers' entry (each layer needs a scheme and a [out, in] "
                              "shape, fused experts a positive expert count); the manifest was edited or damaged "
                              "— re-create the checkpoint")


def verify(path: str | Path, manifest: dict) -> None:
    """Check every data file's sha256 against the manifest; the weights file must be listed.

    Checksums are not optional: a manifest whose ``files`` map is gone or lacks the
    weights would otherwise turn verification off, and names must stay inside the
    folder, or an edited manifest could make lowbit read (and hash) any file.
    """
    path = Path(path)
    files = manifest.get("files")
    unlisted = [w for w in weight_files(manifest) if not isinstance(files, dict) or not isinstance(files.get(w), str)]
    if unlisted:
        raise CheckpointError(f"{path / MANIFEST} has no checksum for {unlisted[0]} (its 'files' map is missing or "
                              "incomplete), so the weights cannot be verified; re-create the checkpoint")
    SEAL.check(path, files)
    _check_unlisted(path, files, manifest.get("checksums") == EVERY_FILE)


def _check_unlisted(path: Path, files: dict, every_file: bool) -> None:
    """Refuse files the loaders read that the checksums do not cover (see module docstring)."""
    read = [n for n in (*_CONFIGS, *_TOKENIZER_NAMES) if (path / n).is_file() and n not in files]
    if not every_file:
        if read:
            warnings.warn(f"{path / MANIFEST} was written by an older lowbit and checksums only the weights: "
                          f"{', '.join(read[:3])}{'...' if len(read) > 3 else ''} are not verified; re-create the "
                          "checkpoint to have them verified", stacklevel=3)
        return
    copied_tokenizer = not any(n in files for n in _TOKENIZER_NAMES)  # saved without one: the user gave it
    unlisted = [n for n in read if not (copied_tokenizer and n in _TOKENIZER_NAMES)]
    if unlisted:
        raise CheckpointError(f"{path / unlisted[0]} is not covered by the checksums of {path / MANIFEST} (added or "
                              "replaced after the checkpoint was written); re-create the checkpoint")


def load(path: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, Any]:
    """Rebuild the quantized model and its tokenizer; outputs equal the saved model's bit for bit."""
    path = Path(path)
    manifest = read_manifest(path)
    verify(path, manifest)
    tensors: dict[str, torch.Tensor] = {}
    for name in weight_files(manifest):
        try:
            tensors.update(load_file(str(path / name)))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {path / name}: {e}") from None
    model = _empty_model(path)
    experts: dict[str, dict[str, QuantStack]] = {}
    for name, spec in manifest["layers"].items():
        if "experts" in spec:
            module, _, param = name.rpartition(".")
            experts.setdefault(module, {})[param] = _quant_stack(name, spec, tensors)
        else:
            set_module(model, name, _quant_layer(name, spec, tensors))
    for module, stacks in experts.items():
        set_module(model, module, _quant_experts(model, module, stacks))
    _install_kv(model, manifest.get("kv_cache"), path)
    _load_rest(model, tensors, manifest)
    model.eval().to(device)
    return model, _load_tokenizer(path)


def _empty_model(path: Path) -> nn.Module:
    """The architecture with every parameter on the meta device (buffers real: rotary tables).

    The quantized layers replace the Linears and the other tensors are assigned from the
    file, so loading never allocates (or randomly initialises) the float model: a 4-bit
    checkpoint loads in about its packed size.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from lowbit.nn.meta import params_on_meta

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with params_on_meta():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _quant_layer(name: str, spec: dict, tensors: dict[str, torch.Tensor]) -> QuantLinear:
    scheme = Scheme.from_dict(spec["scheme"])
    shape = tuple(spec["shape"])
    parts = {k: tensors.pop(f"{name}.{k}") for k in _QKEYS if f"{name}.{k}" in tensors}
    if "codes" not in parts or "scales" not in parts:
        raise CheckpointError(f"layer {name} has no codes/scales in the checkpoint; re-create it")
    inputs = input_quantizer(name, spec, parts.pop("input_amax", None))
    try:
        q = QTensor.from_packed(parts, shape, scheme)  # type: ignore[arg-type]
    except (CheckpointError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"layer {name}: stored tensors disagree with shape {list(shape)} and "
                              f"scheme {scheme.name} ({e}); the checkpoint was edited or damaged") from None
    bias = tensors.pop(f"{name}.bias", None)
    return QuantLinear(q, bias, input_quant=inputs, input_rotation=input_rotation(name, spec))


def _quant_stack(name: str, spec: dict, tensors: dict[str, torch.Tensor]) -> QuantStack:
    scheme = Scheme.from_dict(spec["scheme"])
    shape = tuple(spec["shape"])
    parts = {k: tensors.pop(f"{name}.{k}") for k in _QKEYS if f"{name}.{k}" in tensors}
    amax = parts.pop("input_amax", None)
    if "codes" not in parts or "scales" not in parts:
        raise CheckpointError(f"experts {name}: the checkpoint lacks their codes/scales; re-create it")
    inputs = input_quantizer(name, {"input": spec.get("input")}, None if amax is None else amax.reshape(-1)[:1])
    if inputs is not None and inputs.scheme.needs_calibration and (amax is None or amax.shape != (spec["experts"],)):
        raise CheckpointError(f"experts {name}: input scheme {inputs.scheme.name} needs one calibrated abs-max per "
                              f"expert ({spec['experts']}); the checkpoint was edited or damaged")
    try:
        stack = QuantStack.from_packed(parts, spec["experts"], shape, scheme)  # type: ignore[arg-type]
        return stack if inputs is None else stack.with_input(inputs.scheme, amax)
    except (CheckpointError, ValueError, RuntimeError, IndexError, SchemeError) as e:
        raise CheckpointError(f"experts {name}: stored tensors disagree with {spec['experts']} experts of shape "
                              f"{list(shape)} and scheme {scheme.name} ({e}); the checkpoint was edited or "
                              "damaged") from None


def _quant_experts(model: nn.Module, module: str, stacks: dict[str, QuantStack]) -> QuantExperts:
    """The model's (meta) experts module ``module`` wrapped around its stored stacks."""
    try:
        return QuantExperts(model.get_submodule(module), stacks)
    except (AttributeError, SchemeError) as e:
        raise CheckpointError(f"experts {module}: {e}; the checkpoint does not fit its config.json (edited or "
                              "damaged) — re-create it") from None


def _install_kv(model: nn.Module, spec: object, path: Path) -> None:
    """The KV cache's quantization from the manifest (its scales come with the other tensors)."""
    if spec is None:
        return
    from lowbit.formats.kv import KVScheme

    try:
        if not isinstance(spec, dict) or not isinstance(spec.get("scheme"), dict):
            raise SchemeError("the entry needs a 'scheme'")
        scheme = KVScheme.from_dict(dict(spec["scheme"]))
        if "per_layer" in spec:  # a mixed-precision cache: each attention its own scheme
            layers = spec["per_layer"]
            if not isinstance(layers, dict):
                raise SchemeError("its per_layer must map attention names to schemes")
            scheme = {n: KVScheme.from_dict(dict(d)) for n, d in layers.items()}
        attns = install_kv(model, scheme, values_folded=spec.get("values_folded") is True)
    except (LowbitError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path / MANIFEST}: its kv_cache entry cannot be applied ({e}); the manifest was "
                              "edited or damaged — re-create the checkpoint") from None
    if sorted(attns) != spec.get("layers"):
        raise CheckpointError(f"{path / MANIFEST}: its kv_cache entry names other attention layers than the model "
                              "has; the manifest was edited or damaged — re-create the checkpoint")


def _load_rest(model: nn.Module, tensors: dict[str, torch.Tensor], manifest: dict) -> None:
    for alias, target in manifest.get("aliases", {}).items():
        if target in tensors:
            tensors[alias] = tensors[target]
    expected = model.state_dict()
    for key, t in tensors.items():
        if key not in expected:
            raise CheckpointError(f"checkpoint tensor {key} does not belong to this model; it was edited")
        if expected[key].shape != t.shape:
            raise CheckpointError(f"checkpoint tensor {key} has shape {list(t.shape)}, the model expects "
                                  f"{list(expected[key].shape)}; the checkpoint was edited or damaged")
    qbuf = {f"{n}.{k}" for n in manifest["layers"] for k in (*_QKEYS, "bias", "input_quant.amax")}
    missing = [k for k in expected if k not in tensors and k not in qbuf]
    if missing:
        raise CheckpointError(f"checkpoint lacks tensors {missing[:5]}...; re-create it")
    # the float parameters are still on meta: assign the file's tensors (in the model's dtype)
    model.load_state_dict({k: t.to(expected[k].dtype) for k, t in tensors.items()}, strict=False, assign=True)
    if hasattr(model, "tie_weights") and getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise CheckpointError(f"checkpoint lacks tensors {left[:5]}...; re-create it")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(path: Path) -> Any:
    """The checkpoint's tokenizer; None when it has no tokenizer files (see `require_tokenizer`).

    Files that are present but unreadable are an error, not None: "no tokenizer" would
    send the user looking for files that are there.
    """
    from transformers import AutoTokenizer

    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = str(e).strip().splitlines()[0][:100] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"the tokenizer files in {path} cannot be read ({why}); copy them again from the "
                              "source model or re-create the checkpoint") from None


def require_tokenizer(tokenizer: Any, path: str | Path) -> Any:
    """``tokenizer``, or a clear error for commands that need one (eval, finetune, export to GGUF).

    ``load`` returns None for a checkpoint saved without a tokenizer, because a caller
    that brings its own (or only needs the weights) must still be able to load it.
    """
    if tokenizer is None:
        raise CheckpointError(f"{path} has no tokenizer files; copy them (tokenizer.json, tokenizer_config.json, "
                              "...) from the source model into it, or re-create it with a tokenizer")
    return tokenizer
