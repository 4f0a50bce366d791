"""A Hugging Face model folder checked before anything is built from it.

transformers builds whatever config.json describes and then fills it from the weight
files, so a config that disagrees with the weights either runs away (``num_hidden_layers``
10^6: a million blocks are built while memory grows) or quietly initializes what the
files lack (3 layers for weights of 2: layer 2 is random, and a quantize run succeeds on
it). Damaged files surface as tracebacks from deep inside the loader. `check_folder`
reads only config.json and the safetensors headers (never tensor data) and refuses, in
one line naming the file, tensor or field:

* weights that are only pickles (``pytorch_model.bin``, ``*.pt``): lowbit reads no pickle;
* a weight file that is not safetensors, is truncated, or whose header lies (offsets
  past the end, shapes that do not match the bytes): safetensors' own header validation;
* a config.json that cannot build a model, whose decoder-block count the weights do not
  have, or whose tensors have other shapes than the files (``hidden_size 0``,
  ``vocab_size 1e10``): compared on a skeleton built on the meta device, which allocates
  nothing whatever sizes the config names;
* integer tensors where the model has float parameters: transformers would cast them
  silently (an int32 copy of a weight x1000 became 1000x larger weights). They are
  refused rather than warned about, because no float model stores integer weights: such
  a file is a quantized format lowbit does not read, or a broken conversion.

After loading, `check_loaded` refuses parameters the files did not provide (transformers
initializes them randomly), which catches renamed or missing tensors the header checks
cannot name ahead of time.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from lowbit.errors import ModelError
from lowbit.io import read_json

INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
_BLOCKS = re.compile(r"^(.*?(?:^|\.)(?:layers|layer|h|blocks|block))\.(\d+)\.")
_INT_DTYPES = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")
_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim")

Header = dict[str, tuple[str, tuple[int, ...], str]]  # tensor -> (dtype, shape, file)


def check_folder(path: Path, skeleton: bool = True) -> Any:
    """Refuse ``path`` (see module doc) before any model is built; returns its parsed config.

    skeleton=False leaves out the comparison with the model's own tensors, for folders
    whose files hold another layout of them (compressed-tensors' packed codes and scales).
    """
    headers = read_headers(path, weight_files(path))
    config = read_config(path)
    check_blocks(path, config, headers)
    if skeleton:
        check_against_skeleton(path, config, headers)
    return config


def weight_files(path: Path) -> list[str]:
    """The safetensors files of ``path`` (by its index, or model.safetensors); pickles alone are refused."""
    if (path / INDEX).is_file():
        return _indexed_files(path)
    if (path / WEIGHTS).is_file():
        return [WEIGHTS]
    pickles = sorted(p.name for pattern in PICKLES for p in path.glob(pattern))
    if pickles:
        raise ModelError(f"{path} holds its weights only as pickles ({pickles[0]}); lowbit reads no pickle, since "
                         "loading one can run code. Convert the model you trust to safetensors first (load it with "
                         "transformers, then save_pretrained(FOLDER) writes model.safetensors) and pass that folder")
    raise ModelError(f"{path} has a config.json but no {WEIGHTS} (or {INDEX}); put the model's safetensors "
                     "weights beside it")


def _indexed_files(path: Path) -> list[str]:
    index = read_json(path / INDEX, ModelError, "re-download or re-save the model")
    try:
        files = sorted(set(index["weight_map"].values()))
    except (KeyError, TypeError, AttributeError) as e:
        raise ModelError(f"{path / INDEX} is not a safetensors index ({_first(e)}); re-download or re-save the "
                         "model") from None
    for name in files:
        if not isinstance(name, str) or Path(name).name != name or not (path / name).is_file():
            raise ModelError(f"{path / INDEX} names the weight file {name!r}, which is not a file in {path}; "
                             "re-download or re-save the model")
    return files


def read_headers(path: Path, files: list[str]) -> Header:
    """Every tensor's dtype and shape from the files' headers, validated by safetensors (no data is read)."""
    from safetensors import SafetensorError, safe_open

    out: Header = {}
    for name in files:
        try:
            with safe_open(str(path / name), framework="pt") as f:
                for key in f.keys():
                    s = f.get_slice(key)
                    out[key] = (s.get_dtype(), tuple(s.get_shape()), name)
        except (SafetensorError, OSError) as e:
            raise ModelError(f"{path / name} is not a readable safetensors file ({_first(e)}): it is truncated, "
                             "damaged or another format under that name; re-download or re-save the model") from None
    return out


def read_config(path: Path) -> Any:
    """The model config, its size fields checked to be positive whole numbers."""
    raw = read_json(path / "config.json", ModelError, "fix or re-download it")
    for where in (raw, raw.get("text_config")) if isinstance(raw, dict) else ():
        for key in _SIZE_FIELDS if isinstance(where, dict) else ():
            v = where.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ModelError(f"{path / 'config.json'}: {key} must be a positive whole number, got {v!r}; fix "
                                 "config.json to describe the weights beside it")
    from transformers import AutoConfig

    try:
        with quiet():
            return AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers' validators raise many kinds; one line either way
        raise ModelError(f"cannot read {path / 'config.json'}: {_first(e)}") from None


def check_blocks(path: Path, config: Any, headers: Header) -> None:
    """The weights must hold every decoder block 0..N-1 that config.json's ``num_hidden_layers`` names."""
    n = getattr(_text_config(config), "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        return
    containers: dict[str, set[int]] = {}
    for key in headers:
        m = _BLOCKS.match(key)
        if m:
            containers.setdefault(m.group(1), set()).add(int(m.group(2)))
    if not containers or any(len({i for i in ids if i < n}) == n for ids in containers.values()):
        return
    prefix, ids = max(containers.items(), key=lambda kv: len(kv[1]))
    have = f"blocks {min(ids)}..{max(ids)}" if len(ids) == max(ids) - min(ids) + 1 else f"{len(ids)} blocks"
    raise ModelError(f"{path / 'config.json'} says num_hidden_layers = {n}, but the weights hold {have} "
                     f"({prefix}.N); fix num_hidden_layers (to {max(ids) + 1}?) or use the weights it was written for")


def check_against_skeleton(path: Path, config: Any, headers: Header) -> None:
    """Build the model on the meta device (nothing allocated) and compare its tensors with the files'."""
    from transformers import AutoModelForCausalLM

    try:
        with quiet(), torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - whatever the architecture's constructor raises on a bad config
        raise ModelError(f"{path / 'config.json'} cannot build a model ({type(e).__name__}: {_first(e)}); fix it "
                         "to describe the weights beside it") from None
    for key, t in skeleton.state_dict().items():
        if key not in headers:
            continue  # renamed or fused by transformers' loader, or tied: `check_loaded` sees the result
        dtype, shape, file = headers[key]
        if tuple(t.shape) != shape:
            raise ModelError(f"{path / 'config.json'} does not match the weights: it makes {key} "
                             f"{list(t.shape)}, but {file} stores {list(shape)}; fix config.json (or use the "
                             "weights it was written for)")
        if t.is_floating_point() and dtype in _INT_DTYPES:
            raise ModelError(f"{path / file}: tensor {key} is stored as {dtype}, but it is a floating-point "
                             "weight; lowbit does not cast integer tensors to weights (such a file is a quantized "
                             "format lowbit does not read, or a broken conversion): store it as F32, F16 or BF16")


def check_loaded(path: Path, info: dict[str, Any]) -> None:
    """Refuse a load in which transformers initialized parameters the weight files did not hold."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(info.get("mismatched_keys") or ())
    if missing:
        raise ModelError(f"the weights in {path} lack {missing[0]}" + (f" and {len(missing) - 1} more tensor(s)"
                         if len(missing) > 1 else "") + " that config.json's model needs (they would be random); "
                         "fix config.json or use the complete weights")
    if mismatched:
        raise ModelError(f"the weights in {path} do not fit config.json's model ({mismatched[0]}); fix config.json")


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _first(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__


@contextlib.contextmanager
def quiet():
    """transformers' warnings and load reports would precede lowbit's one error line."""
    import logging

    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
