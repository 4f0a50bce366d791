"""The block-wise engine every tuning method runs on: capture, walk the decoder blocks, resume, offload, shard.

One module per job: ``access`` (a block's planned layers, swapping in QuantLinears),
``cache`` (activation caches and pushing them through a block), ``capture`` (block 0's
inputs), ``shards`` (torch.distributed), ``store`` (the work folder that resumes a run),
``offload`` (where each block's float weights come from), ``options`` (the engine's own
knobs) and ``loop`` (the walk itself, and the `BlockTuner` door a method comes in by).
"""

from lowbit.ptq.blockwise.access import module_names, run_block
from lowbit.ptq.blockwise.cache import CACHE_DEVICES, CACHE_DTYPES
from lowbit.ptq.blockwise.capture import capture_inputs
from lowbit.ptq.blockwise.loop import BlockJob, BlockTuner, quantize_blockwise
from lowbit.ptq.blockwise.options import PipelineOptions
from lowbit.ptq.blockwise.shards import Shard, check_world, current_shard, reduce_tensor
from lowbit.ptq.blockwise.store import WorkDir, check_work_folder, work_settings

__all__ = ["CACHE_DEVICES", "CACHE_DTYPES", "BlockJob", "BlockTuner", "PipelineOptions", "Shard", "WorkDir",
           "capture_inputs", "check_work_folder", "check_world", "current_shard", "module_names",
           "quantize_blockwise", "reduce_tensor", "run_block", "work_settings"]
