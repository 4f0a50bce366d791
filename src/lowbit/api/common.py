"""Settings and helpers that several jobs share: calibration and evaluation text, devices, bits."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowbit.configs import check_fields
from lowbit.errors import ConfigError
from lowbit.plans.plan import Plan


@dataclass(frozen=True)
class Calibration:
    """Calibration rows: ``nsamples`` windows of ``seqlen`` tokens from the calibration split.

    data: a .txt / .jsonl / saved HF dataset (None = the bundled corpus). seed: where the
    windows start (and the seed of a method that draws random numbers of its own).
    """

    data: str | None = None
    nsamples: int = 32
    seqlen: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "calibration setting")
        if self.nsamples < 1 or self.seqlen < 2:
            raise ConfigError(f"calibration needs nsamples >= 1 and seqlen >= 2, got {self.nsamples} x {self.seqlen}")

    def batches(self, tokenizer: Any) -> torch.Tensor:
        from lowbit.data import calibration_batches

        return calibration_batches(tokenizer, self.data, nsamples=self.nsamples, seqlen=self.seqlen, seed=self.seed)


@dataclass(frozen=True)
class Evaluation:
    """Perplexity over the first ``windows`` windows of ``seqlen`` tokens of the evaluation split (0 = all)."""

    data: str | None = None
    seqlen: int = 512
    windows: int = 40

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "evaluation setting")
        if self.seqlen < 2:
            raise ConfigError(f"the evaluation window must be at least 2 tokens, got {self.seqlen}")
        if self.windows < 0:
            raise ConfigError(f"--windows must be >= 0 (0 = the whole evaluation text), got {self.windows}")

    def tokens(self, tokenizer: Any) -> torch.Tensor:
        """The evaluation split, checked to hold at least one window (before any heavy work)."""
        from lowbit.data import eval_tokens
        from lowbit.eval import eval_windows

        ids = eval_tokens(tokenizer, self.data)
        eval_windows(ids, self.seqlen, self.windows or None)
        return ids

    def perplexity(self, model: nn.Module, tokens: torch.Tensor, progress: bool = True):
        from lowbit.eval import perplexity

        return perplexity(model, tokens, seqlen=self.seqlen, windows=self.windows or None, progress=progress)


def work_folder(out: str | Path, workdir: str | Path | None) -> Path:
    """Where a training job's metrics and checkpoints go: ``workdir``, or OUT.train beside --out."""
    return Path(workdir) if workdir else Path(out).with_name(Path(out).name + ".train")


class Phases:
    """Wall seconds per phase of a job (``time_s`` in its summary): where a run's time went.

    ``with phases("load"): ...`` adds that block's seconds to the phase (phases run once or
    add up); the summary keeps the order the phases first ran in.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def report(self) -> dict[str, float]:
        return {k: round(v, 1) for k, v in self.seconds.items()}


def set_threads(threads: int | None) -> None:
    """Apply ``--threads`` (None: torch's default, one thread per core)."""
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def busy_note(threads: int | None) -> str | None:
    """A note when torch used several threads on a machine busier than it has CPUs, else None.

    torch runs one intra-op thread per core, and when other processes keep those cores busy
    its threads wait on each other at every parallel region: on 2 cores at load ~7 a scale
    search took 57 s with 2 threads and 4.3 s with 1. Nothing is changed silently (the thread
    count changes float summation order); the note names the flag.
    """
    load, cpus, used = os.getloadavg()[0], os.cpu_count() or 1, torch.get_num_threads()
    if threads is None and used > 1 and load >= cpus:
        return (f"note: this machine was busy (load average {load:.1f} on {cpus} CPUs), so torch's {used} threads "
                "waited on each other; --threads 1 can run several times faster")
    return None


def job_device(device: str | None) -> torch.device | None:
    """The compute device of this process: ``device`` checked; under torchrun, the rank's GPU.

    With several processes (``WORLD_SIZE`` > 1) on GPUs each rank uses ``cuda:LOCAL_RANK``;
    naming another GPU index would put two ranks on one device, so that is an error.
    """
    from lowbit.models.placement import check_device

    dev = check_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if dev is not None and dev.index is not None and dev.index != local.index:
            raise ConfigError(f"--device {device} under torchrun: each rank uses its own GPU (cuda:LOCAL_RANK); "
                              "pass --device cuda")
        return local
    return dev


def bits_summary(model: nn.Module, plan: Plan, lm_head: bool) -> dict[str, Any]:
    """Bits per weight as `lowbit.formats.bits` defines them, each figure beside its label.

    ``bits_per_weight`` is measured from the packed form the checkpoint stores, so `inspect`
    of the saved checkpoint reports the same figure; unplanned decoder Linears count 16 bits
    (a partial plan's average over its own layers alone would hide them).
    """
    from lowbit.formats.bits import COUNTED, NOMINAL, average_bits
    from lowbit.models import linear_layers
    from lowbit.nn import quant_layers
    from lowbit.nn.quant_experts import quant_stacks
    from lowbit.ptq.blockwise.release import released

    layers = linear_layers(model, include_lm_head=lm_head)
    sizes = {n: (m.out_features, m.in_features) for n, m in layers.items()}
    sizes.update({n: _shape(model, n) for n in plan if n not in sizes})
    rel = released(model)  # blocks written out and emptied: their packed sizes were kept
    written = rel.storage if rel is not None else {}
    quant = {n: written[n] if n in written else m.qweight.storage_bytes() for n, m in quant_layers(model).items()}
    quant |= {n: written[n] if n in written else _packed_bytes(m) for n, m in quant_stacks(model).items()}
    dense = sum(o * i for n, (o, i) in sizes.items() if n not in plan) + _float_block_matrices(model, sizes)
    stored = [(o * i, 8 * quant[n] / (o * i)) for n, (o, i) in sizes.items() if n in plan]
    nominal = [(o * i, plan.weight(n).bits_per_weight(i)) for n, (o, i) in sizes.items() if n in plan]
    return {"bits_per_weight": round(average_bits(stored, dense), 4), "bits_counted": COUNTED,
            "bits_per_weight_nominal": round(average_bits(nominal, dense), 4), "nominal_counts": NOMINAL,
            "layers_quantized": len(plan), "layers_16bit": len(sizes) - len(plan)}


def _float_block_matrices(model: nn.Module, linears: Mapping[str, Any]) -> int:
    """Float matmul weights in the decoder blocks that are not Linears (fused experts, routers): 16 bits each.

    `inspect` counts them from the stored tensors the same way, so both report one figure.
    """
    from lowbit.models import block_path
    from lowbit.models.accounting import account_model

    prefix = block_path(model) + "."
    return sum(w.numel for w in account_model(model).weights if not w.quantized and w.name.startswith(prefix)
               and w.name.rpartition(".")[0] not in linears and w.name not in linears)


def checkpoint_bytes(model: nn.Module, plan: Plan | None = None, bits: float | None = None) -> int:
    """About the size of the checkpoint of ``model`` quantized by ``plan`` (or every decoder Linear at ``bits``
    per weight), to refuse an output its device cannot hold before any work.

    Quantized weights count at their bits per weight, every other tensor at its size in
    memory (float32 ones that fp16 holds exactly are stored in fp16, so this errs on the
    large side), plus 1 MiB for config files; tokenizer files (a few MB at most) are not
    counted: a write that fails anyway is one clear line. Tied tensors count once.
    """
    from lowbit.models import linear_layers
    from lowbit.models.experts import expert_tensors

    if plan is not None:
        layers = {n: (_shape(model, n), plan.weight(n).bits_per_weight) for n in plan}
    else:
        layers = {n: ((m.out_features, m.in_features), lambda _cols: bits) for n, m in linear_layers(model).items()}
    experts = expert_tensors(model)  # a float experts tensor's parameter is the plan name itself
    packed = {n if n in experts else f"{n}.weight": bpw(i) * i * o / 8 for n, ((o, i), bpw) in layers.items()}
    total, seen = sum(packed.values()), set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name not in packed and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return int(total) + (1 << 20)


def _shape(model: nn.Module, name: str) -> tuple[int, int]:
    """(rows, in) of a planned weight: a Linear's, or a fused experts tensor's E matrices as E * out rows."""
    from lowbit.models.experts import planned_shape

    return planned_shape(model, name)


def _packed_bytes(stack: nn.Module) -> int:
    """Bytes the checkpoint stores for a quantized experts stack."""
    return sum(t.numel() * t.element_size() for t in stack.pack().values())


def given(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options a caller actually set (None = not given)."""
    return {k: v for k, v in options.items() if v is not None}
