"""`train(model, batches, config, ...)`: the one loop behind QAT and adapter training.

Data order and the learning rate are pure functions of (seed, step), so the only state
a resume needs is in the checkpoint, and every rank can compute its own slice of the
global batch without communication. With ``world`` ranks, ``grad_accum`` micro-steps
and equal-length sequences, the averaged gradient equals the single-process one for
the same global batch (up to float summation order).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from lowbit.errors import ConfigError, DataError
from lowbit.train import checkpoint as ckpt
from lowbit.train import distributed as dist
from lowbit.train.callbacks import Callback, TrainState
from lowbit.train.config import TrainConfig
from lowbit.train.metrics import MetricsLog

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]
EvalFn = Callable[[nn.Module], dict[str, float]]
Trainable = Callable[[str, nn.Parameter], bool] | Iterable[nn.Parameter] | None


@dataclass(frozen=True)
class TrainResult:
    steps: int
    losses: list[float]
    final_loss: float
    evals: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    resumed_from: int = 0


# ------------------------------------------------------------------ losses
def causal_lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``batch [B, T]``."""
    logits = model(input_ids=batch).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def kd_loss(teacher: nn.Module, temperature: float = 1.0, ce_weight: float = 0.0) -> LossFn:
    """Knowledge distillation: KL(teacher || student) on next-token logits (+ optional CE).

    The KL is scaled by T^2 so its gradient size does not depend on the temperature.
    """
    teacher.eval().requires_grad_(False)

    def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        s = model(input_ids=batch).logits[:, :-1].float()
        with torch.no_grad():
            t = teacher(input_ids=batch).logits[:, :-1].float()
        v = s.shape[-1]
        kl = F.kl_div(F.log_softmax(s.reshape(-1, v) / temperature, -1),
                      F.log_softmax(t.reshape(-1, v) / temperature, -1), log_target=True,
                      reduction="batchmean") * temperature**2
        if ce_weight:
            kl = kl + ce_weight * F.cross_entropy(s.reshape(-1, v), batch[:, 1:].reshape(-1))
        return kl

    return loss


# ------------------------------------------------------------ pure helpers
def lr_at(step: int, config: TrainConfig) -> float:
    """LR of optimizer step ``step`` (0-based): linear warm-up, then cosine to min_lr."""
    if config.warmup and step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    span = max(config.steps - config.warmup - 1, 1)
    progress = min((step - config.warmup) / span, 1.0)
    return config.min_lr + (config.lr - config.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> torch.Tensor:
    """Indices of the global batch of ``step``: consecutive slices of per-epoch permutations."""
    start, stop = step * batch_size, (step + 1) * batch_size
    first, last = start // n, (stop - 1) // n
    perms = [torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + e))
             for e in range(first, last + 1)]
    return torch.cat(perms)[start - first * n: stop - first * n]


def select_trainable(model: nn.Module, trainable: Trainable) -> list[nn.Parameter]:
    """Parameters to optimise; every other parameter is frozen (requires_grad False)."""
    named = list(model.named_parameters())
    if trainable is None:
        chosen = {id(p) for _, p in named if p.requires_grad}
    elif callable(trainable):
        chosen = {id(p) for n, p in named if trainable(n, p)}
    else:
        chosen = {id(p) for p in trainable}
    for _, p in named:
        p.requires_grad_(id(p) in chosen)
    params = [p for _, p in named if id(p) in chosen]
    if not params:
        raise ConfigError("nothing to train: the trainable selection matched no parameters")
    return params


# ---------------------------------------------------------------- the loop
def _can_fuse(params: list[torch.Tensor], config: TrainConfig) -> bool:
    """Fused AdamW (one kernel for all parameters): a fifth of a CPU QAT step's non-GEMM time
    goes to the per-parameter loop otherwise. FSDP's sharded parameters keep the default."""
    if config.parallel == "fsdp" or not params:
        return False
    kinds = {p.device.type for p in params}
    return len(kinds) == 1 and kinds <= {"cpu", "cuda"} and all(p.is_floating_point() for p in params)


def train(model: nn.Module, batches: torch.Tensor | Sequence[torch.Tensor], config: TrainConfig,
          callbacks: Sequence[Callback] = (), trainable: Trainable = None, loss_fn: LossFn = causal_lm_loss,
          eval_fn: EvalFn | None = None, resume: bool = True, extra: dict | None = None) -> TrainResult:
    """Train ``model`` in place for ``config.steps`` optimizer steps; returns the loss curve.

    batches: ``[N, T]`` token ids (or N equal-shape tensors); step t uses a global batch of
        ``config.batch_size`` rows drawn without replacement per epoch.
    trainable: None (parameters that already require grad), a filter ``(name, param) -> bool``,
        or the parameters themselves.
    extra: method settings (scheme, WinQ switches...) that, like the config, a resumed run
        must share with its checkpoint; the callbacks' own `Callback.curve_settings` join them.
    resume: continue from ``config.out_dir/checkpoint/`` when one exists.
    """
    t0 = time.perf_counter()
    rank, world = dist.rank_world()
    data = _as_tensor(batches, config.batch_size)
    micro = config.micro_batch(world)
    if config.parallel == "fsdp" and world > 1 and config.checkpoint_every:
        raise ConfigError("checkpoints of FSDP runs are not supported yet; use parallel='ddp' or "
                          "checkpoint_every=0")
    select_trainable(model, trainable)
    wrapped = dist.wrap(model, config.parallel)  # FSDP replaces parameters: build the optimizer after
    params = [p for p in wrapped.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                                  weight_decay=config.weight_decay, fused=_can_fuse(params, config))
    state = TrainState(model=model, optimizer=optimizer, config=config, rank=rank, world=world)
    out = Path(config.out_dir) if config.out_dir else None
    log = MetricsLog(out / "metrics.jsonl" if out and rank == 0 else None)
    fingerprint, settings = run_identity(config, callbacks, extra)
    start = _maybe_resume(out, resume, fingerprint, settings, state, log)
    model.train()
    for cb in callbacks:
        cb.on_train_start(state)
    bar = tqdm(range(start, config.steps), desc="train", initial=start, total=config.steps,
               disable=not config.progress or rank != 0, unit="step")
    for step in bar:
        for cb in callbacks:
            cb.on_step_start(state)
        loss, gnorm = _optimizer_step(wrapped, data, step, micro, params, state, loss_fn)
        state.step = step + 1
        state.losses.append(loss)
        for cb in callbacks:
            cb.on_after_optimizer_step(state)
        log.write({"step": state.step, "loss": loss, "lr": lr_at(step, config), "grad_norm": gnorm,
                   "seconds": round(time.perf_counter() - t0, 3)})
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr_at(step, config):.2e}")
        if eval_fn and (state.step == config.steps or (config.eval_every and state.step % config.eval_every == 0)):
            _evaluate(model, eval_fn, state, callbacks, log)
        if config.checkpoint_every and state.step % config.checkpoint_every == 0 and state.step < config.steps:
            _save(out, state, fingerprint, settings)
    bar.close()
    for cb in callbacks:
        cb.on_train_end(state)
    if out and rank == 0 and config.plot:
        from lowbit.train.plot import plot_losses

        plot_losses({"train": state.losses}, out / "loss.png")
    return TrainResult(steps=state.step, losses=list(state.losses), final_loss=state.losses[-1],
                       evals=list(state.evals), seconds=round(time.perf_counter() - t0, 2), resumed_from=start)


def run_identity(config: TrainConfig, callbacks: Sequence[Callback] = (), extra: dict | None = None
                 ) -> tuple[str, dict[str, Any]]:
    """(fingerprint, readable settings) a checkpoint records: the config's curve settings, ``extra``
    and the callbacks' own; a resume must match them."""
    extra = {**(extra or {}), **callback_settings(callbacks)}
    return config.fingerprint(extra), {**config.curve_settings(), **{f"extra.{k}": v for k, v in extra.items()}}


def check_resume(config: TrainConfig, callbacks: Sequence[Callback] = (), extra: dict | None = None,
                 resume: bool = True) -> int:
    """The step `train` would resume from (0: none), its checkpoint checked now.

    Jobs call this before their heavy passes (float perplexity, teacher copies,
    adapter initialisation): a checkpoint written with other settings, or damaged, is
    refused in seconds rather than after them. Same arguments as `train`.
    """
    path = ckpt.find_checkpoint(Path(config.out_dir) / "checkpoint") if resume and config.out_dir else None
    if path is None:
        return 0
    return int(ckpt.check_checkpoint(path, *run_identity(config, callbacks, extra))["step"])


def callback_settings(callbacks: Sequence[Callback]) -> dict[str, Any]:
    """``{"callback.<Name>": settings}`` of every callback that declares curve settings."""
    out: dict[str, Any] = {}
    for cb in callbacks:
        s = cb.curve_settings()
        if s is None:
            continue
        key = f"callback.{type(cb).__name__}"
        while key in out:  # two callbacks of one class: keep both, in order
            key += "'"
        out[key] = s
    return out


def _as_tensor(batches: torch.Tensor | Sequence[torch.Tensor], batch_size: int) -> torch.Tensor:
    data = batches if isinstance(batches, torch.Tensor) else torch.stack(list(batches))
    if data.dim() < 2 or len(data) < batch_size:
        raise DataError(f"training data has {len(data)} sequences but a step needs batch_size={batch_size}; "
                        "pass more samples (e.g. --nsamples) or lower the batch size")
    return data


def _optimizer_step(wrapped: nn.Module, data: torch.Tensor, step: int, micro: int, params: list[nn.Parameter],
                    state: TrainState, loss_fn: LossFn) -> tuple[float, float]:
    """Accumulate ``grad_accum`` micro-batches, clip, AdamW step; returns (mean loss, grad norm)."""
    cfg = state.config
    idx = batch_indices(len(data), cfg.batch_size, step, cfg.seed)
    per_micro = cfg.batch_size // cfg.grad_accum
    device = params[0].device
    total = torch.zeros((), dtype=torch.float64)
    for k in range(cfg.grad_accum):
        rows = idx[k * per_micro: (k + 1) * per_micro][state.rank * micro: (state.rank + 1) * micro]
        batch = data[rows].to(device)
        sync = contextlib.nullcontext() if k == cfg.grad_accum - 1 or state.world == 1 else dist.no_sync(wrapped)
        with sync, _autocast(cfg.dtype, device):
            loss = loss_fn(wrapped, batch) / cfg.grad_accum
            loss.backward()
        total += loss.detach().double().cpu()
    for g in state.optimizer.param_groups:
        g["lr"] = lr_at(step, cfg)
    gnorm = _clip(params, cfg.grad_clip)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return float(dist.mean_across(total)), gnorm


def _clip(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm (sharded DTensor gradients included); returns the norm."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def _autocast(dtype: str, device: torch.device):
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _evaluate(model: nn.Module, eval_fn: EvalFn, state: TrainState, callbacks: Sequence[Callback],
              log: MetricsLog) -> None:
    model.eval()
    with torch.no_grad():
        metrics = dict(eval_fn(model))
    model.train()
    record = {"step": state.step, **metrics}
    state.evals.append(record)
    log.write({"step": state.step, "eval": metrics})
    for cb in callbacks:
        cb.on_eval(state, metrics)


def _maybe_resume(out: Path | None, resume: bool, fingerprint: str, settings: dict, state: TrainState,
                  log: MetricsLog) -> int:
    path = ckpt.find_checkpoint(out / "checkpoint" if out else None) if resume else None
    if path is None:
        log.reset()
        return 0
    payload = ckpt.load_checkpoint(path, fingerprint, settings)
    ckpt.restore(payload, state.model, state.optimizer)
    state.step = payload["step"]
    state.losses = list(payload["losses"])
    state.evals = list(payload["evals"])
    log.truncate_after(state.step)
    return state.step


def _save(out: Path | None, state: TrainState, fingerprint: str, settings: dict) -> None:
    if state.rank == 0 and out is not None:
        ckpt.save_checkpoint(out / "checkpoint", model=state.model, optimizer=state.optimizer, step=state.step,
                             losses=state.losses, evals=state.evals, fingerprint=fingerprint, settings=settings)
    dist.barrier()
