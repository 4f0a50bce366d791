"""llama.cpp's K-quant file types (Q2_K, Q3_K_S/M/L, Q4_K_S/M, Q5_K_S/M, Q6_K) as lowbit Plans.

A llama.cpp "Q4_K_M" file is not Q4_K everywhere: ``llama_tensor_get_type`` (llama-quant.cpp)
raises some tensors to a higher type by role and depth (attn_v and ffn_down of the first,
last and every third layer to Q6_K, ...), and ``tensor_type_fallback`` gives rows that are
not a multiple of 256 a legacy 32-block type (Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K ->
Q5_1, Q6_K -> Q8_0). `mix_plan` reproduces both for the decoders lowbit quantizes, from
the names and shapes alone, so a lowbit file of a mix has the same per-tensor types, hence
the same size, as llama.cpp's.

Mixture-of-experts models (``n_expert > 1``): the fused experts tensors are llama.cpp's 3-D
``ffn_gate_exps`` / ``ffn_up_exps`` (lowbit's ``gate_up_proj``: both take the mix's base
type) and ``ffn_down_exps`` (``down_proj``: the ffn_down rules). As llama.cpp does for
experts, the ffn rules then use the block index read from the name (not a running count,
which a shared expert's second ffn_down would skew) over the model's block count; with
exactly 8 experts attn_v and attn_k take Q8_0 and attn_output Q5_K in the Q2_K..Q4_K_M
mixes (llama.cpp's rules for Mixtral-like models). The output tensor (the lm_head,
when planned) gets Q6_K, or Q8_0 when its rows are not a multiple of 256, as llama.cpp
chooses; token embeddings are not Linear layers and stay 16-bit in lowbit.
"""

from __future__ import annotations

from collections.abc import Mapping

from lowbit.errors import SchemeError
from lowbit.formats.kquants import fit_width
from lowbit.formats.scheme import Scheme
from lowbit.plans.plan import Plan

MIXES = ("q2_k_s", "gguf:q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "gguf:q6_k")
_BASE = {"q2_k_s": 2, "gguf:q2_k": 2, "q3_k_s": 3, "q3_k_m": 3, "q3_k_l": 3, "q4_k_s": 4, "q4_k_m": 4,
         "q5_k_s": 5, "q5_k_m": 5, "gguf:q6_k": 6}
_ROLE = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down", "gate_up_proj": "ffn_gate_up",
         # Qwen2-MoE's [1, H] shared-expert gate: llama.cpp's ffn_gate_inp_shexp, the mix's base type (a plan
         # that does not name it explicitly keeps it 16-bit anyway: `lowbit.models.accounting.gate`)
         "shared_expert_gate": "ffn_gate_inp_shexp"}
_FFN = ("ffn_gate", "ffn_up", "ffn_down", "ffn_gate_up")
Q8_0 = 8  # `tensor_type`'s answer for llama.cpp's Q8_0 (w8g32): the only non-K type its rules pick
# mixes whose attn_output llama.cpp raises to Q5_K in an 8-expert model
_ATTN_OUT_8_EXPERTS = ("gguf:q2_k", "q3_k_s", "q3_k_m", "q4_k_s", "q4_k_m")


# the key of a checkpoint manifest's ``meta`` naming the mix its plan reproduces (GGUF's general.file_type)
META_KEY = "llama_cpp_mix"


def is_mix(name: str | Scheme | None) -> bool:
    return isinstance(name, str) and name.strip().lower() in MIXES


def mix_meta(mix: str | None) -> dict[str, str]:
    """The manifest ``meta`` entry recording ``mix`` (nothing when the plan is not a mix)."""
    return {} if mix is None else {META_KEY: mix}


def mix_of(meta: Mapping[str, object]) -> str | None:
    """The mix a checkpoint's manifest ``meta`` records (None: not a mix, or a value that names none).

    Checkpoints written before the key existed carry the mix name as their ``plan`` label.
    """
    value = meta.get(META_KEY, meta.get("plan"))
    return value if isinstance(value, str) and value in MIXES else None


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _k(bits: int) -> Scheme:
    return Scheme.parse("w8g32" if bits == Q8_0 else f"q{bits}_k")


def _block_index(name: str) -> int:
    """The decoder block a tensor belongs to: the first integer component of its name."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    raise SchemeError(f"{name}: no block index in the name; K-quant mixes of MoE models need model.layers.N names")


def role(name: str) -> str | None:
    """llama.cpp's tensor category of a Linear, from its HF name."""
    if name == "lm_head" or name.endswith(".lm_head"):
        return "output"
    return _ROLE.get(name.rsplit(".", 1)[-1])


def tensor_type(mix: str, role_: str | None, i: int, n: int, n_gqa: int, n_expert: int = 0) -> int:
    """K-quant bits of one tensor (before the width fallback): llama_tensor_get_type's rules (`Q8_0` for Q8_0)."""
    base = _BASE[mix]
    if role_ == "output":
        return 6
    if n_expert == 8 and role_ in ("attn_v", "attn_k"):
        return Q8_0
    if n_expert == 8 and role_ == "attn_output":
        return 5 if mix in _ATTN_OUT_8_EXPERTS else base
    if role_ == "attn_v":
        return {"gguf:q2_k": 4 if n_gqa >= 4 else 3, "q2_k_s": 4 if n_gqa >= 4 else base,
                "q3_k_m": 5 if i < 2 else 4, "q3_k_l": 5,
                "q4_k_m": 6 if _more_bits(i, n) else base, "q5_k_m": 6 if _more_bits(i, n) else base,
                "q4_k_s": 5 if i < 4 else base}.get(mix, base)
    if role_ == "ffn_down":
        return {"gguf:q2_k": 3, "q2_k_s": 4 if i < n // 8 else base,
                "q3_k_m": 5 if i < n // 16 else 4, "q3_k_l": 5,
                "q4_k_m": 6 if _more_bits(i, n) else base, "q5_k_m": 6 if _more_bits(i, n) else base,
                "q4_k_s": 5 if i < n // 8 else base}.get(mix, base)
    if role_ == "attn_output":
        return {"gguf:q2_k": 3, "q3_k_m": 4, "q3_k_l": 5}.get(mix, base)
    return base


def mix_plan(sizes: Mapping[str, tuple[int, int]], mix: str, n_gqa: int, n_expert: int = 0) -> Plan:
    """Per-layer schemes of llama.cpp's file type ``mix`` over the planned weights ``sizes`` (model order).

    Counters run over the layers of each role in order, as llama.cpp's ``i_attention_wv`` /
    ``i_ffn_down`` do; with ``n_expert > 1`` (a MoE model; ``sizes`` then holds the fused
    experts tensors too, each expert's [out, in]) the ffn roles use the block index of the
    name over the block count instead. The output tensor with rows not a multiple of 256
    takes Q8_0 (w8g32).
    """
    mix = mix.strip().lower()
    if mix not in MIXES:
        raise SchemeError(f"unknown K-quant mix {mix!r}; choose one of {', '.join(MIXES)}")
    roles = {n: role(n) for n in sizes}
    unknown = [n for n, r in roles.items() if r is None]
    if unknown:
        raise SchemeError(f"{unknown[0]} has no llama.cpp tensor role (q/k/v/o, gate/up/down, lm_head); "
                          "K-quant mixes cover llama-style decoders; use a uniform scheme or a plan file")
    count = {r: sum(1 for x in roles.values() if x == r) for r in set(roles.values())}
    moe = n_expert > 1
    blocks = 1 + max((_block_index(n) for n, r in roles.items() if r in _FFN), default=-1) if moe else 0
    seen: dict[str, int] = {}
    out: dict[str, Scheme] = {}
    for name, (_, cols) in sizes.items():
        r = roles[name]
        i = seen.get(r, 0)
        seen[r] = i + 1
        if r == "output" and cols % 256:
            out[name] = Scheme.parse("w8g32")
            continue
        i, n = (_block_index(name), blocks) if moe and r in _FFN else (i, count[r])
        out[name] = fit_width(_k(tensor_type(mix, r, i, n, n_gqa, n_expert)), cols)
    return Plan(out)


def fallbacks(plan: Plan, sizes: Mapping[str, tuple[int, int]]) -> dict[str, str]:
    """Layers of a K-quant plan that hold a legacy 32-block type because of their width."""
    return {n: s.name for n, s in plan.weights().items() if s.family.name != "kquant" and sizes[n][1] % 256}


def llama_cpp_types(ftype: str, tensors: Mapping[str, tuple[int, ...]], n_gqa: int) -> dict[str, str]:
    """GGUF type llama.cpp's file type ``ftype`` gives each weight of a GGUF file (its names, shapes outermost first).

    What ``llama-quantize --type FTYPE`` (no imatrix) would write for the same tensors: the
    decoder weights by `tensor_type` and the width fallback, token_embd / output by
    `lowbit.files.gguf_types.embedding_types` (tied when the file has no ``output.weight``);
    1-D tensors and norms are not quantized by llama.cpp and are left out.
    """
    from lowbit.files import gguf_types

    base = gguf_types.base_type(ftype)
    quantized = {n: s for n, s in tensors.items() if len(s) == 2 and n.endswith("weight") and "_norm" not in n}
    roles = {n: n.split(".")[2] if n.startswith("blk.") else n.removesuffix(".weight") for n in quantized}
    count = {r: sum(1 for x in roles.values() if x == r) for r in set(roles.values())}
    tied = "output.weight" not in tensors
    seen: dict[str, int] = {}
    out: dict[str, str] = {}
    # llama.cpp counts attn_v / ffn_down in its source file's order: the blocks', whatever order this file has
    order = sorted(quantized, key=lambda n: int(n.split(".")[1]) if n.startswith("blk.") else -1)
    for name in order:
        cols, r = quantized[name][1], roles[name]
        if r in ("token_embd", "output"):
            out[name] = gguf_types.embedding_types(ftype, cols, tied)[r]
            continue
        i = seen.get(r, 0)
        seen[r] = i + 1
        qtype = f"Q{tensor_type(ftype, r, i, count[r], n_gqa)}_K" if ftype in MIXES else base
        out[name] = gguf_types.width_fallback(qtype, cols)
    return out
