"""The block-wise engine's own knobs (a method's settings live in its own dataclass)."""

from __future__ import annotations

from dataclasses import dataclass

from lowbit.configs import check_fields
from lowbit.errors import ConfigError
from lowbit.ptq.blockwise.cache import CACHE_DEVICES, CACHE_DTYPES


@dataclass(frozen=True)
class PipelineOptions:
    """Knobs of the pipeline itself (the tuner has its own config).

    fp_inputs: tune on FP inputs X_fp instead of the quantized blocks' outputs.
    chunk: samples per forward when computing targets / propagating.
    device: compute device for the block being tuned.
    offload_dir: keep FP block weights on disk, loading one block at a time.
    cache_dtype: storage of the cached block inputs and FP targets ("fp32" | "bf16"); the
        block always computes in its own dtype, each mini-batch is cast on the way in.
    cache_device: where those caches live: "device" (the compute device) or "cpu" (host
        memory, page-locked on a GPU machine, streamed per mini-batch: the leanest mode,
        for large models on small GPUs).
    """

    fp_inputs: bool = False
    chunk: int = 8
    device: str = "cpu"
    offload_dir: str | None = None
    cache_dtype: str = "fp32"
    cache_device: str = "device"

    def __post_init__(self) -> None:
        check_fields(self, ConfigError, "pipeline option")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ConfigError(f"cache dtype must be one of {sorted(CACHE_DTYPES)}, got {self.cache_dtype!r}")
        if self.cache_device not in CACHE_DEVICES:
            raise ConfigError(f"--cache-device must be one of {list(CACHE_DEVICES)}, got {self.cache_device!r}")
        if self.chunk < 1:
            raise ConfigError(f"chunk must be >= 1 sample, got {self.chunk}")
