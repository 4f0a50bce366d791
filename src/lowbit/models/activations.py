"""Statistics of the inputs of Linear layers on calibration data, in one place for every method.

Every data-aware method reduces a layer's calibration inputs ``X [tokens, in]`` to a few
statistics, and they are all sums over tokens, so forward pre-hooks can accumulate them
batch by batch without keeping activations:

* ``sumsq``  ``[in]``: ``sum_t x_tj^2``, the diagonal of ``X^T X``: the importance that
  makes ``sum_j imp_j (w_j - q(w_j))^2`` track a layer's output error (RTN's searched
  scales, SignRoundV2's initial scales);
* ``xtx``    ``[in, in]``: the full second moment ``X^T X`` (QWHA's least-squares
  refinement; GPTQ's Hessian is ``2 X^T X``);
* ``absmax`` ``[in]``: the largest ``|x_tj|`` per input channel (static activation
  scales);
* ``sumabs`` ``[in]``: ``sum_t |x_tj|``, the mean magnitude of each input channel once
  divided by ``tokens`` (AWQ's activation-aware channel scales);
* ``tokens``: how many rows were seen (to turn sums into means).

Sums accumulate in float64 so millions of tokens add up exactly enough; a layer that
never ran is an error, not an empty result (its batches never reached it). ``X^T X`` of
one batch is a float64 product by default; ``xtx_dtype=torch.float32`` computes it in
float32 (1.7x faster on a CPU core, relative error ~1e-7 per batch) before the float64
sum, which is what GPTQ's Hessians need.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from lowbit.errors import ConfigError
from lowbit.models.placement import model_device

KINDS = ("sumsq", "xtx", "absmax", "sumabs")


class ActivationStats:
    """Forward pre-hooks accumulating the chosen ``kinds`` of statistics per named layer.

    Use as a context manager around forward passes; ``result()`` afterwards.
    """

    def __init__(self, layers: Mapping[str, nn.Module], kinds: Iterable[str] = ("sumsq",),
                 xtx_dtype: torch.dtype = torch.float64) -> None:
        self.kinds = tuple(dict.fromkeys(kinds))
        self.xtx_dtype = xtx_dtype
        bad = [k for k in self.kinds if k not in KINDS]
        if bad:
            raise ConfigError(f"unknown activation statistic(s) {bad}; choose from {KINDS}")
        self.layers = dict(layers)
        self.sums: dict[str, dict[str, torch.Tensor]] = {k: {} for k in self.kinds}
        self.tokens: dict[str, int] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _hook(self, name: str):
        def hook(_module: nn.Module, args: tuple) -> None:
            x = args[0].detach()
            x = x.reshape(-1, x.shape[-1])
            self.tokens[name] = self.tokens.get(name, 0) + x.shape[0]
            for kind in self.kinds:
                self._add(kind, name, _statistic(kind, x, self.xtx_dtype))

        return hook

    def _add(self, kind: str, name: str, value: torch.Tensor) -> None:
        prev = self.sums[kind].get(name)
        if prev is None:
            self.sums[kind][name] = value.double()
        elif kind == "absmax":
            self.sums[kind][name] = torch.maximum(prev, value.to(prev.device))
        elif kind == "xtx":
            add_rows(prev, value)
        else:
            prev += value.to(prev.device)

    def __enter__(self) -> ActivationStats:
        for name, layer in self.layers.items():
            self._handles.append(layer.register_forward_pre_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def result(self, kind: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
               ) -> dict[str, torch.Tensor]:
        """``name -> statistic`` of one kind, in ``dtype`` on ``device``."""
        if kind not in self.kinds:
            raise ConfigError(f"statistic {kind!r} was not collected (collected: {self.kinds})")
        missing = [n for n in self.layers if n not in self.tokens]
        if missing:
            raise ConfigError(f"layers {missing[:3]} never ran while collecting activation statistics; "
                              "check that the calibration batches reach them")
        return {n: self.sums[kind][n].to(device=device, dtype=dtype) for n in self.layers}


def _statistic(kind: str, x: torch.Tensor, xtx_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    if kind == "sumsq":
        return x.double().pow(2).sum(0)
    if kind == "xtx":
        return gram(x.to(xtx_dtype))  # summed into the float64 total by `add_rows`, a band of rows at a time
    if kind == "sumabs":
        return x.double().abs().sum(0)
    return x.abs().amax(0).double()


PANEL = 192  # columns per panel of `gram`
BAND = 1024  # rows per step of `add_rows`


def add_rows(total: torch.Tensor, part: torch.Tensor, band: int = BAND) -> None:
    """``total += part`` (float64 total, a float32 or float64 part), ``band`` rows at a time.

    The same sums as casting ``part`` to float64 first, without that ``n x n`` float64 copy
    (1.6 GB for the 14336-wide input of an 8B model's ``down_proj``): only a band is cast at once.
    """
    for start in range(0, part.shape[0], band):
        total[start:start + band] += part[start:start + band].to(total.device, total.dtype)


def gram(x: torch.Tensor, panel: int = PANEL) -> torch.Tensor:
    """``x^T x`` computed on and below the diagonal only, mirrored above: ~(1 + 1/k) / 2 of the GEMM work for k panels.

    torch has no symmetric rank-k product (BLAS syrk); panels of ``panel`` columns do the
    same thing with ordinary GEMMs (0.65x the time of ``x.T @ x`` for 1536 columns on one
    CPU core), and the result is exactly symmetric. Narrow inputs take one GEMM.
    """
    n = x.shape[1]
    if n <= panel:
        return x.T @ x
    out = torch.empty(n, n, dtype=x.dtype, device=x.device)
    for start in range(0, n, panel):
        stop = min(start + panel, n)
        rows = x[:, start:stop].T @ x[:, :stop]  # panel rows, columns up to the panel's end
        diag = rows[:, start:].tril()
        rows[:, start:] = diag + diag.tril(-1).T  # a GEMM's diagonal block is not exactly symmetric
        out[start:stop, :stop] = rows
        out[:start, start:stop] = rows[:, :start].T
    return out


@contextlib.contextmanager
def activation_stats(layers: Mapping[str, nn.Module], kinds: Iterable[str] = ("sumsq",),
                     xtx_dtype: torch.dtype = torch.float64) -> Iterator[ActivationStats]:
    with ActivationStats(layers, kinds, xtx_dtype) as stats:
        yield stats


@torch.no_grad()
def collect(model: nn.Module, batches: torch.Tensor, layers: Iterable[str], kinds: Iterable[str] = ("sumsq",),
            batch_size: int = 8, progress: bool = False) -> ActivationStats:
    """Run ``batches`` (LongTensor ``[n, seqlen]``) through ``model`` with the hooks on ``layers``."""
    mods = {n: model.get_submodule(n) for n in layers}
    device = model_device(model)
    with activation_stats(mods, kinds) as stats:
        for chunk in tqdm(batches.split(batch_size), desc="calibration pass", disable=not progress,
                          unit="batch"):
            model(input_ids=chunk.to(device), use_cache=False)
    return stats


def importance(model: nn.Module, batches: torch.Tensor, layers: Iterable[str], batch_size: int = 8
               ) -> dict[str, torch.Tensor]:
    """``name -> [in]`` float32 sum of squared inputs (the diagonal of ``X^T X``), on the CPU."""
    return collect(model, batches, layers, ("sumsq",), batch_size).result("sumsq")


def second_moments(model: nn.Module, batches: torch.Tensor, layers: Iterable[str], batch_size: int = 4,
                   progress: bool = False) -> dict[str, torch.Tensor]:
    """``name -> [in, in]`` float64 ``X^T X`` of every layer's input, on the model's device."""
    stats = collect(model, batches, layers, ("xtx",), batch_size, progress)
    return stats.result("xtx", torch.float64, model_device(model))


def input_amax(model: nn.Module, batches: torch.Tensor, layers: Iterable[str], batch_size: int = 8,
               progress: bool = False) -> dict[str, torch.Tensor]:
    """``name -> []`` float32 largest ``|x|`` over every input of each layer: static activation scales."""
    per_channel = collect(model, batches, layers, ("absmax",), batch_size, progress).result("absmax")
    return {n: a.amax() for n, a in per_channel.items()}
