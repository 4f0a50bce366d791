"""`KVScheme`: how the attention's keys and values are quantized as the KV cache stores them.

Keys and values are quantized after the rotary embedding, as the cache holds them
(``[batch, kv_heads, tokens, head_dim]``). Each key (value) vector of one token and one
head is a row of ``head_dim`` numbers, so every format of an `InputScheme` applies to it
along ``head_dim``; what the KV cache adds is where static scales live:

* ``fp8`` / ``int8``: one static scale per layer for the keys and one for the values,
  calibrated on the calibration split (vLLM's ``kv_cache_dtype=fp8`` with ``k_scale`` /
  ``v_scale``; llm-compressor's ``kv_cache_scheme`` strategy ``tensor``);
* ``fp8-head`` / ``int8-head``: one static scale per KV head (strategy ``attn_head``);
* ``fp8-token`` / ``int8-token``: a run-time scale per token and head (dynamic);
* ``int4``: INT4 in groups of 32 along ``head_dim`` with run-time fp32 scales;
* ``nvfp4``: blocks of 16 along ``head_dim``, E4M3 block scales over a static FP32 tensor
  scale calibrated per layer; ``mxfp4``: blocks of 32, E8M0 scales.

Options after ``:`` go to the element format (``int4:block=64``, ``nvfp4:rule=4over6``),
except ``scale=headroom|rowmax|amax|attn``, how static scales are calibrated (below), and ``center``
(below); a ``-rot`` suffix rotates keys and values per head with a Hadamard before they are
quantized (QuaRot's Q/K rotation; see `lowbit.nn.kv_quant`): ``int4-rot``, ``nvfp4-rot``.

``center`` (any format: ``fp8:center``, ``int4:center``, ``nvfp4-rot:center``) stores
``Q(x - mu)`` with ``mu`` a calibrated mean per layer, KV head and channel, and dequantizes to
``Q(x - mu) + mu`` (SageAttention's key smoothing, kept as a dequantization offset). Exact in
function up to rounding: for keys, dropping ``+ mu`` would change every score of one query by the
same ``q . mu``, which softmax ignores; for values, the attention probabilities sum to 1, so ``mu``
adds back after the attention. What it buys: post-RoPE keys have large, nearly constant channels
whose rounding error is a different score error for every key; centered, they are small. vLLM's
cache holds ``fp8(x / k_scale)`` with no offset, so a centered cache is lowbit-only (the
compressed-tensors export refuses it, `lowbit.files.kv_export`).

``center=rope`` (``fp8:center=rope``, ``fp8-rot:center=rope``) takes the keys' mean before the
rotary embedding instead, ``m`` per KV head and channel, and subtracts it turned to each token's
position: the cache stores ``Q(k_t - RoPE_t(m))`` and the attention reads ``Q(...) + RoPE_t(m)``.
Why: the large key channels are nearly constant *before* RoPE, but RoPE turns each pair by its
frequency times the position, so after RoPE their mean over a calibration row is not the value at
position 8000 (the slow pairs of SmolLM2 turn by ~3 rad over 8192 tokens): a post-RoPE offset from
512-token calibration rows leaves most of the channel in place at long context. Exact in function in
lowbit's forward, as ``center``; unlike ``center``, a kernel that drops the offset would change
``q_s . RoPE_t(m)`` with ``t``, so a kernel must add it back (lowbit-only: no engine stores it).
Values have no RoPE; they are centered as by ``center``. Measured on the bundled model (kv.md, sixth
run; 512-token calibration rows): FP8 with ``center`` costs +1.26 % at 2048 tokens and +13.6 % at 8192
(its offset misses, and its scale clips, far from the calibration positions); ``center=rope`` +0.24 % and
+0.47 %. Use ``center`` only within the calibration rows' length.

Static scales are stored as ``amax / qmax`` (for E4M3 ``amax / 448``: vLLM's meaning of
``k_scale``, ``fp8 value = x / k_scale``), one float per layer or per KV head. Which abs-max:
``scale=rowmax`` takes each calibration row's (sequence's) abs-max and averages them over the rows,
the abs-max of a typical row (`typical_amax`: why); ``scale=amax`` (the default of every other static
format, INT8 and NVFP4's tensor scale) the largest over all rows. ``scale=headroom`` (the default of
``fp8`` / ``fp8-head``, the caches vLLM serves; static E4M3 only) takes rowmax's
statistic and maps it to 256 instead of 448: E4M3's last binade is cut short ([256, 448], mantissas 1
to 1.75), its normal range spans 2^14.8, and its precision is relative, so moving the covered range up
by 448 / 256 = 1.75 costs no element precision (the smallest normal value, 2^-6 of the scale, stays far
below any key or value that matters) and leaves room for the larger values a sequence longer than the
calibration rows holds: on the bundled model the keys of one 8192-token evaluation window reach up to
1.40 times the rowmax of 512-token calibration rows (kv.md, seventh run), where rowmax and
llm-compressor's scales clip. Why only E4M3: an INT8 scale sets the absolute step of every element and
NVFP4's tensor scale caps the block scales of whole blocks, so room above costs them precision (refused).
Made the default by a rule written before it was measured (kv.md, eighth run): on the bundled model at
3 x 8192 tokens over calibration seeds 0-3 its mean perplexity is at most llm-compressor's (calibrated on
the same tokens), its KL divergence to the float-KV model is below llm-compressor's on at least 3 of the 4
seeds, and at 3 x 2048 its mean perplexity is not above rowmax's (the previous default, still
``scale=rowmax``; before it ``scale=amax``). Per head it gains as per tensor; with ``-rot`` or
``center=rope``, which take out the large key channels that rowmax clips, it measured worse on the one
seed run (``fp8-rot`` KL +2.7 %, ``fp8:center=rope`` perplexity +0.25 %, which would lift that cache over
the 0.5 % target), so those lowbit-only caches (and ``:center``) keep rowmax by default. E4M3 keeps a
relative precision, so beyond saturation the scale only decides where each value falls
between two grid points (its "phase"), which matters where many keys share a magnitude (the
large, nearly constant low-frequency RoPE channels). ``scale=attn`` searches it: among
``amax / 448 * 2^(j/16)``, j = -16..15 (half to twice the abs-max scale; the smaller ones clip
the rarest largest values), the key scale and the value scale whose quantization changes each
attention's output (after ``o_proj``) least over the calibration split (`lowbit.nn.kv_quant`),
since a key's error counts only as much as the queries read its channel, through the softmax.
The search runs around ``amax / 448`` and is no default: on the bundled model the search, the
keys' squared error, llm-compressor's scales and amax all land within 0.3 % of perplexity of
each other (benchmarks/results/kv.md), and the search costs about ten calibration passes. The
choice is a calibration rule: a checkpoint's scales are used as stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lowbit.errors import ConfigError, SchemeError, did_you_mean
from lowbit.formats.args import _fmt
from lowbit.formats.inputs import InputScheme, qdq_input

ROTATE_SUFFIX = "-rot"
SCALE_RULES = ("amax", "rowmax", "headroom", "attn")  # how static scales are calibrated: scale=amax|rowmax|headroom|attn
ROW_RULES = ("amax", "rowmax", "headroom")  # the statistic over calibration rows of each row's abs-max (`typical_amax`)
E4M3_TOP_POWER = 256.0  # E4M3's largest power of two: its last binade, [256, 448], is cut short at 1.75 x 256
HEADROOM = 448.0 / E4M3_TOP_POWER  # scale=headroom covers this many times the typical row's abs-max
CENTER = "center"  # the option that subtracts a calibrated mean per head and channel before quantization
ROPE_CENTER = "center=rope"  # the same with the keys' mean taken before RoPE and turned to each token's position
FLAGS = ("per_head", "rotate", "search", "center")  # KVScheme's switches, in field order


@dataclass(frozen=True)
class KVScheme:
    """elements: the format of each key / value row along head_dim.
    per_head: static scales per KV head instead of per layer (static formats only).
    rotate: keys and values rotated per head by a normalized Hadamard before quantization."""

    elements: InputScheme
    per_head: bool = False
    rotate: bool = False
    search: bool = False  # static E4M3: scales chosen by the attention output's error (scale=attn), not amax/448
    center: bool = False  # a calibrated per-(head, channel) mean subtracted before quantization, added back after
    rule: str = "amax"  # static scales: amax over all calibration rows, its mean over rows (rowmax), rowmax x 1.75
    prerope: bool = False  # center=rope: the keys' offset is a pre-RoPE mean, rotated to each token's position

    def __post_init__(self) -> None:
        if not isinstance(self.elements, InputScheme):
            raise SchemeError(f"a KV scheme's elements must be an InputScheme, got {type(self.elements).__name__}")
        if self.per_head and not self.elements.static:
            raise SchemeError(f"per-head KV scales are static scales; {self.elements.name} computes its scales at "
                              "run time (use fp8-head or int8-head)")
        if self.search and not searchable(self.elements):
            raise SchemeError(f"scale=attn searches the phase of static FP8 (E4M3) scales; {self.elements.name} "
                              "has none to search (drop scale=attn)")
        if self.rule not in ROW_RULES:
            raise SchemeError(f"unknown KV scale rule {self.rule!r}; valid: {', '.join(ROW_RULES)}")
        if self.prerope and not self.center:
            raise SchemeError("a pre-RoPE key offset (center=rope) is a form of centering; set center too")
        if self.rule == "headroom" and self.elements.elem != "e4m3":
            raise SchemeError(f"scale=headroom leaves E4M3's top binade free for larger values than calibration "
                              f"saw, which costs E4M3 no precision; {self.elements.name} has no relative precision "
                              "(an INT8 or block scale sets every element's step): use scale=rowmax or amax")
        if self.rule != "amax" and (self.search or not self.elements.needs_calibration):
            raise SchemeError(f"scale={self.rule} is a rule for calibrated static scales; "
                              + ("scale=attn searches around amax / qmax (give one scale= option)" if self.search
                                 else f"{self.elements.name} computes its scales at run time (drop scale=)"))

    @property
    def static(self) -> bool:
        """One calibrated scale per layer (or head): what vLLM's ``k_scale`` / ``v_scale`` hold."""
        return self.elements.static

    @property
    def needs_calibration(self) -> bool:
        """Static scales or the centering offsets to calibrate on the calibration split."""
        return self.elements.needs_calibration or self.center

    @property
    def bits(self) -> int:
        return self.elements.bits

    @property
    def name(self) -> str:
        base, sep, opts = _base_name(self).partition(":")  # the suffix goes on the preset, before the options
        return base + (ROTATE_SUFFIX if self.rotate else "") + sep + opts

    def bytes_per_token(self, layers: int, kv_heads: int, head_dim: int) -> float:
        """Bytes the cache holds per token: elements plus the run-time scales stored with them (keys and values)."""
        e = self.elements
        per_row = head_dim * e.bits / 8
        if not e.static:
            group = head_dim if e.group_size == -1 else e.group_size
            per_row += (head_dim // group) * _scale_bytes(e.scale)
        return 2 * layers * kv_heads * per_row

    def to_dict(self) -> dict[str, Any]:
        """The manifest entry; ``prerope`` only where set, so every entry written before it existed reads the same."""
        d = {"elements": self.elements.to_dict(), "per_head": self.per_head, "rotate": self.rotate,
             "search": self.search, "center": self.center, "rule": self.rule}
        return d | ({"prerope": True} if self.prerope else {})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVScheme:
        """A manifest's entry; one written before ``search`` / ``center`` / ``rule`` existed had neither (false;
        ``amax``: the only rule then, and a checkpoint's scales are used as stored anyway)."""
        unknown = set(d) - {"elements", *FLAGS, "rule", "prerope"}
        if unknown or "elements" not in d:
            raise SchemeError(f"a KV scheme holds 'elements', {', '.join(map(repr, FLAGS))}, 'rule', 'prerope'; "
                              f"got {sorted(d)}")
        flags = [d.get(k, False) for k in FLAGS]
        prerope = d.get("prerope", False)
        if any(type(f) is not bool for f in (*flags, prerope)):
            raise SchemeError(f"a KV scheme's {', '.join(FLAGS)}, prerope must be true or false")
        rule = d.get("rule", "amax")
        if not isinstance(rule, str):
            raise SchemeError(f"a KV scheme's rule must be one of {', '.join(ROW_RULES)}, got {rule!r}")
        return cls(InputScheme.from_dict(dict(d["elements"])), *flags, rule=rule, prerope=prerope)

    @classmethod
    def parse(cls, text: str | KVScheme) -> KVScheme:
        """A KV name (``fp8``, ``int8-head``, ``int4:block=64``, ``nvfp4-rot``), case-insensitive."""
        if isinstance(text, KVScheme):
            return text
        base, sep, opts = text.strip().lower().partition(":")
        rotate = base.endswith(ROTATE_SUFFIX)
        if rotate:
            base = base[: -len(ROTATE_SUFFIX)]
        if base not in PRESETS:
            raise SchemeError(f"unknown KV cache scheme {base!r}{did_you_mean(base, PRESETS)}; valid: "
                              f"{', '.join(PRESETS)} (add -rot for the Hadamard rotation, :key=value for options "
                              "of the element format, e.g. int4:block=64)")
        preset = PRESETS[base]
        rule, center, prerope, rest = _kv_options(opts)
        elements = preset.elements.with_options(rest) if rest else preset.elements
        search = rule == "attn"  # never by default: the search measured no better (benchmarks/results/kv.md)
        row_rule = (("amax" if search else rule) if rule is not None
                    else _default_rule(preset, elements, rotate, center))
        return cls(elements, preset.per_head, rotate, search, center, row_rule, prerope)

    def __str__(self) -> str:
        return self.name


def searchable(e: InputScheme) -> bool:
    """Static E4M3 elements: the scales whose phase `scale=attn` calibrates."""
    return e.static and e.elem == "e4m3"


def _kv_options(opts: str) -> tuple[str | None, bool, bool, str]:
    """``scale=amax|rowmax|headroom|attn`` (None: not given), ``center`` and ``center=rope`` (centered, pre-RoPE) taken out of
    the options, and the element format's options left."""
    rule, center, prerope, rest = None, False, False, []
    for item in filter(None, opts.split(",")):
        key, _, value = item.partition("=")
        if key.strip() == "scale" and value.strip() in SCALE_RULES:
            rule = value.strip()
        elif item.strip() == CENTER:
            center = True
        elif item.replace(" ", "") == ROPE_CENTER:
            center = prerope = True
        elif key.strip() == CENTER:
            raise SchemeError(f"unknown centering {item.strip()!r}; valid: {CENTER} (the cache's mean), "
                              f"{ROPE_CENTER} (the keys' mean before RoPE)")
        else:
            rest.append(item)
    return rule, center, prerope, ",".join(rest)


def _scale_bytes(scale: str) -> float:
    return {"fp32": 4, "fp16": 2, "bf16": 2}.get(scale, 1)


def _base_name(s: KVScheme) -> str:
    """The preset differing in fewest element fields, plus those fields as options (``int4:block=64``)."""
    best, best_diff = "", None
    for key, preset in PRESETS.items():
        if preset.per_head != s.per_head:
            continue
        e = preset.elements
        diff = [f for f in e.FIELD_TO_KEY if getattr(e, f) != getattr(s.elements, f)]
        if best_diff is None or len(diff) < len(best_diff):
            best, best_diff = key, diff
    opts = [f"{s.elements.FIELD_TO_KEY[f]}={_fmt(getattr(s.elements, f))}" for f in best_diff or []]
    if s.search:
        opts.append("scale=attn")
    elif s.rule != _default_rule(PRESETS[best], s.elements, s.rotate, s.center):
        opts.append(f"scale={s.rule}")
    if s.center:
        opts.append(ROPE_CENTER if s.prerope else CENTER)
    return f"{best}:{','.join(opts)}" if opts else best


def _default_rule(preset: KVScheme, elements: InputScheme, rotated: bool = False, centered: bool = False) -> str:
    """The rule a name without ``scale=`` gets: its preset's where options keep a static scale. An ``fp8`` preset
    whose options leave E4M3 (``fp8:elem=int``) gets rowmax as before: headroom needs E4M3's relative precision.
    Rotated (``-rot``) and centered (``:center``, ``:center=rope``) E4M3 caches get rowmax too: both take out the
    large key channels whose clipping headroom leaves room for, and on the bundled model headroom measured worse
    there (``fp8:center=rope`` +0.25 % perplexity, ``fp8-rot`` +2.7 % KL; kv.md, eighth run)."""
    if not elements.needs_calibration:
        return "amax"
    if preset.rule == "headroom" and (elements.elem != "e4m3" or rotated or centered):
        return "rowmax"
    return preset.rule


def _kv(elements: str, per_head: bool = False, rule: str = "amax") -> KVScheme:
    e = InputScheme.parse(elements)
    return KVScheme(e, per_head, rule=rule)


PRESETS: dict[str, KVScheme] = {  # static E4M3 calibrates by headroom (module docstring), every other format by amax
    "fp8": _kv("fp8-static", rule="headroom"),
    "fp8-head": _kv("fp8-static", per_head=True, rule="headroom"),
    "fp8-token": _kv("fp8"),
    "int8": _kv("int8-static"),
    "int8-head": _kv("int8-static", per_head=True),
    "int8-token": _kv("int8"),
    "int4": _kv("int8:bits=4,block=32"),
    "nvfp4": _kv("nvfp4"),
    "mxfp4": _kv("mxfp4"),
}


def parse_kv(text: str | KVScheme | None) -> KVScheme | None:
    """``--kv``: None stays None (keys and values in the compute dtype)."""
    return None if text is None else KVScheme.parse(text)


def parse_kv_options(text: str) -> tuple[KVScheme, ...]:
    """``--kv fp8,int8,int4:block=64,bits=4``: the schemes a per-layer choice picks from, in order, each once.

    Commas also separate a scheme's options, so an item with ``=`` and no ``:`` continues the
    scheme before it (``int4:block=64,bits=4`` is one scheme). Mixing schemes with and without
    ``-rot`` is refused: the value rotation is folded into the weights of every layer or of none.
    """
    items: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise SchemeError(f"--kv {text!r}: an empty scheme between commas; list schemes like fp8,int8,int4")
        if "=" in part and ":" not in part and items:
            items[-1] += "," + part
        else:
            items.append(part)
    schemes = tuple(dict.fromkeys(KVScheme.parse(i) for i in items))
    if len({s.rotate for s in schemes}) > 1:
        raise SchemeError(f"--kv {text}: some schemes rotate (-rot) and some do not; the value rotation is folded "
                          "into every layer's v_proj / o_proj or none, so list only -rot schemes or none")
    return schemes


# --------------------------------------------------------------- quantization
def kv_scale(amax: torch.Tensor, s: KVScheme) -> torch.Tensor:
    """The stored scale of a calibrated abs-max: ``amax / qmax`` (1 where nothing was seen), float32."""
    a = amax.detach().float()
    return torch.where(a > 0, a / s.elements.qmax, torch.ones_like(a))


def qdq_kv(x: torch.Tensor, s: KVScheme, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize then dequantize keys or values ``x [batch, kv_heads, tokens, head_dim]`` (``x``'s dtype out).

    scale: the stored static scale (`kv_scale`): ``[]`` / ``[1]`` per layer, ``[kv_heads]``
    per head; for NVFP4 the tensor scale's abs-max is ``scale * 6``. Computed in float32.
    """
    if s.elements.needs_calibration and scale is None:
        raise ConfigError(f"KV scheme {s.name} has static scales: calibrate them on calibration data first "
                          "(lowbit quantize --kv does so from the calibration split)")
    if not s.static:
        amax = None if scale is None else scale.float().reshape(()) * s.elements.qmax
        return qdq_input(x, s.elements, amax)
    xf = x.detach().float()
    sc = scale.detach().float().to(x.device)
    if s.per_head:
        if sc.numel() != x.shape[1]:
            raise ConfigError(f"per-head KV scales hold {sc.numel()} heads but the keys / values have "
                              f"{x.shape[1]}; calibrate the scales for this model")
        sc = sc.reshape(1, -1, 1, 1)
    else:
        sc = sc.reshape(())
    q = s.elements.family.round_input(xf / sc, s.elements) * sc
    return q.to(x.dtype)


SEARCH_STEPS = 16  # candidates per octave: E4M3's grid repeats past a factor of 2, sampled every 4.4 %
SEARCH_EXPONENTS = tuple(range(-SEARCH_STEPS, SEARCH_STEPS))  # amax / qmax * 2^(j/16), j = -16..15


def search_factors() -> torch.Tensor:
    """The candidate multipliers of the abs-max scale ``2^(j/16)``, j = -16..15: from half (the largest values
    clip at 448) to nearly twice (the largest values fall an octave lower), float32."""
    return 2 ** (torch.tensor(SEARCH_EXPONENTS, dtype=torch.float32) / SEARCH_STEPS)


@dataclass(frozen=True)
class ChannelStats:
    """What calibration keeps of centered keys (values): per KV head and channel, the running sum and count, and
    per calibration row the max and min. Their mean is the centering offset, and each row's abs-max around it
    follows exactly from the row's max and min (``max(hi - mu, mu - lo)`` per channel), so one pass calibrates
    both offset and scale, under either row rule."""

    total: torch.Tensor  # [kv_heads, head_dim] float64
    count: int
    hi: torch.Tensor  # [rows, kv_heads, head_dim] float32
    lo: torch.Tensor

    @classmethod
    def of(cls, x: torch.Tensor) -> ChannelStats:
        """Of ``x [batch, kv_heads, tokens, head_dim]``."""
        xf = x.detach().float()
        return cls(xf.sum(dim=(0, 2), dtype=torch.float64), x.shape[0] * x.shape[2], xf.amax(dim=2), xf.amin(dim=2))

    def merge(self, other: ChannelStats) -> ChannelStats:
        d = self.total.device
        return ChannelStats(self.total + other.total.to(d), self.count + other.count,
                            torch.cat([self.hi, other.hi.to(d)]), torch.cat([self.lo, other.lo.to(d)]))

    def mean(self) -> torch.Tensor:
        """The centering offset ``mu [kv_heads, head_dim]`` (float32)."""
        return (self.total / max(self.count, 1)).float()

    def amax_around(self, mu: torch.Tensor, per_head: bool, rule: str = "amax") -> torch.Tensor:
        """The abs-max of ``x - mu`` per KV head ``[kv_heads]`` or overall ``[1]``, over the rows by ``rule``."""
        dev = torch.maximum(self.hi - mu, mu - self.lo)  # [rows, kv_heads, head_dim]
        rows = dev.amax(dim=2) if per_head else dev.amax(dim=(1, 2)).reshape(-1, 1)
        return typical_amax(rows, rule)


def observe_amax(x: torch.Tensor, s: KVScheme) -> torch.Tensor:
    """What calibration keeps of ``x [b, h, t, d]``: each row's (sequence's) abs-max, per KV head (per-head
    scales) ``[b, kv_heads]`` or overall ``[b, 1]``; `typical_amax` reduces the rows."""
    a = x.detach().abs().float()
    return a.amax(dim=(2, 3)) if s.per_head else a.amax(dim=(1, 2, 3)).reshape(-1, 1)


def typical_amax(rows: torch.Tensor, rule: str) -> torch.Tensor:
    """The abs-max a static scale covers, from each calibration row's abs-max ``rows [rows, n]`` -> ``[n]``.

    ``amax``: the largest over all rows. ``rowmax``: their mean, the abs-max of a typical row. ``headroom``: that mean
    times 448 / 256, so the typical row's abs-max lands on 256, E4M3's largest power of two, and values up to 1.75
    times larger fit (module docstring: why). Why the mean: the
    maximum over rows is the top order statistic of the sample, so it grows with the number of calibration rows
    and rests on the single rarest row; the mean of the rows' maxima estimates a fixed quantity (the expected
    abs-max of one calibration-length sequence) and only gets more precise with more rows. It is what
    llm-compressor's minmax observer estimates from mostly its first row (a moving average with constant 0.01),
    with every row counted alike and no dependence on their order. The largest values of the rarer rows clip.
    """
    if rule == "amax":
        return rows.amax(dim=0)
    if rule == "rowmax":
        return rows.mean(dim=0)
    if rule == "headroom":  # E4M3 only (KVScheme refuses it elsewhere): the typical row's abs-max lands on 256
        return rows.mean(dim=0) * HEADROOM
    raise SchemeError(f"unknown KV scale rule {rule!r}; valid: {', '.join(ROW_RULES)}")
