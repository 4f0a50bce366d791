"""KV-cache quantization inside the model's own forward, for every attention transformers builds.

Every transformers attention (Llama, Mistral / Qwen2 with sliding windows, Qwen3, Gemma-3,
Phi-3, the MoE models' attention) hands its post-RoPE keys and values to
``cache.update(key, value, layer_idx, ...)`` and attends over what it returns. A forward
pre-hook on each attention module puts `QuantizedCache` in that argument: its ``update``
fake-quantizes the new keys and values (`lowbit.formats.kv.qdq_kv`) and then passes them to
the real cache (``use_cache=True``: generation stores the quantized values) or returns them
(``use_cache=False``, as perplexity runs: the hook installs the wrapper even when the model
passes no cache). So the attention never needs re-implementing, and what it attends over is
exactly what a quantized cache would hold. compressed-tensors hooks the cache the same way.

Static scales live on the attention module as ``k_scale`` / ``v_scale`` buffers (float32,
``[1]`` or ``[kv_heads]``), the names vLLM's checkpoint loader reads; they travel in the
model's state dict and so in lowbit's native checkpoint.

The rotation (``-rot`` schemes, QuaRot's): keys are rotated per head by a normalized
Hadamard H after RoPE, quantized, and rotated back, ``k_hat = Q(k H) H^T``. Scores are
``q k_hat^T = (q H) Q(k H)^T``: the same as rotating queries and keys online and storing the
rotated keys, the form a kernel runs, with nothing to change in the attention. Values are
rotated offline instead (`fold_value_rotation`: H folded into ``v_proj``'s rows and
``o_proj``'s columns of each head, exact in float), so the cache holds ``v H`` directly; on a
model whose values were not folded they are rotated online the same way as keys.

Centering (``:center`` schemes): ``k_offset`` / ``v_offset`` buffers (``[kv_heads, head_dim]``,
the calibration split's mean of each head's channel, in the rotated basis under ``-rot``) are
subtracted before quantization and added back after, ``k_hat = Q(k - mu) + mu``. A kernel that
stores ``Q(k - mu)`` and drops ``mu`` computes scores ``q . k_hat - q . mu``: each query's
scores move by one constant, which softmax ignores; values' ``mu`` comes back after the
attention (its probabilities sum to 1). Adding ``mu`` here keeps that function for any
attention, softcapped or with sinks included. Calibration keeps, per head and channel, the
sum, max and min, so the scale around the mean comes from the same single pass.

Pre-RoPE centering (``:center=rope``): ``k_offset`` holds the mean of the keys *before* the rotary
embedding, ``m``, and each token's keys are centered by ``RoPE_t(m)``, that mean turned to the
token's position (the attention's own ``cos`` / ``sin``, read by the pre-hook from its
``position_embeddings`` argument; rotate-half RoPE over the whole head, as every transformers
attention lowbit instruments applies it). The calibration unrotates each key, ``RoPE_t^-1(k_t)``,
to take the mean, then runs a second pass for the scale of the centered keys (their abs-max
depends on the mean). Values are centered as by ``:center``.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lowbit.errors import ConfigError, ModelError
from lowbit.formats.kv import (
    ChannelStats,
    KVScheme,
    kv_scale,
    observe_amax,
    qdq_kv,
    search_factors,
    typical_amax,
)
from lowbit.transforms.hadamard import factor, hadamard

STATE = "_lowbit_kv"
SCALES = ("k_scale", "v_scale")
OFFSETS = ("k_offset", "v_offset")  # ``:center`` schemes: the per-(KV head, channel) means, [kv_heads, head_dim]


@dataclass
class KVState:
    """The quantizer one attention module carries (runtime state, not a config)."""

    scheme: KVScheme
    kv_heads: int
    head_dim: int
    handle: Any = None
    cache_arg: str = "cache"
    values_folded: bool = False
    observed: dict[str, Any] | None = None  # calibration: each row's abs-max (ChannelStats if centered) of keys / values
    search: ScaleSearch | None = None  # scale=attn: the attention output's error per candidate scale
    paused: bool = False  # float keys / values (block tuning's FP targets)
    calls: int = 0
    rotation: torch.Tensor | None = field(default=None, repr=False)
    score: KVScore | None = None  # DeltaLoss: the first-order loss change of this layer's KV quantization
    centered_pass: bool = False  # center=rope calibration, second pass: the centered keys' abs-max per row


@dataclass
class ScaleSearch:
    """``scale=attn`` on one attention: its output's squared error (against float keys and values) for each
    candidate key scale (values float) and each candidate value scale (keys float), summed over the calibration
    batches; ``trial`` is the cache quantization of the forward under way (None: float keys and values)."""

    factors: torch.Tensor
    errors: dict[str, torch.Tensor] = field(default_factory=dict)
    trial: tuple[str, torch.Tensor] | None = None


class KVScore:
    """DeltaLoss's activation term of one attention's cache: ``sum |g (.) (Q(x) - x)|`` (``signed``: without
    the abs) over its keys and values, ``g`` the loss gradient at the quantized keys / values the attention reads."""

    def __init__(self, mode: str = "abs") -> None:
        self.mode, self.total = mode, torch.zeros((), dtype=torch.float64)

    def watch(self, out: torch.Tensor, diff: torch.Tensor) -> None:
        """Add ``g (.) diff`` when the backward pass reaches ``out`` (``diff = Q(x) - x``, kept in bf16: it only ranks)."""
        if not out.requires_grad:
            return
        d = diff.detach().to(torch.bfloat16)

        def hook(g: torch.Tensor) -> None:
            term = g.float() * d.float()
            self.total += (term.abs().sum() if self.mode == "abs" else term.sum()).double().cpu()

        out.register_hook(hook)


class QuantizedCache:
    """What an instrumented attention sees as its cache: ``update`` quantizes, then defers to the real one."""

    def __init__(self, attn: nn.Module, inner: Any, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self._attn, self._inner, self._rope = attn, inner, rope

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = quantize_kv(self._attn, key_states, value_states, self._rope)
        if self._inner is None:
            return k, v
        return self._inner.update(k, v, layer_idx, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


# ------------------------------------------------------------------ finding the attention
def _cache_arg(module: nn.Module) -> str | None:
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return None
    return next((p for p in ("cache", "past_key_values", "past_key_value") if p in params), None)


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> every attention module that stores keys / values in a cache (has ``layer_idx`` and ``head_dim``)."""
    return {n: m for n, m in model.named_modules()
            if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx") and hasattr(m, "head_dim")
            and _cache_arg(m) is not None}


def _kv_heads(attn: nn.Module) -> int:
    cfg = getattr(attn, "config", None)
    n = getattr(attn, "num_key_value_heads", None) or getattr(cfg, "num_key_value_heads", None)
    k_proj = getattr(attn, "k_proj", None)
    if n is None and k_proj is not None:
        n = k_proj.out_features // attn.head_dim
    if not n:
        raise ModelError(f"cannot tell how many key/value heads {type(attn).__name__} has; KV quantization needs it")
    return int(n)


def require_attention(model: nn.Module) -> dict[str, nn.Module]:
    """The attention modules to instrument; a model lowbit cannot instrument is refused by its architecture."""
    found = attention_modules(model)
    if not found:
        arch = type(model).__name__
        raise ModelError(f"{arch}: lowbit finds no attention module that hands its keys and values to a cache "
                         "(a transformers *Attention with layer_idx, head_dim and a cache argument), so it cannot "
                         "quantize its KV cache; drop --kv for this model")
    return found


# ------------------------------------------------------------------ installing
def rotation_matrix(head_dim: int) -> torch.Tensor:
    """The orthonormal Hadamard of order ``head_dim`` (float32), refused where none is constructed."""
    if factor(head_dim) is None:
        raise ConfigError(f"no Hadamard of order {head_dim} (the head size) is known to lowbit; use a KV scheme "
                          "without -rot for this model")
    return hadamard(head_dim) / math.sqrt(head_dim)


def check_kv(model: nn.Module, scheme: KVScheme) -> None:
    """Everything about ``scheme`` on ``model`` that can be refused before any work: the attention is
    found, each head_dim takes the element blocks, the rotation exists and can fold into v_proj / o_proj."""
    attns = require_attention(model)
    for name, attn in attns.items():
        scheme.elements.check_width(int(attn.head_dim), f"{name} (the keys' head_dim)")
        if scheme.rotate:
            rotation_matrix(int(attn.head_dim))
            _value_pair(name, attn)


def cache_shape(model: nn.Module) -> tuple[int, int, int]:
    """(attention layers, KV heads, head_dim) of the cache (the first layer's heads and size)."""
    attns = list(require_attention(model).values())
    return len(attns), _kv_heads(attns[0]), int(attns[0].head_dim)


def cache_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Attention name -> (KV heads, head_dim) of its cache."""
    return {n: (_kv_heads(a), int(a.head_dim)) for n, a in require_attention(model).items()}


def per_layer(model: nn.Module, scheme: KVScheme | Mapping[str, KVScheme]) -> dict[str, KVScheme]:
    """Attention name -> its scheme: one for all, or a per-layer choice that must name every attention."""
    attns = require_attention(model)
    if isinstance(scheme, KVScheme):
        return dict.fromkeys(attns, scheme)
    if sorted(scheme) != sorted(attns):
        odd = sorted(set(scheme) ^ set(attns))
        raise ConfigError(f"a per-layer KV choice must name every attention of the model once; {odd[0]} "
                          f"{'is not an attention of it' if odd[0] in scheme else 'has no scheme'}")
    return {n: KVScheme.parse(scheme[n]) for n in attns}


def install_kv(model: nn.Module, scheme: KVScheme | Mapping[str, KVScheme],
               values_folded: bool = False) -> dict[str, nn.Module]:
    """Instrument every attention of ``model`` with ``scheme`` (replacing an earlier KV scheme); a mapping
    gives each attention (by name) its own scheme: a mixed-precision cache.

    Static schemes get ``k_scale`` / ``v_scale`` buffers of ones (to be calibrated, or filled by
    a checkpoint's load); returns the instrumented attention modules by name.
    """
    attns = require_attention(model)
    schemes = per_layer(model, scheme)
    for name, attn in attns.items():
        schemes[name].elements.check_width(int(attn.head_dim), f"{name} (the keys' head_dim)")
    remove_kv(model)
    for name, attn in attns.items():
        scheme = schemes[name]
        state = KVState(scheme, _kv_heads(attn), int(attn.head_dim), cache_arg=_cache_arg(attn) or "cache",
                        values_folded=values_folded)
        if scheme.rotate:
            state.rotation = rotation_matrix(state.head_dim)
        device = next(attn.parameters(), torch.empty(0)).device
        if scheme.elements.needs_calibration:
            n = state.kv_heads if scheme.per_head else 1
            for buf in SCALES:
                attn.register_buffer(buf, torch.ones(n, dtype=torch.float32, device=device))
        if scheme.center:
            for buf in OFFSETS:
                attn.register_buffer(buf, torch.zeros(state.kv_heads, state.head_dim, dtype=torch.float32,
                                                      device=device))
        state.handle = attn.register_forward_pre_hook(_swap_cache, with_kwargs=True)
        setattr(attn, STATE, state)
    return attns


@contextlib.contextmanager
def kv_paused(model: nn.Module) -> Iterator[None]:
    """Float keys and values inside the body (the FP targets block tuning matches), quantized again after."""
    states = [getattr(a, STATE) for a in attention_modules(model).values() if hasattr(a, STATE)]
    for st in states:
        st.paused = True
    try:
        yield
    finally:
        for st in states:
            st.paused = False


def remove_kv(model: nn.Module) -> None:
    """Undo `install_kv`: hooks and scale buffers gone, the attention back to float keys and values."""
    for attn in attention_modules(model).values():
        state = getattr(attn, STATE, None)
        if state is None:
            continue
        state.handle.remove()
        delattr(attn, STATE)
        for name in (*SCALES, *OFFSETS):
            if name in attn._buffers:
                del attn._buffers[name]


def kv_scheme_of(model: nn.Module) -> KVScheme | None:
    """The KV scheme installed on ``model`` (None: keys and values stay in the compute dtype)."""
    for attn in attention_modules(model).values():
        state = getattr(attn, STATE, None)
        if state is not None:
            return state.scheme
    return None


def values_folded(model: nn.Module) -> bool:
    return any(getattr(getattr(a, STATE, None), "values_folded", False) for a in attention_modules(model).values())


def _swap_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    state: KVState = getattr(module, STATE)
    inner = None
    for name in ("cache", "past_key_values", "past_key_value"):
        if name in kwargs:
            inner = kwargs.pop(name)
    if isinstance(inner, QuantizedCache):
        inner = inner._inner
    rope = _position_embeddings(module, args, kwargs) if state.scheme.prerope else None
    kwargs[state.cache_arg] = QuantizedCache(module, inner, rope)
    return args, kwargs


def _position_embeddings(module: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(cos, sin)`` the attention applies to its keys (``[batch, tokens, head_dim]``), for ``center=rope``;
    refused where the attention takes none or rotates only part of each head."""
    pe = kwargs.get("position_embeddings")
    if pe is None:
        with contextlib.suppress(TypeError, ValueError):
            pe = inspect.signature(type(module).forward).bind(module, *args, **kwargs).arguments.get(
                "position_embeddings")
    name = type(module).__name__
    if not (isinstance(pe, tuple) and len(pe) == 2 and all(isinstance(t, torch.Tensor) for t in pe)):
        raise ModelError(f"{name} takes no position_embeddings (cos, sin) argument, so lowbit cannot turn a pre-RoPE "
                         "key offset to each position; use :center instead of :center=rope for this model")
    if pe[0].shape[-1] != int(module.head_dim):
        raise ModelError(f"{name} applies RoPE to {pe[0].shape[-1]} of its {module.head_dim} head channels; "
                         ":center=rope needs it on the whole head (use :center for this model)")
    return pe


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension: with ``cos`` / ``sin`` repeated over both halves, each
    pair ``(x_i, x_{i + d/2})`` turns by its angle (the rotate-half RoPE of transformers' attentions)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_turn(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], back: bool = False) -> torch.Tensor:
    """``x [batch or 1, kv_heads, tokens or 1, head_dim]`` turned to each token's position by ``rope`` (cos, sin of
    ``[batch, tokens, head_dim]``), or back from it; float32."""
    cos, sin = (t.float().unsqueeze(1).to(x.device) for t in rope)
    xf = x.float()
    return xf * cos + _rotate_half(xf) * (-sin if back else sin)


# ------------------------------------------------------------------ the quantization
def _rotate(x: torch.Tensor, h: torch.Tensor, back: bool = False) -> torch.Tensor:
    h = h.to(x.device)
    return x.float() @ (h.T if back else h)


def quantize_kv(attn: nn.Module, key: torch.Tensor, value: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values ``attn``'s cache holds for these new ones (observed only, while calibrating); ``rope``:
    the attention's (cos, sin) for these tokens, which a ``center=rope`` scheme needs."""
    state: KVState = getattr(attn, STATE)
    if state.scheme.prerope and rope is None:
        raise ModelError(f"{type(attn).__name__}: a :center=rope KV scheme needs the attention's position embeddings; "
                         "call the attention through its forward (lowbit's hook reads them there)")
    state.calls += 1
    if state.paused:
        return key, value
    if state.score is not None and state.observed is None:  # leaves, so the gradient reaches the hooks
        key = key if key.requires_grad else key.detach().requires_grad_(True)
        value = value if value.requires_grad else value.detach().requires_grad_(True)
    if state.search is not None:  # calibration: float keys / values, except the one candidate under trial
        return _trial(attn, state, key, value, rope)
    h = state.rotation
    rot_v = h is not None and not state.values_folded
    if state.observed is not None:
        if state.centered_pass:  # center=rope's second pass: the centered keys' abs-max, for their scale
            _observe(state, "k", _center(key, h, _key_offset(attn, state, rope)))
            return key, value
        k_seen = key if h is None else _rotate(key, h)
        if state.scheme.prerope:  # the mean is taken before RoPE (and before the Hadamard, applied after RoPE)
            k_seen = rope_turn(key, rope, back=True)
        for name, x in (("k", k_seen), ("v", value if not rot_v else _rotate(value, h))):
            _observe(state, name, x)
        return key, value
    kq = _fake_quant(state, key, getattr(attn, "k_scale", None), h, _key_offset(attn, state, rope))
    vq = _fake_quant(state, value, getattr(attn, "v_scale", None), h if rot_v else None, getattr(attn, "v_offset", None))
    kout, vout = _ste(key, kq), _ste(value, vq)
    if state.score is not None:
        state.score.watch(kout, kq - key.detach())
        state.score.watch(vout, vq - value.detach())
    return kout, vout


def _key_offset(attn: nn.Module, state: KVState, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
    """What the keys are centered by: ``k_offset`` (``[kv_heads, head_dim]``, the cache's frame), or under
    ``center=rope`` the pre-RoPE mean turned to each token's position (``[batch, kv_heads, tokens, head_dim]``,
    rotated by the Hadamard too where the scheme rotates: `_fake_quant` adds it in that frame)."""
    offset = getattr(attn, "k_offset", None)
    if offset is None or not state.scheme.prerope:
        return offset
    turned = rope_turn(offset.reshape(1, *offset.shape[:1], 1, offset.shape[-1]), rope)
    return turned if state.rotation is None else _rotate(turned, state.rotation)


def _center(x: torch.Tensor, h: torch.Tensor | None, offset: torch.Tensor) -> torch.Tensor:
    """``x`` in the frame it is quantized in (rotated by ``h`` if any) minus the offset (`_broadcast_offset`)."""
    return (x.float() if h is None else _rotate(x, h)) - _broadcast_offset(offset)


def _broadcast_offset(offset: torch.Tensor) -> torch.Tensor:
    """An offset of ``[kv_heads, head_dim]`` as ``[1, kv_heads, 1, head_dim]``; a per-token one unchanged."""
    return offset.float().reshape(1, offset.shape[0], 1, offset.shape[1]) if offset.dim() == 2 else offset.float()


def _observe(state: KVState, name: str, x: torch.Tensor) -> None:
    """Calibration: fold ``x`` (keys or values as they are quantized, rotated if so) into what is kept of them."""
    prev = state.observed.get(name)
    if state.scheme.center and not state.centered_pass:
        st = ChannelStats.of(x)
        state.observed[name] = st if prev is None else prev.merge(st)
        return
    a = observe_amax(x, state.scheme)
    state.observed[name] = a if prev is None else torch.cat([prev, a.to(prev.device)])


def _fake_quant(state: KVState, x: torch.Tensor, scale: torch.Tensor | None, h: torch.Tensor | None,
                offset: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` as the cache holds it, dequantized: rotated by ``h`` (if any), centered by ``offset`` (if any:
    ``[kv_heads, head_dim]`` or per token, subtracted before quantizing and added back after), quantized, rotated
    back; ``x``'s dtype."""
    xs = x if h is None else _rotate(x, h)
    if offset is None:
        q = qdq_kv(xs, state.scheme, scale)
    else:
        mu = _broadcast_offset(offset.to(x.device))
        q = qdq_kv(xs.float() - mu, state.scheme, scale).float() + mu
    return (q if h is None else _rotate(q, h, back=True)).to(x.dtype)


def _trial(attn: nn.Module, state: KVState, key: torch.Tensor, value: torch.Tensor,
           rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    trial = state.search.trial
    if trial is None:
        return key, value
    which, scale = trial
    h = state.rotation
    if which == "k":
        return _fake_quant(state, key, scale, h, _key_offset(attn, state, rope)), value
    return key, _fake_quant(state, value, scale, h if not state.values_folded else None, getattr(attn, "v_offset", None))


def _ste(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Straight-through: the quantized values forward, the identity gradient backward (for tuning)."""
    return q if not x.requires_grad else x + (q - x).detach()


# ------------------------------------------------------------------ calibration
@torch.no_grad()  # not inference_mode: the scales and rotation are used under autograd later (tuning)
def calibrate_kv(model: nn.Module, batches: Iterable[torch.Tensor] | None, scheme: KVScheme | Mapping[str, KVScheme],
                 values_folded: bool = False) -> dict[str, nn.Module]:
    """Install ``scheme`` (one for all, or per attention) and, for static scales, set them from the abs-max of
    keys / values over ``batches``.

    Every attention must see its cache's update during the pass (refused by class otherwise),
    so a scheme never stands on an attention it does not reach. ``batches`` None (dynamic
    schemes only, nothing to calibrate): a short probe of token 0 checks that.
    """
    schemes = per_layer(model, scheme)
    static = [s for s in schemes.values() if s.needs_calibration]
    if batches is None:
        if static:
            raise ConfigError(f"KV scheme {static[0].name} has static scales or centering offsets: pass calibration "
                              "batches")
        batches = [torch.zeros(1, 4, dtype=torch.long)]
    attns = install_kv(model, schemes, values_folded)
    device = next(model.parameters()).device
    for attn in attns.values():
        state: KVState = getattr(attn, STATE)
        state.observed = {} if state.scheme.needs_calibration else None
    batches = list(_batches(batches))
    for batch in batches:
        model(input_ids=batch.to(device), use_cache=False)
    check_reached(attns)
    for attn in attns.values():
        state = getattr(attn, STATE)
        if state.observed is not None:
            for short in ("k", "v"):
                _set_calibrated(attn, state.scheme, short, state.observed[short])
            state.observed = None
    _prerope_scales(model, attns, batches)
    _search_scales(model, attns, batches)
    return attns


def _prerope_scales(model: nn.Module, attns: dict[str, nn.Module], batches: list[torch.Tensor]) -> None:
    """``center=rope`` with static scales: one more pass over the batches, in float, for the keys' scale around the
    offsets the first pass set (each row's abs-max of ``k_t - RoPE_t(m)``, which the first pass, before ``m`` was
    known, could not see), reduced over rows by the scheme's rule."""
    todo = {n: a for n, a in attns.items()
            if getattr(a, STATE).scheme.prerope and getattr(a, STATE).scheme.elements.needs_calibration}
    if not todo:
        return
    others = [getattr(a, STATE) for n, a in attns.items() if n not in todo]
    for attn in todo.values():
        state = getattr(attn, STATE)
        state.observed, state.centered_pass = {}, True
    for st in others:
        st.paused = True  # float keys / values, as in the first pass
    device = next(model.parameters()).device
    try:
        for batch in batches:
            model(input_ids=batch.to(device), use_cache=False)
        for attn in todo.values():
            state = getattr(attn, STATE)
            attn.k_scale.copy_(kv_scale(typical_amax(state.observed["k"], state.scheme.rule), state.scheme))
    finally:
        for attn in todo.values():
            state = getattr(attn, STATE)
            state.observed, state.centered_pass = None, False
        for st in others:
            st.paused = False


def _set_calibrated(attn: nn.Module, scheme: KVScheme, short: str, seen: Any) -> None:
    """Keys' (``short`` "k") or values' calibrated buffers from what was seen: the offset (centered schemes: the
    mean) and the static scale (of the rows' abs-max, around the offset, reduced over rows by the scheme's rule)."""
    if scheme.center:
        mu = seen.mean()
        getattr(attn, f"{short}_offset").copy_(mu)
        amax = seen.amax_around(mu, scheme.per_head, scheme.rule)
    else:
        amax = typical_amax(seen, scheme.rule)
    if scheme.elements.needs_calibration:
        getattr(attn, f"{short}_scale").copy_(kv_scale(amax, scheme))


def _search_scales(model: nn.Module, attns: dict[str, nn.Module], batches: list[torch.Tensor]) -> None:
    """``scale=attn``: one more pass over the batches, in float; at each attention the pass stops to run it again
    with each candidate key scale ``amax / 448 * f`` (f in `search_factors`, values float), then each candidate
    value scale (keys float), adding each output's squared error against the float output; then every scale
    becomes its least-error candidate. Keys and values are searched apart (their errors add to first order),
    and on the attention's own output (after ``o_proj``): it weighs a key's error by the queries that read it,
    through the softmax, and a value's by ``o_proj`` — what the layer's output sees, which the keys' squared
    error does not. Later layers see float inputs, as in every calibration pass. Per-head scales move together."""
    searching = {n: a for n, a in attns.items() if getattr(a, STATE).scheme.search}
    if not searching:
        return
    handles = []
    for attn in searching.values():
        getattr(attn, STATE).search = ScaleSearch(search_factors())
        handles.append(attn.register_forward_pre_hook(_search_trials, with_kwargs=True))
    device = next(model.parameters()).device
    try:
        for batch in batches:
            model(input_ids=batch.to(device), use_cache=False)
        for attn in searching.values():
            search = getattr(attn, STATE).search
            for short in ("k", "v"):
                best = search.factors[int(search.errors[short].argmin())]
                getattr(attn, f"{short}_scale").mul_(best)
    finally:
        for h in handles:
            h.remove()
        for attn in searching.values():
            getattr(attn, STATE).search = None


def _search_trials(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """The pre-hook of `_search_scales`: this batch's output error for every candidate (the forward then goes on
    in float: ``trial`` is None). The attention's submodules whose inputs do not change between trials (the
    q / k / v projections) are computed once (`_Replay`)."""
    search: ScaleSearch = getattr(module, STATE).search
    children = dict(module.named_children())
    for name, child in children.items():
        setattr(module, name, _Replay(child))
    try:
        ref = _attn_out(module.forward(*args, **kwargs)).float()
        for short in ("k", "v"):
            base = getattr(module, f"{short}_scale")
            errs = torch.empty(len(search.factors), dtype=torch.float64)
            for i, f in enumerate(search.factors):
                search.trial = (short, base * f)
                errs[i] = float((_attn_out(module.forward(*args, **kwargs)).float() - ref).pow(2).sum())
            search.errors[short] = errs if short not in search.errors else search.errors[short] + errs
    finally:
        search.trial = None
        for name, child in children.items():
            setattr(module, name, child)


class _Replay(nn.Module):
    """A submodule that returns its last output again when called with the very same input objects (the trials of
    one search step pass the same hidden states, so the projections of them need computing once)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.seen: tuple[tuple, dict, Any] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        seen = self.seen
        if seen is not None and _same(seen[0], args) and seen[1].keys() == kwargs.keys() and \
                _same(tuple(seen[1].values()), tuple(kwargs.values())):
            return seen[2]
        out = self.inner(*args, **kwargs)
        self.seen = (args, kwargs, out)
        return out


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _attn_out(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _batches(batches: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    if isinstance(batches, torch.Tensor):  # [samples, tokens]: a few samples per forward
        batches = batches.reshape(-1, batches.shape[-1]).split(4)
    for b in batches:
        yield b if b.dim() == 2 else b.reshape(1, -1)


def check_reached(attns: dict[str, nn.Module]) -> None:
    """Refuse when some attention ran without handing its keys / values to the cache (it cannot be instrumented)."""
    missed = [n for n, a in attns.items() if getattr(a, STATE).calls == 0]
    if missed:
        cls = type(attns[missed[0]]).__name__
        raise ModelError(f"{cls} ({missed[0]}) did not hand its keys and values to the cache during the forward, so "
                         f"lowbit cannot quantize its KV cache; drop --kv for this architecture")


def set_scales(attn: nn.Module, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Static scales from elsewhere (a checkpoint, a test); their head count must match the attention's."""
    state: KVState = getattr(attn, STATE)
    want = state.kv_heads if state.scheme.per_head else 1
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t.numel() != want:
            raise ConfigError(f"{name} of {type(attn).__name__} layer {attn.layer_idx} holds {t.numel()} values, the "
                              f"{state.scheme.name} scheme of an attention with {state.kv_heads} KV heads needs "
                              f"{want}; calibrate the scales for this model")
        getattr(attn, name).copy_(t.detach().float().reshape(want))


# ------------------------------------------------------------------ the offline V/O rotation
def fold_value_rotation(model: nn.Module) -> None:
    """Rotate each head's values by H: H^T into ``v_proj``'s rows (and bias), H into ``o_proj``'s columns.

    Exact in float (H orthonormal): ``o_proj(attn(v H)) = o_proj(attn(v)) `` with ``W_o`` per
    head times H. Needs float ``v_proj`` / ``o_proj`` Linears and no norm on the values; run it
    before the weights are quantized.
    """
    for name, attn in require_attention(model).items():
        v, o = _value_pair(name, attn)
        d = int(attn.head_dim)
        h = rotation_matrix(d).to(v.weight.device)
        with torch.no_grad():
            w = v.weight.data.float().reshape(-1, d, v.in_features)
            v.weight.data.copy_(torch.einsum("ed,hdi->hei", h.T, w).reshape(v.weight.shape))
            if v.bias is not None:
                v.bias.data.copy_((v.bias.data.float().reshape(-1, d) @ h).reshape(-1))
            wo = o.weight.data.float().reshape(o.out_features, -1, d)
            o.weight.data.copy_((wo @ h).reshape(o.weight.shape))


def _value_pair(name: str, attn: nn.Module) -> tuple[nn.Linear, nn.Linear]:
    v, o = getattr(attn, "v_proj", None), getattr(attn, "o_proj", None)
    if type(v) is not nn.Linear or type(o) is not nn.Linear or hasattr(attn, "v_norm"):
        raise ModelError(f"{type(attn).__name__} ({name}): the value rotation folds into float v_proj / o_proj "
                         "Linears with no norm on the values, which this attention lacks (or they are already "
                         "quantized); use a KV scheme without -rot, or rotate before quantizing the weights")
    return v, o


# ------------------------------------------------------------------ the checkpoint entry
def kv_spec(model: nn.Module) -> dict[str, Any] | None:
    """The manifest entry of the installed KV scheme (None when there is none)."""
    schemes = kv_schemes(model)
    if not schemes:
        return None
    return {**kv_entry(schemes, values_folded(model)), "layers": sorted(schemes)}


def kv_schemes(model: nn.Module) -> dict[str, KVScheme]:
    """Attention name -> the KV scheme installed on it (empty: keys and values stay in the compute dtype)."""
    return {n: getattr(a, STATE).scheme for n, a in attention_modules(model).items() if hasattr(a, STATE)}


def kv_entry(scheme: KVScheme | Mapping[str, KVScheme], folded: bool) -> dict[str, Any]:
    """The scheme and whether the values were rotated offline: what a KV cache's quantization depends on
    besides its calibrated scales (a checkpoint's manifest, a tuning work folder's record). A per-layer
    choice that differs between layers adds ``per_layer`` (name -> scheme); ``scheme`` is then the one
    most layers hold."""
    if isinstance(scheme, KVScheme):
        return {"scheme": scheme.to_dict(), "values_folded": folded}
    names = [s.name for s in scheme.values()]
    common = max(dict.fromkeys(names), key=names.count)
    entry = {"scheme": KVScheme.parse(common).to_dict(), "values_folded": folded}
    if len(set(names)) > 1:
        entry["per_layer"] = {n: s.to_dict() for n, s in sorted(scheme.items())}
    return entry
