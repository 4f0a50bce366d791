"""The Linears that inference engines fuse into one matmul, by name.

vLLM loads a llama-style block's ``q_proj`` / ``k_proj`` / ``v_proj`` as one ``qkv_proj``
and ``gate_proj`` / ``up_proj`` as one ``gate_up_proj`` (its ``packed_modules_mapping``);
DeepSeek-V2/V3's MLA ``q_a_proj`` and ``kv_a_proj_with_mqa`` as one ``fused_qkv_a_proj``
(deepseek_v2.py's ``mla_params_mapping``: both read the hidden states).
That is a fact about the engines that read the files lowbit writes, so it lives with the
writers: the compressed-tensors writer refuses parts of one matmul that disagree, and
`lowbit.models.fused` gives such a group one shared tensor scale while quantizing.

Only names matter here (``...self_attn.q_proj``), so the grouping serves plans, models
and checkpoints alike; a part missing from the mapping given is simply not grouped.
"""

from __future__ import annotations

from collections.abc import Iterable

# the parts of each fused matmul, as vLLM's llama-family models name them
FUSED_PARTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"))


def fused_groups(names: Iterable[str]) -> list[list[str]]:
    """Groups (two or more names) of ``names`` that an engine runs as one matmul, in ``FUSED_PARTS`` order."""
    present = set(names)
    groups: dict[tuple[str, int], list[str]] = {}
    for name in present:
        parent, _, leaf = name.rpartition(".")
        for i, parts in enumerate(FUSED_PARTS):
            if leaf in parts:
                groups.setdefault((parent, i), []).append(name)
    order = {leaf: j for parts in FUSED_PARTS for j, leaf in enumerate(parts)}
    return [sorted(g, key=lambda n: order[n.rpartition(".")[2]])
            for _, g in sorted(groups.items()) if len(g) > 1]
