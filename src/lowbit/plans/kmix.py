"""llama.cpp's K-quant file types (Q2_K, Q3_K_S/M/L, Q4_K_S/M, Q5_K_S/M, Q6_K) as lowbit Plans.

A llama.cpp "Q4_K_M" file is not Q4_K everywhere: ``llama_tensor_get_type`` (llama-quant.cpp)
raises some tensors to a higher type by role and depth (attn_v and ffn_down of the first,
last and every third layer to Q6_K, ...), and ``tensor_type_fallback`` gives rows that are
not a multiple of 256 a legacy 32-block type (Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K ->
Q5_1, Q6_K -> Q8_0). `mix_plan` reproduces both for the dense (non-MoE) decoders lowbit
quantizes, from the Linear names and shapes alone, so a lowbit file of a mix has the same
per-tensor types, hence the same size, as llama.cpp's. The output tensor (the lm_head,
when planned) gets Q6_K, or Q8_0 when its rows are not a multiple of 256, as llama.cpp
chooses; token embeddings are not Linear layers and stay 16-bit in lowbit.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from lowbit.errors import SchemeError
from lowbit.formats.kquants import fit_width
from lowbit.formats.scheme import Scheme
from lowbit.plans.plan import Plan

MIXES = ("q2_k_s", "gguf:q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "gguf:q6_k")
_BASE = {"q2_k_s": 2, "gguf:q2_k": 2, "q3_k_s": 3, "q3_k_m": 3, "q3_k_l": 3, "q4_k_s": 4, "q4_k_m": 4,
         "q5_k_s": 5, "q5_k_m": 5, "gguf:q6_k": 6}
_ROLE = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
         # fused experts (`lowbit.models.experts`): gate_up_proj is GGUF's ffn_gate_exps + ffn_up_exps, which
         # llama.cpp types alike (ffn_gate / ffn_up); down_proj is ffn_down_exps. Shared experts are plain MLPs
         "gate_up_proj": "ffn_gate",
         # DeepSeek's MLA (`lowbit.files.gguf_mla`): llama.cpp gives these no category of their own (the base type);
         # kv_b_proj's plan entry is attn_v_b's type (its key half, attn_k_b, is written as float)
         "q_a_proj": "attn_q_a", "q_b_proj": "attn_q_b", "kv_a_proj_with_mqa": "attn_kv_a_mqa",
         "kv_b_proj": "attn_v_b"}
# the 1-row shared-expert gate (Qwen2-MoE): a 1-D F32 tensor in llama.cpp's files, never quantized by its mixes
UNPLANNED = ("shared_expert_gate",)
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
    return Scheme.parse(f"q{bits}_k")


def role(name: str) -> str | None:
    """llama.cpp's tensor category of a Linear, from its HF name."""
    if name == "lm_head" or name.endswith(".lm_head"):
        return "output"
    return _ROLE.get(name.rsplit(".", 1)[-1])


def tensor_type(mix: str, role_: str | None, i: int, n: int, n_gqa: int, n_expert: int = 0) -> int:
    """K-quant bits of one tensor (before the width fallback): llama_tensor_get_type's rules; 8 means Q8_0.

    ``n_expert``: the model's expert count. llama.cpp special-cases exactly 8 experts (Mixtral):
    attn_v and attn_k take Q8_0 in every mix, attn_output Q5_K in the low mixes and the base type
    otherwise. ``i`` / ``n`` of an ffn_down are its block and the block count in a MoE model
    (llama.cpp parses the block from the tensor name there), the role's counter otherwise.
    """
    base = _BASE[mix]
    if role_ == "output":
        return 6
    if n_expert == 8 and role_ in ("attn_v", "attn_k"):
        return 8
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
    """Per-layer schemes of llama.cpp's file type ``mix`` over the Linear layers and fused experts ``sizes``.

    Counters run over the layers of each role in order, as llama.cpp's ``i_attention_wv`` /
    ``i_ffn_down`` do; in a MoE model (``n_expert`` > 1) an ffn_down's rule takes its block
    index instead, so a shared expert's down projection gets its block's type like the routed
    experts' (llama.cpp parses ``blk.N`` there). The output tensor with rows not a multiple of
    256 takes Q8_0 (w8g32); Qwen2-MoE's one-row shared-expert gate is left out (16-bit), as
    llama.cpp's files keep it F32.
    """
    mix = mix.strip().lower()
    if mix not in MIXES:
        raise SchemeError(f"unknown K-quant mix {mix!r}; choose one of {', '.join(MIXES)}")
    sizes = {n: v for n, v in sizes.items() if n.rsplit(".", 1)[-1] not in UNPLANNED}
    roles = {n: role(n) for n in sizes}
    unknown = [n for n, r in roles.items() if r is None]
    if unknown:
        raise SchemeError(f"{unknown[0]} has no llama.cpp tensor role (q/k/v/o, gate/up/down, lm_head); "
                          "K-quant mixes cover llama-style decoders; use a uniform scheme or a plan file")
    count = {r: sum(1 for x in roles.values() if x == r) for r in set(roles.values())}
    blocks = {n: _block(n) for n in sizes}
    n_blocks = max((b for b in blocks.values() if b is not None), default=-1) + 1
    seen: dict[str, int] = {}
    out: dict[str, Scheme] = {}
    for name, (_, cols) in sizes.items():
        r = roles[name]
        i = seen.get(r, 0)
        seen[r] = i + 1
        if r == "output" and cols % 256:
            out[name] = Scheme.parse("w8g32")
            continue
        i, n = (blocks[name], n_blocks) if n_expert > 1 and r == "ffn_down" and blocks[name] is not None \
            else (i, count[r])
        bits = tensor_type(mix, r, i, n, n_gqa, n_expert)
        out[name] = Scheme.parse("w8g32") if bits == 8 else fit_width(_k(bits), cols)
    return Plan(out)


def _block(name: str) -> int | None:
    """The decoder block index in a module name (``model.layers.3.mlp...`` -> 3; GGUF's ``blk.3...`` too)."""
    got = re.search(r"(?:layers|blk)\.(\d+)\.", name)
    return int(got.group(1)) if got else None


def fallbacks(plan: Plan, sizes: Mapping[str, tuple[int, int]]) -> dict[str, str]:
    """Layers of a K-quant plan that hold a legacy 32-block type because of their width."""
    return {n: s.name for n, s in plan.weights().items() if s.family.name != "kquant" and sizes[n][1] % 256}


def llama_cpp_types(ftype: str, tensors: Mapping[str, tuple[int, ...]], n_gqa: int, n_expert: int = 0
                    ) -> dict[str, str]:
    """GGUF type llama.cpp's file type ``ftype`` gives each weight of a GGUF file (its names, shapes outermost first).

    What ``llama-quantize --type FTYPE`` (no imatrix) would write for the same tensors: the
    decoder weights by `tensor_type` and the width fallback, token_embd / output by
    `lowbit.files.gguf_types.embedding_types` (tied when the file has no ``output.weight``);
    1-D tensors and norms are not quantized by llama.cpp and are left out.
    """
    from lowbit.files import gguf_types

    base = gguf_types.base_type(ftype)
    quantized = {n: s for n, s in tensors.items() if len(s) in (2, 3) and n.endswith("weight") and "_norm" not in n
                 and "ffn_gate_inp" not in n}
    roles = {n: _gguf_role(n) for n in quantized}
    count = {r: sum(1 for x in roles.values() if x == r) for r in set(roles.values())}
    tied = "output.weight" not in tensors
    seen: dict[str, int] = {}
    out: dict[str, str] = {}
    # llama.cpp counts attn_v / ffn_down in its source file's order: the blocks', whatever order this file has
    order = sorted(quantized, key=lambda n: int(n.split(".")[1]) if n.startswith("blk.") else -1)
    for name in order:
        cols, r = quantized[name][-1], roles[name]
        if r in ("token_embd", "output"):
            out[name] = gguf_types.embedding_types(ftype, cols, tied)[r]
            continue
        i = seen.get(r, 0)
        seen[r] = i + 1
        if n_expert > 1 and r == "ffn_down":
            i, n = _block(name), max(_block(x) or 0 for x in quantized) + 1
        else:
            n = count[r]
        bits = tensor_type(ftype, r, i, n, n_gqa, n_expert) if ftype in MIXES else 0
        qtype = base if not bits else "Q8_0" if bits == 8 else f"Q{bits}_K"
        out[name] = gguf_types.width_fallback(qtype, cols)
    return out


def _gguf_role(name: str) -> str:
    """llama.cpp's tensor category of a GGUF tensor name (``blk.3.ffn_down_exps.weight`` -> ffn_down)."""
    if not name.startswith("blk."):
        return name.removesuffix(".weight")
    part = name.split(".")[2]
    for cat in ("ffn_gate", "ffn_up", "ffn_down"):  # the _exps / _shexp tensors share their category's rule
        if part.startswith(cat):
            return cat
    return part
