"""DeltaLoss on a lazily loaded model: the whole-model scores with one decoder block in memory at a time.

`lowbit.ptq.sensitivity.delta_loss` back-propagates the whole quantized model's causal-LM
loss, so it needs the whole float model in memory. The same gradients come out of
gradient checkpointing at block granularity, which needs one block at a time:

1. the inputs of block 0 are captured (only the embeddings run);
2. per candidate option, a streamed forward pass: each block is read from the checkpoint,
   its planned weights quantized by the option exactly as ``delta_loss`` quantizes them
   (`sensitivity.WeightTensors.qdq`; inputs straight-through by the same hooks), its input
   stored and pushed through it, the block released;
3. the final norm, the lm_head and the model's own loss function on the last block's
   output, chunk by chunk, each chunk's loss scaled as ``delta_loss`` scales it; the
   gradient at the last block's output is stored;
4. a streamed backward pass in reverse block order: block ``i`` is read again, quantized
   again, its forward recomputed from the stored input with gradients, the stored gradient
   of its output back-propagated through it; the weight term and the activation term of its
   planned layers are then taken exactly as ``delta_loss`` takes them (the same functions),
   the gradient at its input stored in place for block ``i - 1``, the block released.

Each block sees the same samples in the same chunks (``batch_size``) and the same order as
in the whole-model passes, and every weight gradient is summed over the chunks before the
abs, as there. In fp32 the scores equal the whole-model ones: bit for bit on this project's
CPU (tests/test_streamed_deltaloss.py holds them to ``rel=1e-6``, since the one difference, autograd
summing the residual stream's gradient at a block boundary into a leaf instead of inside one
graph, could reorder a float sum elsewhere).

Static input scales (NVFP4's tensor scale, W8A8's static per-tensor scale) are the abs-max
of each planned layer's float inputs on the same batches, as ``delta_loss`` calibrates them
(experts: one per expert, every token reaching every expert): one more streamed float
forward pass, before any option.

Memory: one block (its float weights, their quantized copy and gradients), one chunk's
backward through it, the stored block inputs (``layers + 1`` caches of ``nsamples x seqlen x
hidden``; files in the offload folder when they do not fit, `lowbit.ptq.blockwise.cache`)
and one gradient cache; as in the walk, the allocator's freed pages are handed back after each
block and large tensors are mapped apart (`lowbit.ptq.blockwise.release`). Each option's scores
go to ``FOLDER/deltaloss/`` as they are finished, with a record of everything that determines
them, so a killed run does not score a finished option again (a record that differs is ignored
and the option scored anew).

What it cannot do is refused before any work (`check_streamable`): the router's auxiliary loss
in the training loss (``output_router_logits``), a model whose head is not norm -> lm_head
-> loss, a planned layer outside the blocks other than the lm_head, a planned lm_head tied to
the embeddings (as ``delta_loss`` refuses it too).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from lowbit.errors import ConfigError
from lowbit.formats import Recipe, Scheme
from lowbit.io import atomic_write_bytes
from lowbit.models.activations import activation_stats
from lowbit.models.layers import block_path, decoder_blocks
from lowbit.models.lazy import SOURCE_ATTR, is_lazy, load_block, state_tensors
from lowbit.models.narrow_tables import widen
from lowbit.ptq.blockwise.cache import disk_caches, new_cache
from lowbit.ptq.blockwise.capture import capture_inputs
from lowbit.ptq.blockwise.release import give_back_free_memory, steady_allocator
from lowbit.ptq.expert_calib import MIN_TOKENS, expert_stats
from lowbit.ptq.expert_calib import input_amax as expert_input_amax
from lowbit.ptq.sensitivity import (
    WeightTensors,
    _by_module,
    check_delta_args,
    input_hooks,
    quantize_weights,
    weight_scores,
    weight_tensors,
)

FIX = "drop --offload-dir (mixed precision then scores the whole float model in memory)"
SUBDIR = "deltaloss"


def check_streamable(model: nn.Module, layers: Iterable[str]) -> None:
    """Refuse, before any work, what the streamed passes cannot score as ``delta_loss`` would."""
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        raise ConfigError("the model's config adds the router's auxiliary loss to the training loss "
                          "(output_router_logits), which needs every block's router logits at once: block by block "
                          f"DeltaLoss cannot include it; {FIX}")
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            raise ConfigError(f"the model's head applies {attr} after the lm_head, which block-by-block DeltaLoss "
                              f"does not reproduce; {FIX}")
    _final_norm(model)
    prefix = block_path(model) + "."
    head = _head_name(model)
    for n in layers:
        if n.startswith(prefix):
            continue
        if n != head:
            raise ConfigError(f"{n} lies outside the decoder blocks and is not the lm_head: block-by-block DeltaLoss "
                              f"scores the blocks' layers and the lm_head only; leave it out of the plan or {FIX}")
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if emb is not None and model.get_submodule(n).weight is emb.weight:
            raise ConfigError(f"{n} shares its weight with the input embedding; leave tied layers out of the "
                              "mixed-precision search (the lm_head is excluded by default)")


def streamed_delta_loss(model: nn.Module, layers: Iterable[str], schemes: Sequence[Recipe | Scheme | str],
                        batches: torch.Tensor, mode: str = "abs", batch_size: int = 4, progress: bool = True,
                        dtype: str = "fp32", folder: str | Path | None = None, cache_device: str = "cpu",
                        device: torch.device | None = None,
                        on_option: Any = None) -> dict[str, dict[str, float]]:
    """Scores ``recipe name -> layer name -> DeltaLoss``, as `sensitivity.delta_loss` computes them (module doc).

    folder: where finished options' scores are kept (``FOLDER/deltaloss/``) and, with ``cache_device="disk"``,
    the activation caches' files. on_option: called with each option's name once its scores are stored (tests
    interrupt here).
    """
    check_delta_args(mode, dtype, batches)
    if cache_device == "disk" and folder is None:
        raise ConfigError("--cache-device disk keeps the activations in files in --offload-dir; pass --offload-dir")
    names = list(layers)
    check_streamable(model, names)
    recipes = list(dict.fromkeys(Recipe.parse(s) for s in schemes))
    store = _Store(folder, _record(model, names, recipes, batches, mode, batch_size, dtype, device))
    out = {r.name: s for r in recipes if (s := store.load(r.name, names)) is not None}
    todo = [r for r in recipes if r.name not in out]
    if not todo:
        return {r.name: out[r.name] for r in recipes}
    # parameters in memory ask for no gradient during the passes; a block read from the checkpoint is put back on
    # meta as it was (`_Passes._release`)
    flags = [(p, p.requires_grad) for p in model.parameters() if p.device.type != "meta"]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        with disk_caches(Path(folder) / SUBDIR if cache_device == "disk" else None):
            passes = _Passes(model, names, batches, batch_size, dtype, mode, device, progress,
                             weight_term=any(r.input is None for r in recipes))
            amax = passes.float_amax() if any(r.needs_calibration for r in todo) else {}
            for r in todo:
                out[r.name] = passes.score(r, amax)
                store.save(r.name, out[r.name])
                if on_option is not None:
                    on_option(r.name)
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
    return {r.name: out[r.name] for r in recipes}


class _Passes:
    """The streamed passes over one model and one calibration set (see the module doc)."""

    def __init__(self, model: nn.Module, names: list[str], batches: torch.Tensor, batch_size: int, dtype: str,
                 mode: str, device: torch.device | None, progress: bool, weight_term: bool) -> None:
        self.model, self.batches, self.batch_size, self.dtype, self.mode = model, batches, batch_size, dtype, mode
        self.blocks = decoder_blocks(model)
        self.prefix = block_path(model)
        self.device = device or torch.device("cpu")
        self.progress, self.weight_term = progress, weight_term
        self.head = _head_name(model)
        self.norm = _final_norm(model)
        self.by_block: list[dict[str, str]] = []  # block index -> {full name -> name in the block}
        for i in range(len(self.blocks)):
            pre = f"{self.prefix}.{i}."
            self.by_block.append({n: n[len(pre):] for n in names if n.startswith(pre)})
        self.head_planned = self.head in names
        if self.head_planned:  # quantized and scored in float32, as the whole-model path (which widens it) does
            widen(model.get_submodule(self.head))
        blocks = self.blocks
        if is_lazy(model):  # one block's peak, not a heap fragmented by every block before it (`blockwise.release`)
            steady_allocator()
        # the inputs of block 0 for every sample, captured once (only the embeddings run); every pass starts there
        self.x0, self.kwargs = capture_inputs(model, blocks[0], batches, self.device, where=torch.device("cpu"))

    # -------------------------------------------------------------------------------- blocks in and out
    def _load(self, i: int) -> tuple[nn.Module, dict[str, bool]]:
        """Block ``i`` with its float weights (read from the checkpoint when lazy); the names read (-> whether the
        meta parameter asked for gradients, which it asks again once released)."""
        block = self.blocks[i]
        loaded: dict[str, bool] = {}
        if is_lazy(self.model):
            loaded = {n: t.requires_grad for n, t in state_tensors(block).items() if t.device.type == "meta"}
            load_block(self.model, f"{self.prefix}.{i}", block, self.device)
            state = state_tensors(block)
            for n in loaded:
                if isinstance(state[n], nn.Parameter):
                    state[n].requires_grad_(False)
        return block, loaded

    def _release(self, block: nn.Module, loaded: dict[str, bool], originals: dict[str, torch.Tensor],
                 tensors: WeightTensors) -> None:
        """Back as before: the tensors read from the checkpoint to meta again, the others' float values restored;
        the allocator's freed pages handed back (as the walk does after each block: `blockwise.release`)."""
        with torch.no_grad():
            for n, w in tensors.weights.items():
                w.grad = None
                if n not in loaded and f"{n}.weight" not in loaded:
                    w.copy_(originals[n])
        for n, flag in loaded.items():
            parent, _, leaf = n.rpartition(".")
            mod = block.get_submodule(parent) if parent else block
            t = getattr(mod, leaf)
            meta = torch.empty_like(t, device="meta")
            if leaf in mod._parameters:
                mod._parameters[leaf] = nn.Parameter(meta, requires_grad=flag)
            else:
                mod._buffers[leaf] = meta
        give_back_free_memory()

    def _quantized(self, root: nn.Module, rel: list[str], recipe: Recipe
                   ) -> tuple[WeightTensors, dict[str, torch.Tensor]]:
        """``root``'s planned weights replaced by their quantized copies, as `sensitivity._score_scheme` does."""
        tensors = weight_tensors(root, rel)
        originals = {n: w.detach().clone() for n, w in tensors.weights.items()}
        quantize_weights(tensors, originals, recipe)
        return tensors, originals

    def _autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == "bf16")

    def _chunks(self) -> list[slice]:
        n = len(self.batches)
        return [slice(s, min(s + self.batch_size, n)) for s in range(0, n, self.batch_size)]

    def _run(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = block(x, **self.kwargs)
        return y[0] if isinstance(y, tuple) else y

    # -------------------------------------------------------------------------------- static input scales
    def float_amax(self) -> dict[str, torch.Tensor]:
        """Full name -> static input abs-max of each planned layer (``[E]`` per experts tensor), from the float
        model on the calibration batches, as `sensitivity.delta_loss` calibrates them."""
        h = new_cache(tuple(self.x0.shape), self.x0.dtype, torch.device("cpu"), self.device)
        h.copy_(self.x0)
        out: dict[str, torch.Tensor] = {}
        for i in tqdm(range(len(self.blocks)), desc="deltaloss scales", unit="block", disable=not self.progress):
            block, loaded = self._load(i)
            rel = self.by_block[i]
            tensors = weight_tensors(block, list(rel.values()))
            linears = {n: block.get_submodule(n) for n in tensors.weights if n not in tensors.experts}
            modules = {m: block.get_submodule(m) for m in _by_module(tensors)}
            with torch.no_grad(), activation_stats(linears, ("absmax",)) as st, \
                    expert_stats(modules, ("absmax",)) as est:
                for c in self._chunks():
                    h[c] = self._run(block, h[c].to(self.device)).to(h.dtype)
            full = {r: f for f, r in rel.items()}
            out |= {full[n]: a.amax() for n, a in st.result("absmax").items()}
            out |= {full[n]: expert_input_amax(est[m], p, MIN_TOKENS)
                    for m, ps in _by_module(tensors).items() for p, n in ps.items()}
            self._release(block, loaded, {}, WeightTensors({}, {}))
        if self.head_planned:
            head = self.model.get_submodule(self.head)
            with torch.no_grad(), _on(self.device, self.norm, head), \
                    activation_stats({self.head: head}, ("absmax",)) as st:
                for c in self._chunks():
                    head(self.norm(h[c].to(self.device)))
            out[self.head] = st.result("absmax")[self.head].amax()
        return out

    # -------------------------------------------------------------------------------- one option
    def score(self, recipe: Recipe, amax: dict[str, torch.Tensor]) -> dict[str, float]:
        """Layer -> DeltaLoss of ``recipe`` (`sensitivity._score_scheme`'s, block by block)."""
        weight_term = self.weight_term or recipe.input is None
        nblocks = len(self.blocks)
        with tqdm(total=2 * nblocks + 1, desc=f"deltaloss {recipe.name}", unit="block",
                  disable=not self.progress) as bar:
            xs = self._forward(recipe, amax, bar)
            g = self._head(xs[nblocks], recipe, amax, weight_term)
            xs[nblocks] = None  # type: ignore[call-overload]
            scores, grad = g.scores, g.grad
            bar.update()
            for i in reversed(range(nblocks)):
                scores |= self._backward(i, xs[i], grad, recipe, amax, weight_term)
                xs[i] = None  # type: ignore[call-overload]
                bar.update()
        return scores

    def _forward(self, recipe: Recipe, amax: dict[str, torch.Tensor], bar: tqdm) -> list[torch.Tensor]:
        """The input of every block and the last block's output, the model quantized by ``recipe``."""
        xs = [self.x0]
        for i in range(len(self.blocks)):
            block, loaded = self._load(i)
            rel = self.by_block[i]
            tensors, originals = self._quantized(block, list(rel.values()), recipe)
            local = {r: amax[f] for f, r in rel.items() if f in amax}
            sink = {n: torch.zeros((), dtype=torch.float64) for n in tensors.weights}  # never reached: no backward
            handles = input_hooks(block, tensors, recipe, local, self.mode, sink)
            x = xs[i]
            y = new_cache(tuple(x.shape), x.dtype, torch.device("cpu"), self.device)
            try:  # the input hooks build a straight-through graph: gradients on, thrown away chunk by chunk
                with torch.set_grad_enabled(recipe.input is not None):
                    for c in self._chunks():
                        with self._autocast():
                            out = self._run(block, x[c].to(self.device))
                        y[c] = out.detach().to(y.dtype)
            finally:
                for hd in handles:
                    hd.remove()
            self._release(block, loaded, originals, tensors)
            xs.append(y)
            bar.update()
        return xs

    def _head(self, h: torch.Tensor, recipe: Recipe, amax: dict[str, torch.Tensor], weight_term: bool
              ) -> _HeadResult:
        """The final norm, the lm_head and the loss on each chunk (on the compute device for the duration, as the
        whole-model path has them); the gradient at the last block's output."""
        head = self.model.get_submodule(self.head)
        with _on(self.device, self.norm, head):
            out = self._head_on(h, head, recipe, amax, weight_term)
        give_back_free_memory()  # the chunks' logits
        return out

    def _head_on(self, h: torch.Tensor, head: nn.Module, recipe: Recipe, amax: dict[str, torch.Tensor],
                 weight_term: bool) -> _HeadResult:
        model = self.model
        grad = new_cache(tuple(h.shape), h.dtype, torch.device("cpu"), self.device)
        tensors, originals = (self._quantized(model, [self.head], recipe) if self.head_planned
                              else (WeightTensors({}, {}), {}))
        acts = {n: torch.zeros((), dtype=torch.float64) for n in tensors.weights}
        handles = input_hooks(model, tensors, recipe, {n: a.to(self.device) for n, a in amax.items()}, self.mode,
                              acts)
        for w in tensors.weights.values():
            w.requires_grad_(weight_term)
            w.grad = None
        n = len(self.batches)
        try:
            for c in self._chunks():
                x = h[c].to(self.device).requires_grad_(True)
                ids = self.batches[c].to(self.device)
                with self._autocast():
                    logits = head(self.norm(x))
                    loss = model.loss_function(logits, ids, model.config.vocab_size)
                ((loss.float()) * ((c.stop - c.start) / n)).backward()
                grad[c] = x.grad.to(grad.dtype)  # type: ignore[union-attr]
        finally:
            for hd in handles:
                hd.remove()
        scores = self._scores(tensors, originals, acts, weight_term, {self.head: self.head})
        with torch.no_grad():
            for name, w in tensors.weights.items():
                w.copy_(originals[name])
                w.requires_grad_(False)
                w.grad = None
        return _HeadResult(grad, scores)

    def _backward(self, i: int, x: torch.Tensor, grad: torch.Tensor, recipe: Recipe,
                  amax: dict[str, torch.Tensor], weight_term: bool) -> dict[str, float]:
        """Block ``i``'s scores; ``grad`` (at its output) becomes the gradient at its input, in place."""
        block, loaded = self._load(i)
        rel = self.by_block[i]
        tensors, originals = self._quantized(block, list(rel.values()), recipe)
        for w in tensors.weights.values():
            w.requires_grad_(weight_term)
            w.grad = None
        acts = {n: torch.zeros((), dtype=torch.float64) for n in tensors.weights}
        handles = input_hooks(block, tensors, recipe, {r: amax[f] for f, r in rel.items() if f in amax}, self.mode,
                              acts)
        want_input = i > 0  # block 0's input is the embedding: nothing before it is scored
        try:
            for c in self._chunks():
                xc = x[c].to(self.device)
                if want_input:
                    xc.requires_grad_(True)
                with torch.enable_grad(), self._autocast():
                    out = self._run(block, xc)
                if out.requires_grad:
                    out.backward(grad[c].to(self.device, out.dtype))
                if want_input:
                    grad[c] = (xc.grad if xc.grad is not None else torch.zeros_like(xc)).to(grad.dtype)
        finally:
            for hd in handles:
                hd.remove()
        scores = self._scores(tensors, originals, acts, weight_term, {r: f for f, r in rel.items()})
        for w in tensors.weights.values():
            w.requires_grad_(False)
        self._release(block, loaded, originals, tensors)
        return scores

    def _scores(self, tensors: WeightTensors, originals: dict[str, torch.Tensor], acts: dict[str, torch.Tensor],
                weight_term: bool, full: dict[str, str]) -> dict[str, float]:
        """`sensitivity.weight_scores`, under the model's full names (``full``: name in the block -> full name)."""
        return {full[n]: v for n, v in weight_scores(tensors, originals, acts, weight_term, self.mode).items()}


@dataclass(frozen=True)
class _HeadResult:
    """The head's step: the gradient at the last block's output (every sample), a planned lm_head's score."""

    grad: torch.Tensor
    scores: dict[str, float]


# ------------------------------------------------------------------------------------ the model's head
def _head_name(model: nn.Module) -> str:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for n, m in model.named_modules():
        if m is head and isinstance(m, nn.Linear):
            return n
    raise ConfigError(f"{type(model).__name__} has no Linear output head that block-by-block DeltaLoss can run; {FIX}")


def _final_norm(model: nn.Module) -> nn.Module:
    """The decoder's final norm (what runs between the last block and the lm_head)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, nn.Module):
        raise ConfigError(f"{type(model).__name__}'s decoder has no final norm named 'norm' between its blocks and "
                          f"the lm_head; block-by-block DeltaLoss runs only that head; {FIX}")
    return norm


class _on:
    """``modules`` on ``device`` for the body (the head's modules, which a lazily loaded model keeps on the CPU),
    back where they were after; nothing to do on the CPU."""

    def __init__(self, device: torch.device, *modules: nn.Module) -> None:
        self.device, self.modules = device, modules
        self.homes: list[torch.device] = []

    def __enter__(self) -> None:
        for m in self.modules:
            p = next(iter([*m.parameters(), *m.buffers()]), None)
            self.homes.append(p.device if p is not None else self.device)
            m.to(self.device)

    def __exit__(self, *exc: object) -> None:
        for m, home in zip(self.modules, self.homes, strict=True):
            m.to(home)


# ------------------------------------------------------------------------------------ resume
def _record(model: nn.Module, names: list[str], recipes: list[Recipe], batches: torch.Tensor, mode: str,
            batch_size: int, dtype: str, device: torch.device | None) -> dict[str, Any]:
    """Everything an option's scores depend on besides the option (weight_term: whether all options keep it; the
    device type: another kernel's rounding)."""
    source = getattr(model, SOURCE_ATTR, None)
    return {"source": str(getattr(source, "folder", type(model).__name__)), "layers": names, "mode": mode,
            "device": (device or torch.device("cpu")).type,
            "batch_size": batch_size, "dtype": dtype, "weight_term": any(r.input is None for r in recipes),
            "calib_sha256": hashlib.sha256(batches.to(torch.int64).contiguous().numpy().tobytes()).hexdigest(),
            "calib_shape": list(batches.shape)}


class _Store:
    """Finished options' scores in ``FOLDER/deltaloss/<option>.json``, each with the record it was scored under."""

    def __init__(self, folder: str | Path | None, record: dict[str, Any]) -> None:
        self.folder = None if folder is None else Path(folder) / SUBDIR
        self.record = record

    def _path(self, name: str) -> Path:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
        return self.folder / f"scores_{safe}.json"  # type: ignore[operator]

    def load(self, name: str, names: list[str]) -> dict[str, float] | None:
        if self.folder is None or not self._path(name).is_file():
            return None
        try:
            d = json.loads(self._path(name).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(d, dict) or d.get("record") != self.record or d.get("option") != name:
            return None
        scores = d.get("scores")
        if not isinstance(scores, dict) or set(scores) != set(names):
            return None
        return {n: float(scores[n]) for n in names}

    def save(self, name: str, scores: dict[str, float]) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        body = {"option": name, "record": self.record, "scores": scores}
        atomic_write_bytes(self._path(name), json.dumps(body, indent=1).encode())
