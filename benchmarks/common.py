"""What every benchmark script shares: where results go, how rows are merged, how runs are timed.

Conventions (benchmarks/README.md): each script prints a table and writes JSON under
``benchmarks/results/``; rows are merged into that file as they finish (atomically, under
a lock, so two sweeps may run side by side and an interrupted one keeps what it measured);
every row records the machine it ran on; speed is reported as ratios against a peer or a
physical limit measured in the same run, from medians of several runs in fresh processes.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
T = TypeVar("T")

# The PTQ protocol every tuning benchmark shares (issue 4): 32 x 256 tokens of the calibration
# split (seed 0), tuning mini-batch 8, evaluation 40 windows x 512 tokens of the eval split.
NSAMPLES, SEQLEN, BATCH = 32, 256, 8
EVAL_WINDOWS, EVAL_SEQLEN = 40, 512


def result_path(name: str | Path) -> Path:
    """``benchmarks/results/NAME`` (``.json`` added when NAME has no suffix); an absolute NAME is kept as is."""
    p = RESULTS / name
    return p if p.suffix else p.with_suffix(".json")


def out_path(arg: str | None, default: str) -> Path:
    """A script's ``--out``: the default results file, or the given path (relative to the working folder)."""
    return result_path(default) if arg is None else Path(arg).absolute()


def load_results(name: str | Path, empty: dict | None = None) -> dict:
    p = result_path(name)
    return json.loads(p.read_text()) if p.exists() else dict({"rows": []} if empty is None else empty)


def save_results(name: str | Path, data: dict) -> Path:
    """Write a results file atomically (temp file beside it, then rename)."""
    from lowbit.io import atomic_write_text

    p = result_path(name)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(p, json.dumps(data, indent=1, default=_plain))
    return p


def _plain(value: Any) -> Any:
    """JSON for what ``json`` cannot encode: numpy / torch scalars as numbers, anything else as text."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):  # not a one-element array or tensor
            pass
    return str(value)


def merge_row(name: str | Path, row: dict, key: Sequence[str] | Callable[[dict], tuple], **fields: Any) -> dict:
    """Replace the row with the same ``key`` values (or append), set top-level ``fields``; returns the data.

    Serialised with a lock file, so sweeps running side by side never lose each other's rows.
    ``key`` is field names, or a function of a row (for keys whose older rows lack a field).
    """
    p = result_path(name)
    p.parent.mkdir(parents=True, exist_ok=True)
    ident_of = key if callable(key) else (lambda r: tuple(r.get(k) for k in key))
    with open(p.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = load_results(name)
        ident = ident_of(row)
        data["rows"] = [r for r in data.get("rows", []) if ident_of(r) != ident] + [row]
        data.update(fields)
        save_results(name, data)
    return data


def machine() -> dict[str, Any]:
    """The hardware a row was measured on: rates and ratios only compare within one machine."""
    import torch

    from lowbit.nn.precision import cpu_description

    info: dict[str, Any] = {"cpu": cpu_description(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def peak_gpu_mib() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def timed(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall seconds of ``fn()`` over ``repeats`` runs after ``warmup`` untimed ones (and all runs)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return median(times), times


def gemm_gflops(m: int = 2048, k: int = 576, n: int = 1536, dtype: str = "fp32", repeats: int = 30,
                device: str = "cpu") -> float:
    """Median GEMM throughput on one ``[m, k] x [k, n]`` product: the physical limit rows are held to."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a, b = torch.randn(m, k, dtype=dt, device=device), torch.randn(k, n, dtype=dt, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def run() -> None:
        a @ b
        sync()

    seconds, _ = timed(run, repeats, warmup=3)
    return 2 * m * k * n / seconds / 1e9


def run_child(module: str, args: Sequence[str], timeout: float | None = None, env: dict | None = None,
              threads: int | None = None, show_stderr: bool = False) -> dict:
    """Run ``python -m benchmarks.MODULE ARGS`` in a fresh process; returns the JSON of its last stdout line.

    A fresh process per measured run gives each its own wall time and peak memory, and
    no warm caches from the run before. The child ends by printing its row (`emit`).
    show_stderr: let the child's stderr (progress bars, log lines) through to this terminal,
    for runs long enough that someone watches them; otherwise its tail goes into the error.
    """
    full_env = {**os.environ, **(env or {})}
    if threads is not None:
        full_env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", f"benchmarks.{module}", *args]
    r = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=None if show_stderr else subprocess.PIPE,
                       text=True, timeout=timeout, env=full_env)
    if r.returncode != 0:
        tail = "(its output is above)" if show_stderr else r.stderr[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{tail}")
    lines = r.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"{' '.join(cmd)} printed no result row")
    return json.loads(lines[-1])


def emit(row: dict) -> None:
    """The child's side of `run_child`: its result row as the last line of stdout."""
    print(json.dumps(row, default=_plain), flush=True)


def alternating(items: Sequence[T], repeats: int) -> Iterator[tuple[int, T]]:
    """``(repeat, item)`` for ``repeats`` rounds, every other round reversed, so a drift in
    machine speed (another job starting, thermal state) hits every item alike."""
    for rep in range(repeats):
        for item in items if rep % 2 == 0 else list(items)[::-1]:
            yield rep, item


# pip requirement and how to get it, per peer module
PEERS = {
    "auto_round": ("auto-round", "pip install 'auto-round>=0.16' (or: make bench-setup)"),
    "fouroversix": ("fouroversix", "make bench-setup (builds fouroversix's CPU path with SKIP_CUDA_BUILD=1)"),
    "llama_cpp": ("llama-cpp-python", "pip install -e '.[llamacpp]'"),
    "peft": ("peft", "pip install 'peft>=0.15' (or: make bench-setup)"),
}


def has_peer(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def require_peer(module: str, alternative: str = "") -> None:
    """Exit with one line naming what to install when peer ``module`` is missing (before any heavy work)."""
    if has_peer(module):
        return
    name, how = PEERS[module]
    raise SystemExit(f"error: this run needs {name}, which is not installed: {how}"
                     + (f"; or {alternative}" if alternative else ""))


def bundled_model(threads: int | None = 1, seed: int = 0, model: str = "bundled"):
    """The model a benchmark runs on (``--model``), loaded after pinning ``threads`` and the torch seed.

    bundled: SmolLM2-135M-Instruct. Its "float" weights are a Q4_1 GGUF (4-bit asymmetric,
    group 32) dequantized: every perplexity measured on it is relative to that
    already-quantized model. offgrid: the same function with its weights off every grid
    (`offgrid_folder`).
    """
    import torch

    from lowbit.models import load_model

    if model not in MODELS:
        raise SystemExit(f"error: unknown --model {model!r}; choose from {', '.join(MODELS)}")
    source = None if model == "bundled" else offgrid_folder()  # made (or checked) before the seed is set
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    return load_model(source)


# ------------------------------------------------------------------ the off-grid model
# The bundled model's weights lie exactly on an asymmetric 4-bit group-32 grid (it is a dequantized
# Q4_1 GGUF), which gives every method whose grid aligns with it a head start and makes any rotation
# look harmful. A dense random orthogonal rotation of the residual stream, folded into the weights
# (lowbit's own rotation, kind "haar"), leaves the function as it is and the weights on no grid.
MODELS = ("bundled", "offgrid")
OFFGRID_SEED = 0
OFFGRID_META = "offgrid.json"
MODEL_HELP = ("bundled: SmolLM2-135M-Instruct (a dequantized Q4_1 GGUF: its weights lie on a 4-bit g32 grid); "
              "offgrid: the same model with a seeded Haar-random rotation of the residual stream folded into the "
              "weights (same function, weights on no grid; made once and cached under the lowbit cache folder)")


def offgrid_folder(source: str | Path | None = None, seed: int = OFFGRID_SEED, cache: Path | None = None) -> Path:
    """A Hugging Face folder holding ``source`` (default: the bundled model) with a seeded Haar-random
    orthogonal rotation of its residual stream folded into the weights; made once, then reused.

    Every RMSNorm's scale is folded into the Linears reading it (then set to 1), the embedding,
    every reader and writer Linear and the lm_head are turned; a tied lm_head is untied (its
    weight becomes ``E diag(final norm) R``, no longer the embedding's), which adds one
    vocab x width float table. The folder records its digest (sha256 of model.safetensors),
    checked on every use: a damaged copy is made again. An architecture whose residual
    stream lowbit cannot rotate is refused (`ModelError` naming it) before anything is written.
    cache: the folder the copies live in (default: ``offgrid`` beside lowbit's GGUF cache).
    """
    import fcntl

    from lowbit.files.gguf_read import cache_root
    from lowbit.models.loading import bundled_gguf

    src = bundled_gguf() if source is None else Path(source).expanduser().resolve()
    root = Path(cache) if cache is not None else cache_root().parent / "offgrid"
    digest = _source_digest(src)
    folder = root / f"{src.stem if src.is_file() else src.name}-haar{seed}-{digest[:12]}"
    if _intact(folder):
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{folder.name}.lock", "w") as lock:  # one maker at a time; the others wait, then reuse
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _intact(folder):
            _make_offgrid(None if source is None else src, folder, seed, digest)
    return folder


def offgrid_info(folder: Path | None = None) -> dict:
    """What the off-grid folder records: source and its digest, the rotation, the model's sha256."""
    return json.loads(((folder or offgrid_folder()) / OFFGRID_META).read_text())


def model_fields(model: str) -> dict:
    """The fields a result row records about the model it ran on (the off-grid copy's digest)."""
    if model == "bundled":
        return {"model": "bundled"}
    info = offgrid_info()
    return {"model": model, "model_sha256": info["sha256"], "model_seed": info["seed"]}


def _source_digest(src: Path) -> str:
    """sha256 of a model file, or of a folder's config and safetensors files."""
    import hashlib

    from lowbit.io import sha256_file

    if src.is_file():
        return sha256_file(src)
    if not src.is_dir():
        raise SystemExit(f"error: {src} does not exist; an off-grid copy needs a model folder or .gguf file")
    h = hashlib.sha256()
    for f in sorted([*src.glob("*.safetensors"), *src.glob("config.json")]):
        h.update(f"{f.name}:{sha256_file(f)}".encode())
    return h.hexdigest()


def _intact(folder: Path) -> bool:
    from lowbit.io import sha256_file

    try:
        meta = json.loads((folder / OFFGRID_META).read_text())
        return sha256_file(folder / "model.safetensors") == meta["sha256"]
    except (OSError, ValueError, KeyError):
        return False


def _make_offgrid(source: Path | None, folder: Path, seed: int, source_digest: str) -> None:
    """Load, refuse what cannot be rotated, rotate, write to a temporary folder, check the written copy
    against the source's logits, then rename into place (nothing half-written is ever used)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from lowbit.io import atomic_dir, sha256_file
    from lowbit.models import load_model
    from lowbit.models.structure import residual_map
    from lowbit.ptq.rotation import RotationSettings, rotate_model

    lm = load_model(source)
    model = lm.model
    residual_map(model, "an off-grid copy (a rotation of the residual stream)")  # ModelError naming the arch
    ids = torch.randint(0, model.get_input_embeddings().weight.shape[0], (2, 64),
                        generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        before = model(input_ids=ids).logits.double()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    info = rotate_model(model, RotationSettings(kind="haar", seed=seed, keep=0))
    with atomic_dir(folder, force=True, kind="off-grid model (cache)") as tmp:
        model.config.save_pretrained(tmp)
        save_file({k: t.contiguous() for k, t in model.state_dict().items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        lm.tokenizer.save_pretrained(tmp)
        back = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        with torch.no_grad():
            after = back(input_ids=ids).logits.double()
        err = float((after - before).abs().max() / before.abs().max())
        if not err < 1e-4:
            from lowbit.errors import ModelError

            raise ModelError(f"the off-grid copy of {lm.source} does not compute what it does (relative logit "
                             f"difference {err:.3g} after saving and loading it); nothing was cached")
        meta = {"source": str(lm.source), "source_sha256": source_digest, "seed": seed, "rotation": info,
                "untied_head": tied, "reload_rel_logit_diff": err, "sha256": sha256_file(tmp / "model.safetensors")}
        (tmp / OFFGRID_META).write_text(json.dumps(meta, indent=1, default=_plain))


def calibration(tokenizer: Any, nsamples: int = NSAMPLES, seqlen: int = SEQLEN, seed: int = 0):
    """``[nsamples, seqlen]`` token windows of the calibration split (never the eval text)."""
    from lowbit.data import calibration_batches

    return calibration_batches(tokenizer, None, nsamples=nsamples, seqlen=seqlen, seed=seed)


def tuning_gflop(model: Any, iters: int, tokens: int, qkv_input_grad: bool = False) -> float:
    """GEMM work (GFLOP) of block-wise rounding tuning: the physical floor its time is held to.

    Per iteration, every decoder-block Linear runs on ``tokens`` tokens its forward, the
    gradient of its (fake-quantized) weight and the gradient of its input: 3 x 2 x params x
    tokens. q/k/v need no input gradient (nothing upstream of them in the block is trained),
    so they count 2 passes unless ``qkv_input_grad`` (the cruder bound ``benchmarks.ptq``
    has recorded since its first rows, kept so its rows stay comparable). Attention's own
    products are excluded.
    """
    from lowbit.models import linear_layers

    total = 0.0
    for name, m in linear_layers(model).items():
        qkv = name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj")
        passes = 3 if qkv_input_grad or not qkv else 2
        total += passes * 2 * m.weight.numel() * tokens
    return total * iters / 1e9


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def adapter_step_macs(model: Any, names: Sequence[str], rank: int, tokens: int, seqlen: int) -> dict:
    """Multiply-adds of one adapter training step, frozen-base LoRA vs QWHA's dense path.

    Both run the base GEMM forward and its input gradient for every adapted Linear, the
    tied lm_head (forward + input gradient) and attention (scores and values, forward and
    backward). LoRA adds rank-r products; QWHA's dense delta adds the weight gradient of
    each adapted Linear (``tokens * out * in``), which a rank-r adapter never forms. The
    ratio is what step time would be if every multiply-add ran at the same speed: a floor
    for the dense path, which no kernel tuning can go below.
    """
    cfg = model.config
    lin = sum(model.get_submodule(n).weight.numel() for n in names)
    lora = sum(rank * sum(model.get_submodule(n).weight.shape) for n in names)
    head = cfg.vocab_size * cfg.hidden_size
    attn = cfg.num_hidden_layers * 2 * seqlen * cfg.hidden_size  # QK^T and AV per token, causal ~ half x2
    shared = tokens * (2 * lin + 2 * head + 3 * attn)
    lora_macs = shared + tokens * 3 * lora
    qwha_macs = shared + tokens * lin
    return {"tokens_per_step": tokens, "lora_macs": lora_macs, "qwha_dense_macs": qwha_macs,
            "qwha_over_lora_floor": round(qwha_macs / lora_macs, 3)}


def rtn_base(model: Any, names: Sequence[str], scheme: str) -> dict:
    """Quantize ``names`` of ``model`` in place with plain RTN (the adapters' base); returns their FP weights."""
    from lowbit.formats import Scheme
    from lowbit.nn import replace_linears
    from lowbit.plans.plan import Plan

    fp = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    replace_linears(model, Plan.uniform(names, Scheme.parse(scheme)))
    return fp
