"""What an export holds: format, per-layer scheme, bits per weight, size against fp16.

Works on the three outputs lowbit writes — a native checkpoint folder, a
compressed-tensors folder, a GGUF file — reading only headers and small tensors, never
building the model. Bits per weight are `lowbit.formats.bits`'s definition, measured from
the bytes actually stored for a layer (codes + scales + zeros + tensor scale), not from
the scheme's nominal formula, so a format's padding or wider scale dtype shows up; the
decoder Linears a plan left in 16 bits count 16, as in `lowbit quantize`'s figure.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lowbit.errors import CheckpointError
from lowbit.formats.bits import COUNTED, NOMINAL, average_bits

NATIVE, CT, GGUF = "lowbit", "compressed-tensors", "gguf"
_BYTES = {"U8": 1, "I8": 1, "F8_E4M3": 1, "F16": 2, "BF16": 2, "F32": 4, "I32": 4, "I64": 8, "F64": 8}


@dataclass(frozen=True)
class LayerInfo:
    """input: the layer's activation format (None = inputs not quantized)."""

    name: str
    scheme: str
    shape: tuple[int, int]
    bits_per_weight: float
    input: str | None = None
    input_amax: float | None = None
    experts: int = 0  # a fused experts tensor of this many ``shape`` matrices (0: a Linear)

    @property
    def numel(self) -> int:
        return max(self.experts, 1) * self.shape[0] * self.shape[1]


def detect(path: str | Path) -> str:
    """``lowbit`` | ``compressed-tensors`` | ``gguf``; anything else is a clear error."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist; pass a folder or .gguf file written by lowbit")
    if p.is_file():
        with open(p, "rb") as f:
            if f.read(4) == b"GGUF":
                return GGUF
        raise CheckpointError(f"{p} is not a GGUF file (no GGUF magic); pass a .gguf written by `lowbit export`")
    if (p / "lowbit.json").is_file():
        return NATIVE
    cfg = p / "config.json"
    if cfg.is_file():
        qc = _quantization_config(cfg)
        if qc.get("quant_method") == CT:
            return CT
    raise CheckpointError(f"{p} is neither a lowbit checkpoint (lowbit.json), a compressed-tensors folder "
                          "(config.json quant_method) nor a GGUF file")


def _quantization_config(cfg: Path) -> dict:
    """The ``quantization_config`` object of a config.json (empty when it has none)."""
    from lowbit.io import read_json

    d = read_json(cfg, CheckpointError, "it is not a valid config.json — re-create the export")
    qc = d.get("quantization_config") if isinstance(d, dict) else None
    if not isinstance(d, dict) or not isinstance(qc or {}, dict):
        raise CheckpointError(f"{cfg} is not a valid config.json (no JSON object); re-create the export")
    return qc or {}


def _headers(folder: Path) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, dtype) for every tensor in the folder's safetensors files."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, tuple[list[int], str]] = {}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no .safetensors files; the export is incomplete")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    sl = st.get_slice(k)
                    out[k] = (list(sl.get_shape()), sl.get_dtype())
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f} is truncated or damaged ({str(e)[:100]}); re-create the export") from None
    return out


def _nbytes(shape: list[int], dtype: str) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * _BYTES.get(dtype, 4)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _layer_bits(headers: dict, prefix: str, keys: tuple[str, ...], shape: tuple[int, int], count: int = 1) -> float:
    stored = sum(_nbytes(*headers[f"{prefix}.{k}"]) for k in keys if f"{prefix}.{k}" in headers)
    return 8 * stored / max(count * shape[0] * shape[1], 1)


def _dense_params(headers: dict, quant_keys: set[str]) -> int:
    return sum(_numel(s) for k, (s, _) in headers.items() if k not in quant_keys)


# a tensor inside a decoder block: ``model.layers.3.``, ``transformer.h.3.``, GGUF's ``blk.3.``
_BLOCK = re.compile(r"(^|\.)(layers|h|blocks|blk)\.\d+\.")


def _dense_linear_weights(shapes: dict[str, list[int]], quantized: set[str]) -> int:
    """Matmul weights in the decoder blocks stored in 16 bits: 2-D ``*.weight`` tensors (Linears, routers) and
    fused experts (3-D), as `lowbit quantize` counts them."""
    return sum(_numel(shape) for name, shape in shapes.items()
               if (name.endswith(".weight") and len(shape) == 2 or len(shape) >= 3) and _BLOCK.search(name)
               and name.removesuffix(".weight") not in quantized and name.rpartition(".")[0] not in quantized)


def inspect_native(folder: Path) -> tuple[list[LayerInfo], int]:
    from lowbit.files.native import read_manifest, verify
    from lowbit.formats import InputScheme

    manifest = read_manifest(folder)
    verify(folder, manifest)  # a report on a damaged checkpoint must not look like a good one
    headers = _headers(folder)
    keys = ("codes", "scales", "zeros", "tensor_scale")
    layers, qkeys = [], set()
    for name, spec in manifest["layers"].items():
        shape = (int(spec["shape"][0]), int(spec["shape"][1]))
        count = int(spec.get("experts", 0))
        scheme = _scheme(folder, name, spec)
        _check_stored(folder, name, shape, scheme, headers, count)
        inp = spec.get("input")
        label = None if inp is None else InputScheme.from_dict(dict(inp)).name
        amax = _amax(folder, name) if f"{name}.input_amax" in headers else None
        bits = _layer_bits(headers, name, keys, shape, max(count, 1))
        layers.append(LayerInfo(name, scheme.name, shape, bits, label, amax, count))
        qkeys |= {f"{name}.{k}" for k in (*keys, "input_amax")}
    stray = sorted(k for k in headers if k.endswith(".codes") and k[: -len(".codes")] not in manifest["layers"])
    if stray:
        raise CheckpointError(f"{folder / 'model.safetensors'} stores quantized codes {stray[0]} that lowbit.json "
                              "does not list; the checkpoint was edited or damaged — re-create it")
    # tied copies (manifest aliases) are stored once, as an fp16 export would store them
    return layers, _dense_params(headers, qkeys) + sum(i.numel for i in layers)


def _scheme(folder: Path, name: str, spec: dict) -> Any:
    from lowbit.errors import SchemeError
    from lowbit.formats import Scheme

    try:
        return Scheme.from_dict(spec["scheme"])
    except (SchemeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{folder / 'lowbit.json'}, layer {name}: its scheme cannot be read ({e}); the "
                              "checkpoint was edited or damaged — re-create it") from None


def _check_stored(folder: Path, name: str, shape: tuple[int, int], scheme: Any, headers: dict,
                  experts: int = 0) -> None:
    """The stored parts of a layer have the shapes its manifest entry implies (from the header alone);
    a fused experts tensor stores each part stacked along a leading axis of ``experts``."""
    from lowbit.formats.qtensor import packed_shapes

    for part, want in packed_shapes(shape, scheme).items():
        want = (experts, *want) if experts else want
        got = headers.get(f"{name}.{part}")
        if got is None or tuple(got[0]) != want:
            have = "missing" if got is None else f"of shape {list(got[0])}"
            raise CheckpointError(f"layer {name}: its stored {part} is {have}, but lowbit.json says {list(shape)} "
                                  f"with {scheme.name}, which stores {list(want)}; the checkpoint was edited or "
                                  "damaged — re-create it")


def _amax(folder: Path, name: str) -> float:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as st:
        return float(st.get_tensor(f"{name}.input_amax").reshape(-1)[0])


def _ct_input_label(args: dict | None) -> str | None:
    """``input_activations`` in words, e.g. ``float4 tensor_group g16 dynamic=local``."""
    if not args:
        return None
    kind = "float" if args.get("type") == "float" else "int"
    g = args.get("group_size")
    return (f"{kind}{args.get('num_bits')} {args.get('strategy')}{' g' + str(g) if g else ''} "
            f"dynamic={str(args.get('dynamic')).lower()}")


def _ct_label(weights: dict, fmt: str) -> str:
    kind = "fp" if weights.get("type") == "float" else "int"
    g = weights.get("group_size")
    sym = "" if weights.get("symmetric", True) else " asym"
    return f"{fmt}: {kind}{weights.get('num_bits')} {'g' + str(g) if g else weights.get('strategy')}{sym}"


def inspect_ct(folder: Path) -> tuple[list[LayerInfo], int]:
    from safetensors import safe_open

    qc = _quantization_config(folder / "config.json")
    headers = _headers(folder)
    label, inputs = {}, {}
    for group in qc.get("config_groups", {}).values():
        for target in group.get("targets", []):
            label[target] = _ct_label(group.get("weights") or {}, group.get("format") or qc.get("format"))
            inputs[target] = _ct_input_label(group.get("input_activations"))
    keys = ("weight_packed", "weight_scale", "weight_zero_point", "weight_global_scale", "weight")
    layers, qkeys = [], set()
    patterns = [(re.compile(t[3:]), t) for t in label if t.startswith("re:")]  # per-expert layers: one per layer

    def target(name: str) -> str | None:
        return name if name in label else next((t for rx, t in patterns if rx.match(name)), None)

    stored = [k for k in headers if k.endswith(".weight_packed")]
    stored += [k for k in headers if k.endswith(".weight") and headers[k][1] in ("I8", "F8_E4M3")
               and target(k[: -len(".weight")]) is not None]
    for key in sorted(stored):
        name = key.rsplit(".", 1)[0]
        out, packed_cols = headers[key][0]
        if key.endswith(".weight"):  # int8 / float8 elements, one per byte
            shape = (out, packed_cols)
        elif f"{name}.weight_shape" in headers:
            f = next(p for p in sorted(folder.glob("*.safetensors")) if _has(p, f"{name}.weight_shape"))
            with safe_open(str(f), framework="pt") as st:
                shape = tuple(int(v) for v in st.get_tensor(f"{name}.weight_shape").tolist())
        else:  # nvfp4: two E2M1 codes per byte
            shape = (out, packed_cols * 2)
        t = target(name)
        layers.append(LayerInfo(name, label.get(t, qc.get("format", CT)), shape,  # type: ignore[arg-type]
                                _layer_bits(headers, name, keys, shape), inputs.get(t)))  # type: ignore[arg-type]
        qkeys |= {f"{name}.{k}" for k in (*keys, "weight_shape", "input_scale", "input_zero_point",
                                           "input_global_scale")}
    return layers, _dense_params(headers, qkeys) + sum(i.shape[0] * i.shape[1] for i in layers)


def _has(path: Path, key: str) -> bool:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as st:
        return key in st.keys()


def inspect_gguf(path: Path) -> tuple[list[LayerInfo], int]:
    import gguf

    from lowbit.files.gguf_read import open_gguf

    reader = open_gguf(path)
    layers, total = [], 0
    dense = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    for t in reader.tensors:
        n = int(t.n_elements)
        total += n
        if t.tensor_type in dense or len(t.shape) != 2:
            continue
        shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF lists dims innermost first
        layers.append(LayerInfo(t.name, t.tensor_type.name, shape, 8 * int(t.n_bytes) / max(n, 1)))
    return layers, total


def gguf_layout(path: Path) -> dict[str, Any]:
    """A GGUF file's llama.cpp file type, head grouping, and every tensor: name, type, shape (outermost first), bytes."""
    from lowbit.files.gguf_read import open_gguf

    reader = open_gguf(path)

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    heads, kv = field(f"{arch}.attention.head_count"), field(f"{arch}.attention.head_count_kv")
    tensors = [{"name": t.name, "type": t.tensor_type.name, "shape": [int(d) for d in reversed(t.shape)],
                "bytes": int(t.n_bytes)} for t in reader.tensors]
    return {"file_type": field("general.file_type"), "n_gqa": (heads // kv) if heads and kv else 1,
            "n_expert": int(field(f"{arch}.expert_count") or 0), "tensors": tensors}


def _tensor_shapes(p: Path, fmt: str) -> dict[str, list[int]]:
    """name -> shape of every stored tensor (GGUF names, dims outermost first)."""
    if fmt != GGUF:
        return {k: s for k, (s, _) in _headers(p).items()}
    from lowbit.files.gguf_read import open_gguf

    return {t.name: [int(d) for d in reversed(t.shape)] for t in open_gguf(p).tensors
            if t.tensor_type.name in ("F32", "F16", "BF16")}


def _nominal_bits(p: Path, fmt: str, layers: list[LayerInfo], dense: int) -> float | None:
    """The schemes' nominal rate (native checkpoints, whose manifest names each layer's scheme)."""
    if fmt != NATIVE:
        return None
    from lowbit.files.native import read_manifest
    from lowbit.formats import Scheme

    specs = read_manifest(p)["layers"]
    return average_bits(((i.numel, Scheme.from_dict(specs[i.name]["scheme"]).bits_per_weight(
        i.shape[1])) for i in layers), dense)


def stored_matmul_weights(p: Path, fmt: str, layers: list[LayerInfo]) -> list[tuple[str, tuple[int, ...], bool]]:
    """Every stored weight as (name, shape, quantized): what the accounting of `lowbit.models.accounting` classifies.

    The classification by kind lives with the models (it shares its rules with the accounting of a
    built model); this layer only says what the file holds, so the caller passes the classifier in.
    """
    if fmt == GGUF:
        from lowbit.files.gguf_read import open_gguf

        entries = [(t.name, tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name not in ("F32", "F16", "BF16"))
                   for t in open_gguf(p).tensors]
    else:  # a quantized layer counts as its matrix; its stored parts (codes, scales...) are not weights
        quant = {i.name.removesuffix(".weight") for i in layers}
        entries = [(i.name, (i.experts, *i.shape), True) if i.experts else
                   (f"{i.name.removesuffix('.weight')}.weight", i.shape, True) for i in layers]
        entries += [(k, tuple(s), False) for k, (s, dtype) in _headers(p).items()
                    if k.rpartition(".")[0] not in quant and dtype in ("F16", "BF16", "F32", "F64")]
    return entries


Accountant = Callable[[list[tuple[str, tuple[int, ...], bool]]], dict[str, Any]]


def inspect(path: str | Path, account: Accountant | None = None) -> dict[str, Any]:
    """Summary of an export (see module docstring); ``layers`` holds the per-layer rows.

    ``account`` classifies the stored matmul weights by kind (``matmul_weights``); without it the
    key is absent (the export job reads only formats and sizes).
    """
    p = Path(path)
    fmt = detect(p)
    layers, params = {NATIVE: inspect_native, CT: inspect_ct, GGUF: inspect_gguf}[fmt](p)
    size = p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.iterdir() if f.is_file())
    dense = _dense_linear_weights(_tensor_shapes(p, fmt), {i.name.removesuffix(".weight") for i in layers})
    bits = average_bits(((i.numel, i.bits_per_weight) for i in layers), dense)
    nominal = _nominal_bits(p, fmt, layers, dense)
    schemes: dict[str, int] = {}
    inputs: dict[str, int] = {}
    for i in layers:
        schemes[i.scheme] = schemes.get(i.scheme, 0) + 1
        if i.input is not None:
            inputs[i.input] = inputs.get(i.input, 0) + 1
    return {"format": fmt, "path": str(p), "quantized_layers": len(layers), "schemes": schemes, "inputs": inputs,
            "bits_per_weight": round(bits, 4), "bits_counted": COUNTED,
            **({} if nominal is None else {"bits_per_weight_nominal": round(nominal, 4), "nominal_counts": NOMINAL}),
            "linears_16bit_weights": dense, **_kv_cache(p, fmt),
            **({} if account is None else {"matmul_weights": account(stored_matmul_weights(p, fmt, layers))}),
            "params": params, "file_bytes": size, "fp16_bytes": 2 * params,
            "size_vs_fp16": round(size / max(2 * params, 1), 4),
            "layers": [asdict(i) | {"bits_per_weight": round(i.bits_per_weight, 4)} for i in layers]}


def _kv_cache(p: Path, fmt: str) -> dict[str, Any]:
    """The KV cache's scheme, where the file holds one (native ``kv_cache``, compressed-tensors ``kv_cache_scheme``)."""
    if fmt == NATIVE:
        from lowbit.files.native import read_manifest
        from lowbit.formats.kv import KVScheme

        entry = read_manifest(p).get("kv_cache")
        return {} if entry is None else {"kv_cache": KVScheme.from_dict(dict(entry["scheme"])).name}
    if fmt == CT:
        kv = _quantization_config(p / "config.json").get("kv_cache_scheme")
        return {} if not kv else {"kv_cache": ("fp8-head" if kv.get("strategy") == "attn_head" else "fp8")
                                                + " (kv_cache_scheme)"}
    return {}
