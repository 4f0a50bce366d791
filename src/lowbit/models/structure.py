"""The residual stream of a pre-norm decoder: which norms feed which Linears, which Linears write back.

Transforms that change a model's weights without changing its function need this map:
a Hadamard rotation of the residual stream (every Linear that reads the stream turns its
input side, every Linear that writes it turns its output side, the RMSNorm scales first
folded into the readers) and AWQ's per-channel scales (divided out of a norm or a
Linear, multiplied into the Linears it feeds). Both are exact only for llama-style
blocks::

    h = h + o_proj(attn(q/k/v_proj(norm1(h))))
    h = h + down_proj(act(gate_proj(x)) * up_proj(x)),  x = norm2(h)

with plain RMSNorms (``x / rms(x) * w``). `block_layout` finds such blocks by their
module names (Llama, Mistral, Qwen2, Qwen3, SmolLM, Phi-3's fused projections) and
checks every norm numerically; anything else (Gemma's ``1 + w`` norms, Gemma 2/3's
norms after the attention and the MLP, LayerNorm with a mean and a bias) is refused
naming the architecture and the module, because folding would silently change the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lowbit.errors import ModelError
from lowbit.models.layers import block_path, decoder_blocks


@dataclass(frozen=True)
class BlockLayout:
    """Module names relative to a decoder block.

    attn_in / mlp_in read the output of attn_norm / mlp_norm; attn_out / mlp_out add
    into the residual stream. value -> attn_out and up -> mlp_out are the Linear pairs
    whose shared channels can be rescaled (None when the block has no such pair).
    """

    attn_norm: str
    attn_in: tuple[str, ...]
    attn_out: str
    mlp_norm: str
    mlp_in: tuple[str, ...]
    mlp_out: str
    value: str | None
    up: str | None

    @property
    def norms(self) -> tuple[str, str]:
        return self.attn_norm, self.mlp_norm

    @property
    def readers(self) -> tuple[str, ...]:
        return (*self.attn_in, *self.mlp_in)

    @property
    def writers(self) -> tuple[str, str]:
        return self.attn_out, self.mlp_out


LAYOUTS = {
    "llama": BlockLayout("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                         "self_attn.o_proj", "post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"),
                         "mlp.down_proj", value="self_attn.v_proj", up="mlp.up_proj"),
    "phi3": BlockLayout("input_layernorm", ("self_attn.qkv_proj",), "self_attn.o_proj", "post_attention_layernorm",
                        ("mlp.gate_up_proj",), "mlp.down_proj", value=None, up=None),
}
SUPPORTED = ("Llama, Mistral, Qwen2, Qwen3, SmolLM (input_layernorm -> q/k/v_proj -> o_proj, "
             "post_attention_layernorm -> gate/up_proj -> down_proj) and Phi-3 (fused qkv_proj / gate_up_proj)")


@dataclass(frozen=True)
class ResidualMap:
    """Full names of everything on a model's residual stream.

    embed: the input embedding; final_norm: the norm before the head; head: the lm_head
    Linear; blocks: the decoder blocks in order; tied: the head shares the embedding.
    """

    embed: str
    final_norm: str
    head: str
    blocks: tuple[str, ...]
    layout: BlockLayout
    tied: bool
    width: int


def block_layout(model: nn.Module, purpose: str) -> BlockLayout:
    """The layout of ``model``'s decoder blocks, every norm checked to be a plain RMSNorm.

    purpose: what needs it ("rotation", "AWQ"), for the error message.
    """
    blocks = decoder_blocks(model)
    arch = type(blocks[0]).__name__
    layout = _match_layout(blocks[0])
    if layout is None:
        raise ModelError(f"{purpose} needs llama-style decoder blocks; {type(model).__name__} has {arch} blocks "
                         f"without them (lowbit knows {SUPPORTED}); quantize without it")
    extra = _extra_norms(blocks[0], layout)
    if extra:
        raise ModelError(f"{purpose} folds scales into the Linears that read each norm; {arch} blocks also "
                         f"normalize at {', '.join(extra)}, where no Linear can absorb them, so the transform would "
                         "change the model; quantize without it")
    for i, block in enumerate(blocks):
        check_block_norms(block, layout, i, purpose)
    return layout


def check_block_norms(block: nn.Module, layout: BlockLayout, i: int, purpose: str) -> None:
    """Refuse block ``i`` when one of its pre-norms is not a plain RMSNorm. A block still on the meta device (a
    lazily loaded model) is checked when the walk reads it (`lowbit.ptq.block_prep`)."""
    arch = type(block).__name__
    for name in layout.norms:
        norm = block.get_submodule(name)
        if getattr(getattr(norm, "weight", None), "device", None) == torch.device("meta"):
            continue
        why = not_plain_rms(norm)
        if why:
            raise ModelError(f"{purpose} folds scales into the Linears after each norm, but {arch} block {i}'s "
                             f"{name} ({type(norm).__name__}) {why}; quantize without it")


def residual_map(model: nn.Module, purpose: str = "rotation") -> ResidualMap:
    """The residual-stream map for a rotation: the block layout plus the embedding, final norm and head."""
    layout = block_layout(model, purpose)
    blocks = decoder_blocks(model)
    path = block_path(model)
    parent = path.rpartition(".")[0]
    final = f"{parent}.norm" if parent else "norm"
    try:
        norm = model.get_submodule(final)
    except AttributeError:
        raise ModelError(f"{type(model).__name__} has no final norm at {final}; {purpose} folds it into the "
                         "lm_head and cannot find it") from None
    why = not_plain_rms(norm)
    if why:
        raise ModelError(f"{purpose}: the final norm {final} ({type(norm).__name__}) {why}")
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or not isinstance(embed, nn.Embedding):
        raise ModelError(f"{purpose} needs a plain embedding table and Linear lm_head; {type(model).__name__} has "
                         f"{type(embed).__name__} / {type(head).__name__}")
    names = {id(m): n for n, m in model.named_modules()}
    return ResidualMap(names[id(embed)], final, names[id(head)], tuple(f"{path}.{i}" for i in range(len(blocks))),
                       layout, head.weight is embed.weight, embed.weight.shape[1])


def _match_layout(block: nn.Module) -> BlockLayout | None:
    have = {n for n, _ in block.named_modules()}
    for layout in LAYOUTS.values():
        wanted = (*layout.norms, *layout.readers, *layout.writers)
        if all(n in have for n in wanted):
            return layout
    return None


def _extra_norms(block: nn.Module, layout: BlockLayout) -> list[str]:
    """Norm modules of the block other than the two pre-norms, outside the attention's per-head q/k norms."""
    attn = layout.attn_out.rpartition(".")[0] + "."
    out = []
    for name, mod in block.named_modules():
        if "norm" not in type(mod).__name__.lower() or name in layout.norms:
            continue
        if name.startswith(attn):  # Qwen3 / Gemma3 q_norm, k_norm: per head, after the projections
            continue
        out.append(name)
    return out


def not_plain_rms(norm: nn.Module) -> str | None:
    """Why ``norm`` is not ``x / sqrt(mean(x^2) + eps) * w`` (None when it is), checked on probe inputs."""
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        return "has no per-channel weight vector"
    if getattr(norm, "bias", None) is not None:
        return "has a bias (a LayerNorm, not an RMSNorm)"
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(eps, float):
        return "has no epsilon attribute lowbit recognises (variance_epsilon or eps)"
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, w.numel(), generator=gen) * 3 + 1).to(w.device, w.dtype)
    with torch.no_grad():
        got = norm(x).float()
        xf = x.float()
        want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-3, atol=1e-4):
        return "does not compute x / rms(x) * weight (e.g. x * (1 + weight), or it subtracts the mean)"
    return None
