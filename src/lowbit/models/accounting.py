"""Every matmul weight of a model, by kind, quantized or left in float.

lowbit never reports success while a matmul weight silently stays float. A walker over
``nn.Linear`` alone misses most of a mixture-of-experts model: in transformers 5 the
experts are fused 3-D parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``;
gpt-oss stores them transposed, with biases) inside an ``...Experts`` module, and the
routers are bare ``[E, H]`` Parameters of a ``...TopKRouter``. So this module counts by
structure, not by a list of names: every parameter (or quantized layer) with two or more
dimensions is a matrix some forward multiplies by (embeddings: looks rows up in), and
nothing with fewer is (norm scales, biases, attention sinks). Kinds come from structure
first (an ``nn.Embedding``, the output embeddings, a 3-D stack of matrices = experts, a
bare 2-D weight beside the experts = the router) and from the names every decoder uses
for the rest (``attn`` / ``attention``, ``mlp`` / ``ffn``, ``shared_expert``).

The same rules classify stored tensors by name and shape (`account_tensors`), so
``lowbit inspect`` reports the accounting of a file without building the model. The
refusal before quantizing (`check_float_left`) lives here too: it needs only the
accounting a plan would give and what the user asked to keep.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from lowbit.errors import ConfigError, ModelError

KINDS = ("attention", "mlp", "experts", "shared_experts", "router", "embeddings", "lm_head", "adapters", "other")
# kinds a plan may leave in float without being asked: lookups, the router (it picks experts: 16 bits by
# rule) and the lm_head (lowbit's default, --lm-head quantizes it); norms are no matmul weights at all
FLOAT_BY_DEFAULT = ("embeddings", "router", "lm_head")
# model types whose expert, router and shared-expert tensors lowbit maps (each tested on a tiny random model)
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3")
# config fields that declare routed experts (transformers' names across architectures)
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class Weight:
    """One matmul weight: its tensor name, kind, shape and whether it is (or will be) quantized."""

    name: str
    kind: str
    shape: tuple[int, ...]
    quantized: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Accounting:
    """The matmul weights of a model; ``to_dict`` is what summaries, manifests and `inspect` show."""

    weights: tuple[Weight, ...]

    @property
    def total(self) -> int:
        return sum(w.numel for w in self.weights)

    def by_kind(self) -> dict[str, tuple[int, int]]:
        """kind -> (quantized, float) parameters, in `KINDS` order, kinds the model has only."""
        out = {k: [0, 0] for k in KINDS}
        for w in self.weights:
            out[w.kind][0 if w.quantized else 1] += w.numel
        return {k: (q, f) for k, (q, f) in out.items() if q or f}

    def float_weights(self, kinds: Collection[str] | None = None) -> list[Weight]:
        return [w for w in self.weights if not w.quantized and (kinds is None or w.kind in kinds)]

    def to_dict(self) -> dict[str, Any]:
        """Totals, then parameters per kind quantized and left in float, and each kind's share of the total.

        Flat per-kind maps rather than one record per kind, so the text summary reads as
        ``quantized: attention: 24576, float: experts: 98304, ...``.
        """
        total = self.total
        kinds = self.by_kind()
        return {"params": total, "quantized_share": _share(sum(q for q, _ in kinds.values()), total),
                "quantized": {k: q for k, (q, _) in kinds.items() if q},
                "float": {k: f for k, (_, f) in kinds.items() if f},
                "share": {k: _share(q + f, total) for k, (q, f) in kinds.items()}}


def _share(part: int, total: int) -> float:
    return round(part / total, 4) if total else 0.0


# ------------------------------------------------------------------ names

_ATTENTION = re.compile(r"(^|[._])(self_attn|attn|attention|cross_attn|attn_\w+)([._]|$)")
_MLP = re.compile(r"(^|[._])(mlp|ffn|feed_forward|block_sparse_moe|moe)([._]|$)")
_SHARED = re.compile(r"shared_expert|shexp")
_EXPERTS = re.compile(r"(^|\.)experts\.\d+\.|_exps(\.|$)")
# routers by name (files only: in memory they are found by structure), GGUF's ffn_gate_inp included
_ROUTER = re.compile(r"(^|\.)(mlp|block_sparse_moe|moe)\.(gate|router)\.weight$|shared_expert_gate\.weight$"
                     r"|ffn_gate_inp(_shexp)?\.weight$")
_EMBED = re.compile(r"(^|\.)(embed_tokens|wte|wpe|embeddings?|token_embd|tok_embeddings)\.weight$")
_BIAS = re.compile(r"[._]bias$")  # added, not multiplied: gpt-oss's per-expert [E, out] biases are 2-D
_HEAD = re.compile(r"(^|\.)(lm_head|embed_out)\.weight$|^output\.weight$")  # GGUF's output: top level only


def kind_by_name(name: str, shape: tuple[int, ...]) -> str:
    """The kind of a stored matmul weight from its name and shape (GGUF names included)."""
    if ".adapters." in name:
        return "adapters"
    if _ROUTER.search(name):
        return "router"
    if _SHARED.search(name):
        return "shared_experts"
    if _EXPERTS.search(name) or (len(shape) >= 3 and not _ATTENTION.search(name)):  # MLA's 3-D attn_k_b / attn_v_b
        return "experts"
    if _EMBED.search(name):
        return "embeddings"
    if _HEAD.search(name):
        return "lm_head"
    if _ATTENTION.search(name):
        return "attention"
    if _MLP.search(name):
        return "mlp"
    return "other"


def account_tensors(tensors: Iterable[tuple[str, tuple[int, ...], bool]]) -> Accounting:
    """The accounting of stored tensors: (name, shape, quantized) for every tensor with 2+ dimensions.

    Quantized layers are given by their layer name (or ``name.weight``) and the shape of
    the matrix they hold, not by their packed parts.
    """
    ws = []
    for name, shape, quantized in tensors:
        if len(shape) < 2 or _BIAS.search(name):
            continue
        ws.append(Weight(name, kind_by_name(name, tuple(shape)), tuple(int(d) for d in shape), bool(quantized)))
    return Accounting(tuple(ws))


# ------------------------------------------------------------------ models

def is_fused_experts(module: nn.Module) -> bool:
    """A module holding a stack of matrices (one per expert): any own parameter with 3+ dimensions.

    transformers 5 decorates such classes with ``@use_experts_implementation`` (flags
    ``is_transposed`` / ``has_bias``), but the structure is what makes them experts.
    """
    return any(p.ndim >= 3 for p in module.parameters(recurse=False))


def _quantized_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """suffix -> matrix shape of the quantized matrices a module stores packed (buffers, not Parameters)."""
    from lowbit.nn import QuantLinear

    if isinstance(module, QuantLinear):
        return {"weight": (module.out_features, module.in_features)}
    own = getattr(module, "quantized_shapes", None)  # a quantized experts module says what it stores
    return dict(own()) if callable(own) else {}


def _quantized_experts(module: nn.Module) -> list[tuple[int, ...]]:
    """The 3-D shapes a quantized experts module stores packed (none for any other module)."""
    return [s for s in _quantized_shapes(module).values() if len(s) >= 3]


def account_model(model: nn.Module, planned: Collection[str] = ()) -> Accounting:
    """Every matmul weight of ``model``; a Linear or a fused experts parameter (``...experts.gate_up_proj``)
    named in ``planned`` counts as quantized (a plan's prediction).

    Tied parameters count once (a tied lm_head under embeddings), so the total equals
    ``sum(p.numel())`` over the distinct parameters with 2+ dimensions plus the matrices
    of the quantized layers.
    """
    planned = set(planned)
    head = _output_weight(model)
    embeds = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    routers = _router_params(model)
    seen: set[int] = set()
    ws = []
    for mname, mod in model.named_modules():
        prefix = f"{mname}." if mname else ""
        for suffix, shape in _quantized_shapes(mod).items():
            ws.append(Weight(prefix + suffix, kind_by_name(prefix + suffix, shape), shape, True))
        fused = is_fused_experts(mod)  # its 2-D parameters are per-expert biases ([E, out])
        for pname, p in mod.named_parameters(recurse=False):
            if p.ndim < 2 or (fused and p.ndim < 3) or _BIAS.search(pname) or id(p) in seen:
                continue
            seen.add(id(p))
            name = prefix + pname
            if id(p) in embeds:
                kind = "embeddings"
            elif id(p) == head:
                kind = "lm_head"
            elif id(p) in routers:
                kind = "router"
            else:
                kind = kind_by_name(name, tuple(p.shape))
            quantized = (mname in planned and isinstance(mod, nn.Linear)) or (fused and p.ndim >= 3 and name in planned)
            ws.append(Weight(name, kind, tuple(p.shape), quantized))
    return Accounting(tuple(ws))


def _output_weight(model: nn.Module) -> int | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    w = getattr(head, "weight", None)
    return id(w) if isinstance(w, nn.Parameter) else None


def _router_params(model: nn.Module) -> set[int]:
    """Routers found by structure: in a block holding fused experts, a child's 2-D weight with E or 1 rows.

    E rows: the top-k router (a bare Parameter in transformers 5, a Linear in older
    code); one row: a shared expert's sigmoid gate (Qwen2-MoE's ``shared_expert_gate``).
    """
    out: set[int] = set()
    for block in model.modules():
        experts = [c for c in block.children() if is_fused_experts(c) or _quantized_experts(c)]
        if not experts:
            continue
        n = {p.shape[0] for c in experts for p in c.parameters(recurse=False) if p.ndim >= 3}
        n |= {shape[0] for c in experts for shape in _quantized_experts(c)}
        for child in block.children():
            if child in experts:
                continue
            for p in child.parameters(recurse=False):
                if p.ndim == 2 and (p.shape[0] in n or p.shape[0] == 1):
                    out.add(id(p))
    return out


# ------------------------------------------------------------------ architectures and refusals

def expert_count(model: nn.Module) -> int:
    """Routed experts the config declares (0 for a dense model)."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    return max((int(v) for k in _EXPERT_COUNTS if isinstance(v := getattr(cfg, k, None), int)), default=0)


def check_architecture(model: nn.Module) -> None:
    """A mixture-of-experts model lowbit cannot map is refused by name, before any work."""
    has_experts = expert_count(model) > 1 or any(is_fused_experts(m) for m in model.modules())
    if not has_experts:
        return
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in MOE_ARCHITECTURES:
        raise ModelError(f"{type(model).__name__} (model_type {kind!r}) has experts lowbit cannot map; lowbit "
                         f"maps the mixture-of-experts architectures {', '.join(MOE_ARCHITECTURES)}")


def kept(accounting: Accounting, patterns: Iterable[str]) -> set[str]:
    """Names of the weights ``patterns`` keep in float: a kind (``experts``) or a glob over names.

    A glob matches a weight's name or its module's (``model.layers.0.*``, ``*.self_attn.*``);
    a pattern that matches nothing is an error naming the kinds this model has.
    """
    names: set[str] = set()
    for pat in patterns:
        hit = {w.name for w in accounting.weights if w.kind == pat or fnmatch.fnmatchcase(w.name, pat)
               or fnmatch.fnmatchcase(w.name.rpartition(".")[0], pat)}
        if not hit:
            raise ConfigError(f"--keep {pat} matches no matmul weight of this model; give a kind "
                              f"({', '.join(accounting.by_kind())}) or a glob over names, e.g. 'model.layers.0.*'")
        names |= hit
    return names


def modules_of(names: Iterable[str]) -> set[str]:
    """Module names of weight names (``a.b.weight`` -> ``a.b``)."""
    return {n.rpartition(".")[0] for n in names}


def check_float_left(accounting: Accounting, asked: Collection[str] = ()) -> None:
    """Refuse a plan that leaves matmul weights in float beyond `FLOAT_BY_DEFAULT` and the names in ``asked``.

    One line naming each kind left in float (with its share of the matmul weights and
    where it lives) and the flag that keeps it on purpose.
    """
    left = [w for w in accounting.float_weights() if w.kind not in FLOAT_BY_DEFAULT and w.name not in asked]
    if not left:
        return
    total = max(accounting.total, 1)
    parts = []
    for kind in KINDS:
        ws = [w for w in left if w.kind == kind]
        if ws:
            n = sum(w.numel for w in ws)
            parts.append(f"{kind} {n:,} ({100 * n / total:.1f}%: {_where(ws)})")
    share = 100 * sum(w.numel for w in left) / total
    kinds = [k for k in KINDS if any(w.kind == k for w in left)]
    why = ("; a --scheme (uniform or a llama.cpp mix) or --avg-bits plan covers fused mixture-of-experts experts"
           if "experts" in kinds else "")
    plan = "" if kinds == ["experts"] else " (or name them in a --plan)"
    keep = ",".join(_keep_pattern(accounting, k, [w for w in left if w.kind == k]) for k in kinds)
    raise ConfigError(f"this plan would leave {share:.1f}% of the matmul weights in float: {'; '.join(parts)}"
                      f"{why}; pass --keep {keep} to keep them in float on purpose{plan}")


def _keep_pattern(accounting: Accounting, kind: str, left: list[Weight]) -> str:
    """The --keep pattern for ``left``: its kind when the plan quantizes none of that kind, else a name glob.

    A vision tower's attention left out of a decoder's plan must not be kept as ``attention``
    (that would drop the decoder's attention from the plan too): its common prefix is.
    """
    if all(not w.quantized for w in accounting.weights if w.kind == kind):
        return kind
    parts = [w.name.rpartition(".")[0].split(".") for w in left]
    common = []
    for segs in zip(*parts, strict=False):
        if len(set(segs)) > 1:
            break
        common.append(segs[0])
    return ".".join(common) + ".*" if common else "'" + _where(left).split(", ")[0] + "'"


def _where(weights: list[Weight]) -> str:
    """Up to three name patterns (block indices as *) of ``weights``."""
    pats = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", w.name) for w in weights))
    return ", ".join(pats[:3]) + (f", +{len(pats) - 3} more" if len(pats) > 3 else "")


def gate(model: nn.Module, planned: Collection[str], keep: Iterable[str] = (), explicit: bool = False) -> set[str]:
    """Everything a quantizing job checks about float weights before any work; returns the planned Linears --keep drops.

    The architecture must be one lowbit maps; ``keep`` (kinds or globs) names what stays in
    float on purpose; router Linears leave a plan that is not ``explicit``; with ``explicit``
    (a plan file) the Linears the plan leaves out are the user's choice too. Anything else a plan would leave in float beyond embeddings,
    routers and the lm_head is refused (`check_float_left`).
    """
    check_architecture(model)
    keep = tuple(keep)
    whole = account_model(model)
    asked = kept(whole, keep)
    planned = set(planned)
    dropped = (modules_of(asked) | asked) & planned  # a kept Linear's module, a kept experts tensor's own name
    if explicit and dropped:
        raise ConfigError(f"--keep {','.join(keep)} keeps layers the plan file quantizes ({sorted(dropped)[0]}...); "
                          "drop them from the plan or from --keep")
    if not explicit:  # routers stay 16-bit unless a plan names them (Qwen2-MoE's shared_expert_gate is a Linear)
        dropped |= modules_of(w.name for w in whole.weights if w.kind == "router") & planned
    if explicit:
        asked |= {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    check_float_left(account_model(model, planned - dropped), asked)
    return dropped


def keep_patterns(value: object) -> tuple[str, ...]:
    """A job's ``keep``: one pattern or a sequence of them, each non-empty text."""
    pats = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (tuple, list)) else None
    if pats is None or not all(isinstance(p, str) and p.strip() for p in pats):
        raise ConfigError(f"keep takes kinds or name globs (e.g. ('experts',)), got {value!r}")
    return tuple(p.strip() for p in pats)
