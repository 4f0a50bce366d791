"""Tiny random Llama models and calibration tokens shared by the PTQ tests."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lowbit.plans.plan import Plan


def tiny_model(layers: int = 2, seed: int = 0, hidden: int = 64, inter: int = 128) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    return LlamaForCausalLM(cfg).eval()


def block_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]


def uniform(model, scheme: str) -> Plan:
    return Plan.uniform(block_names(model), scheme)


def calib(n: int = 8, seqlen: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n, seqlen), generator=torch.Generator().manual_seed(seed))
