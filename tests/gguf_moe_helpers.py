"""Tiny random mixture-of-experts models of each architecture GGUF export maps, built from transformers configs."""

from __future__ import annotations

import torch
import transformers as tf


def tiny_moe(arch: str, vocab: int = 128, hidden: int = 64, inter: int = 32, experts: int = 8, layers: int = 2,
             seed: int = 0, yarn: bool = False) -> torch.nn.Module:
    """``arch`` with ``experts`` experts (top-2) of ``inter`` rows, in the routing llama.cpp's graph computes.

    Norms and biases are perturbed so a dropped bias or a wrong norm shows in the logits.
    """
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256, num_experts_per_tok=2,
                  tie_word_embeddings=False)
    if arch == "qwen3_moe":  # llama.cpp's qwen3moe always renormalises the top-k weights (as Qwen3 ships)
        cfg = tf.Qwen3MoeConfig(**common, intermediate_size=2 * inter, moe_intermediate_size=inter, num_experts=experts,
                                norm_topk_prob=True)
    elif arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**common, intermediate_size=2 * inter, moe_intermediate_size=inter,
                                shared_expert_intermediate_size=2 * inter, num_experts=experts)
    elif arch == "mixtral":
        cfg = tf.MixtralConfig(**common, intermediate_size=inter, num_local_experts=experts, sliding_window=None)
    elif arch == "olmoe":
        cfg = tf.OlmoeConfig(**{k: v for k, v in common.items() if k not in ("head_dim", "num_key_value_heads")},
                             num_key_value_heads=4, intermediate_size=inter,
                             num_experts=experts, pad_token_id=0, eos_token_id=1)
    elif arch == "gpt_oss":  # yarn: gpt-oss's own rope (factor 32 over 4096 positions), else plain rope
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096} if yarn else \
            {"rope_type": "default", "rope_theta": 10000.0}
        cfg = tf.GptOssConfig(**{**common, "max_position_embeddings": 131072 if yarn else 256},
                              intermediate_size=inter, num_local_experts=experts, rope_parameters=rope)
    elif arch == "deepseek_v3":  # MLA, a dense first block, one shared expert, 2 groups of which 1 is kept
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096} if yarn else \
            {"rope_type": "default", "rope_theta": 10000.0}  # yarn: DeepSeek-V3's own rope (163840 positions)
        cfg = tf.DeepseekV3Config(**{**common, "num_key_value_heads": 4, "head_dim": 16,
                                     "max_position_embeddings": 163840 if yarn else 256}, rope_parameters=rope,
                                  intermediate_size=2 * inter,
                                  moe_intermediate_size=inter, n_routed_experts=experts, n_shared_experts=1,
                                  first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=64, qk_rope_head_dim=16,
                                  qk_nope_head_dim=32, v_head_dim=hidden // 4, n_group=2, topk_group=1,
                                  routed_scaling_factor=2.5, norm_topk_prob=True)
    else:
        raise ValueError(arch)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    if arch == "deepseek_v3":  # routing that matters: spread sigmoid scores, a score-correction bias that changes
        with torch.no_grad():  # which groups and experts win (zero as built), experts loud enough to move the logits;
            for layer in model.model.layers:  # attention sharp enough that its softmax scale (YaRN's) shows
                for proj in (layer.self_attn.q_b_proj, layer.self_attn.kv_a_proj_with_mqa, layer.self_attn.kv_b_proj):
                    proj.weight.mul_(6)
            for layer in model.model.layers[1:]:
                layer.mlp.gate.weight.mul_(20)
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(experts) * 0.1)
                layer.mlp.experts.gate_up_proj.mul_(2)
                layer.mlp.experts.down_proj.mul_(2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("bias") or n.endswith("sinks"):
                p.add_(torch.randn_like(p) * 0.1)
    return model
