"""The tuning walk's own knobs, beside the run context every method shares.

A method's settings live in its own dataclass, and what every run shares (calibration
tokens, device, work and offload folders, cache placement, progress) in one
`lowbit.ptq.methods.RunContext` that reaches the engine whole: nothing is unpacked on
the way, so no flag can be dropped. These are what a method chooses for the walk
itself, and they are recorded in the work folder because they change the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.configs import check_fields
from lowbit.errors import ConfigError
from lowbit.ptq.blockwise.cache import CACHE_DEVICES, CACHE_DTYPES


@dataclass(frozen=True)
class PipelineOptions:
    """Knobs of the tuning walk itself (the tuner has its own config).

    fp_inputs: tune on FP inputs X_fp instead of the quantized blocks' outputs.
    chunk: samples per forward when computing targets / propagating.
    cache_dtype: storage of the cached block inputs and FP targets ("fp32" | "bf16"); the
        block always computes in its own dtype, each mini-batch is cast on the way in.
    """

    fp_inputs: bool = False
    chunk: int = 8
    cache_dtype: str = "fp32"

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "pipeline option")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ConfigError(f"cache dtype must be one of {sorted(CACHE_DTYPES)}, got {self.cache_dtype!r}")
        if self.chunk < 1:
            raise ConfigError(f"chunk must be >= 1 sample, got {self.chunk}")


def cache_place(cache_device: str, device: torch.device) -> torch.device:
    """Where the activation caches live: on the compute ``device`` ("device") or in host memory ("cpu").

    "cpu" keeps them in (page-locked) host memory, streamed per mini-batch: the leanest
    mode, for large models on small GPUs. "disk" keeps them in memory-mapped files in the
    offload folder (`lowbit.ptq.blockwise.cache.disk_caches`), for activations memory cannot hold.
    """
    if cache_device not in CACHE_DEVICES:
        raise ConfigError(f"--cache-device must be one of {list(CACHE_DEVICES)}, got {cache_device!r}")
    return device if cache_device == "device" else torch.device("cpu")  # "disk": host tensors mapped from files
