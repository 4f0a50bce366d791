"""Adapters on quantized models: QWHA (Walsh-Hadamard), LoRA, LoftQ, FourierFT.

Typical use::

    cfg = PeftConfig(adapter="qwha", rank=8)
    xtx = second_moments(qmodel, calib_batches, target_layers(qmodel))   # lowbit.models.activations
    apply_adapters(qmodel, cfg, fp_weights=fp_linear_weights, xtx=xtx)
    ... train the adapter parameters (lowbit.train) ...
    save_adapters(qmodel, "adapter/", cfg)          # adapter alone, with base fingerprint
    merge_and_requantize(qmodel)                    # or: a plain quantized model again
"""

from lowbit.peft.adaalloc import allocate, lora_budget
from lowbit.peft.apply import (
                               KINDS,
                               PeftConfig,
                               adapters_of,
                               apply_adapters,
                               build_adapter,
                               count_trainable,
                               freeze_base,
                               merge,
                               merge_and_requantize,
                               target_layers,
                               unmerge,
)
from lowbit.peft.base import Adapter
from lowbit.peft.fourierft import FourierFTAdapter
from lowbit.peft.loftq import LoftQAdapter, loftq_adapter
from lowbit.peft.lora import LoRAAdapter
from lowbit.peft.qwha import QWHAAdapter
from lowbit.peft.refine import init_qwha
from lowbit.peft.store import fingerprint, load_adapters, save_adapters
from lowbit.transforms.hadamard import hadamard, plan_width, wht

__all__ = ["KINDS", "Adapter", "FourierFTAdapter", "LoRAAdapter", "LoftQAdapter", "PeftConfig", "QWHAAdapter",
           "adapters_of", "allocate", "apply_adapters", "build_adapter", "count_trainable",
           "fingerprint", "freeze_base", "hadamard", "init_qwha", "load_adapters", "loftq_adapter", "lora_budget",
           "merge", "merge_and_requantize", "plan_width", "save_adapters", "target_layers", "unmerge", "wht"]
