"""Hadamard rotation of the residual stream, fused into the weights (QuaRot-style).

An orthogonal ``R`` applied to the residual stream changes no output when every writer
turns its output by ``R`` and every reader its input by ``R^T``: the embedding rows
``E -> E R``, the Linears after a norm ``W -> W R``, the Linears adding into the stream
(o_proj, down_proj) ``W -> R^T W`` (bias ``b -> b R``), the lm_head ``W -> W R``. An
RMSNorm commutes with ``R`` (``rms(h R) = rms(h)``) only without its per-channel scale,
so each norm's scale is first folded into the Linears that read it and then set to 1.
Nothing is added at inference: the rotated model is a model of the same architecture,
whose weights have no outlier channels left for the quantizer to clip (the point).

``R = diag(s) H^T / sqrt(n)`` with the Walsh-Hadamard construction of `lowbit.transforms.hadamard`
(any width ``m * 2^k``, e.g. SmolLM2's 576 = 36 * 16) and ``s`` random signs
(``kind="random"``, QuaRot's randomized Hadamard) or all ones (``kind="hadamard"``).
``kind="haar"`` is a dense orthogonal matrix drawn from the Haar measure instead (QR of a
seeded Gaussian, any width, ``n^2`` float64 numbers): it has none of the Hadamard's
structure, so fused into a model whose weights sit on a quantization grid (the bundled
SmolLM2 is a dequantized Q4_1 GGUF) it moves every weight off that grid while keeping the
function, the benchmarks' "off-grid" baseline; `Rotation.dense` takes any given orthogonal
matrix the same way. The products run in float64 so the rotated float model equals the original to float32
rounding; `rotate_model` checks that on a probe input before returning.

Channels the model switches off: SmolLM2 (like many LLMs) carries a few "massive"
channels in its residual stream and multiplies them by ~0 in the RMSNorm before every MLP
(|w| ~ 1e-4 against a median of 0.2). Folded into gate/up and rotated, that ~0 scale no
longer shields them: the quantization error of the rotated weights meets the full
massive input, and gate/up's output error grows 2.4-4.4x (measured). ``keep`` leaves such
channels out of the rotation (identity on them, their norm scales stay in the norms,
only the other channels are folded and rotated by a Hadamard of the remaining width):
``None`` picks the channels some RMSNorm scales below ``QUIET`` times its median, adding
the next quietest until the rest of the width has a Hadamard construction.

A tied lm_head cannot stay tied: the embedding becomes ``E R`` but the head
``E diag(w_norm) R``, so the head is untied (one extra vocab x width table, stored in
16 bits like the embedding) and the model config says so.

Online rotations (``online``, e.g. ``("down_proj",)``): a Linear whose input nothing
upstream can absorb a rotation into (down_proj reads SwiGLU's product) gets its weight
rows rotated and a Hadamard applied to its input at run time (`lowbit.nn.input_rotation`),
QuaRot's rotation for activation quantization. They work with or without the residual
rotation (``residual``) and are checked by the same probe.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from lowbit.configs import check_fields
from lowbit.errors import ConfigError, ModelError
from lowbit.models.layers import block_path, decoder_blocks, linear_layers
from lowbit.models.structure import BlockLayout, ResidualMap, residual_map
from lowbit.nn.input_rotation import attach
from lowbit.transforms.hadamard import factor, wht, wht_columns

KINDS = ("random", "hadamard", "haar")
QUIET = 0.02  # a norm scale below this fraction of the norm's median switches its channel off
_ROWS = 8192  # rows transformed per float64 chunk (a 128k x 4096 embedding must not be copied whole)


@dataclass(frozen=True)
class RotationSettings:
    """kind: "random" (random signs, then Hadamard: QuaRot's choice), "hadamard" (plain) or "haar" (a dense
    random orthogonal matrix, see the module doc); seed of the signs or of the Haar matrix.

    keep: channels left out of the rotation: 0 = none (every channel is rotated), None =
    the channels some RMSNorm switches off (see the module doc), k = the k quietest.
    residual: rotate the residual stream (fused into the weights).
    online: names (last component, e.g. ``down_proj``) of the Linears whose input is also
    rotated at run time; each must match a Linear of every decoder block.
    """

    kind: str = "random"
    seed: int = 0
    keep: int | None = 0
    residual: bool = True
    online: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "rotation setting")
        object.__setattr__(self, "online", tuple(self.online))
        if not self.residual and not self.online:
            raise ConfigError("a rotation with residual=False needs online layers (e.g. down_proj); otherwise "
                              "it rotates nothing")
        if self.kind not in KINDS:
            raise ConfigError(f"rotation kind must be one of {KINDS}, got {self.kind!r}")
        if self.keep is not None and self.keep < 0:
            raise ConfigError(f"rotation keep must be >= 0 channels (or None: automatic), got {self.keep}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Rotation:
    """``h -> h R`` with ``R`` = identity on the kept channels and, on the others, ``diag(signs) H^T / sqrt(n)``
    (Hadamard kinds) or the dense orthogonal ``matrix`` (``[n, n]`` float64, when given)."""

    signs: torch.Tensor  # [n] float64, +-1, one per rotated channel
    mixed: torch.Tensor  # [n] long: the rotated channels
    width: int
    matrix: torch.Tensor | None = None  # [n, n] float64 orthogonal: replaces the signed Hadamard

    @classmethod
    def make(cls, width: int, settings: RotationSettings, kept: list[int] | None = None) -> Rotation:
        mixed = _mixed(width, kept)
        n = mixed.numel()
        if settings.kind == "haar":
            return cls.dense(width, haar_orthogonal(n, settings.seed), kept)
        if factor(n) is None:
            raise ModelError(f"no Hadamard construction for the model width {n} (needs m * 2^k with a known "
                             "Hadamard order m); quantize without --rotate, or with a --rotate-keep that leaves such a width")
        if settings.kind == "hadamard":
            return cls(torch.ones(n, dtype=torch.float64), mixed, width)
        gen = torch.Generator().manual_seed(settings.seed)
        return cls(torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1, mixed, width)

    @classmethod
    def dense(cls, width: int, matrix: torch.Tensor, kept: list[int] | None = None) -> Rotation:
        """The rotation by a given orthogonal ``matrix`` on the channels not ``kept`` (checked: ``Q^T Q = I``)."""
        mixed = _mixed(width, kept)
        n = mixed.numel()
        q = matrix.detach().to("cpu", torch.float64)
        if q.shape != (n, n):
            raise ConfigError(f"a rotation of {n} channels needs an {n} x {n} matrix, got {tuple(q.shape)}")
        err = float((q.T @ q - torch.eye(n, dtype=torch.float64)).abs().max())
        if not err < 1e-9:
            raise ConfigError(f"the rotation matrix is not orthogonal (max |Q^T Q - I| = {err:.3g}); the rotated "
                              "model would not compute the same function")
        return cls(torch.ones(n, dtype=torch.float64), mixed, width, q)

    @property
    def n(self) -> int:
        return self.signs.numel()

    @property
    def kept(self) -> list[int]:
        return sorted(set(range(self.width)) - set(self.mixed.tolist()))

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x R`` for ``x [..., width]`` (embedding rows, reader weights, writer biases), in x's dtype."""
        flat = x.reshape(-1, self.width)
        out = flat.clone()
        s, idx = self.signs.to(x.device), self.mixed.to(x.device)
        q = None if self.matrix is None else self.matrix.to(x.device)
        for i in range(0, flat.shape[0], _ROWS):
            part = flat[i: i + _ROWS, idx].double() * s
            turned = part @ q if q is not None else wht(part, scale=1 / math.sqrt(self.n))
            out[i: i + _ROWS, idx] = turned.to(x.dtype)
        return out.reshape(x.shape)

    def columns(self, w: torch.Tensor) -> torch.Tensor:
        """``R^T W`` for a writer's ``W [width, in]`` (its output turns with the stream)."""
        out = w.clone()
        s, idx = self.signs.to(w.device).unsqueeze(1), self.mixed.to(w.device)
        q = None if self.matrix is None else self.matrix.to(w.device)
        for i in range(0, w.shape[1], _ROWS):
            part = w[idx, i: i + _ROWS].double() * s
            turned = q.T @ part if q is not None else wht_columns(part, scale=1 / math.sqrt(self.n))
            out[idx, i: i + _ROWS] = turned.to(w.dtype)
        return out


def _mixed(width: int, kept: list[int] | None) -> torch.Tensor:
    """The rotated channels: all but ``kept``, in order."""
    skip = set(kept or [])
    return torch.tensor([c for c in range(width) if c not in skip], dtype=torch.long)


def haar_orthogonal(n: int, seed: int) -> torch.Tensor:
    """A random ``[n, n]`` orthogonal matrix distributed by the Haar measure, from ``seed`` (float64).

    QR of a Gaussian matrix, each column of Q multiplied by the sign of R's diagonal
    (without that step Q is orthogonal but not uniformly distributed; Mezzadri 2007).
    """
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


def quiet_channels(model: nn.Module, rmap: ResidualMap) -> tuple[list[int], torch.Tensor]:
    """Channels by how far some RMSNorm of the stream switches them off, and that ratio (min of |w| / median |w|)."""
    ratio = torch.full((rmap.width,), float("inf"), dtype=torch.float64)
    for norm in _norms(model, rmap):
        g = norm.weight.detach().abs().double().cpu()
        ratio = torch.minimum(ratio, g / g.median().clamp_min(1e-30))
    return [int(c) for c in ratio.argsort()], ratio


def kept_channels(model: nn.Module, rmap: ResidualMap, keep: int | None, dense: bool = False) -> list[int]:
    """The channels ``keep`` leaves out of the rotation (see `RotationSettings`).

    dense: the rotation is a dense matrix (any width), so ``keep=None`` adds no channels
    beyond the switched-off ones to reach a width with a Hadamard construction.
    """
    if keep == 0:
        return []
    order, ratio = quiet_channels(model, rmap)
    if keep is not None:
        return order[:keep]
    k = int((ratio < QUIET).sum())
    if k == 0:
        return []
    while not dense and factor(rmap.width - k) is None:
        k += 1
    return order[:k]


def _norms(model: nn.Module, rmap: ResidualMap) -> list[nn.Module]:
    out = []
    for bname in rmap.blocks:
        block = model.get_submodule(bname)
        out += [block.get_submodule(n) for n in rmap.layout.norms]
    return [*out, model.get_submodule(rmap.final_norm)]


def rotate_model(model: nn.Module, settings: RotationSettings = RotationSettings(), check: bool = True
                 ) -> dict[str, Any]:
    """Fold the norms and rotate the residual stream of ``model`` in place; returns what was done.

    check: compare the logits of a probe input before and after (a `ModelError` if the
    architecture turned out not to be what the map said; the model is then unusable).
    """
    t0 = time.perf_counter()
    rmap = residual_map(model, "rotation") if settings.residual else None
    planned = [n for n, m in linear_layers(model).items() if not isinstance(m, nn.Linear)]
    if planned:
        raise ConfigError(f"rotation rewrites float weights, but {planned[0]} is already quantized; rotate the "
                          "float model before quantizing it")
    blocks = [f"{block_path(model)}.{i}" for i in range(len(decoder_blocks(model)))]
    online = online_layers(model, blocks, settings.online)
    rot = None if rmap is None else Rotation.make(
        rmap.width, settings, kept_channels(model, rmap, settings.keep, dense=settings.kind == "haar"))
    probe = probe_ids(model) if check else None
    before = _logits(model, probe) if check else None
    info: dict[str, Any] = settings.to_dict()
    if rmap is not None and rot is not None:
        rotate_tables(model, rmap, rot)
        for bname in rmap.blocks:
            rotate_block(model.get_submodule(bname), rmap.layout, rot)
        info.update(_residual_info(rmap, rot))
    for name in online:
        attach(model.get_submodule(name))
    info["online_layers"] = len(online)
    if check:
        err = _max_rel_diff(before, _logits(model, probe))
        info["probe_rel_diff"] = err
        if not err < 1e-3:
            raise ModelError(f"the rotated {type(model).__name__} no longer computes the same function (relative "
                             f"logit difference {err:.3g}); its blocks are not the pre-norm residual stream lowbit "
                             "rotates. Quantize without --rotate")
    info["seconds"] = round(time.perf_counter() - t0, 3)
    return info


# ---------------------------------------------------------------------- steps
def online_layers(model: nn.Module, blocks: list[str], online: tuple[str, ...]) -> list[str]:
    """Full names of the Linears to rotate online: ``online`` names in every block, checked first."""
    out = []
    for short in online:
        found = {f"{b}.{rel}": m for b in blocks for rel, m in model.get_submodule(b).named_modules()
                 if rel.rpartition(".")[2] == short and isinstance(m, nn.Linear)}
        if len(found) != len(blocks):
            names = sorted({rel.rpartition(".")[2] for rel, m in model.get_submodule(blocks[0]).named_modules()
                            if isinstance(m, nn.Linear)})
            raise ConfigError(f"online rotation of {short!r}: every decoder block needs exactly one Linear of that "
                              f"name ({len(found)} found in {len(blocks)} blocks); the blocks' Linears are "
                              f"{names}")
        for m in found.values():
            if factor(m.in_features) is None:
                raise ConfigError(f"online rotation of {short!r}: no Hadamard construction for its {m.in_features} "
                                  "inputs (needs m * 2^k with a known Hadamard order m); leave it out of --rotate-online")
        out += found
    return out


def untie_head(model: nn.Module, rmap: ResidualMap) -> None:
    """Give the lm_head a weight of its own (a copy of the embedding) and record it in the config."""
    head = model.get_submodule(rmap.head)
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
    configs = [getattr(model, "config", None)]
    text = getattr(configs[0], "get_text_config", None)
    configs.append(text() if callable(text) else None)
    for cfg in configs:
        if cfg is not None and hasattr(cfg, "tie_word_embeddings"):
            cfg.tie_word_embeddings = False
    if hasattr(model, "all_tied_weights_keys"):
        model.all_tied_weights_keys = {}


@torch.no_grad()
def fold_norms(model: nn.Module, rmap: ResidualMap, channels: torch.Tensor | None = None) -> None:
    """Multiply every RMSNorm's scale into the Linears reading its output, then set the scale to 1.

    channels: fold these only (the rotated ones); the others keep their scale in the norm.
    """
    idx = torch.arange(rmap.width) if channels is None else channels
    for bname in rmap.blocks:
        _fold_block(model.get_submodule(bname), rmap.layout, idx)
    _fold(model.get_submodule(rmap.final_norm), [model.get_submodule(rmap.head)], idx)


def _fold_block(block: nn.Module, lay: BlockLayout, idx: torch.Tensor) -> None:
    _fold(block.get_submodule(lay.attn_norm), [block.get_submodule(n) for n in lay.attn_in], idx)
    _fold(block.get_submodule(lay.mlp_norm), [block.get_submodule(n) for n in lay.mlp_in], idx)


def _fold(norm: nn.Module, readers: list[nn.Module], idx: torch.Tensor) -> None:
    """Each reader's columns ``idx`` times the norm's scale (float64 products, rounded once), ``_ROWS`` rows at a
    time: elementwise, so the same numbers as one pass, without float64 copies of a whole lm_head."""
    idx = idx.to(norm.weight.device)
    g = norm.weight.detach()[idx].double()
    for lin in readers:
        cols, gl = idx.to(lin.weight.device), g.to(lin.weight.device)
        for r in range(0, lin.weight.shape[0], _ROWS):
            rows = lin.weight[r: r + _ROWS]
            rows[:, cols] = (rows[:, cols].double() * gl).to(lin.weight.dtype)
    norm.weight[idx] = 1.0


def _turn_rows(rot: Rotation, w: torch.Tensor) -> None:
    """``w <- w R`` in place, ``_ROWS`` rows at a time: the chunks `Rotation.rows` itself makes, so the same
    numbers, without a copy of the whole table (a 128k x 4096 embedding is 2 GiB in float32)."""
    flat = w.view(-1, rot.width)
    for i in range(0, flat.shape[0], _ROWS):
        flat[i: i + _ROWS] = rot.rows(flat[i: i + _ROWS])


@torch.no_grad()
def rotate_tables(model: nn.Module, rmap: ResidualMap, rot: Rotation) -> None:
    """The residual rotation's part outside the blocks: a tied head untied, the final norm folded into the head,
    the embedding rows and the head turned. Each tensor's new value depends on itself (and the norm folded into
    it) only, so this and `rotate_block` per block give the weights `rotate_model` gives, in any order."""
    if rmap.tied:
        untie_head(model, rmap)
    rotate_embedding(model, rmap, rot)
    rotate_head(model, rmap, rot)


@torch.no_grad()
def rotate_embedding(model: nn.Module, rmap: ResidualMap, rot: Rotation) -> None:
    """The embedding's part: its rows turned."""
    _turn_rows(rot, model.get_submodule(rmap.embed).weight)


@torch.no_grad()
def rotate_head(model: nn.Module, rmap: ResidualMap, rot: Rotation) -> None:
    """The lm_head's part (untied first): the final norm folded into it, its rows turned."""
    _fold(model.get_submodule(rmap.final_norm), [model.get_submodule(rmap.head)], torch.arange(rmap.width))
    _turn_rows(rot, model.get_submodule(rmap.head).weight)


@torch.no_grad()
def rotate_block(block: nn.Module, lay: BlockLayout, rot: Rotation) -> None:
    """One decoder block's part of the residual rotation: its norms folded into their readers (scales set to 1),
    the readers' rows and the writers' columns (and biases) turned."""
    _fold_block(block, lay, torch.arange(rot.width))
    for name in lay.readers:
        lin = block.get_submodule(name)
        lin.weight.copy_(rot.rows(lin.weight))
    for name in lay.writers:
        lin = block.get_submodule(name)
        lin.weight.copy_(rot.columns(lin.weight))
        if lin.bias is not None:
            lin.bias.copy_(rot.rows(lin.bias))


def _residual_info(rmap: ResidualMap, rot: Rotation) -> dict[str, Any]:
    return dict(width=rmap.width, rotated_width=rot.n, kept_channels=rot.kept, untied_head=rmap.tied,
                **({"hadamard_m": factor(rot.n)} if rot.matrix is None else {}))


# ---------------------------------------------------------------------- check
def probe_ids(model: nn.Module) -> torch.Tensor:
    """The input the rotation is checked on: 16 seeded token ids (block by block without data, the walk's one
    sample: `lowbit.ptq.blockwise.rounding`)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    return torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    dev = model.get_input_embeddings().weight.device
    return model(input_ids=ids.to(dev), use_cache=False).logits.double().cpu()


def _max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
